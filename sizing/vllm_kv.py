"""KV-cache capacity as vLLM 0.32.0 allocates it: pages, block groups, blocks per
request, and the "Maximum concurrency for N tokens per request" line it logs.

Rules, read from vLLM 0.32.0's source (the file named on each):
- page of one layer (`kv_cache_interface.py`): attention `block_size x kv_heads_rank x
  (head_dim + v_head_dim) x dtype bytes`, MLA `block_size x (kv_lora_rank +
  qk_rope_head_dim) x dtype bytes` (one latent, no V), Mamba / linear attention the
  state itself (conv + recurrent, in the model dtype), independent of block_size.
- hybrid attention + state models (`platforms/interface.py` `_align_hybrid_block_size`):
  the attention block grows to `a x cdiv(state_page, a x attn_page_per_token)` tokens
  (`a` = max(16, --block-size), 128 for MLA) and the state page is padded to the
  attention page.
- groups (`core/kv_cache_utils.py` `get_kv_cache_groups`): one group when every layer
  has the same spec or the same kind (all full, all one sliding window, all state);
  otherwise pages are unified (smaller attention pages scale their block) and each kind
  is split into groups of `group_size` layers (the smallest kind's layer count, or the
  largest when it is below 1.5x the smallest), `layers[i::n]` to the i-th group.
- pool (`get_kv_cache_config_from_groups`): every worker's `num_blocks =
  available // bytes_per_block`, `bytes_per_block` = the largest group's page total on
  that worker (a pipeline stage holds its own layers); the engine keeps the smallest.
- per request at `max_model_len` L (`max_memory_usage_bytes`): full / MLA
  `cdiv(L, B)` blocks; sliding window W `cdiv(min(W - 1 + in_flight, L), B) + 1` with
  `in_flight = max_concurrent_batches x max_num_batched_tokens` (2 batches with async
  scheduling, the default since 0.14, pp + 1 with pipeline parallelism; `config/vllm.py`;
  one batch before 0.26); state `1` block, `2` when prefix caching is on
  (mamba_cache_mode "align", the default for hybrid models).
- `max_concurrency = num_blocks / sum of the groups' blocks per request`;
  "GPU KV cache size" = `int(max_concurrency x L)` tokens (`update_kv_cache_capacity`;
  before 0.20 `num_blocks // groups x min block size`). One block is the null block: the
  scheduler can hand out `num_blocks - 1`.
- `vllm serve`'s batch defaults (`engine/arg_utils.py` `get_batch_defaults`), keyed on
  the total CUDA reports: 16384 tokens / 1024 sequences at >= 160 GiB, 8192 / 1024 at
  >= 70 GiB except A100, else 2048 / 256.

Release differences are `vllm_versions.VllmPolicy`.

Modelled for bf16 / fp16 / fp8 (per-tensor scales) caches on the default FlashAttention
backend (kernel blocks of 16). Knows nothing of weights or GPUs: `available` comes in.
"""

from __future__ import annotations

from dataclasses import dataclass

from infer_tool.common.errors import BadInput
from infer_tool.sizing.defaults import VLLM_VERSION
from infer_tool.sizing.kv import KvDtype, ceil_div, state_bytes, token_bytes
from infer_tool.sizing.shape import MLA, SLIDING, STATE, ModelShape
from infer_tool.sizing.vllm_versions import VllmPolicy, policy

KERNEL_BLOCK = 16  # FlashAttention's kernel block multiple
GiB = 2**30


@dataclass(frozen=True)
class EngineArgs:
    """The vLLM engine arguments that change the cache and memory arithmetic (vLLM's
    names; None: the release's or `vllm serve`'s default)."""

    block_size: int = 16
    max_num_batched_tokens: int | None = None
    async_scheduling: bool | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int | None = None
    enforce_eager: bool = False
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    max_cudagraph_capture_size: int | None = None
    vllm_version: str = VLLM_VERSION
    model_runner: str | None = None  # "v1" / "v2" (VLLM_USE_V2_MODEL_RUNNER=0 / 1); None: the release's default
    decode_query_len: int = 1  # 1 + num_speculative_tokens with speculative decoding
    speculative_method: str | None = None  # vLLM 0.32's V2 runner falls back to V1 for suffix / medusa

    @property
    def policy(self) -> VllmPolicy:
        return policy(self.vllm_version)

    @property
    def async_on(self) -> bool:
        return self.policy.async_scheduling if self.async_scheduling is None else self.async_scheduling


def serve_batch_defaults(gpu_memory_bytes: int, gpu_name: str) -> tuple[int, int]:
    """`vllm serve`'s (max_num_batched_tokens, max_num_seqs) for a GPU of this total."""
    if gpu_memory_bytes >= 160 * GiB:
        return 16384, 1024
    if gpu_memory_bytes >= 70 * GiB and "a100" not in gpu_name.lower():
        return 8192, 1024
    return 2048, 256


@dataclass(frozen=True)
class Group:
    """Layers sharing one block table: their kind, window, block size and page."""

    kind: str
    window: int | None
    block: int
    page: int
    layers: tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    """What vLLM decides at start-up for one model on one TP rank."""

    groups: tuple[Group, ...]
    block_size: int  # attention block after hybrid alignment
    notes: tuple[str, ...] = ()


def _check_dtype(kv: KvDtype) -> None:
    if kv.scale_bytes or kv.bits not in (8, 16):
        raise BadInput(
            f"--kv-dtype {kv.name} has no vLLM {VLLM_VERSION} cache layout modelled here "
            "(accepted with vLLM accounting: bf16, fp16, fp8); use --accounting plain"
        )


def layout(shape: ModelShape, kv: KvDtype, *, tp: int, block_size: int = 16) -> Layout:
    """Groups, pages and block size of `shape` on one of `tp` ranks."""
    _check_dtype(kv)
    layers = shape.layers
    notes: list[str] = []
    attn = [i for i, l in enumerate(layers) if l.kind != STATE]
    states = [i for i, l in enumerate(layers) if l.kind == STATE]
    block = block_size
    state_page = max((state_bytes(layers[i], tp) for i in states), default=0)
    if attn and states:  # hybrid: grow the attention block until its page holds a state
        per_token = token_bytes(layers[attn[0]], kv, tp)
        align = max(KERNEL_BLOCK, block_size, 128 if layers[attn[0]].kind == MLA else 0)
        need = align * ceil_div(state_page, align * per_token)
        need = KERNEL_BLOCK * ceil_div(need, KERNEL_BLOCK)
        if block < need:
            block = need
            notes.append(f"attention block raised to {block} tokens so one page holds a state, as vLLM does")
        state_page = block * per_token  # the state page is padded to the attention page

    def spec(i: int) -> tuple[str, int | None, int, int]:
        l = layers[i]
        if l.kind == STATE:
            return STATE, None, block, state_page
        return l.kind, l.window if l.kind == SLIDING else None, block, block * token_bytes(l, kv, tp)

    specs = [spec(i) for i in range(len(layers))]
    kinds = {(k, w) for k, w, _, _ in specs}
    if len(kinds) == 1:  # uniform spec or uniform type: one group of every layer
        k, w, b, _ = specs[0]
        pages = {p for _, _, _, p in specs}
        page = pages.pop() if len(pages) == 1 else 0  # 0: per-layer pages (summed by the pool)
        return Layout((Group(k, w, b, page, tuple(range(len(layers)))),), block, tuple(notes))
    specs = _unify_pages(specs)
    buckets: dict[tuple, list[int]] = {}
    for i, s in enumerate(specs):
        buckets.setdefault(s, []).append(i)
    sizes = [len(v) for v in buckets.values()]
    group_size = min(sizes) if max(sizes) >= 1.5 * min(sizes) else max(sizes)
    groups = []
    for (k, w, b, page), members in buckets.items():
        n = ceil_div(len(members), group_size)
        groups += [Group(k, w, b, page, tuple(members[i::n])) for i in range(n)]
        if len(members) % group_size:
            notes.append(f"{group_size - len(members) % group_size} padding layer(s) in a {k} group, as vLLM adds")
    return Layout(tuple(groups), block, tuple(notes))


def _unify_pages(specs: list[tuple]) -> list[tuple]:
    """`unify_kv_cache_spec_page_size`: smaller attention pages scale their block up to
    the largest page; pages that do not divide it are padded (not MLA)."""
    top = max(p for *_, p in specs)
    out = []
    for k, w, b, p in specs:
        if p != top and k != STATE:
            if top % p == 0:
                b, p = b * (top // p), top
            elif k == MLA:
                raise BadInput(
                    f"vLLM {VLLM_VERSION} cannot unify this model's page sizes (MLA page {p} B vs {top} B); "
                    "use --accounting plain"
                )
            else:
                p = top
        out.append((k, w, b, top if k == STATE else p))
    return out


def layer_page(group: Group, layer: int, shape: ModelShape, kv: KvDtype, tp: int) -> int:
    """Page of one layer of `group` (per-layer when a uniform-type group mixes pages)."""
    if group.page:
        return group.page
    return group.block * token_bytes(shape.layers[layer], kv, tp)


def bytes_per_block(lay: Layout, stage: range, shape: ModelShape, kv: KvDtype, tp: int) -> int:
    """Pool bytes one block id costs on a worker holding the layers in `stage`."""
    return max(sum(layer_page(g, i, shape, kv, tp) for i in g.layers if i in stage) for g in lay.groups)


def num_blocks(lay: Layout, stages: list[range], available: list[int], shape: ModelShape, kv: KvDtype, tp: int) -> int:
    """Blocks every worker can hold with `available[i]` bytes on stage i (the smallest
    count wins), 0 if none."""
    counts = [a // bytes_per_block(lay, s, shape, kv, tp) for s, a in zip(stages, available) if len(s)]
    return max(0, min(counts))


def in_flight_tokens(engine: EngineArgs, max_num_batched_tokens: int, pp: int) -> int:
    """`VllmConfig.max_in_flight_tokens`: concurrent batches x max_num_batched_tokens
    (one batch before 0.26)."""
    if not engine.policy.sliding_in_flight_batches:
        return max_num_batched_tokens
    batches = pp + 1 if engine.async_on else pp  # Model Runner V2, the default
    return batches * max_num_batched_tokens


def group_blocks(group: Group, max_model_len: int, in_flight: int, prefix_caching: bool) -> int:
    """Blocks of this group one request at `max_model_len` tokens reserves."""
    if group.kind == STATE:
        return 2 if prefix_caching else 1
    if group.kind == SLIDING and group.window is not None:
        return ceil_div(min(group.window - 1 + in_flight, max_model_len), group.block) + 1
    return ceil_div(max_model_len, group.block)


def shared_prefix_blocks(group: Group, prefix: int) -> int:
    """Whole blocks of a common prompt prefix one copy serves for all requests
    (prefix caching; full-attention and MLA groups only, whose blocks stay resident)."""
    return 0 if group.kind in (STATE, SLIDING) else prefix // group.block


@dataclass(frozen=True)
class Capacity:
    """vLLM's figures for one max_model_len on one replica."""

    num_blocks: int
    blocks_per_request: int
    shared_blocks: int  # prefix blocks stored once (0 without --shared-prefix)
    max_concurrency_log: float  # what vLLM logs: num_blocks / blocks_per_request
    kv_cache_tokens: int  # "GPU KV cache size: N tokens"
    max_concurrency: int  # whole requests that fit in num_blocks - 1, with the shared prefix

    def fits(self, requests: int) -> bool:
        return (
            requests == 0
            or self.shared_blocks + requests * (self.blocks_per_request - self.shared_blocks) <= self.num_blocks - 1
        )


def capacity(
    lay: Layout,
    blocks: int,
    max_model_len: int,
    *,
    in_flight: int,
    prefix_caching: bool,
    prefix: int = 0,
    tokens_per_concurrency: bool = True,
) -> Capacity:
    prefix = min(prefix, max_model_len - 1)  # a request owns at least its last token
    per_request = sum(group_blocks(g, max_model_len, in_flight, prefix_caching) for g in lay.groups)
    shared = sum(
        min(shared_prefix_blocks(g, prefix), group_blocks(g, max_model_len, in_flight, prefix_caching))
        for g in lay.groups
    )
    log = blocks / per_request
    own = per_request - shared
    usable = blocks - 1 - shared
    tokens = (
        int(log * max_model_len)
        if tokens_per_concurrency
        else blocks // len(lay.groups) * min(g.block for g in lay.groups)
    )
    return Capacity(
        num_blocks=blocks,
        blocks_per_request=per_request,
        shared_blocks=shared,
        max_concurrency_log=log,
        kv_cache_tokens=tokens,
        max_concurrency=max(0, usable // own) if usable >= 0 else 0,
    )
