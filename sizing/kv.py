"""KV-cache bytes of one sequence on one tensor-parallel rank, layer by layer.

Per token per layer (elements): standard attention `kv_heads_rank * (head_dim +
v_head_dim)` with `kv_heads_rank = max(1, kv_heads // tp)` (heads replicated when
tp > kv_heads); MLA `kv_lora_rank + qk_rope_head_dim` on every rank (the latent is not
split by heads). A paged cache holds whole blocks of `block_size` tokens: full layers
`ceil(L / B)` blocks; sliding layers at most the blocks `W` consecutive tokens can span,
`ceil((W - 1) / B) + 1` (worst case over positions, so memory never shrinks as L
grows). Linear-attention / Mamba layers hold a constant state per sequence, split over
TP ranks by heads or channels: the conv state in the model dtype, the recurrent (SSM)
state in its own dtype (`LayerSpec.ssm_dtype_bytes`, float32 where the config asks);
KV quantization does not apply.

A shared prompt prefix of P tokens (prefix caching) is stored once per replica: only
whole blocks are shared, and in sliding layers only the part still inside the window.

Knows nothing of GPUs, weights or concurrency (see `capacity`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infer_tool.common.errors import BadInput
from infer_tool.sizing.shape import FULL, MLA, SLIDING, STATE, LayerSpec


@dataclass(frozen=True)
class KvDtype:
    """Element width of the cache and the scale bytes stored with each K or V vector
    (one vector = one token of one head, or one MLA latent)."""

    name: str
    bits: int
    scale_bytes: int
    scales: str


KV_DTYPES: dict[str, KvDtype] = {
    d.name: d
    for d in (
        KvDtype("bf16", 16, 0, "none"),
        KvDtype("fp16", 16, 0, "none"),
        # vLLM fp8 (e4m3) cache: one k_scale / v_scale per layer, a constant, not per token.
        KvDtype("fp8", 8, 0, "per-tensor k_scale/v_scale per layer (vLLM)"),
        # Online int8/int4 KV (LMDeploy quant_policy 8/4, KIVI-style): asymmetric, an fp16
        # scale and an fp16 zero point per token per head.
        KvDtype("int8", 8, 4, "fp16 scale + zero point per token per head"),
        KvDtype("int4", 4, 4, "fp16 scale + zero point per token per head"),
    )
}


def kv_dtype(name: str) -> KvDtype:
    try:
        return KV_DTYPES[name.lower()]
    except KeyError:
        raise BadInput(f"--kv-dtype {name!r} not known; accepted: {', '.join(KV_DTYPES)}") from None


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def token_bytes(layer: LayerSpec, kv: KvDtype, tp: int) -> int:
    """Bytes one token adds to `layer`'s cache on one TP rank (0 for state layers)."""
    if layer.kind in (FULL, SLIDING):
        heads = max(1, layer.kv_heads // tp)
        elements = heads * (layer.head_dim + layer.v_head_dim)
        vectors = 2 * heads  # one K and one V vector per head
    elif layer.kind == MLA:
        elements, vectors = layer.latent_dim, 1
    else:
        return 0
    return ceil_div(elements * kv.bits, 8) + vectors * kv.scale_bytes


def state_bytes(layer: LayerSpec, tp: int) -> int:
    """Constant bytes a state layer holds per sequence on one TP rank."""
    if layer.kind != STATE:
        return 0
    shards = min(tp, layer.state_shards)
    conv = layer.state_elements - layer.ssm_state_elements
    return (
        ceil_div(conv, shards) * layer.conv_dtype_bytes
        + ceil_div(layer.ssm_state_elements, shards) * layer.ssm_dtype_bytes
    )


def held_blocks(layer: LayerSpec, context: int, block: int) -> int:
    """Cache blocks a sequence of `context` tokens holds in `layer`."""
    blocks = ceil_div(context, block)
    if layer.kind == SLIDING and layer.window is not None:
        blocks = min(blocks, ceil_div(layer.window - 1, block) + 1)
    return blocks


def shared_blocks(layer: LayerSpec, context: int, prefix: int, block: int) -> int:
    """Whole blocks of a common `prefix` this layer still needs at `context` tokens."""
    prefix = min(prefix, context)
    if layer.kind == SLIDING and layer.window is not None and context > layer.window:
        prefix = max(0, prefix - (context - layer.window))  # the part inside the window
    return min(prefix // block, held_blocks(layer, context, block))


@dataclass
class SequenceBytes:
    """One sequence's cache on one rank: `unique` bytes are its own, `shared` bytes are
    the common prefix (stored once per replica). `by_kind` splits unique + shared."""

    unique: int = 0
    shared: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)

    @property
    def alone(self) -> int:
        return self.unique + self.shared


def sequence_bytes(
    layers: tuple[LayerSpec, ...] | list[LayerSpec],
    context: int,
    kv: KvDtype,
    *,
    tp: int,
    block: int,
    prefix: int = 0,
) -> SequenceBytes:
    """Cache bytes of one sequence of `context` tokens over `layers`, on one TP rank."""
    out = SequenceBytes()
    for layer in layers:
        if layer.kind == STATE:
            unique, shared = state_bytes(layer, tp), 0
        else:
            per_block = block * token_bytes(layer, kv, tp)
            held = held_blocks(layer, context, block)
            common = shared_blocks(layer, context, prefix, block)
            unique, shared = (held - common) * per_block, common * per_block
        out.unique += unique
        out.shared += shared
        out.by_kind[layer.kind] = out.by_kind.get(layer.kind, 0) + unique + shared
    return out
