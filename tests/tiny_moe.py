"""Tiny random mixture-of-experts models of each family in the table, for tests (no hub).

Each has 2-3 decoder layers, hidden 64, 4-8 experts of width 32 (group size 32 divides
every K), top-2 routing, and DeepSeek-V3's dense first layer, MLA and shared expert,
Qwen2-MoE's gated shared expert. `starve` makes one expert of every MoE layer of the
DeepSeek model unreachable (its router's score-correction bias very negative), the case
where tools leave experts without calibration; `starving` does it for any family, in process.
"""

from __future__ import annotations

from pathlib import Path

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")


def moe_config(family: str, vocab_size: int = 300):  # noqa: ANN201
    import transformers as tf

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=256,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )
    if family == "mixtral":
        return tf.MixtralConfig(
            **common, intermediate_size=32, num_hidden_layers=2, num_key_value_heads=2, num_local_experts=4
        )
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(
            **common,
            intermediate_size=128,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_hidden_layers=2,
            num_key_value_heads=2,
            num_experts=4,
        )
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **common,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_key_value_heads=2,
            num_experts=4,
            head_dim=16,
        )
    if family == "deepseek_v3":
        return tf.DeepseekV3Config(
            **common,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            num_key_value_heads=4,
            n_routed_experts=8,
            n_group=2,
            topk_group=2,
            n_shared_experts=1,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_rope_head_dim=16,
            qk_nope_head_dim=16,
            v_head_dim=16,
        )
    raise KeyError(family)


def routers(model):  # noqa: ANN001, ANN201
    """The router of every MoE layer."""
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "experts")]


def make_moe(family: str, vocab_size: int = 300, seed: int = 0, starve: int | None = None):  # noqa: ANN201
    """A random model of `family` in eval mode; `starve` (DeepSeek): an expert no token reaches."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_config(family, vocab_size), attn_implementation="eager").eval()
    with torch.no_grad():
        for gate in routers(model):
            gate.weight.normal_(0, 0.5)  # routers start at zero (Qwen) or tiny: spread the tokens
            if starve is not None:
                gate.e_score_correction_bias[starve] = -1e4  # ranked last by the top-k choice
    return model


def starving(model, expert: int):  # noqa: ANN001, ANN201
    """A context in which no token is routed to `expert` (each router's choice masked)."""
    import contextlib

    import torch

    @contextlib.contextmanager
    def ctx():  # noqa: ANN202
        saved = []
        for gate in routers(model):
            original = gate.forward

            def forward(hidden_states, original=original, gate=gate):  # noqa: ANN001, ANN202
                logits, _, _ = original(hidden_states)
                masked = logits.float().clone()
                masked[:, expert] = -float("inf")
                probs = torch.softmax(masked, dim=-1)
                top, index = torch.topk(probs, gate.top_k, dim=-1)
                top = top / top.sum(-1, keepdim=True)
                return logits, top.to(logits.dtype), index

            gate.forward = forward
            saved.append(gate)
        try:
            yield
        finally:
            for gate in saved:
                del gate.forward

    return ctx()


def save_moe(path: Path, family: str, seed: int = 0, starve: int | None = None) -> Path:
    """A tiny MoE + tokenizer saved as a local HF directory (original checkpoint names)."""
    from tiny import make_tokenizer

    tok = make_tokenizer()
    model = make_moe(family, len(tok), seed=seed, starve=starve)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path
