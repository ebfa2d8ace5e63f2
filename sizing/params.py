"""Parameter count of a decoder-only model from its config: every linear layer's
`(N, K)` shape (what a weight-only quantizer packs) and the rest (embeddings, norms,
biases, state-space vectors).

Covers the families the presets use: Llama-style GQA with gated MLP, GPT-2 (learned
positions, biased LayerNorm, 4h MLP), Qwen2 q/k/v biases, Gemma 2/3 sandwich norms,
MoE (Mixtral, Qwen3-MoE, Qwen3-Next shared expert, DeepSeek shared + routed experts with
dense first layers, Jamba every other layer), MLA projections, Gated DeltaNet and
Mamba-1 mixers. Vision towers of multimodal wrappers are not counted.
"""

from __future__ import annotations

import math

from infer_tool.common.errors import BadInput
from infer_tool.sizing.config_view import ConfigView
from infer_tool.sizing.shape import FULL, MLA, SLIDING, STATE, LayerSpec, LinearShape, ParamCount

# Families whose MLP is `fc2(act(fc1 x))` (two matrices) rather than gated (three).
UNGATED_MLP = {"gpt2", "gpt_neox", "gpt_bigcode", "opt", "bloom", "falcon", "phi", "starcoder2"}
# Families with LayerNorm (weight + bias) rather than RMSNorm (weight only).
_LAYERNORM_BIAS = {"gpt2", "gpt_neox", "gpt_bigcode", "opt", "bloom", "falcon", "phi", "starcoder2"}


def estimate_params(cfg: ConfigView, layers: tuple[LayerSpec, ...]) -> ParamCount:
    """Parameter count of the language model described by `cfg` with `layers`."""
    h = cfg.int("hidden_size", "n_embd", "d_model")
    vocab = cfg.int("vocab_size")
    n_heads = cfg.int("num_attention_heads", "n_head", "num_heads")
    mt = cfg.model_type
    norm = 2 * h if mt in _LAYERNORM_BIAS else h  # one norm's parameters
    linears: list[LinearShape] = []
    other = vocab * h + norm  # token embeddings + final norm
    if mt == "gpt2":
        other += cfg.int("n_positions", "max_position_embeddings") * h  # learned positions
    tied_head = 0
    if not cfg.get("tie_word_embeddings", default=False):
        linears.append(LinearShape(h, vocab, quantizable=False))  # lm_head
    else:
        tied_head = vocab * h  # the embedding, multiplied by again as the output projection
    norms_per_layer = 4 if mt.startswith("gemma2") or mt.startswith("gemma3") else 2

    inactive = 0
    for i, layer in enumerate(layers):
        other += norms_per_layer * norm
        if layer.kind in (FULL, SLIDING):
            other += _attention(cfg, layer, h, n_heads, linears)
        elif layer.kind == MLA:
            other += _mla(cfg, h, n_heads, linears)
        elif layer.kind == STATE:
            other += _state_mixer(cfg, h, linears)
        extra, idle = _mlp(cfg, i, h, linears)
        other += extra
        inactive += idle
    return ParamCount(linears=tuple(_merge(linears)), other=other, inactive=inactive, tied_head=tied_head)


def _attention(cfg: ConfigView, layer: LayerSpec, h: int, n_heads: int, out: list[LinearShape]) -> int:
    q_dim = n_heads * layer.head_dim
    kv_dim = layer.kv_heads * layer.head_dim
    gate = 2 if cfg.model_type in ("qwen3_next", "qwen3_5_text") else 1  # gated attention output
    out += [
        LinearShape(h, q_dim * gate),
        LinearShape(h, kv_dim, count=2),
        LinearShape(q_dim, h),
    ]
    extra = 0
    if cfg.get("attention_bias", "qkv_bias", default=False):
        extra += q_dim + 2 * kv_dim + (h if cfg.model_type == "gpt2" else 0)
    if cfg.model_type in ("qwen3", "qwen3_moe", "qwen3_next", "qwen3_5_text", "gemma3_text"):
        extra += 2 * layer.head_dim  # q_norm, k_norm
    return extra


def _mla(cfg: ConfigView, h: int, n_heads: int, out: list[LinearShape]) -> int:
    """DeepSeek-V2/V3 multi-head latent attention projections."""
    rope, nope = cfg.int("qk_rope_head_dim"), cfg.int("qk_nope_head_dim")
    v_dim, r_kv = cfg.int("v_head_dim"), cfg.int("kv_lora_rank")
    r_q = cfg.int("q_lora_rank", default=0, minimum=0)
    extra = r_kv  # kv_a_layernorm
    if r_q:
        out += [LinearShape(h, r_q), LinearShape(r_q, n_heads * (nope + rope))]
        extra += r_q  # q_a_layernorm
    else:
        out.append(LinearShape(h, n_heads * (nope + rope)))
    out += [
        LinearShape(h, r_kv + rope),  # kv_a_proj_with_mqa
        LinearShape(r_kv, n_heads * (nope + v_dim)),  # kv_b_proj
        LinearShape(n_heads * v_dim, h),  # o_proj
    ]
    return extra


def _state_mixer(cfg: ConfigView, h: int, out: list[LinearShape]) -> int:
    if cfg.has("linear_num_value_heads"):  # Gated DeltaNet
        nk, nv = cfg.int("linear_num_key_heads"), cfg.int("linear_num_value_heads")
        dk, dv = cfg.int("linear_key_head_dim"), cfg.int("linear_value_head_dim")
        key_dim, value_dim = nk * dk, nv * dv
        out += [
            LinearShape(h, 2 * key_dim + 2 * value_dim),  # in_proj_qkvz
            LinearShape(h, 2 * nv),  # in_proj_ba
            LinearShape(value_dim, h),  # out_proj
        ]
        conv = (2 * key_dim + value_dim) * cfg.int("linear_conv_kernel_dim")
        return conv + 2 * nv + dv  # conv1d, dt_bias + A_log, gated norm
    # Mamba-1 (Jamba)
    d_inner = cfg.int("mamba_expand") * h
    d_state, d_conv = cfg.int("mamba_d_state"), cfg.int("mamba_d_conv")
    dt_rank = cfg.get("mamba_dt_rank", default="auto")
    dt_rank = math.ceil(h / 16) if dt_rank == "auto" else cfg.int("mamba_dt_rank")
    out += [
        LinearShape(h, 2 * d_inner),  # in_proj
        LinearShape(d_inner, dt_rank + 2 * d_state),  # x_proj
        LinearShape(dt_rank, d_inner),  # dt_proj
        LinearShape(d_inner, h),  # out_proj
    ]
    conv = d_inner * d_conv + (d_inner if cfg.get("mamba_conv_bias", default=True) else 0)
    norms = dt_rank + 2 * d_state if cfg.model_type == "jamba" else 0  # dt/B/C layernorms
    return conv + d_inner + d_inner * d_state + d_inner + norms  # conv, dt bias, A_log, D


def is_moe_layer(cfg: ConfigView, i: int) -> bool:
    if cfg.has("n_routed_experts"):  # DeepSeek
        first_dense = cfg.int("first_k_dense_replace", default=0, minimum=0)
        return i >= first_dense and i % cfg.int("moe_layer_freq", default=1) == 0
    if cfg.has("expert_layer_period"):  # Jamba
        return cfg.int("num_experts", default=1) > 1 and i % cfg.int("expert_layer_period") == cfg.int(
            "expert_layer_offset", minimum=0
        )
    if cfg.has("num_local_experts"):  # Mixtral
        return True
    if cfg.has("num_experts"):  # Qwen MoE
        dense = cfg.get("mlp_only_layers", default=[]) or []
        if not isinstance(dense, list):
            raise BadInput(
                f"{cfg.source}: config field 'mlp_only_layers' = {dense!r}; expected a list of layer indices"
            )
        return i not in dense and (i + 1) % cfg.int("decoder_sparse_step", default=1) == 0
    return False


def _gated(h: int, inter: int, count: int = 1) -> list[LinearShape]:
    return [LinearShape(h, inter, count=2 * count), LinearShape(inter, h, count=count)]


def _mlp(cfg: ConfigView, i: int, h: int, out: list[LinearShape]) -> tuple[int, int]:
    """Append layer i's MLP linears; return (other params, routed-expert params a token
    does not use)."""
    if not is_moe_layer(cfg, i):
        if cfg.model_type in UNGATED_MLP:
            inter = cfg.int("n_inner", "intermediate_size", default=4 * h)
            out += [LinearShape(h, inter), LinearShape(inter, h)]
            return (inter + h if cfg.model_type == "gpt2" else 0), 0  # fc biases
        out += _gated(h, cfg.int("intermediate_size"))
        return 0, 0
    n_exp = cfg.int("n_routed_experts", "num_local_experts", "num_experts")
    inter = cfg.int("moe_intermediate_size", "intermediate_size")
    if cfg.has("num_experts_per_tok", "moe_topk"):
        top_k = min(n_exp, cfg.int("num_experts_per_tok", "moe_topk"))
    else:  # memory still counts every expert; what a token multiplies by is unknown
        cfg.unknown["active parameters"] = "num_experts_per_tok"
        top_k = n_exp
    idle = 3 * h * inter * (n_exp - top_k)
    out += _gated(h, inter, count=n_exp)
    out.append(LinearShape(h, n_exp, quantizable=False))  # router
    extra = n_exp if cfg.get("topk_method", default="") == "noaux_tc" else 0  # score bias
    if cfg.has("n_shared_experts"):
        out += _gated(h, cfg.int("n_shared_experts") * inter)
    elif cfg.has("shared_expert_intermediate_size"):
        out += _gated(h, cfg.int("shared_expert_intermediate_size"))
        out.append(LinearShape(h, 1, quantizable=False))  # shared_expert_gate
    return extra, idle


def _merge(linears: list[LinearShape]) -> list[LinearShape]:
    """Sum counts of identical shapes (keeps the table small for 100-layer models)."""
    counts: dict[tuple[int, int, bool], int] = {}
    for l in linears:
        key = (l.in_features, l.out_features, l.quantizable)
        counts[key] = counts.get(key, 0) + l.count
    return [LinearShape(k, n, c, q) for (k, n, q), c in counts.items()]
