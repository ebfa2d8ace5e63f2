"""A tiny random EAGLE-3 head for a tiny Llama, in the layout EAGLE-3 checkpoints ship and
vLLM 0.32 loads (`vllm/model_executor/models/llama_eagle3.py`): one decoder layer
(`midlayer.*`, its q/k/v read the token embedding and the hidden state concatenated, 2 x
hidden wide, with its own `hidden_norm`), `fc` mapping three of the target's hidden states
(3 x hidden) to one, a final `norm` and an `lm_head` over the target's whole vocabulary (so no
`d2t` / `t2d` map); the embedding is the target's. Random weights: it exercises the plumbing
(`--draft '{"method": "eagle3", "model": DIR}'`), not acceptance."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def save_tiny_target(path: Path) -> Path:
    """A 4-layer Llama (hidden 128, 4 heads of 32: head sizes vLLM's CPU attention takes)
    with the tests' offline tokenizer."""
    from tiny import save_tiny_llama

    return save_tiny_llama(path, seed=0, hidden=128, layers=4)


def save_eagle3_head(target: Path, path: Path, seed: int = 1) -> Path:
    cfg = json.loads((target / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = hidden // heads
    vocab = cfg["vocab_size"]
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).contiguous()

    tensors = {
        "midlayer.self_attn.q_proj.weight": w(heads * hd, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": w(kv * hd, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": w(kv * hd, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": w(hidden, heads * hd),
        "midlayer.mlp.gate_proj.weight": w(inter, hidden),
        "midlayer.mlp.up_proj.weight": w(inter, hidden),
        "midlayer.mlp.down_proj.weight": w(hidden, inter),
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        "fc.weight": w(hidden, 3 * hidden),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": w(vocab, hidden),
    }
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    head = {
        **{k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")},
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "vocab_size": vocab,
        "draft_vocab_size": vocab,
        "max_position_embeddings": cfg["max_position_embeddings"],
        "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        # the target layers whose hidden states fc reads (vLLM's default assumes a deep target)
        "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
    }
    (path / "config.json").write_text(json.dumps(head, indent=2))
    return path
