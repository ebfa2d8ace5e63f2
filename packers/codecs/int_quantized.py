"""compressed-tensors `int-quantized` W8A8 checkpoints, as llm-compressor writes its W8A8
(INT8) scheme and vLLM loads it (`CompressedTensorsW8A8Int8`; transformers through the
`compressed-tensors` package).

Per quantized linear `name` (weight (N, K)):
- `name.weight`       int8 (N, K): the signed codes q - 128 of our symmetric 8-bit
                      `QuantizedWeight` (RTN gives [-127, 127]; GPTQ's error feedback can reach -128);
- `name.weight_scale` float32 (N, 1), one per output channel;
- `name.input_scale`  float32 (1,), static activations only.
Dequantization: weight * weight_scale. config.json's one config group: int 8-bit symmetric
`channel` weights, and input activations int 8-bit symmetric `token` `dynamic: true` or
`tensor` `dynamic: false` (a calibrated `input_scale`).

Our scales are absmax / 127 (codes within [-127, 127] before GPTQ's feedback); llm-compressor's
observers take absmax / 127.5 over [-128, 127]. Both are valid `int-quantized` checkpoints: a
reader dequantizes whatever scale is stored.

This module knows nothing about models or directories (`packers/checkpoint.py` writes them;
`FORMAT` plugs into its registry as ("compressed-tensors", "w8a8")).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from infer_tool.common.errors import BadInput
from infer_tool.packers.checkpoint import CheckpointFormat, group_quantizes_inputs
from infer_tool.packers.codecs.fp8_formats import quant_args
from infer_tool.packers.int8_activations import ZERO
from infer_tool.packers.int_weight import QuantizedWeight
from infer_tool.schemes.integer import W8A8_KIND, QuantScheme, observer_name

FORMAT_NAME = "int-quantized"
SUFFIXES = ("weight", "weight_scale", "input_scale")


def _args(**kw: Any) -> dict[str, Any]:
    """A compressed-tensors QuantizationArgs dict for 8-bit symmetric ints."""
    return quant_args(**{"type": "int", "strategy": "channel", **kw})


def quantization_config(scheme: QuantScheme, ignore: Sequence[str]) -> dict[str, Any]:
    weights = _args(observer=observer_name(scheme), actorder="weight" if getattr(scheme, "act_order", False) else None)
    if scheme.int8_activations == "dynamic":
        inputs = _args(strategy="token", dynamic=True)
    else:
        inputs = _args(strategy="tensor", observer="minmax")
    return {
        "quant_method": "compressed-tensors",
        "format": FORMAT_NAME,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": inputs,
                "output_activations": None,
                "format": FORMAT_NAME,
            }
        },
        "ignore": sorted(set(ignore)),
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "global_compression_ratio": None,
    }


def check(scheme: QuantScheme, quantized: Mapping[str, QuantizedWeight]) -> None:
    if scheme.kind != W8A8_KIND:
        raise BadInput("int-quantized checkpoints carry W8A8 schemes (int8 activations) only")
    for name, qw in quantized.items():
        if qw.bits != 8 or not qw.symmetric or qw.num_groups != 1:
            raise BadInput(f"{name}: int-quantized W8A8 needs 8-bit symmetric per-channel weights")
        if (scheme.int8_activations == "static") != (qw.input_scale is not None):
            raise BadInput(f"{name}: static int8 activations need an input_scale, dynamic ones none")


def layer_tensors(name: str, qw: QuantizedWeight, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors of one quantized linear `name` (module path, no `.weight`); scales float32."""
    w8, scale = qw.int8()
    out = {f"{name}.weight": w8, f"{name}.weight_scale": scale.reshape(-1, 1).float()}
    if qw.input_scale is not None:
        out[f"{name}.input_scale"] = qw.input_scale.float().reshape(1).clone()
    return out


def read_layers(tensors: Mapping[str, torch.Tensor], quant_config: Mapping[str, Any]) -> dict[str, QuantizedWeight]:
    """{linear name: QuantizedWeight (bits 8, symmetric, per channel)} for every int8 `*.weight`."""
    groups = list(quant_config.get("config_groups", {}).values())
    if len(groups) != 1 or (groups[0].get("weights") or {}).get("num_bits") != 8:
        raise BadInput("this int-quantized checkpoint does not have exactly one 8-bit INT weight group")
    if (groups[0]["weights"].get("strategy"), groups[0]["weights"].get("symmetric")) != ("channel", True):
        raise BadInput("int-quantized: we read symmetric per-channel int8 weights only")
    out = {}
    for key in sorted(tensors):
        t = tensors[key]
        if not key.endswith(".weight") or t.dtype != torch.int8:
            continue
        name = key[: -len(".weight")]
        scale_key = f"{name}.weight_scale"
        if scale_key not in tensors:
            raise BadInput(f"checkpoint has int8 {key} but no {scale_key}")
        n, k = t.shape
        inp = tensors.get(f"{name}.input_scale")
        out[name] = QuantizedWeight(
            q=(t.to(torch.int16) + ZERO).to(torch.uint8),
            scale=tensors[scale_key].float().reshape(n, 1),
            zero=None,
            g_idx=None,
            bits=8,
            group_size=k,
            input_scale=None if inp is None else inp.float().reshape(1),
        )
    return out


def matches(quant_config: Mapping[str, Any]) -> bool:
    return quant_config.get("quant_method") == "compressed-tensors" and quant_config.get("format") == FORMAT_NAME


FORMAT = CheckpointFormat(
    name="compressed-tensors",
    kind=W8A8_KIND,
    suffixes=SUFFIXES,
    config=quantization_config,
    tensors=layer_tensors,
    read=read_layers,
    matches=matches,
    check=check,
    scale_dtype="float32",
    activations_quantized=group_quantizes_inputs,
)
