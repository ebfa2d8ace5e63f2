"""Throughput of `eval ppl` on the demo model on this machine.

Times `evaluate_ppl` (our path) and, in the same run, a plain transformers loop over the
same windows (`model(input_ids, labels=x).loss`) as the reference; prints the median of
several runs of each, tokens/s and the ratio, and checks both give the same perplexity.

    python benchmarks/eval_ppl.py [--tokens 8192] [--seq-len 2048] [--runs 3] [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import time

import torch

from infer_tool.calib.corpora import load_text, tokenize
from infer_tool.calib.models import load_model
from infer_tool.evals.ppl import evaluate_ppl


def reference_ppl(model, ids, seq_len):
    nll, n = 0.0, 0
    for b in range(0, ids.numel() - seq_len + 1, seq_len):
        x = ids[b : b + seq_len].unsqueeze(0)
        with torch.no_grad():
            nll += model(input_ids=x, labels=x).loss.double().item() * (seq_len - 1)
        n += seq_len - 1
    return math.exp(nll / n), n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", default="sotu:eval")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()

    lm = load_model(args.model)
    ids = tokenize(load_text(args.data), lm.tokenizer)[: args.tokens]
    ours, ref = [], []
    for _ in range(args.runs):
        t = time.perf_counter()
        r = evaluate_ppl(lm.model, ids, args.seq_len)
        ours.append(time.perf_counter() - t)
        t = time.perf_counter()
        ref_ppl, n = reference_ppl(lm.model, ids, args.seq_len)
        ref.append(time.perf_counter() - t)
    assert n == r.tokens and math.isclose(r.ppl, ref_ppl, rel_tol=1e-5), (r.ppl, ref_ppl)
    mo, mr = statistics.median(ours), statistics.median(ref)
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}")
    print(
        f"model {args.model}, {r.tokens} predicted tokens in {r.windows} x {args.seq_len} windows, "
        f"median of {args.runs} runs, ppl {r.ppl:.4f}"
    )
    print()
    print("| path | median s | tokens/s | ratio to reference |")
    print("|---|---:|---:|---:|")
    print(f"| infer-tool evaluate_ppl | {mo:.2f} | {r.tokens / mo:.1f} | {mr / mo:.2f}x |")
    print(f"| transformers loss loop (reference) | {mr:.2f} | {r.tokens / mr:.1f} | 1.00x |")


if __name__ == "__main__":
    main()
