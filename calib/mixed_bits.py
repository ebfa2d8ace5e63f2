"""Bits per weight of one linear exactly as our compressed-tensors writers store it: codes,
scales, zero points, global scales, shapes and `g_idx`, in bytes, for a scheme and a weight
shape (N, K).

What each format stores per linear (`packers/compressed_tensors.py`, `fp8_formats.py`,
`fp4_format.py`; b bits, G = K / group size groups per row, P = 32 / b codes per int32):
- INT `pack-quantized` (kind "int"): `weight_packed` int32 (N, ceil(K / P)); `weight_scale`
  (N, G) in the checkpoint dtype; `weight_shape` int64 (2,); asymmetric: `weight_zero_point`
  int32 (ceil(N / P), G). No `g_idx` (only static act-order groups are written).
- FP8 `float-quantized` (kind "fp8"): `weight` e4m3 (N, K), `weight_scale` float32 of shape
  (1,) per tensor, (N, 1) per channel, (ceil(N / bn), ceil(K / bk)) per block; static
  activations add `input_scale` float32 (1,).
- FP4 (kind "fp4"): `weight_packed` uint8 (N, ceil(K / 2)); `weight_scale` one byte per 16
  (NVFP4, e4m3) or 32 (MXFP4, e8m0) inputs; NVFP4 adds `weight_global_scale` float32 (1,).
- unquantized (scheme None): `weight` (N, K) in the checkpoint dtype.
A bias is stored as the model's either way and is not counted. The tests check these sizes
against the tensors the writers write for a tiny model. Schemes that quantize activations
with a stored scale (W8A8, W4A4) are not sized here. Standard library only.
"""

from __future__ import annotations

import math
from typing import Any

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_bytes(dtype: str) -> int:
    """Bytes of one element of a checkpoint dtype name ("bfloat16", "torch.float16", ...)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"checkpoint dtype {dtype!r}: expected one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


def stored_bytes(scheme: Any, n: int, k: int, dtype: str) -> int:
    """Bytes our compressed-tensors writer stores for one (N, K) linear under `scheme` (None:
    unquantized) in a checkpoint of `dtype` (the dtype of unquantized tensors and INT scales)."""
    d = dtype_bytes(dtype)
    if scheme is None:
        return n * k * d
    kind = scheme.kind
    if kind == "int":
        per_word = 32 // scheme.bits
        groups = 1 if scheme.group_size == -1 else k // scheme.group_size
        size = n * math.ceil(k / per_word) * 4 + n * groups * d + 2 * 8
        if not scheme.symmetric:
            size += math.ceil(n / per_word) * groups * 4
        return size
    if kind == "fp8":
        if scheme.granularity == "tensor":
            scales = 1
        elif scheme.granularity == "channel":
            scales = n
        else:
            bn, bk = scheme.block_size
            scales = math.ceil(n / bn) * math.ceil(k / bk)
        return n * k + 4 * scales + (4 if scheme.activations == "static" else 0)
    if kind == "fp4":
        if scheme.w4a4:
            raise ValueError("W4A4 schemes (an input global scale per linear) are not sized here")
        size = n * math.ceil(k / 2) + n * (k // scheme.group_size)
        return size + (4 if scheme.global_scales else 0)
    raise ValueError(f"no stored size known for schemes of kind {kind!r}")


def bits_per_weight(scheme: Any, n: int, k: int, dtype: str) -> float:
    """8 · stored bytes / (N · K): the average bits one weight of the linear costs on disk."""
    return 8.0 * stored_bytes(scheme, n, k, dtype) / (n * k)
