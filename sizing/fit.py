"""Does a context x concurrency fit one deployment, by vLLM's block accounting (the
default) or the plain per-token arithmetic, and what binds when it does not.

`Fit` wraps `capacity.Planner` (plain bytes, always computed) and, with vLLM
accounting, `vllm_kv` (blocks); each row carries both so the two can be compared. What a
GPU keeps beside weights and KV cache is vLLM's start-up profile (`vllm_memory`, one per
pipeline stage; the engine keeps the smallest block count) unless the deployment gives a
flat reserve. Knows nothing of speed (`roofline`) or of searching deployments (`solve`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from infer_tool.common.errors import BadInput
from infer_tool.sizing import vllm_kv, vllm_memory
from infer_tool.sizing.capacity import MAX_CONTEXT_SEARCH, Deployment, Planner, Row, pp_stages, validate
from infer_tool.sizing.kv import ceil_div
from infer_tool.sizing.presets import GpuPreset
from infer_tool.sizing.shape import STATE, ModelShape

ACCOUNTINGS = ("vllm", "plain")


@dataclass(frozen=True)
class FitRow:
    plain: Row
    vllm: vllm_kv.Capacity | None  # None with plain accounting
    fits: bool
    binding: str | None  # None if it fits, else "weights", "kv cache" or "max-num-seqs"
    kv_bytes_per_gpu: int  # by the chosen accounting, busiest GPU
    used_bytes_per_gpu: int

    @property
    def headroom_bytes(self) -> int:
        return self.plain.usable_bytes_per_gpu - self.used_bytes_per_gpu


class Fit:
    """One model on one deployment with one accounting."""

    def __init__(
        self,
        shape: ModelShape,
        dep: Deployment,
        weight_total: int,
        *,
        accounting: str = "vllm",
        engine: vllm_kv.EngineArgs = vllm_kv.EngineArgs(),
        gpu: GpuPreset | None = None,
        weights_per_gpu: int | None = None,
    ) -> None:
        if accounting not in ACCOUNTINGS:
            raise BadInput(f"--accounting {accounting!r} not known; accepted: {', '.join(ACCOUNTINGS)}")
        validate(shape, dep)
        self.shape, self.dep, self.accounting, self.engine = shape, dep, accounting, engine
        self.policy = engine.policy
        self.stages = [range(a, b) for a, b in pp_stages(shape.num_layers, dep.pp)]
        self.gpu_name = gpu.name if gpu else ""
        self.stage_weights = self._stage_weights(weight_total, weights_per_gpu)
        self.profiles: list[vllm_memory.MemoryProfile] | None = None
        reserve = dep.reserve_bytes
        if reserve is None:
            cc = gpu.compute_capability if gpu else ""
            self.profiles = [
                vllm_memory.profile(
                    shape,
                    self.profile_engine(),
                    self.policy,
                    total=dep.gpu_memory_bytes,
                    mem_util=dep.mem_util,
                    weights=weights,
                    compute_capability=cc,
                    tp=dep.tp,
                    layers=stage,
                    last_stage=i == len(self.stages) - 1,
                )
                for i, (stage, weights) in enumerate(zip(self.stages, self.stage_weights))
            ]
            reserve = max(p.overhead for p in self.profiles)
        self.planner = Planner(shape, dep, weight_total, reserve=reserve, weights_per_gpu=max(self.stage_weights))
        self.layout = (
            vllm_kv.layout(shape, dep.kv, tp=dep.tp, block_size=dep.block_size) if accounting == "vllm" else None
        )
        self.vllm = lru_cache(maxsize=4096)(self._vllm)

    def _stage_weights(self, total: int, per_gpu: int | None) -> list[int]:
        """Weight bytes on one GPU of each pipeline stage: its share of the decoder layers,
        the embedding on the first stage and the LM head on the last (a second copy of a
        tied embedding there, as vLLM builds it); each split over the TP ranks."""
        d = self.dep
        if per_gpu is not None:
            return [per_gpu] * len(self.stages)
        params = self.shape.params
        if d.pp == 1 or params is None:
            return [ceil_div(total, d.tp * d.pp)] * len(self.stages)
        edge = self.shape.vocab_size * self.shape.hidden_size * 2  # 16-bit embedding / head
        head_in_total = edge if not params.tied_head else 0
        per_layer = max(0, total - edge - head_in_total) / self.shape.num_layers
        out = []
        for i, stage in enumerate(self.stages):
            b = per_layer * len(stage) + (edge if i == 0 else 0) + (edge if i == len(self.stages) - 1 else 0)
            out.append(ceil_div(int(b), d.tp))
        return out

    # --- vLLM ---------------------------------------------------------------------
    def max_num_batched_tokens(self, max_model_len: int | None = None) -> int:
        """The engine's value, else `vllm serve`'s default (capped at max_num_seqs x
        max_model_len when one is given)."""
        if self.engine.max_num_batched_tokens is not None:
            return self.engine.max_num_batched_tokens
        tokens, seqs = vllm_kv.serve_batch_defaults(self.dep.gpu_memory_bytes, self.gpu_name)
        return tokens if max_model_len is None else min(tokens, seqs * max_model_len)

    def max_num_seqs(self) -> int:
        if self.engine.max_num_seqs is not None:
            return self.engine.max_num_seqs
        return vllm_kv.serve_batch_defaults(self.dep.gpu_memory_bytes, self.gpu_name)[1]

    def seq_cap(self) -> int | None:
        """Sequences one replica runs at once: --max-num-seqs, else vllm serve's default
        (vLLM accounting); None with plain accounting and no --max-num-seqs."""
        if self.engine.max_num_seqs is not None or self.layout is not None:
            return self.max_num_seqs()
        return None

    def _over_seq_cap(self, concurrency: int) -> bool:
        cap = self.seq_cap()
        return cap is not None and ceil_div(concurrency, self.dep.dp) > cap

    def model_runner_v2(self) -> bool:
        """The engine's --model-runner, else the release's default for this model."""
        if self.engine.model_runner is not None:
            return self.engine.model_runner == "v2"
        if self.engine.speculative_method in ("suffix", "medusa"):  # 0.32: V2 does not support them
            return False
        s = self.shape
        attention = any(l.kind != STATE for l in s.layers)
        moe = s.forward is not None and s.forward.num_experts > 0
        return self.policy.model_runner_v2(
            s.model_type, moe=moe, hybrid=attention and s.count(STATE) > 0, attention_free=not attention
        )

    def profile_engine(self) -> vllm_memory.ProfileEngine:
        e = self.engine
        return vllm_memory.ProfileEngine(
            self.max_num_batched_tokens(),
            self.max_num_seqs(),
            e.enforce_eager,
            e.cudagraph_capture_sizes,
            e.max_cudagraph_capture_size,
            self.model_runner_v2(),
            e.decode_query_len,
        )

    def stage_budgets(self) -> list[int]:
        """KV-cache bytes each pipeline stage's workers have (vLLM sizes them apart)."""
        if self.profiles is None or self.dep.kv_cache_memory_bytes is not None:
            spare = self.planner.kv_budget_per_gpu
            if self.dep.kv_cache_memory_bytes is None:  # a flat reserve: each stage's own weights
                spare += self.planner.weight_bytes_per_gpu
                return [spare - w for w in self.stage_weights]
            return [spare] * len(self.stages)
        return [p.available for p in self.profiles]

    def num_blocks(self) -> int:
        assert self.layout is not None
        d = self.dep
        return vllm_kv.num_blocks(self.layout, self.stages, self.stage_budgets(), self.shape, d.kv, d.tp)

    def bytes_per_block(self) -> int:
        """Pool bytes of one block on the stage that limits num_blocks."""
        assert self.layout is not None
        d = self.dep
        return max(vllm_kv.bytes_per_block(self.layout, s, self.shape, d.kv, d.tp) for s in self.stages)

    def _vllm(self, max_model_len: int) -> vllm_kv.Capacity:
        return self.vllm_at(self.stage_budgets(), max_model_len)

    def vllm_at(self, budgets: list[int], max_model_len: int) -> vllm_kv.Capacity:
        """vLLM's capacity with the given KV bytes per GPU of each pipeline stage (as its
        workers log "Available KV cache memory")."""
        assert self.layout is not None
        d = self.dep
        if len(budgets) != len(self.stages):
            raise BadInput(f"{len(budgets)} KV budgets given for {len(self.stages)} pipeline stages")
        blocks = vllm_kv.num_blocks(self.layout, self.stages, budgets, self.shape, d.kv, d.tp)
        in_flight = vllm_kv.in_flight_tokens(self.engine, self.max_num_batched_tokens(max_model_len), self.dep.pp)
        return vllm_kv.capacity(
            self.layout,
            blocks,
            max_model_len,
            in_flight=in_flight,
            prefix_caching=self.engine.enable_prefix_caching,
            prefix=self.dep.shared_prefix,
            tokens_per_concurrency=self.policy.kv_tokens_per_concurrency,
        )

    # --- rows and limits -------------------------------------------------------------
    def row(self, context: int, concurrency: int) -> FitRow:
        plain = self.planner.row(context, concurrency)
        weights_fit = self.planner.weights_fit
        if self.layout is None:
            fits, kv_gpu, cap = plain.fits, plain.kv_bytes_per_gpu, None
        else:
            cap = self.vllm(context)
            n = ceil_div(concurrency, self.dep.dp)
            fits = weights_fit and cap.fits(n)
            blocks = cap.shared_blocks + n * (cap.blocks_per_request - cap.shared_blocks) + 1  # + null block
            kv_gpu = blocks * self.bytes_per_block()
        over = self._over_seq_cap(concurrency)
        binding = (
            None
            if fits and not over
            else ("weights" if not weights_fit else "kv cache" if not fits else "max-num-seqs")
        )
        fits = fits and not over
        used = plain.weight_bytes_per_gpu + plain.reserve_bytes_per_gpu + kv_gpu
        return FitRow(plain, cap, fits, binding, kv_gpu, used)

    def fits(self, context: int, concurrency: int) -> bool:
        if self._over_seq_cap(concurrency):
            return False
        if self.layout is None:
            return self.planner.fits(context, concurrency)
        return self.planner.weights_fit and self.vllm(context).fits(ceil_div(concurrency, self.dep.dp))

    def max_concurrency(self, context: int) -> int:
        """Most sequences of `context` tokens served at once: what the KV cache holds,
        capped at max_num_seqs per replica."""
        cap = self.seq_cap()
        if self.layout is None:
            kv_max = self.planner.max_concurrency(context)
            return kv_max if cap is None else min(kv_max, cap * self.dep.dp)
        if not self.planner.weights_fit:
            return 0
        assert cap is not None
        return min(self.vllm(context).max_concurrency, cap) * self.dep.dp

    def max_context(self, concurrency: int) -> tuple[int, str]:
        """Longest context at which `concurrency` sequences fit, and what limits it."""
        if self._over_seq_cap(concurrency):
            return 0, "max-num-seqs"
        if self.layout is None:
            return self.planner.max_context(concurrency)
        if not self.planner.weights_fit:
            return 0, "weights"
        limit = self.shape.max_position_embeddings
        if not self.fits(1, concurrency):
            return 0, "memory"
        hi = limit or MAX_CONTEXT_SEARCH
        if self.fits(hi, concurrency):
            return hi, "model" if limit else "unbounded"
        lo = 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.fits(mid, concurrency) else (lo, mid)
        return lo, "memory"

    def headroom(self, context: int, concurrency: int) -> float:
        """Share of the KV budget left at this row (negative when it does not fit)."""
        budget = self.planner.kv_budget_per_gpu
        if budget <= 0:
            return -1.0
        return 1 - self.row(context, concurrency).kv_bytes_per_gpu / budget
