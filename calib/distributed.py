"""Calibration across processes (`accelerate launch` / `torchrun`): which chunks this process
runs, and the reductions that make every statistic bit-identical to a one-process run.

The calibration samples are cut into chunks of the pipeline's batch size, independently
of the number of processes W; process r runs the contiguous chunks [a_r, b_r) (`Shard`,
the first n mod W processes one chunk more). Everything a layer measures is then combined
in float64 in an order that does not depend on W:

- A sum statistic (Σ xxᵀ, Σ|x|) is the pairwise sum of its per-chunk contributions over
  the global chunk index: the aligned binary tree whose node (l, i) covers chunks
  [i·2^l, (i+1)·2^l) and is the sum of its two children (left + right; a chunk that
  contributed nothing is an exact zero). One process builds it as a binary counter
  (`TreeSum`: a stack of complete nodes, merged when two siblings meet; at most
  ⌈log₂ n⌉ + 1 partial sums alive). A process owning [a, b) builds the same nodes inside
  its range; `TreeSum.total` then sends every process's nodes, in chunk order, through
  the same counter on every process (one broadcast per node, so memory stays at the stack
  and one receive buffer, never a gather of per-chunk copies), and folds the final stack
  from the right as the one-process run does. IEEE addition is commutative and every
  node is the same two operands added once, so the bits are the one-process bits.
- Maxima (max |x|, KV-cache amax) are all-reduced with MAX (exact in any order); counts
  (tokens, routed tokens per expert) are int64 sums (exact).
- The reported layer error ‖Ŷ − Y‖/‖Y‖ sums per-chunk float64 terms in chunk order
  (`relative_error`: the terms are gathered, a few floats per chunk).
- Searches that read whole search samples (AWQ's scale and clip grids) run on process 0,
  which holds the first chunks, and their results are broadcast (`on_first`); solves
  (GPTQ, RTN, FP8) run on every process from identical statistics and weights.

So with the same per-process kernels (same device type, and on CPUs the same threads per
process), the checkpoint is the one-process checkpoint byte for byte.

A process that fails ends the run: torch.distributed's errors in a peer become `PeerFailed`
(one line; the failing process printed the cause), the launcher stops the rest.
This module knows no quantization method, no model and no file.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from infer_tool.common.errors import BadInput, PeerFailed

T = TypeVar("T")
FAIL_RANK_ENV = "INFER_TOOL_TEST_FAIL_RANK"  # tests only: this process fails at the second layer


def world() -> tuple[int, int]:
    """(rank, world size) under accelerate launch / torchrun, else (0, 1); joins the process
    group the launcher describes (NCCL on GPUs, gloo on CPUs) through accelerate."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        from accelerate import PartialState

        PartialState()
    return dist.get_rank(), dist.get_world_size()


def finish() -> None:
    """Leave the process group cleanly (a barrier, then destroy it); without this, a rank
    that exits while its peer still holds the connection can abort at shutdown."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        with collective():
            dist.barrier()
        dist.destroy_process_group()


@contextlib.contextmanager
def collective() -> Iterator[None]:
    """A torch.distributed call; a peer's failure (a closed connection) becomes `PeerFailed`."""
    try:
        yield
    except (RuntimeError, ConnectionError) as e:
        raise PeerFailed("stopped: another process of this run failed (its error is above); nothing was written") from e


def stop_on_sigterm() -> None:
    """Under several processes, the launcher's SIGTERM (a peer failed) becomes `PeerFailed`,
    so this process removes what it started writing."""
    import signal

    def handler(signum: int, frame: Any) -> None:
        raise PeerFailed("stopped: another process of this run failed (its error is above); nothing was written")

    signal.signal(signal.SIGTERM, handler)


@dataclass(frozen=True)
class Shard:
    """This process's chunks [first, stop) of `chunks`; `world` processes in all."""

    rank: int = 0
    world: int = 1
    first: int = 0
    stop: int = 0
    chunks: int = 0

    @classmethod
    def split(cls, chunks: int, rank: int, world: int) -> Shard:
        base, extra = divmod(chunks, world)
        first = rank * base + min(rank, extra)
        return cls(rank, world, first, first + base + (rank < extra), chunks)

    def local(self, global_chunks: int) -> int:
        """How many of the first `global_chunks` chunks are this process's (its first ones)."""
        return max(0, min(global_chunks, self.stop) - self.first)


_shard = Shard()
_chunk: int | None = None  # the global index of the chunk being run, while a layer runs


@contextlib.contextmanager
def sharding(s: Shard) -> Iterator[None]:
    """While open, this process's chunks are `s` (the pipeline's run)."""
    global _shard
    saved, _shard = _shard, s
    try:
        yield
    finally:
        _shard = saved


def plan_shard(
    samples: int, batch_size: int, needs_data: bool, first_chunks: int, where: tuple[int, int] | None = None
) -> Shard:
    """This process's chunks of `samples` sequences in chunks of `batch_size`. Data-free runs
    (nothing measured but the reported error) stay on process 0; otherwise every process
    needs a chunk, and process 0 the first `first_chunks` (the searches' samples).
    where: (rank, world size); None: this process's (`world`)."""
    rank, size = where or world()
    n = max(1, -(-samples // batch_size))
    if size == 1 or not needs_data:
        return Shard(rank, size, 0, n if rank == 0 else 0, n)
    s = Shard.split(n, rank, size)
    if n < size or Shard.split(n, 0, size).stop < first_chunks:
        need = size * max(first_chunks, 1) * batch_size
        raise BadInput(
            f"--num-samples {samples} makes {n} chunks of {batch_size} sequences, too few for {size} processes: "
            f"use --num-samples >= {need} or fewer processes"
        )
    return s


def chunks(items: Iterable[T], start: int = 0) -> Iterator[T]:
    """Iterate this process's per-chunk `items` (local chunk `start`, ...), marking each as the
    chunk being run, so the statistics file what they see under the global chunk index."""
    global _chunk
    try:
        for k, item in enumerate(items, start):
            _chunk = _shard.first + k
            yield item
    finally:
        _chunk = None


def current_chunk(calls: int) -> int:
    """The global index of the chunk being run; outside `chunks`, this process's chunk
    `calls` (each call of the caller counting as one chunk)."""
    return _shard.first + calls if _chunk is None else _chunk


def fail_for_test(layer: int) -> None:
    """Tests only: the process named by INFER_TOOL_TEST_FAIL_RANK fails at layer 1."""
    if layer == 1 and os.environ.get(FAIL_RANK_ENV) == str(_shard.rank) and _shard.world > 1:
        raise BadInput(f"process {_shard.rank} failed on purpose ({FAIL_RANK_ENV})")


# ---------------------------------------------------------------- exact reductions

Node = tuple[int, int, "torch.Tensor | None"]  # (level, index, value); None: an exact zero


def _add(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    if b is None:
        return a
    return a.add_(b)


def _push(stack: list[Node], level: int, index: int, value: torch.Tensor | None, origin: int = 0) -> None:
    """Push node (level, index) after the stack's nodes, which start at chunk `origin` (gaps
    become zero leaves), merging siblings."""
    end = (stack[-1][1] + 1) << stack[-1][0] if stack else origin
    for leaf in range(end, index << level):
        _push(stack, 0, leaf, None, origin)
    stack.append((level, index, value))
    while (
        len(stack) >= 2 and stack[-1][0] == stack[-2][0] and stack[-2][1] % 2 == 0 and stack[-1][1] == stack[-2][1] + 1
    ):
        (l, i, a), (_, _, b) = stack[-2], stack.pop()
        stack[-1] = (l + 1, i // 2, _add(a, b))


class TreeSum:
    """The pairwise float64 sum over the global chunk index (module docstring) of the leaves
    `at` hands out, one per chunk; the caller adds that chunk's terms into its leaf."""

    def __init__(self) -> None:
        self.stack: list[Node] = []
        self.leaf: Node | None = None

    def at(self, index: int, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The leaf of chunk `index` (`make()`, zeros, when new); chunks come in order."""
        if self.leaf is not None and self.leaf[1] != index:
            if index < self.leaf[1]:
                raise ValueError(f"chunk {index} after chunk {self.leaf[1]}: chunks must come in order")
            _push(self.stack, *self.leaf, origin=_shard.first)
            self.leaf = None
        if self.leaf is None:
            self.leaf = (0, index, make())
        return self.leaf[2]

    def total(self, like: torch.Tensor) -> torch.Tensor:
        """The sum over every process's chunks (a collective under several processes); zeros
        shaped as `like` when nothing was added anywhere."""
        if self.leaf is not None:
            _push(self.stack, *self.leaf, origin=_shard.first)
            self.leaf = None
        local, self.stack = self.stack, []
        if _shard.world == 1:
            stack = local
        else:
            import torch.distributed as dist

            metas: list[Any] = [None] * _shard.world
            with collective():
                dist.all_gather_object(metas, [(l, i, v is not None) for l, i, v in local])
            stack = []
            for r, meta in enumerate(metas):
                for k, (l, i, present) in enumerate(meta):
                    value = None
                    if present:
                        value = local[k][2] if r == _shard.rank else torch.empty_like(like)
                        with collective():
                            dist.broadcast(value, src=r)
                    _push(stack, l, i, value)
        out = _fold(stack)
        return torch.zeros_like(like) if out is None else out


def _fold(stack: list[Node]) -> torch.Tensor | None:
    """The tree's root from the final stack: its nodes added from the right."""
    out = None
    for _, _, value in reversed(stack):
        out = _add(value, out)
    return out


def all_max(values: list[float]) -> list[float]:
    """Element-wise maximum over processes (exact)."""
    if _shard.world == 1 or not values:
        return values
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=_device())
    with collective():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def all_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum over processes of an int64 tensor (exact)."""
    if _shard.world == 1:
        return values
    import torch.distributed as dist

    t = values.to(_device(), torch.int64)
    with collective():
        dist.all_reduce(t)
    return t.to(values.device)


def _device() -> torch.device:
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def gather_terms(terms: list[Any]) -> list[Any]:
    """Every process's per-chunk `terms`, concatenated in chunk order."""
    if _shard.world == 1:
        return terms
    import torch.distributed as dist

    out: list[Any] = [None] * _shard.world
    with collective():
        dist.all_gather_object(out, terms)
    return [t for part in out for t in part]


def gather_counts(count: int) -> list[int]:
    """Every process's `count`, in rank order."""
    return gather_terms([count])


_inside_first = False


def on_first(fn: Callable[[], T]) -> T:
    """`fn()` on process 0, its result (picklable; tensors on the CPU) broadcast to all.
    Nested calls, already on process 0 only, just run."""
    global _inside_first
    if _shard.world == 1 or _inside_first:
        return fn()
    import torch.distributed as dist

    box: list[Any] = [None]
    if _shard.rank == 0:
        _inside_first = True
        try:
            box[0] = fn()
        finally:
            _inside_first = False
    with collective():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def shard() -> Shard:
    """This process's chunks (the pipeline's run; one process outside it)."""
    return _shard


def sum_in_order(
    owners: list[int], term: Callable[[int], list[torch.Tensor]], likes: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Σ_k term(k) for k = 0 .. len(owners) − 1 (each term a list of tensors shaped as
    `likes`), added left to right in that order, on every process. Term k is computed on
    process `owners[k]` only (`term(k)` there) and broadcast, so the sum has the same bits on
    every process and for any number of processes (a step every process must take alike,
    e.g. AutoRound's sign step). `likes`: the shapes, dtypes and device (gloo: CPU)."""
    total: list[torch.Tensor] | None = None
    for k, owner in enumerate(owners):
        if _shard.world == 1:
            values = term(k)
        else:
            import torch.distributed as dist

            values = term(k) if owner == _shard.rank else [torch.empty_like(t) for t in likes]
            with collective():
                for v in values:
                    dist.broadcast(v, src=owner)
        if total is None:
            total = values
        else:
            for t, v in zip(total, values):
                t.add_(v)
    return total if total is not None else [torch.zeros_like(t) for t in likes]
