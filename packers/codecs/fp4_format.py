"""compressed-tensors FP4 checkpoints: `nvfp4-pack-quantized` and `mxfp4-pack-quantized`, as
llm-compressor 0.14 writes them (its `NVFP4A16`, `NVFP4`, `MXFP4A16`, `MXFP4` presets), read by
vLLM and by transformers through the `compressed-tensors` package.

Per quantized linear `L` (weight (N, K); no `weight_shape`, unlike INT pack-quantized):
- `L.weight_packed`       uint8 `(N, K/2)`: code 2j in the low nibble of byte j, 2j+1 in the
                          high one (compressed-tensors `pack_fp4_to_uint8`, `kernels/fp4_layout.py`);
- `L.weight_scale`        NVFP4 float8_e4m3fn `(N, K/16)`; MXFP4 uint8 `(N, K/32)` (E8M0 exponents);
- `L.weight_global_scale` NVFP4 float32 `(1,)`, the divisor `448·6 / amax`;
- `L.input_global_scale`  NVFP4 W4A4 float32 `(1,)`.
config: `quant_method: "compressed-tensors"`, `format` (also in the config group), one group
targeting `Linear` with weights `{num_bits: 4, type: "float", symmetric: true, strategy:
"tensor_group" (NVFP4) | "group" (MXFP4), group_size: 16 | 32, dynamic: false, scale_dtype:
"torch.float8_e4m3fn" | "torch.uint8", observer, actorder: "static" (GPTQ with act-order) or
null}` and, for W4A4, input_activations of the same type with `dynamic: "local"` (NVFP4:
static global, dynamic local scales; observer "static_minmax") or `dynamic: true` (MXFP4).
(compressed-tensors 0.19 `quantization/quant_scheme.py` `NVFP4A16`, `NVFP4`, `MXFP4A16`,
`MXFP4`; the field values as llm-compressor's saved config.json holds them.)

This module knows nothing about models or directories (`packers/checkpoint.py` writes them;
`FORMAT` plugs into its registry).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from infer_tool.common.errors import BadInput
from infer_tool.kernels.fp4_layout import pack_fp4, unpack_fp4
from infer_tool.packers.checkpoint import CheckpointFormat
from infer_tool.packers.fp4_weight import Fp4Weight
from infer_tool.schemes.fp4 import FP4_GROUP_SIZE, Fp4Scheme
from infer_tool.schemes.integer import observer_name

FORMATS = {"nvfp4": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized"}
SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")


def _args(fmt: str, **kw: Any) -> dict[str, Any]:
    nv = fmt == "nvfp4"
    base = {
        "actorder": None,
        "block_structure": None,
        "dynamic": False,
        "group_size": FP4_GROUP_SIZE[fmt],
        "num_bits": 4,
        "observer": None,
        "observer_kwargs": {},
        "scale_dtype": "torch.float8_e4m3fn" if nv else "torch.uint8",
        "strategy": "tensor_group" if nv else "group",
        "symmetric": True,
        "type": "float",
        "zp_dtype": None,
    }
    return {**base, **kw}


def quantization_config(scheme: Fp4Scheme, ignore: Sequence[str]) -> dict[str, Any]:
    fmt = scheme.fp4
    weights = _args(
        fmt, observer=observer_name(scheme), actorder="static" if getattr(scheme, "act_order", False) else None
    )
    inputs = None
    if scheme.w4a4:
        inputs = _args(fmt, dynamic="local", observer="static_minmax") if fmt == "nvfp4" else _args(fmt, dynamic=True)
    return {
        "quant_method": "compressed-tensors",
        "format": FORMATS[fmt],
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": inputs,
                "output_activations": None,
                "format": FORMATS[fmt],
            }
        },
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
        "transform_config": {},
    }


def layer_tensors(name: str, w: Fp4Weight, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors of one quantized linear `name` (module path, no `.weight`); `dtype` is unused:
    FP4's scales have their own dtypes."""
    out = {f"{name}.weight_packed": pack_fp4(w.codes), f"{name}.weight_scale": w.w_scale.contiguous()}
    if w.global_scale is not None:
        out[f"{name}.weight_global_scale"] = w.global_scale.reshape(1).to(torch.float32).clone()
    if w.input_global_scale is not None:
        out[f"{name}.input_global_scale"] = w.input_global_scale.reshape(1).to(torch.float32).clone()
    return out


def _group(quant_config: Mapping[str, Any]) -> tuple[str, bool]:
    """(fp4 format, W4A4) of a checkpoint's config."""
    fmt = next((f for f, name in FORMATS.items() if name == quant_config.get("format")), None)
    groups = list(quant_config.get("config_groups", {}).values())
    if fmt is None or len(groups) != 1:
        raise BadInput("this compressed-tensors checkpoint is not a single-group NVFP4 / MXFP4 one")
    return fmt, bool(groups[0].get("input_activations"))


def read_layers(tensors: Mapping[str, torch.Tensor], quant_config: Mapping[str, Any]) -> dict[str, Fp4Weight]:
    """{linear name: Fp4Weight} for every `*.weight_packed` in `tensors`."""
    fmt, w4a4 = _group(quant_config)
    want = torch.float8_e4m3fn if fmt == "nvfp4" else torch.uint8
    out = {}
    for key in sorted(tensors):
        if not key.endswith(".weight_packed"):
            continue
        name = key[: -len(".weight_packed")]
        packed, scale = tensors[key], tensors.get(f"{name}.weight_scale")
        gs = tensors.get(f"{name}.weight_global_scale")
        if packed.dtype != torch.uint8 or scale is None or scale.dtype != want or (gs is None) != (fmt == "mxfp4"):
            raise BadInput(
                f"{name}: its tensors are not {FORMATS[fmt]}'s (uint8 weight_packed, {want} weight_scale"
                f"{', float32 weight_global_scale' if fmt == 'nvfp4' else ''})"
            )
        igs = tensors.get(f"{name}.input_global_scale")
        if w4a4 and fmt == "nvfp4" and igs is None:
            raise BadInput(f"{name}: a W4A4 NVFP4 checkpoint needs {name}.input_global_scale")
        out[name] = Fp4Weight(
            codes=unpack_fp4(packed),
            w_scale=scale,
            global_scale=None if gs is None else gs.float().reshape(1),
            input_global_scale=None if igs is None else igs.float().reshape(1),
            activations="fp4" if w4a4 else "none",
        )
    return out


def matches(quant_config: Mapping[str, Any]) -> bool:
    return quant_config.get("quant_method") == "compressed-tensors" and quant_config.get("format") in FORMATS.values()


FORMAT = CheckpointFormat(
    name="compressed-tensors",
    kind="fp4",
    suffixes=SUFFIXES,
    config=quantization_config,
    tensors=layer_tensors,
    read=read_layers,
    matches=matches,
)
