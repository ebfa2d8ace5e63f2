"""Deterministic reduction of split-K partial products.

Two forms:

- `serial_store` (a `@triton.jit` helper, one launch): each of the SPLIT_K programs of an
  output tile writes its fp32 partial to a workspace `(SPLIT_K, M, N)`, then increments
  the tile's counter with an acq_rel atomic; the program that sees `SPLIT_K - 1` (the
  last to finish) sums the partials in the fixed order 0..SPLIT_K-1, stores the output
  and resets the counter to 0 for the next launch (CUTLASS's "serial split-K"). No float
  atomics, no second launch, bitwise reproducible run to run. The counters (`tile_locks`)
  are int32 zeros kept per device and left zero by every launch, so a CUDA graph that
  captured a launch can replay it. Launches that share the counters must not run
  concurrently on two streams.
- `sum_partials` (its own launch): sums partials `(SPLIT_K, M, N)` in the order
  0..SPLIT_K-1 (used by the FP4 kernels).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infer_tool.kernels import backend
from infer_tool.kernels.backend import Launch

BLOCK = 1024
_LOCKS: dict[tuple[str, int | None], torch.Tensor] = {}


def tile_locks(device: torch.device, n: int) -> torch.Tensor:
    """int32 zeros `(>= n,)` on `device`: one counter per output tile, shared by launches
    (each launch leaves them zero). Allocated once per device (65,536 counters; grown if a
    launch needs more: call once before capturing a CUDA graph), never per call."""
    device = torch.device(device)
    key = (device.type, device.index)
    locks = _LOCKS.get(key)
    if locks is None or locks.numel() < n:
        locks = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)  # 256 KiB: no regrowth in practice
        _LOCKS[key] = locks
    return locks


@triton.jit
def serial_store(acc, out_ptrs, ws_ptrs, stride_ws, lock_ptr, pid_k, mask, SPLIT_K: tl.constexpr):
    """Store the output tile `acc` (fp32) of split `pid_k` of SPLIT_K.

    out_ptrs / ws_ptrs: pointer tiles shaped like acc into the output `(M, N)` and into
    split 0 of the fp32 workspace `(SPLIT_K, M, N)`; stride_ws: elements between splits;
    lock_ptr: this tile's counter; mask: the tile's valid elements."""
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=mask)
    else:
        tl.store(ws_ptrs + pid_k * stride_ws, acc, mask=mask)
        # Every thread's partial is stored before the counter moves (the atomic runs in one
        # thread, whose release then covers the whole tile, as CUTLASS's semaphore does).
        tl.debug_barrier()
        arrived = tl.atomic_add(lock_ptr, 1, sem="acq_rel")  # release our partial, acquire theirs
        if arrived == SPLIT_K - 1:
            total = tl.load(ws_ptrs, mask=mask, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                total += tl.load(ws_ptrs + s * stride_ws, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, total.to(out_ptrs.dtype.element_ty), mask=mask)
            tl.atomic_xchg(lock_ptr, 0)  # ready for the next launch


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
