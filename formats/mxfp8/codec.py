"""compressed-tensors `mxfp8-quantized` checkpoints, as compressed-tensors 0.20 defines them
(`compressors/mxfp8/base.py`: the naive quantized compressor with E8M0 scales; presets
`MXFP8A16`, `MXFP8` in `quantization/quant_scheme.py`), read by vLLM (its W8A8 MXFP8 scheme)
and by transformers through the `compressed-tensors` package.

Per quantized linear `L` (weight (N, K)):
- `L.weight`        float8_e4m3fn `(N, K)`;
- `L.weight_scale`  uint8 `(N, K/32)`: E8M0 exponents (`numerics.py`).
config: `quant_method: "compressed-tensors"`, `format: "mxfp8-quantized"` (also in the config
group), one group targeting `Linear` with weights `{num_bits: 8, type: "float", symmetric:
true, strategy: "group", group_size: 32, dynamic: false, scale_dtype: "torch.uint8",
zp_dtype: "torch.uint8"}` and, for MXFP8 (W8A8), input activations of the same type with
`dynamic: true`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from infer_tool.common.errors import BadInput
from infer_tool.formats.mxfp8.numerics import GROUP_SIZE
from infer_tool.formats.mxfp8.scheme import KIND, Mxfp8Scheme
from infer_tool.formats.mxfp8.weight import Mxfp8Weight
from infer_tool.packers.checkpoint import CheckpointFormat, group_quantizes_inputs

FORMAT_NAME = "mxfp8-quantized"
SUFFIXES = ("weight", "weight_scale")


def _args(**kw: Any) -> dict[str, Any]:
    base = {
        "actorder": None,
        "block_structure": None,
        "dynamic": False,
        "group_size": GROUP_SIZE,
        "num_bits": 8,
        "observer": None,
        "observer_kwargs": {},
        "scale_dtype": "torch.uint8",
        "strategy": "group",
        "symmetric": True,
        "type": "float",
        "zp_dtype": "torch.uint8",
    }
    return {**base, **kw}


def quantization_config(scheme: Mxfp8Scheme, ignore: Sequence[str]) -> dict[str, Any]:
    weights = _args(observer="memoryless_minmax", actorder="static" if getattr(scheme, "act_order", False) else None)
    return {
        "quant_method": "compressed-tensors",
        "format": FORMAT_NAME,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": _args(dynamic=True) if scheme.w8a8 else None,
                "output_activations": None,
                "format": FORMAT_NAME,
            }
        },
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": {},
    }


def layer_tensors(name: str, w: Mxfp8Weight, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors of one quantized linear `name` (module path, no `.weight`); `dtype` is unused:
    MXFP8's values and scales have their own dtypes."""
    return {f"{name}.weight": w.values.contiguous(), f"{name}.weight_scale": w.scale_exp.contiguous()}


def read_layers(tensors: Mapping[str, torch.Tensor], quant_config: Mapping[str, Any]) -> dict[str, Mxfp8Weight]:
    """{linear name: Mxfp8Weight} for every float8 `*.weight` with a uint8 `*.weight_scale`."""
    groups = list(quant_config.get("config_groups", {}).values())
    if len(groups) != 1:
        raise BadInput("this mxfp8-quantized checkpoint does not have exactly one config group")
    activations = "mxfp8" if group_quantizes_inputs(quant_config) else "none"
    out = {}
    for key in sorted(tensors):
        if not key.endswith(".weight") or tensors[key].dtype != torch.float8_e4m3fn:
            continue
        name = key[: -len(".weight")]
        values, scale = tensors[key], tensors.get(f"{name}.weight_scale")
        n, k = values.shape
        if scale is None or scale.dtype != torch.uint8 or tuple(scale.shape) != (n, k // GROUP_SIZE) or k % GROUP_SIZE:
            raise BadInput(f"{name}: its tensors are not {FORMAT_NAME}'s (uint8 weight_scale of (N, K/32))")
        out[name] = Mxfp8Weight(values, scale, activations)
    return out


def matches(quant_config: Mapping[str, Any]) -> bool:
    return quant_config.get("quant_method") == "compressed-tensors" and quant_config.get("format") == FORMAT_NAME


FORMAT = CheckpointFormat(
    name="compressed-tensors",
    kind=KIND,
    suffixes=SUFFIXES,
    config=quantization_config,
    tensors=layer_tensors,
    read=read_layers,
    matches=matches,
    activations_quantized=group_quantizes_inputs,
)
