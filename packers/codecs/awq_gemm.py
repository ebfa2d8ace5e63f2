"""AWQ GEMM checkpoints (AutoAWQ's `WQLinear_GEMM`, read by vLLM's awq / awq_marlin and by
transformers through autoawq).

Per quantized linear `name` (weight (N, K), G = K / g groups), 4 bits only:
- `name.qweight` int32 (K, N/8): W transposed, packed along the OUTPUT dim; nibble i of
                 word j holds output column 8j + AWQ_ORDER[i], AWQ_ORDER = [0,2,4,6,1,3,5,7].
- `name.qzeros`  int32 (G, N/8): unsigned zero points (no offset), packed the same way.
- `name.scales`  fp16 (G, N).
Dequantization: W[n, k] = (q[k, n] - z[k // g, n]) · s[k // g, n].
The format always stores zero points: a symmetric scheme is written with zero = 8.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from infer_tool.common.errors import BadInput
from infer_tool.packers.checkpoint import CheckpointFormat
from infer_tool.packers.int_weight import QuantizedWeight
from infer_tool.packers.packing import AWQ_ORDER, pack_int32, unpack_int32
from infer_tool.schemes.integer import QuantScheme

SUFFIXES = ("qweight", "qzeros", "scales")


def check(scheme: QuantScheme, quantized: Mapping[str, QuantizedWeight]) -> None:
    if scheme.bits != 4:
        raise BadInput(
            f"bits={scheme.bits}: the AWQ GEMM format holds 4-bit weights only; use --format compressed-tensors"
        )
    if scheme.group_size == -1:
        raise BadInput(
            "the AWQ GEMM format needs a group size (not -1); use --format compressed-tensors for per-channel"
        )
    for name, qw in quantized.items():
        if qw.shape[0] % 8:
            raise BadInput(f"{name}: N={qw.shape[0]} output features is not a multiple of 8, which AWQ GEMM packs")
        if not qw.has_trivial_g_idx():
            raise BadInput(f"{name}: AWQ GEMM has no g_idx; use static act-order groups or --format gptq")


def quantization_config(scheme: QuantScheme, ignore: Sequence[str]) -> dict[str, Any]:
    return {
        "quant_method": "awq",
        "bits": scheme.bits,
        "group_size": scheme.group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": list(ignore),
    }


def layer_tensors(name: str, qw: QuantizedWeight, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors of one quantized linear `name` (scales are fp16 whatever the model dtype)."""
    return {
        f"{name}.qweight": pack_int32(qw.q.T, 4, dim=1, order=AWQ_ORDER),  # (K, N/8)
        f"{name}.qzeros": pack_int32(qw.zero_points().T, 4, dim=1, order=AWQ_ORDER),  # (G, N/8)
        f"{name}.scales": qw.scale.T.to(torch.float16),  # (G, N)
    }


def read_layers(tensors: Mapping[str, torch.Tensor], quant_config: Mapping[str, Any]) -> dict[str, QuantizedWeight]:
    """{linear name: QuantizedWeight} for every `*.qweight` in `tensors`."""
    bits = int(quant_config.get("bits", 4))
    if bits != 4:
        raise BadInput(f"AWQ checkpoint with bits={bits}: only 4-bit AWQ GEMM is read")
    out = {}
    for key in sorted(tensors):
        if not key.endswith(".qweight"):
            continue
        name = key[: -len(".qweight")]
        scales = tensors[f"{name}.scales"].float()  # (G, N)
        G, n = scales.shape
        q = unpack_int32(tensors[key], 4, dim=1, size=n, order=AWQ_ORDER)  # (K, N)
        k = q.shape[0]
        out[name] = QuantizedWeight(
            q=q.T.contiguous(),
            scale=scales.T.contiguous(),
            zero=unpack_int32(tensors[f"{name}.qzeros"], 4, dim=1, size=n, order=AWQ_ORDER).T.contiguous(),
            g_idx=None,
            bits=4,
            group_size=k // G,
        )
    return out


def matches(quant_config: Mapping[str, Any]) -> bool:
    return quant_config.get("quant_method") == "awq" and str(quant_config.get("version", "gemm")).lower() == "gemm"


FORMAT = CheckpointFormat(
    name="awq",
    kind="int",
    suffixes=SUFFIXES,
    config=quantization_config,
    tensors=layer_tensors,
    read=read_layers,
    matches=matches,
    check=check,
    scale_dtype="float16",
)
