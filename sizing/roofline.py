"""Roofline speed model of serving one model on one GPU type: decode step time, prefill
time, TTFT, TPOT and output tokens/s (standard library only; no engine, no GPU).

    from infer_tool.sizing.presets import gpu_preset
    from infer_tool.sizing.resolve import resolve_model
    from infer_tool.sizing.roofline import Hardware, Workload, step_times

    shape = resolve_model("llama-3.1-70b").shape
    t = step_times(shape, Hardware.from_preset(gpu_preset("H100-80GB")),
                   Workload(prompt_len=1000, output_len=1000, batch=16), weights="fp8", tp=2)
    t.tpot_s, t.ttft_s, t.output_tokens_per_s

Model (per replica of `tp x pp` GPUs; times in seconds):
- decode step over `batch` sequences of `q` query tokens each (q = 1, or k + 1 when a
  speculative pass verifies k drafts): `max(memory, compute) + comm + overhead` with
  memory = (weight bytes / tp + batch x KV bytes read per sequence per rank) / (HBM
  bandwidth x hbm efficiency); compute = batch x q x (2 x active linear params + attention
  FLOPs) / tp / (dense peak of the weight dtype x mfu); comm = 2 all-reduces per layer of
  `batch x q x hidden x 2` bytes over the link (ring: 2 (tp-1)/tp of the message each way)
  plus a latency per call, and one hand-off per pipeline boundary. Pipeline stages run
  one after another (no micro-batch overlap is assumed). MoE: every expert is read,
  only the active ones multiply.
- prefill of P tokens: `2 x active linear params x P` + causal attention FLOPs at
  the same peak x mfu, bounded below by one read of the weights, plus the all-reduces.
- TTFT = prefill of the prompt on an idle replica. TPOT = the decode step at the mean
  context (prompt + output / 2) plus, under continuous batching, the prefill work that
  arrives per step: `batch / output_len` new prompts. With speculation: (verify step +
  k x c x plain step) / tokens per pass (Leviathan et al. 2023). Output tokens/s =
  batch / TPOT.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infer_tool.common.errors import BadInput
from infer_tool.sizing.kv import KvDtype, kv_dtype, state_bytes, token_bytes
from infer_tool.sizing.presets import GpuPreset
from infer_tool.sizing.shape import MLA, SLIDING, STATE, ModelShape
from infer_tool.sizing.weights import weight_bytes

ACT_BYTES = 2  # bf16 activations on the wire


@dataclass(frozen=True)
class Hardware:
    """One GPU: peak HBM bandwidth, dense tensor FLOP/s per dtype, link bandwidth per
    direction (bytes/s, FLOP/s)."""

    name: str
    hbm_bytes_per_s: float
    flops: dict[str, float]
    link_bytes_per_s: float

    @classmethod
    def from_preset(cls, p: GpuPreset) -> Hardware:
        if not p.has_speed:
            raise BadInput(f"GPU {p.key}: its datasheet gives no dense BF16 FLOP/s or bandwidth; no speed model")
        flops = {"bf16": p.bf16_flops}
        if p.fp8_flops:
            flops["fp8"] = p.fp8_flops
        return cls(p.key, p.hbm_bytes_per_s, flops, p.link_bytes_per_s or 0.0)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of the datasheet peaks, and fixed costs. Defaults are round
    engineering figures, not fitted to the benchmarks the tests compare against."""

    hbm: float = 0.80  # decode GEMV / paged-attention reads vs peak HBM bandwidth
    mfu: float = 0.50  # tensor-core FLOP/s achieved vs the dense peak
    link: float = 0.70  # all-reduce bus bandwidth vs the link peak
    allreduce_latency_s: float = 10e-6  # fixed cost of one all-reduce / hand-off
    step_overhead_s: float = 0.0  # per engine step (hidden by async scheduling in vLLM)

    def __post_init__(self) -> None:
        for flag, v in (("--hbm-efficiency", self.hbm), ("--mfu", self.mfu), ("--link-efficiency", self.link)):
            if not 0 < v <= 1:
                raise BadInput(f"{flag} {v} must be in (0, 1]")
        if not (0 <= self.allreduce_latency_s < 1 and 0 <= self.step_overhead_s < 10):
            raise BadInput("latency and overhead must be finite, non-negative seconds")


@dataclass(frozen=True)
class Speculation:
    """Speculative decoding: k drafts per pass at relative cost c, E tokens per pass."""

    alpha: float
    k: int
    cost_ratio: float

    def __post_init__(self) -> None:
        if not 0 <= self.alpha <= 1:
            raise BadInput(f"speculative alpha {self.alpha} must be in [0, 1]")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or not 1 <= self.k <= 64:
            raise BadInput(f"speculative k {self.k!r} must be an integer from 1 to 64")
        if not 0 <= self.cost_ratio < 100:
            raise BadInput(f"draft cost ratio c {self.cost_ratio} must be in [0, 100)")

    @property
    def tokens_per_pass(self) -> float:
        """(1 - α^(k+1)) / (1 - α)."""
        return float(self.k + 1) if self.alpha >= 1.0 else (1 - self.alpha ** (self.k + 1)) / (1 - self.alpha)


@dataclass(frozen=True)
class Workload:
    """Per replica: `batch` concurrent sequences of `prompt_len` + `output_len` tokens."""

    prompt_len: int
    output_len: int
    batch: int = 1
    spec: Speculation | None = None


@dataclass(frozen=True)
class StepTimes:
    decode_step_s: float  # one plain decode step of the batch
    memory_s: float
    compute_s: float
    comm_s: float
    bound: str  # "memory" or "compute" (the larger term of the decode step)
    prefill_s: float  # = TTFT on an idle replica
    tokens_per_pass: float
    tpot_s: float
    output_tokens_per_s: float  # per replica
    terms: dict[str, float] = field(default_factory=dict)

    @property
    def ttft_s(self) -> float:
        return self.prefill_s


def _compute_dtype(weights: str, hw: Hardware) -> str:
    """FP8 (and INT8 W8A8) weights run on the FP8-rate tensor cores where the GPU has
    them; 16-bit and weight-only INT4 run at the BF16 rate."""
    return "fp8" if weights in ("fp8", "int8") and "fp8" in hw.flops else "bf16"


class _Model:
    """Per-token costs of one model on one rank of a `tp` x `pp` replica."""

    def __init__(self, shape: ModelShape, kv: KvDtype, tp: int, weight_total: int) -> None:
        if shape.params is None:
            raise BadInput(f"{shape.name}: parameter count unknown; the speed model needs it")
        self.shape, self.kv, self.tp = shape, kv, tp
        self.weight_bytes_rank = weight_total / tp
        self.linear_flops = 2 * shape.params.matmul_params / tp  # a tied lm_head multiplies too

    def kv_read(self, context: float) -> float:
        """KV bytes one sequence reads per step on one rank (all stages together)."""
        total = 0.0
        for l in self.shape.layers:
            if l.kind == STATE:
                total += 2 * state_bytes(l, self.tp)  # read and write the state
            else:
                span = min(context, l.window) if l.kind == SLIDING and l.window else context
                total += token_bytes(l, self.kv, self.tp) * span
        return total

    def attention_flops(self, context: float, new_tokens: float) -> float:
        """FLOPs of `new_tokens` queries attending to `context` keys, on one rank."""
        heads = self.shape.num_attention_heads / self.tp
        total = 0.0
        for l in self.shape.layers:
            if l.kind == STATE:
                continue
            span = min(context, l.window) if l.kind == SLIDING and l.window else context
            width = (2 * l.kv_lora_rank + l.qk_rope_head_dim) if l.kind == MLA else (l.head_dim + l.v_head_dim)
            total += 2 * heads * width * span * new_tokens
        return total

    def prefill_attention_flops(self, prompt: int) -> float:
        """Causal attention over a prompt: token i sees min(i, window) keys."""
        mean_span = (prompt + 1) / 2
        return self.attention_flops(mean_span, prompt)  # windows cap the span inside


def _comm(shape: ModelShape, hw: Hardware, eff: Efficiency, tp: int, pp: int, tokens: float) -> float:
    message = tokens * shape.hidden_size * ACT_BYTES
    link = hw.link_bytes_per_s * eff.link
    total = 0.0
    if tp > 1:
        if link <= 0:
            raise BadInput(f"GPU {hw.name}: no interconnect bandwidth known for tensor parallelism")
        per_call = 2 * (tp - 1) / tp * message / link + eff.allreduce_latency_s
        total += 2 * shape.num_layers * per_call
    if pp > 1:
        total += (pp - 1) * ((message / link if link > 0 else 0.0) + eff.allreduce_latency_s)
    return total


def step_times(
    shape: ModelShape,
    hw: Hardware,
    work: Workload,
    *,
    weights: str = "bf16",
    kv: str | KvDtype = "bf16",
    tp: int = 1,
    pp: int = 1,
    group_size: int = 128,
    weight_total: int | None = None,
    eff: Efficiency = Efficiency(),
) -> StepTimes:
    """Step times of `work` on one replica of `tp x pp` GPUs of type `hw`.
    `weight_total` overrides the bytes estimated from the parameter count and `weights`."""
    if work.batch < 1 or work.prompt_len < 1 or work.output_len < 1:
        raise BadInput(f"batch, prompt and output lengths must be at least 1 (got {work})")
    kvd = kv_dtype(kv) if isinstance(kv, str) else kv
    if weight_total is None:
        if shape.params is None:
            raise BadInput(f"{shape.name}: parameter count unknown; the speed model needs it")
        weight_total = weight_bytes(shape.params, weights, group_size).total
    m = _Model(shape, kvd, tp, weight_total)
    peak = hw.flops[_compute_dtype(weights, hw)] * eff.mfu
    bw = hw.hbm_bytes_per_s * eff.hbm
    context = work.prompt_len + work.output_len / 2

    def decode(q: int) -> tuple[float, float, float, float]:
        memory = (m.weight_bytes_rank + work.batch * m.kv_read(context)) / bw
        compute = work.batch * (q * m.linear_flops + m.attention_flops(context, q)) / peak
        comm = _comm(shape, hw, eff, tp, pp, work.batch * q)
        return max(memory, compute) + comm + eff.step_overhead_s, memory, compute, comm

    step, memory, compute, comm = decode(1)
    p = work.prompt_len
    prefill = (
        max((p * m.linear_flops + m.prefill_attention_flops(p)) / peak, m.weight_bytes_rank / bw)
        + _comm(shape, hw, eff, tp, pp, p)
        + eff.step_overhead_s
    )
    spec = work.spec
    if spec is None:
        per_pass, tokens = step, 1.0
    else:
        per_pass = decode(spec.k + 1)[0] + spec.k * spec.cost_ratio * step
        tokens = spec.tokens_per_pass
    interference = work.batch / work.output_len * prefill  # prompts arriving per step
    tpot = per_pass / tokens + interference
    return StepTimes(
        decode_step_s=step,
        memory_s=memory,
        compute_s=compute,
        comm_s=comm,
        bound="memory" if memory >= compute else "compute",
        prefill_s=prefill,
        tokens_per_pass=tokens,
        tpot_s=tpot,
        output_tokens_per_s=work.batch / tpot,
        terms={"prefill_interference_s": interference, "pass_s": per_pass},
    )
