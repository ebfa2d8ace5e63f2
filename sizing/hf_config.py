"""Hugging Face `config.json` -> `ModelShape`: which kind each decoder layer is and what
it caches.

Layer kinds come from, in order: an explicit `layer_types` list; Qwen3-Next's
`full_attention_interval`; Jamba's `attn_layer_period`/`attn_layer_offset`; MLA fields
(`kv_lora_rank`); then `sliding_window` -- alternating for Gemma 2, every
`sliding_window_pattern`-th layer global for Gemma 3, Qwen2's `use_sliding_window` /
`max_window_layers`, otherwise uniform (Mistral-7B-v0.1).

State dtypes follow vLLM 0.32's config hooks (`vllm/model_executor/models/config.py`)
and `MambaStateDtypeCalculator` (`model_executor/layers/mamba/mamba_utils.py`): the conv
state is kept in the model dtype (16-bit; float32 checkpoints are served in bf16), the
recurrent (SSM) state in the same dtype unless a hook names another: Qwen3.5 / Qwen4Exp
architectures take `mamba_ssm_dtype` from the config, NemotronH `mamba_ssm_cache_dtype`
(float32 when absent).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from infer_tool.common.errors import BadInput
from infer_tool.sizing.config_view import KNOWN_MODEL_TYPES, ConfigView, MissingField
from infer_tool.sizing.json_file import read_json
from infer_tool.sizing.params import UNGATED_MLP, estimate_params, is_moe_layer
from infer_tool.sizing.shape import FULL, MLA, SLIDING, STATE, ForwardShape, LayerSpec, ModelShape

# `layer_types` names (transformers and vLLM spellings) -> our kinds.
_LAYER_TYPE_NAMES = {
    "full_attention": FULL,
    "attention": FULL,
    "global": FULL,
    "sliding_attention": SLIDING,
    "sliding_window": SLIDING,
    "local": SLIDING,
    "linear_attention": STATE,
    "mamba": STATE,
}

# Bytes of the state dtypes vLLM's `--mamba-ssm-cache-dtype` accepts ("auto": the model dtype).
STATE_DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "float32": 4}
# vLLM 0.32 `models/config.py` hooks: architecture prefix -> (config field, value when absent).
_SSM_DTYPE_HOOKS = {
    "Qwen3_5": ("mamba_ssm_dtype", None),  # Qwen3_5ForConditionalGenerationConfig
    "Qwen4Exp": ("mamba_ssm_dtype", None),  # Qwen4ExpForConditionalGenerationConfig
    "NemotronH": ("mamba_ssm_cache_dtype", "float32"),  # NemotronHForCausalLMConfig
}


def load_config(path: str | Path) -> dict[str, Any]:
    """Parse a config.json (path to the file or to its directory)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise BadInput(f"{path}: no config.json found (expected a model directory or a config.json file)")
    return read_json(p, "config.json")


def shape_from_config(raw: dict[str, Any], name: str, source: str = "") -> ModelShape:
    """Build the shape of the model described by a config.json dict."""
    cfg = ConfigView(raw, source or name)
    n_layers = cfg.int("num_hidden_layers", "n_layer", "num_layers", "n_layers")
    n_heads = cfg.int("num_attention_heads", "n_head", "num_heads")
    hidden = cfg.int("hidden_size", "n_embd", "d_model")
    kinds = _layer_kinds(cfg, n_layers)
    layers = tuple(_layer_spec(cfg, kind, n_heads, hidden) for kind in kinds)
    notes: list[str] = []
    if cfg.nested:
        notes.append("sized from text_config (language model only; vision/audio towers not counted)")
    if cfg.model_type not in KNOWN_MODEL_TYPES:
        notes.append(
            f"model_type {cfg.model_type or '(none)'!r} is not a family this tool knows; its layers were sized "
            "from the generic fields (layer_types, sliding_window, kv_lora_rank, heads) and may miss "
            "architecture-specific caches"
        )
    try:
        params = estimate_params(cfg, layers)
    except MissingField as e:  # weights may still come from safetensors headers
        params = None
        cfg.unknown["parameter count"] = e.field
    try:
        forward = _forward_shape(cfg, layers, hidden)
    except MissingField as e:
        forward = None
        cfg.unknown["activation peak"] = e.field
    for term, missing in cfg.unknown.items():
        notes.append(
            f"{term} unknown: the config has no '{missing}' and nothing defaults it for model_type "
            f"'{cfg.model_type or 'unknown'}'; add it to config.json"
            + (
                " or give --reserve SIZE (what vLLM keeps beside weights and KV per GPU)"
                if term == "activation peak"
                else ""
            )
        )
    if (note := cfg.defaults_note()) is not None:
        notes.insert(0, note)
    return ModelShape(
        name=name,
        layers=layers,
        num_attention_heads=n_heads,
        hidden_size=hidden,
        vocab_size=cfg.int("vocab_size", default=0, minimum=0),
        max_position_embeddings=cfg.optional_int("max_position_embeddings", "n_positions", "max_seq_len"),
        params=params,
        forward=forward,
        model_type=cfg.model_type,
        source=source,
        notes=tuple(notes),
        unknown=tuple(cfg.unknown.items()),
        mtp_layers=cfg.optional_int("num_nextn_predict_layers", "mtp_num_hidden_layers", minimum=0) or 0,
    )


def _forward_shape(cfg: ConfigView, layers: tuple[LayerSpec, ...], hidden: int) -> ForwardShape:
    """The intermediate widths vLLM's forward pass allocates (see `ForwardShape`)."""
    moe = [is_moe_layer(cfg, i) for i in range(len(layers))]
    out: dict[str, int | bool] = {"gated_mlp": cfg.model_type not in UNGATED_MLP}
    if not all(moe):
        if cfg.model_type in UNGATED_MLP:
            out["intermediate_size"] = cfg.int("n_inner", "intermediate_size", default=4 * hidden)
        else:
            out["intermediate_size"] = cfg.int("intermediate_size")
    if any(moe):
        out["num_experts"] = cfg.int("n_routed_experts", "num_local_experts", "num_experts")
        out["experts_per_token"] = min(out["num_experts"], cfg.int("num_experts_per_tok", "moe_topk"))
        out["moe_intermediate_size"] = cfg.int("moe_intermediate_size", "intermediate_size")
        if cfg.has("n_shared_experts"):
            out["shared_intermediate_size"] = cfg.int("n_shared_experts") * out["moe_intermediate_size"]
        elif cfg.has("shared_expert_intermediate_size"):
            out["shared_intermediate_size"] = cfg.int("shared_expert_intermediate_size")
    kinds = {l.kind for l in layers}
    if MLA in kinds:
        out["q_lora_rank"] = cfg.int("q_lora_rank", default=0, minimum=0)
        out["qk_nope_head_dim"] = cfg.int("qk_nope_head_dim")
        out["v_head_dim"] = cfg.int("v_head_dim")
    if STATE in kinds and cfg.has("linear_num_value_heads"):
        out["linear_key_dim"] = cfg.int("linear_num_key_heads") * cfg.int("linear_key_head_dim")
        out["linear_value_dim"] = cfg.int("linear_num_value_heads") * cfg.int("linear_value_head_dim")
        out["linear_value_heads"] = cfg.int("linear_num_value_heads")
    elif STATE in kinds:
        out["mamba_d_inner"] = cfg.int("mamba_expand") * hidden
    return ForwardShape(**out)  # type: ignore[arg-type]


def ssm_state_dtype(cfg: ConfigView) -> str:
    """The recurrent-state dtype vLLM 0.32's config hook picks for this architecture."""
    archs = cfg.get("architectures", default=[]) or []
    if not isinstance(archs, list):
        archs = [archs]
    for prefix, (field, absent) in _SSM_DTYPE_HOOKS.items():
        if any(str(a).startswith(prefix) for a in archs):
            value = cfg.get(field, default=absent)
            if value is None:
                return "auto"
            if value not in STATE_DTYPE_BYTES:
                raise BadInput(f"{cfg.source}: {field} {value!r} not known; accepted: {', '.join(STATE_DTYPE_BYTES)}")
            return str(value)
    return "auto"


def _layer_kinds(cfg: ConfigView, n_layers: int) -> list[str]:
    types = cfg.get("layer_types", default=None)
    if types is not None:
        if not isinstance(types, list) or len(types) != n_layers or not all(isinstance(t, str) for t in types):
            raise BadInput(f"{cfg.source}: layer_types must list {n_layers} names (one per layer)")
        unknown = sorted({t for t in types if t not in _LAYER_TYPE_NAMES})
        if unknown:
            raise BadInput(f"{cfg.source}: unknown layer_types {unknown}; accepted: {sorted(_LAYER_TYPE_NAMES)}")
        return [_LAYER_TYPE_NAMES[t] for t in types]
    if cfg.model_type == "qwen3_next" or cfg.has("full_attention_interval"):
        k = cfg.int("full_attention_interval")
        return [FULL if (i + 1) % k == 0 else STATE for i in range(n_layers)]
    if cfg.has("attn_layer_period"):  # Jamba: attention at i % period == offset, else Mamba
        period, offset = cfg.int("attn_layer_period"), cfg.int("attn_layer_offset", minimum=0)
        return [FULL if i % period == offset else STATE for i in range(n_layers)]
    if cfg.has("kv_lora_rank"):
        return [MLA] * n_layers
    if not cfg.has("sliding_window") or cfg.get("use_sliding_window", default=True) is False:
        return [FULL] * n_layers
    if cfg.model_type == "qwen2" or cfg.has("max_window_layers"):
        first = cfg.int("max_window_layers", minimum=0)
        return [SLIDING if i >= first else FULL for i in range(n_layers)]
    if cfg.model_type == "gemma2":  # local/global alternate, layer 0 local
        return [SLIDING if i % 2 == 0 else FULL for i in range(n_layers)]
    if cfg.has("sliding_window_pattern"):  # Gemma 3: every P-th layer global
        p = cfg.int("sliding_window_pattern")
        return [FULL if (i + 1) % p == 0 else SLIDING for i in range(n_layers)]
    return [SLIDING] * n_layers  # uniform window (Mistral-7B-v0.1)


def _layer_spec(cfg: ConfigView, kind: str, n_heads: int, hidden: int) -> LayerSpec:
    if kind in (FULL, SLIDING):
        head_dim = cfg.int("head_dim", default=0, minimum=0) or _even_split(cfg, hidden, n_heads)
        kv_heads = (
            1
            if cfg.get("multi_query", default=False) is True
            else cfg.int("num_key_value_heads", "num_kv_heads", "n_head_kv", default=n_heads)
        )
        return LayerSpec(
            kind=kind,  # type: ignore[arg-type]
            kv_heads=kv_heads,
            head_dim=head_dim,
            v_head_dim=head_dim,
            window=cfg.int("sliding_window") if kind == SLIDING else None,
        )
    if kind == MLA:
        return LayerSpec(kind=MLA, kv_lora_rank=cfg.int("kv_lora_rank"), qk_rope_head_dim=cfg.int("qk_rope_head_dim"))
    return _state_spec(cfg, hidden)


def _state_spec(cfg: ConfigView, hidden: int) -> LayerSpec:
    """Constant per-sequence state of a linear-attention or Mamba layer."""
    if cfg.has("linear_num_value_heads", "linear_num_key_heads"):
        # Gated DeltaNet (Qwen3-Next): causal-conv state over q,k,v channels for the last
        # (kernel - 1) positions + a (head_k_dim x head_v_dim) recurrent state per value head.
        nk, nv = cfg.int("linear_num_key_heads"), cfg.int("linear_num_value_heads")
        dk, dv = cfg.int("linear_key_head_dim"), cfg.int("linear_value_head_dim")
        conv_dim = 2 * nk * dk + nv * dv
        conv = conv_dim * (cfg.int("linear_conv_kernel_dim") - 1)
        recurrent = nv * dk * dv
        ssm = ssm_state_dtype(cfg)
        return LayerSpec(
            kind=STATE,
            state_elements=conv + recurrent,
            state_shards=nv,
            state_note=f"gated-deltanet conv {conv} + recurrent {recurrent} elements ({ssm} recurrent state)",
            ssm_state_elements=recurrent,
            ssm_dtype_bytes=STATE_DTYPE_BYTES[ssm],
        )
    if cfg.has("mamba_d_state", "mamba_expand"):
        # Mamba-1 (Jamba): conv state (d_inner, d_conv - 1) + SSM state (d_inner, d_state).
        d_inner = cfg.int("mamba_expand") * hidden
        conv = d_inner * (cfg.int("mamba_d_conv") - 1)
        ssm = d_inner * cfg.int("mamba_d_state")
        dtype = ssm_state_dtype(cfg)
        return LayerSpec(
            kind=STATE,
            state_elements=conv + ssm,
            state_shards=d_inner,
            state_note=f"mamba conv {conv} + ssm {ssm} elements ({dtype} ssm state)",
            ssm_state_elements=ssm,
            ssm_dtype_bytes=STATE_DTYPE_BYTES[dtype],
        )
    raise BadInput(
        f"{cfg.source}: linear/recurrent layers need 'linear_num_value_heads' "
        "(Gated DeltaNet) or 'mamba_d_state' (Mamba) in the config"
    )


def _even_split(cfg: ConfigView, hidden: int, n_heads: int) -> int:
    if hidden % n_heads:
        raise BadInput(
            f"{cfg.source}: hidden_size {hidden} is not divisible by {n_heads} heads; "
            "the config needs an explicit 'head_dim'"
        )
    return hidden // n_heads
