"""Capacity planning: weights + KV cache + reserve per GPU against the usable budget
(`ceil(mem_util x GPU memory)`, as vLLM's --gpu-memory-utilization, or a fixed KV-cache
size as vLLM's --kv-cache-memory-bytes), for a grid of contexts and concurrencies; the
largest concurrency at each context and the longest context at each concurrency. This
is the plain per-token arithmetic; `vllm_kv` holds vLLM's block accounting.

Parallelism: `tp` ranks split heads (see `kv`); `pp` stages split layers as vLLM's
`get_pp_indices` does (even split, the remainder to the stages before the last); GPUs
beyond `tp x pp` are data-parallel replicas, each with its own weights, serving an
equal share of the sequences (`ceil(c / dp)` on the busiest). Weights are split evenly
over a replica's `tp x pp` GPUs. "All GPUs together" figures count every replica of a
replicated head or MLA latent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from infer_tool.common.errors import BadInput
from infer_tool.sizing.defaults import DEFAULT_BLOCK_SIZE, DEFAULT_MEM_UTIL
from infer_tool.sizing.kv import KvDtype, SequenceBytes, ceil_div, sequence_bytes, token_bytes
from infer_tool.sizing.shape import FULL, MLA, SLIDING, STATE, ModelShape

MAX_CONTEXT_SEARCH = 2**24  # tokens; beyond this a context is reported as unbounded


@dataclass(frozen=True)
class Deployment:
    gpu_memory_bytes: int
    num_gpus: int
    tp: int
    pp: int
    kv: KvDtype
    mem_util: float = DEFAULT_MEM_UTIL
    reserve_bytes: int | None = None  # None: vLLM's start-up profile, modelled by `fit.Fit`
    block_size: int = DEFAULT_BLOCK_SIZE
    shared_prefix: int = 0
    kv_cache_memory_bytes: int | None = None  # fixed KV cache per GPU (ignores mem_util)

    @property
    def dp(self) -> int:
        return self.num_gpus // (self.tp * self.pp)

    @property
    def usable_bytes(self) -> int:
        """Memory per GPU the weights, reserve and KV cache may use."""
        if self.kv_cache_memory_bytes is not None:
            return self.gpu_memory_bytes
        return math.ceil(self.gpu_memory_bytes * self.mem_util)  # vLLM's request_memory


@dataclass(frozen=True)
class Row:
    context: int
    concurrency: int
    kv_bytes_per_sequence: int  # one sequence alone, all layers, all GPUs together
    kv_bytes_total: int  # all sequences, shared prefix once per replica, all GPUs
    kv_bytes_per_gpu: int  # busiest GPU
    weight_bytes_per_gpu: int
    reserve_bytes_per_gpu: int
    used_bytes_per_gpu: int
    usable_bytes_per_gpu: int
    fits: bool

    @property
    def headroom_bytes(self) -> int:
        """Usable minus used per GPU: negative when it does not fit."""
        return self.usable_bytes_per_gpu - self.used_bytes_per_gpu


def pp_stages(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """[start, end) layer ranges of each pipeline stage (vLLM `get_pp_indices`)."""
    sizes = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):
        sizes[-i] += 1
    bounds, start = [], 0
    for s in sizes:
        bounds.append((start, start + s))
        start += s
    return bounds


def validate(shape: ModelShape, dep: Deployment) -> None:
    """Raise BadInput for a deployment the model cannot be split over."""
    for flag, v in (("--tp", dep.tp), ("--pp", dep.pp), ("--num-gpus", dep.num_gpus), ("--block-size", dep.block_size)):
        if v < 1:
            raise BadInput(f"{flag} {v} must be at least 1")
    if dep.shared_prefix < 0:
        raise BadInput(f"--shared-prefix {dep.shared_prefix} must be 0 or more")
    if not 0 < dep.mem_util <= 1:
        raise BadInput(f"--mem-util {dep.mem_util} must be in (0, 1]")
    if dep.gpu_memory_bytes <= 0:
        raise BadInput(f"GPU memory {dep.gpu_memory_bytes} must be greater than zero")
    if dep.reserve_bytes is not None and dep.reserve_bytes < 0:
        raise BadInput(f"--reserve {dep.reserve_bytes} must be 0 or more")
    if dep.kv_cache_memory_bytes is not None and dep.kv_cache_memory_bytes <= 0:
        raise BadInput(f"--kv-cache-memory {dep.kv_cache_memory_bytes} must be greater than zero")
    if dep.num_gpus % (dep.tp * dep.pp):
        raise BadInput(
            f"--num-gpus {dep.num_gpus} is not a multiple of --tp {dep.tp} x --pp {dep.pp}; "
            "accepted: num_gpus = tp x pp x data-parallel replicas"
        )
    if dep.pp > shape.num_layers:
        raise BadInput(f"--pp {dep.pp} exceeds the model's {shape.num_layers} layers")
    if shape.num_attention_heads % dep.tp:
        raise BadInput(
            f"--tp {dep.tp} does not divide the model's {shape.num_attention_heads} attention heads; "
            f"accepted: {', '.join(str(d) for d in _divisors(shape.num_attention_heads))}"
        )
    for layer in shape.layers:
        h = layer.kv_heads
        if h and (h % dep.tp if dep.tp <= h else dep.tp % h):
            raise BadInput(f"--tp {dep.tp} neither divides nor is a multiple of the {h} KV heads")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class Planner:
    """Memory arithmetic for one model on one deployment (all sizes in bytes). `reserve`
    (else `dep.reserve_bytes`) is what the GPU keeps beside weights and KV cache;
    `weights_per_gpu` overrides an even split of `weight_bytes`."""

    def __init__(
        self,
        shape: ModelShape,
        dep: Deployment,
        weight_bytes: int,
        *,
        reserve: int | None = None,
        weights_per_gpu: int | None = None,
    ) -> None:
        validate(shape, dep)
        self.shape, self.dep = shape, dep
        self.reserve_bytes = dep.reserve_bytes if reserve is None else reserve
        if self.reserve_bytes is None:
            raise ValueError("Planner needs a reserve: Deployment.reserve_bytes or reserve=")
        self.stages = [shape.layers[a:b] for a, b in pp_stages(shape.num_layers, dep.pp)]
        self.weight_bytes_per_gpu = (
            weights_per_gpu if weights_per_gpu is not None else ceil_div(weight_bytes, dep.tp * dep.pp)
        )
        # KV budget per GPU; <= 0 when the weights (and reserve) alone do not fit
        spare = dep.usable_bytes - self.weight_bytes_per_gpu - self.reserve_bytes
        if dep.kv_cache_memory_bytes is None:
            self.kv_budget_per_gpu = spare
        else:
            self.kv_budget_per_gpu = dep.kv_cache_memory_bytes if spare >= dep.kv_cache_memory_bytes else min(spare, 0)
        self._stage_bytes = lru_cache(maxsize=4096)(self._stage_bytes_uncached)

    @property
    def weights_fit(self) -> bool:
        """Weights + reserve (+ a fixed --kv-cache-memory) leave room for a KV cache."""
        return self.kv_budget_per_gpu > 0

    def weights_shortfall(self) -> int:
        """Bytes per GPU by which weights + reserve (+ fixed KV) exceed the usable memory."""
        fixed = self.dep.kv_cache_memory_bytes or 0
        return self.weight_bytes_per_gpu + self.reserve_bytes + fixed - self.dep.usable_bytes

    # --- per-token / per-sequence figures -------------------------------------------
    def bytes_per_token_by_kind(self) -> dict[str, int]:
        """Bytes one more token of context costs, per growing layer kind, all GPUs of a
        replica together (sliding layers until their window is full)."""
        out: dict[str, int] = {}
        for layer in self.shape.layers:
            if layer.kind != STATE:
                out[layer.kind] = out.get(layer.kind, 0) + token_bytes(layer, self.dep.kv, self.dep.tp) * self.dep.tp
        return out

    def state_bytes_per_sequence(self) -> int:
        seq = sequence_bytes([l for l in self.shape.layers if l.kind == STATE], 1, self.dep.kv, tp=self.dep.tp, block=1)
        return seq.unique * self.dep.tp

    def _stage_bytes_uncached(self, context: int) -> tuple[SequenceBytes, ...]:
        d = self.dep
        return tuple(
            sequence_bytes(layers, context, d.kv, tp=d.tp, block=d.block_size, prefix=d.shared_prefix)
            for layers in self.stages
        )

    def sequence_by_kind(self, context: int) -> dict[str, int]:
        """One sequence alone at `context`, bytes per layer kind, all GPUs together."""
        out: dict[str, int] = {}
        for s in self._stage_bytes(context):
            for kind, b in s.by_kind.items():
                out[kind] = out.get(kind, 0) + b * self.dep.tp
        return out

    # --- grid ------------------------------------------------------------------------
    def kv_per_gpu(self, context: int, concurrency: int) -> int:
        n = ceil_div(concurrency, self.dep.dp)  # sequences on the busiest replica
        if n == 0:
            return 0
        return max(s.shared + n * s.unique for s in self._stage_bytes(context))

    def row(self, context: int, concurrency: int) -> Row:
        d = self.dep
        stages = self._stage_bytes(context)
        replicas = min(d.dp, concurrency)
        kv_gpu = self.kv_per_gpu(context, concurrency)
        used = self.weight_bytes_per_gpu + kv_gpu + self.reserve_bytes
        return Row(
            context=context,
            concurrency=concurrency,
            kv_bytes_per_sequence=sum(s.alone for s in stages) * d.tp,
            kv_bytes_total=sum(replicas * s.shared + concurrency * s.unique for s in stages) * d.tp,
            kv_bytes_per_gpu=kv_gpu,
            weight_bytes_per_gpu=self.weight_bytes_per_gpu,
            reserve_bytes_per_gpu=self.reserve_bytes,
            used_bytes_per_gpu=used,
            usable_bytes_per_gpu=d.usable_bytes,
            fits=self.fits(context, concurrency),
        )

    def fits(self, context: int, concurrency: int) -> bool:
        return self.weights_fit and self.kv_per_gpu(context, concurrency) <= self.kv_budget_per_gpu

    def max_concurrency(self, context: int) -> int:
        """Largest number of sequences of `context` tokens that fit (0 if none). Every
        sequence owns at least one block beyond a shared prefix shorter than the context
        (the caller refuses a prefix that is not)."""
        if not self.weights_fit:
            return 0
        per_replica = min((self.kv_budget_per_gpu - s.shared) // s.unique for s in self._stage_bytes(context))
        return max(0, per_replica) * self.dep.dp

    def max_context(self, concurrency: int) -> tuple[int, str]:
        """Longest context at which `concurrency` sequences fit, and what limits it:
        'memory', 'weights' (no room for any cache), 'model' (max_position_embeddings) or
        'unbounded' (no growth, no limit)."""
        limit = self.shape.max_position_embeddings
        if not self.weights_fit:
            return 0, "weights"
        if not self.fits(1, concurrency):
            return 0, "memory"
        if limit and self.fits(limit, concurrency):
            return limit, "model"
        hi = limit or MAX_CONTEXT_SEARCH
        if self.fits(hi, concurrency):
            return hi, "unbounded"
        lo = 1  # fits(lo) and not fits(hi); memory grows with context, so bisect
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.fits(mid, concurrency) else (lo, mid)
        return lo, "memory"


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


KIND_LABELS = {FULL: "full attention", SLIDING: "sliding window", MLA: "MLA latent", STATE: "linear/recurrent state"}
