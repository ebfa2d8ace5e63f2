"""Deterministic reduction of split-K partial products in one launch.

The split-K GEMM paths write fp32 partials `(SPLIT_K, M, N)`; this kernel sums them in
the fixed order 0..SPLIT_K-1 and casts to the output dtype, so results are bitwise
reproducible (no float atomics) at the cost of one small extra launch (torch's
`partials.sum(0).to(dtype)` would take two).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer_tool.kernels import backend
from infer_tool.kernels.backend import Launch

BLOCK = 1024


@triton.jit
def _sum_partials_kernel(p_ptr, out_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """p `(SPLIT_K, numel)` fp32 contiguous -> out `(numel,)` in out's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(p_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(p_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_partials(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`partials` fp32 `(S, M, N)` contiguous -> `(M, N)` in `dtype`, summed in order."""
    S, M, N = partials.shape
    out = backend.empty_output((M, N), dtype, partials.device)
    numel = M * N
    Launch(
        _sum_partials_kernel,
        (triton.cdiv(numel, BLOCK),),
        (partials, out, numel),
        dict(SPLIT_K=S, BLOCK=BLOCK, num_warps=4, num_stages=1),
    ).run()
    return out
