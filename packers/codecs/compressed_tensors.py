"""compressed-tensors `pack-quantized` INT checkpoints (llm-compressor's output, read by
vLLM and by transformers through the `compressed-tensors` package).

Per quantized linear `name` (weight (N, K), G groups):
- `name.weight_packed`     int32 (N, K·b/32): element k of a row in word k·b//32 at bits
                           (k·b) % 32 (sequential along K); codes stored signed + 2^(b-1),
                           i.e. exactly our unsigned codes q.
- `name.weight_scale`      (N, G) in the model dtype.
- `name.weight_shape`      int64 (2,) = [N, K].
- `name.weight_zero_point` asymmetric only: int32 (ceil(N·b/32), G), the zero points packed
                           along dim 0 the same way (signed zero + 2^(b-1) = our unsigned zero).
Dequantization: (q_signed - z_signed)·scale = (q - zero)·scale.
Act-order: only static groups ("actorder": "weight"), whose g_idx is k // g and is not
stored; compressed-tensors no longer loads dynamic-group ("group") checkpoints.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from infer_tool.common.errors import BadInput
from infer_tool.packers.checkpoint import CheckpointFormat
from infer_tool.packers.int_weight import QuantizedWeight
from infer_tool.packers.packing import pack_int32, unpack_int32
from infer_tool.schemes.integer import QuantScheme, observer_name

FORMAT_NAME = "pack-quantized"
SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")


def check(scheme: QuantScheme, quantized: Mapping[str, QuantizedWeight]) -> None:
    if scheme.bits not in (2, 4, 8):
        raise BadInput(f"bits={scheme.bits}: our pack-quantized writer packs 2, 4 or 8 bits")
    for name, qw in quantized.items():
        if not qw.has_trivial_g_idx():
            raise BadInput(
                f"{name}: act-order with dynamic groups (non-trivial g_idx) is not loadable by "
                "compressed-tensors; use static groups (the default) or --format gptq"
            )


def quantization_config(scheme: QuantScheme, ignore: Sequence[str]) -> dict[str, Any]:
    channel = scheme.group_size == -1
    weights: dict[str, Any] = {
        "num_bits": scheme.bits,
        "type": "int",
        "symmetric": scheme.symmetric,
        "strategy": "channel" if channel else "group",
        "group_size": None if channel else scheme.group_size,
        "dynamic": False,
        "observer": observer_name(scheme),
    }
    if getattr(scheme, "act_order", False):
        weights["actorder"] = "weight"
    return {
        "quant_method": "compressed-tensors",
        "format": FORMAT_NAME,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": list(ignore),
        "kv_cache_scheme": None,
    }


def layer_tensors(name: str, qw: QuantizedWeight, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors of one quantized linear `name` (module path, no `.weight`)."""
    n, k = qw.shape
    out = {
        f"{name}.weight_packed": pack_int32(qw.q, qw.bits, dim=1),  # (N, K·b/32)
        f"{name}.weight_scale": qw.scale.to(dtype),  # (N, G)
        f"{name}.weight_shape": torch.tensor([n, k], dtype=torch.int64),
    }
    if qw.zero is not None:
        out[f"{name}.weight_zero_point"] = pack_int32(qw.zero, qw.bits, dim=0)  # (N·b/32, G)
    return out


def _weights_args(quant_config: Mapping[str, Any]) -> dict[str, Any]:
    groups = list(quant_config.get("config_groups", {}).values())
    ints = [g["weights"] for g in groups if (g.get("weights") or {}).get("type") == "int"]
    if len(ints) != 1:
        raise BadInput("this compressed-tensors checkpoint does not have exactly one INT weight group")
    return ints[0]


def read_layers(tensors: Mapping[str, torch.Tensor], quant_config: Mapping[str, Any]) -> dict[str, QuantizedWeight]:
    """{linear name: QuantizedWeight} for every `*.weight_packed` in `tensors`."""
    args = _weights_args(quant_config)
    bits = int(args["num_bits"])
    out = {}
    for key in sorted(tensors):
        if not key.endswith(".weight_packed"):
            continue
        name = key[: -len(".weight_packed")]
        n, k = (int(v) for v in tensors[f"{name}.weight_shape"].tolist())
        scale = tensors[f"{name}.weight_scale"].float()  # (N, G)
        G = scale.shape[1]
        zp = tensors.get(f"{name}.weight_zero_point")
        out[name] = QuantizedWeight(
            q=unpack_int32(tensors[key], bits, dim=1, size=k),
            scale=scale,
            zero=None if zp is None else unpack_int32(zp, bits, dim=0, size=n),
            g_idx=None,
            bits=bits,
            group_size=k // G,
        )
    return out


def matches(quant_config: Mapping[str, Any]) -> bool:
    """pack-quantized INT weights whose activations are not float: FP8 ones are W4AFP8's format."""
    groups = list(quant_config.get("config_groups", {}).values())
    floats = any((g.get("input_activations") or {}).get("type") == "float" for g in groups)
    return (
        quant_config.get("quant_method") == "compressed-tensors"
        and quant_config.get("format") == FORMAT_NAME
        and not floats
    )


FORMAT = CheckpointFormat(
    name="compressed-tensors",
    kind="int",
    suffixes=SUFFIXES,
    config=quantization_config,
    tensors=layer_tensors,
    read=read_layers,
    matches=matches,
    check=check,
)
