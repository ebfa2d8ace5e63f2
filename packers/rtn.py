"""Round-to-nearest (RTN) integer quantization: the baseline solver and the quantizer
primitives GPTQ and AWQ reuse.

Conventions (per group of columns):
- asymmetric: the range [min(w, 0), max(w, 0)] (zero always representable, as in GPTQ and
  compressed-tensors), scale = (max - min) / (2^b - 1), zero = round(-min / scale);
- symmetric: scale = absmax / (2^(b-1) - 1), zero = 2^(b-1) (AutoAWQ's convention: the
  largest magnitude is not clipped and already-representable weights round-trip exactly);
- symmetric, full range (`full_range`, llama.cpp's Q4_0 grid and auto-round's `int_sym`):
  scale = ±max(-min(w, 0), max(w, 0)) / 2^(b-1), signed so that the larger side of the group
  lands on code 0 (the level -2^(b-1)): every one of the 2^b levels is used, a step 7/8 of the
  restricted one at 4 bits; the smaller side clips at (2^(b-1) - 1)·|scale|. The scale is
  negative where the group's positive side is the larger (or the sides tie, as auto-round).
A group of all zeros gets scale 1 (any scale dequantizes it to zero).

Observers (how a group's range is chosen): "minmax" is the range above; "mse" shrinks it,
llm-compressor 0.14's MSE observer (`observers/mse_quant.py` `_grid_search_mse`, defaults
`MSE_DEFAULTS`): the range [p·min(w, 0), p·max(w, 0)] for p = 1 - i / grid, i < maxshrink·grid,
minimising Σ |qdq(w) - w|^norm over the group, stopped after `patience` steps in which no
group improved; scored with the scales as stored (`scale_dtype`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from infer_tool.packers.int_weight import QuantizedWeight
from infer_tool.schemes.integer import QuantScheme, RTNScheme

MSE_DEFAULTS = {"grid": 100.0, "maxshrink": 0.2, "norm": 2.4, "patience": 5}  # llm-compressor's


def qparams(
    w: torch.Tensor,
    bits: int,
    symmetric: bool,
    scale_dtype: torch.dtype = torch.float32,
    *,
    full_range: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point reducing over the last dim: w (..., c) -> scale (...), zero (...).

    Both returned as float32; zero holds integers in 0 .. 2^bits - 1; every scale is a
    value of `scale_dtype` (the checkpoint's), rounded before the zero point is derived.
    `full_range` (symmetric only): the signed full-range grid (module docstring).
    """
    w = w.float()
    maxq = (1 << bits) - 1
    if symmetric and full_range:
        scale = _storable(
            full_range_scale(-w.amin(dim=-1).clamp(max=0.0), w.amax(dim=-1).clamp(min=0.0), bits), scale_dtype
        )
        zero = torch.full_like(scale, float(1 << (bits - 1)))
        return torch.where(scale != 0, scale, torch.ones_like(scale)), zero
    if symmetric:
        scale = _storable(w.abs().amax(dim=-1) / ((1 << (bits - 1)) - 1), scale_dtype)
        zero = torch.full_like(scale, float(1 << (bits - 1)))
    else:
        lo = w.amin(dim=-1).clamp(max=0.0)
        hi = w.amax(dim=-1).clamp(min=0.0)
        scale = _storable((hi - lo) / maxq, scale_dtype)
        zero = torch.zeros_like(scale)
        nz = scale > 0
        zero[nz] = torch.round(-lo[nz] / scale[nz]).clamp(0, maxq)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return scale, zero


def full_range_scale(neg: torch.Tensor, pos: torch.Tensor, bits: int) -> torch.Tensor:
    """The signed full-range scale of groups whose sides reach −neg and pos (both ≥ 0, same
    shape): ±max(neg, pos) / 2^(bits−1), negative when pos ≥ neg so that the larger side lands
    on the level −2^(bits−1). Differentiable (AutoRound scales neg and pos by its clip factors)."""
    return torch.where(pos < neg, neg, -pos) / (1 << (bits - 1))


def shrink_search(
    evaluate: Callable[[float], tuple[torch.Tensor, tuple[torch.Tensor, ...]]],
    *,
    grid: float = MSE_DEFAULTS["grid"],
    maxshrink: float = MSE_DEFAULTS["maxshrink"],
    patience: int = MSE_DEFAULTS["patience"],
) -> tuple[torch.Tensor, ...]:
    """llm-compressor's MSE grid: `evaluate(p)` gives (error per group, the group's values)
    for the range shrunk by p = 1 - i / grid, i < maxshrink·grid; returns the values of the
    least error per group (the first p on ties, p = 1 where every error is NaN), stopping
    after `patience` steps in which no group improved."""
    best: tuple[torch.Tensor, ...] | None = None
    best_err = torch.empty(0)
    stale = 0
    for i in range(int(maxshrink * grid)):
        err, values = evaluate(1 - i / grid)
        if best is None:  # p = 1
            best, best_err = values, torch.full_like(err, float("inf"))
        improved = err < best_err
        if bool(improved.any()):
            best_err = torch.where(improved, err, best_err)
            best = tuple(torch.where(improved, v, b) for v, b in zip(values, best))
            stale = 0
        else:
            stale += 1
            if stale >= patience:
                break
    return best if best is not None else evaluate(1.0)[1]


def mse_qparams(
    w: torch.Tensor,
    bits: int,
    symmetric: bool,
    scale_dtype: torch.dtype = torch.float32,
    *,
    norm: float = MSE_DEFAULTS["norm"],
    full_range: bool = False,
    **search: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`qparams` of the shrunk range minimising the group's error (module doc, "mse"):
    w (..., c) -> scale (...), zero (...), float32; `search`: `shrink_search`'s grid,
    maxshrink, patience. p = 1 is `qparams(w)` itself."""
    w = w.float()
    lo, hi = w.amin(dim=-1).clamp(max=0.0), w.amax(dim=-1).clamp(min=0.0)

    def evaluate(p: float) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        scale, zero = qparams(
            torch.stack([lo * p, hi * p], dim=-1), bits, symmetric, scale_dtype, full_range=full_range
        )
        s, z = scale.unsqueeze(-1), zero.unsqueeze(-1)
        return ((quantize_codes(w, s, z, bits) - z) * s - w).abs().pow(norm).sum(dim=-1), (scale, zero)

    scale, zero = shrink_search(evaluate, **search)
    return scale, zero


def observed_qparams(
    w: torch.Tensor, bits: int, symmetric: bool, scale_dtype: torch.dtype, observer: str, *, full_range: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`qparams` ("minmax") or `mse_qparams` ("mse") of w (..., c)."""
    if observer == "mse":
        return mse_qparams(w, bits, symmetric, scale_dtype, full_range=full_range)
    if observer != "minmax":
        raise ValueError(f"observer {observer!r}: expected minmax or mse")
    return qparams(w, bits, symmetric, scale_dtype, full_range=full_range)


def _storable(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 values of `dtype` nearest `scale` (within its finite range)."""
    if dtype == torch.float32:
        return scale
    return scale.clamp(max=torch.finfo(dtype).max).to(dtype).float()


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes clamp(round(w / scale) + zero, 0, 2^bits - 1) as float32 (broadcasting)."""
    return torch.clamp(torch.round(w.float() / scale) + zero, 0, (1 << bits) - 1)


def fake_quantize(
    weight: torch.Tensor,
    bits: int,
    group_size: int,
    symmetric: bool,
    scale_dtype: torch.dtype = torch.float32,
    *,
    full_range: bool = False,
) -> torch.Tensor:
    """Quantize-dequantize (N, K) with contiguous groups of `group_size` columns (-1: per row).

    Returns float32 (N, K). The hot loop of AWQ's searches; equal to
    `quantize_rtn(weight, scheme=...).dequantize()`.
    """
    n, k = weight.shape
    g = k if group_size == -1 else group_size
    w = weight.float().reshape(n, k // g, g)  # (N, G, g)
    scale, zero = qparams(w, bits, symmetric, scale_dtype, full_range=full_range)  # (N, G)
    scale, zero = scale.unsqueeze(-1), zero.unsqueeze(-1)
    q = quantize_codes(w, scale, zero, bits)
    return ((q - zero) * scale).reshape(n, k)


def quantize_rtn(
    weight: torch.Tensor,
    stats: object | None = None,
    scheme: QuantScheme = RTNScheme(),
    *,
    g_idx: torch.Tensor | None = None,
) -> QuantizedWeight:
    """RTN-quantize a linear weight (N, K). `stats` is unused (uniform solver signature).

    g_idx (K,) optionally assigns columns to groups (default k // group_size); groups need
    not be contiguous.
    """
    n, k = weight.shape
    g = scheme.group_for(k)
    if k % g:
        raise ValueError(f"group size {g} does not divide K={k}")
    w = weight.float()
    observer = getattr(scheme, "observer", "minmax")
    if g_idx is None:
        scale, zero = observed_qparams(
            w.reshape(n, k // g, g),
            scheme.bits,
            scheme.symmetric,
            scheme.torch_scale_dtype,
            observer,
            full_range=scheme.full_range,
        )  # (N, G)
        cols = torch.arange(k, device=w.device) // g
    else:
        if observer != "minmax":
            raise ValueError(f"observer {observer!r} needs contiguous groups (no g_idx)")
        cols = g_idx.long()
        num_groups = int(cols.max()) + 1
        idx = cols.expand(n, k)
        lo = torch.zeros(n, num_groups, device=w.device).scatter_reduce(1, idx, w, "amin", include_self=True)
        hi = torch.zeros(n, num_groups, device=w.device).scatter_reduce(1, idx, w, "amax", include_self=True)
        scale, zero = qparams(
            torch.stack([lo, hi], dim=-1),
            scheme.bits,
            scheme.symmetric,
            scheme.torch_scale_dtype,
            full_range=scheme.full_range,
        )
    q = quantize_codes(w, scale[:, cols], zero[:, cols], scheme.bits)
    return QuantizedWeight(
        q=q.to(torch.uint8),
        scale=scale,
        zero=None if scheme.symmetric else zero.to(torch.uint8),
        g_idx=None if g_idx is None else g_idx.to(torch.int32),
        bits=scheme.bits,
        group_size=g,
        info={"method": "rtn"},
    )
