"""Bits per weight of one linear exactly as our compressed-tensors writers store it: codes,
scales, zero points, global scales and shapes, in bytes, for a scheme and a weight shape (N, K).

Measured, not restated: the scheme's own data-free solve (`LayerQuantizer.solve_data_free`) of a
stand-in (N, K) weight goes through its format's compressed-tensors codec (`tensors`), and the
bytes of the tensors it writes are summed; so every format (INT, FP8, FP4, MXFP8, W4AFP8, a new
one) is sized by the code that writes it. Unquantized (scheme None): `weight` (N, K) in the
checkpoint dtype. A bias is stored as the model's either way and is not counted; nor is an
activation scale a calibrated scheme stores per linear (W8A8 static, NVFP4 W4A4: 4 bytes). The
tests check these sizes against the tensors the writers write for a tiny model.
"""

from __future__ import annotations

from functools import lru_cache
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
    return _written_bytes(scheme, n, k, str(dtype).removeprefix("torch."))


@lru_cache(maxsize=256)
def _written_bytes(scheme: Any, n: int, k: int, dtype: str) -> int:
    import torch

    from infer_tool.calib.quantizers import quantizer_for
    from infer_tool.packers.checkpoint import get_format

    fmt = get_format("compressed-tensors", scheme.kind)
    stored = scheme.for_storage(fmt.scale_dtype or dtype)
    w = torch.linspace(-1.0, 1.0, n * k, dtype=torch.float32).reshape(n, k)  # a stand-in: sizes only
    quantizer = quantizer_for(stored)
    shared = quantizer.fused_share([w], stored) if quantizer.shares_fused(stored) else None
    if quantizer.needs(stored).data_free:
        solved = quantizer.solve_data_free(w, stored, "linear", shared)
    else:  # a method reading statistics (GPTQ): stand-in statistics, the sizes are the format's
        from infer_tool.calib.stats import LayerStats

        ones = torch.ones(k)
        solved = quantizer.solve(w, LayerStats(2 * torch.eye(k), ones, 1.0, n, ones), stored, "linear")
    tensors = fmt.tensors("linear", solved, getattr(torch, dtype))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def bits_per_weight(scheme: Any, n: int, k: int, dtype: str) -> float:
    """8 · stored bytes / (N · K): the average bits one weight of the linear costs on disk."""
    return 8.0 * stored_bytes(scheme, n, k, dtype) / (n * k)
