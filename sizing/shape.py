"""A model's shape as far as memory planning needs it: its layers (what each one caches
per token or per sequence) and its parameter counts.

This module knows nothing about config files, dtypes of a deployment or GPUs: readers
(`hf_config`, `gguf`) build a `ModelShape`; `kv`, `weights` and `capacity` consume it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# Layer kinds, named as in transformers' `layer_types` where a name exists.
FULL = "full_attention"
SLIDING = "sliding_attention"
MLA = "mla"
STATE = "linear_state"  # linear attention (Gated DeltaNet) or Mamba: constant per sequence

LayerKind = Literal["full_attention", "sliding_attention", "mla", "linear_state"]
KINDS: tuple[str, ...] = (FULL, SLIDING, MLA, STATE)


@dataclass(frozen=True)
class LayerSpec:
    """What one decoder layer keeps for each sequence.

    - full / sliding attention: K of `kv_heads x head_dim` and V of `kv_heads x
      v_head_dim` elements per token; sliding layers keep at most `window` tokens;
    - MLA: one latent of `kv_lora_rank + qk_rope_head_dim` elements per token, shared by
      all heads (no K/V pair, so no factor 2);
    - linear state: `state_elements` per sequence whatever the context (conv + recurrent
      state), split over at most `state_shards` tensor-parallel ranks (its heads or
      channels); `ssm_state_elements` of them are the recurrent (SSM) state, stored in
      `ssm_dtype_bytes`, the rest the conv state in `conv_dtype_bytes`.
    """

    kind: LayerKind
    kv_heads: int = 0
    head_dim: int = 0
    v_head_dim: int = 0
    window: int | None = None
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    state_elements: int = 0
    state_shards: int = 1
    state_note: str = ""
    ssm_state_elements: int = 0
    conv_dtype_bytes: int = 2
    ssm_dtype_bytes: int = 2

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ForwardShape:
    """Widths (elements per token, whole model before tensor parallelism) of the
    intermediates one decoder layer computes, for the activation peak of a forward pass.

    - `intermediate_size`: the dense MLP's width (0 when every layer is MoE); `gated_mlp`:
      gate and up fused into one `2 x intermediate_size` output, then the activation;
    - MoE: `num_experts`, `experts_per_token`, `moe_intermediate_size`, and the shared
      experts' total width `shared_intermediate_size`;
    - MLA: `q_lora_rank`, `qk_nope_head_dim`, `v_head_dim` (with the layer's latent);
    - Gated DeltaNet: `linear_key_dim` / `linear_value_dim` (heads x head dim) and
      `linear_value_heads`; Mamba: `mamba_d_inner`.
    """

    intermediate_size: int = 0
    gated_mlp: bool = True
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_intermediate_size: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_value_heads: int = 0
    mamba_d_inner: int = 0


@dataclass(frozen=True)
class LinearShape:
    """`count` linear layers of weight `(N, K)` = (out_features, in_features).
    `quantizable` is False for layers kept in the model dtype (routers, lm_head)."""

    in_features: int  # K
    out_features: int  # N
    count: int = 1
    quantizable: bool = True


@dataclass(frozen=True)
class ParamCount:
    """Parameters of the model: `linears` (the matrices a weight-only quantizer packs)
    and `other` (embeddings, norms, biases, state-space vectors: kept in model dtype).
    `inactive` counts the routed-expert weights a token does not use (MoE: experts
    beyond the top-k), so `active` is what one token multiplies by. `tied_head`: the
    output projection's parameters when it shares the token embedding (counted once, in
    `other`, for memory; every token still multiplies by it)."""

    linears: tuple[LinearShape, ...]
    other: int
    inactive: int = 0
    tied_head: int = 0

    @property
    def matmul_params(self) -> int:
        """Weights one token multiplies by in matmuls: active linears and a tied head."""
        return self.linear_params - self.inactive + self.tied_head

    @property
    def linear_params(self) -> int:
        return sum(l.in_features * l.out_features * l.count for l in self.linears)

    @property
    def total(self) -> int:
        return self.linear_params + self.other

    @property
    def active(self) -> int:
        return self.total - self.inactive


@dataclass(frozen=True)
class ModelShape:
    """Layers in order, plus what the reports name."""

    name: str
    layers: tuple[LayerSpec, ...]
    num_attention_heads: int
    hidden_size: int
    vocab_size: int = 0
    max_position_embeddings: int | None = None
    params: ParamCount | None = None
    forward: ForwardShape | None = None  # None: the reader could not tell (no activation model)
    model_type: str = ""  # config.json's model_type ("qwen3", "llama"); "" when the reader has none
    source: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)
    mtp_layers: int = 0  # multi-token-prediction layers the checkpoint carries (num_nextn_predict_layers)
    # terms nothing could default: (term, the config field that would give it)
    unknown: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def count(self, kind: str) -> int:
        return sum(1 for l in self.layers if l.kind == kind)
