"""Validate a `quantize-plan` (issue 62) against the KL divergence measured on the demo model.

    infer-tool quantize-plan smollm2-135m --candidates W4A16_G64,W8A16_G64,FP8 --target-bits 4.3,4.5,5 \
        --dtype bfloat16 --num-samples 4 --seq-len 512 --json > plan.json
    python benchmarks/mixed_plan_validate.py plan.json groups --pairs 24 --eval-tokens 1024 --seq-len 512
    python benchmarks/mixed_plan_validate.py plan.json totals --variants "plan:4.5 bits" uniform:W4A16_G32 \
        --eval-tokens 8192 --seq-len 2048

`groups`: for a seeded sample of (linear group, candidate) pairs, the KL divergence measured with
only that group quantized (RTN, in memory), against the plan's predicted cost of each estimator:
Spearman's rank correlation and the ratios. `totals`: every variant (a plan's assignment by its
budget, a candidate on every group, or `none`: the weights rounded to the checkpoint dtype only)
quantized in memory with each linear's candidate (RTN); its stored bits, predicted and measured
KL. The reference is the fp32 model as loaded; the first `--eval-tokens` of sotu:eval are scored
in windows of `--seq-len` (evals/ppl.py's windows, evals/kld.py's per-token KL). Prints one JSON
document; progress on stderr.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import sys
import time
from typing import Any

import torch

from infer_tool.calib.architectures import architecture_for
from infer_tool.calib.corpora import load_text, tokenize
from infer_tool.calib.mixed_bits import stored_bytes
from infer_tool.calib.mixed_candidates import Candidate, parse_candidate
from infer_tool.calib.mixed_sensitivity import ESTIMATORS, linear_groups, plan_weights, weights_replaced
from infer_tool.calib.models import load_model
from infer_tool.evals.kld import token_kl
from infer_tool.evals.ppl import make_windows, window_logits
from infer_tool.jobs.quantize_run import round_to


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (no ties expected in measured floats)."""
    ra = torch.tensor(a, dtype=torch.float64).argsort().argsort().double()
    rb = torch.tensor(b, dtype=torch.float64).argsort().argsort().double()
    return float(torch.corrcoef(torch.stack([ra, rb]))[0, 1])


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("plan")
    ap.add_argument("mode", choices=("groups", "totals"))
    ap.add_argument("--pairs", type=int, default=24)
    ap.add_argument("--variants", nargs="*", default=[])
    ap.add_argument("--eval", default="sotu:eval")
    ap.add_argument("--eval-tokens", type=int, default=1024)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    plan = json.loads(open(args.plan).read())
    t0 = time.perf_counter()
    loaded = load_model(plan["model"])
    reference = loaded.model
    model = copy.deepcopy(reference)
    dtype = plan["dtype"]
    if dtype != "float32":
        round_to(model, getattr(torch, dtype))
    arch = architecture_for(model.config.model_type, model.config)
    groups = linear_groups(model, arch)
    by_name = {g.name: g for g in groups}

    def cand(name: str) -> Candidate:
        c = parse_candidate(name)
        return Candidate(c.name, None if c.scheme is None else c.scheme.for_storage(dtype))

    ids = tokenize(load_text(args.eval), loaded.tokenizer, max_tokens=args.eval_tokens)[: args.eval_tokens]
    windows = make_windows(ids.numel(), args.seq_len)
    log(f"loaded in {time.perf_counter() - t0:.0f} s; {ids.numel()} tokens in {len(windows)} windows")

    per_window: dict[int, dict[str, float]] = {}  # window -> variant -> its mean KL (the last measure call)

    def measure(variants: dict[str, dict[str, Candidate]]) -> dict[str, float]:
        """Mean per-token KL of each variant ({group: candidate}), windows scored once for the reference."""
        weights = {k: plan_weights(model, arch, groups, v) for k, v in variants.items()}
        sums = dict.fromkeys(variants, 0.0)
        n = 0
        for i, w in enumerate(windows):
            ref, _ = window_logits(reference, ids, w)
            per_window[i] = {}
            for k, ws in weights.items():
                with weights_replaced(model, arch, ws):
                    logits, _ = window_logits(model, ids, w)
                kl = math.fsum(token_kl(ref, logits).tolist())
                sums[k] += kl
                per_window[i][k] = kl / w.scored
            n += w.scored
            # the running means: a run cut short still compares every variant on the same windows
            log(f"window {i + 1}/{len(windows)}, {n} tokens: {json.dumps({k: s / n for k, s in sums.items()})}")
        return {k: s / n for k, s in sums.items()}

    costs = plan["group_costs"]
    if not all(e in ESTIMATORS for e in costs):  # a plan written before every estimator was kept
        costs = {plan["estimator"]: costs}
    out: dict[str, Any] = {
        "plan": args.plan,
        "mode": args.mode,
        "eval": args.eval,
        "tokens": ids.numel(),
        "seq_len": args.seq_len,
        "dtype": dtype,
    }
    if args.mode == "groups":
        rng = random.Random(args.seed)
        names = [c["name"] for c in plan["candidates"] if c["scheme"] is not None]
        pairs = rng.sample([(g.name, c) for g in groups for c in names], args.pairs)
        measured = {}
        for i in range(0, len(pairs), 6):  # six variants per pass over the windows
            chunk = pairs[i : i + 6]
            measured.update(measure({f"{g}|{c}": {g: cand(c)} for g, c in chunk}))
            log(f"{i + len(chunk)}/{len(pairs)} pairs: {json.dumps({k: measured[k] for k in measured})}")
        truth = [measured[f"{g}|{c}"] for g, c in pairs]
        out["pairs"] = [
            {"group": g, "candidate": c, "measured": m, **{e: costs[e][g][c] for e in costs}}
            for (g, c), m in zip(pairs, truth)
        ]
        for e in costs:
            pred = [costs[e][g][c] for g, c in pairs]
            ratios = sorted(p / m for p, m in zip(pred, truth) if m > 0)
            out[e] = {
                "spearman": spearman(pred, truth),
                "median_ratio": ratios[len(ratios) // 2],
                "sum_ratio": math.fsum(pred) / math.fsum(truth),
            }
    else:
        variants: dict[str, dict[str, Candidate]] = {}
        for v in args.variants:
            kind, _, what = v.partition(":")
            if kind == "plan":
                row = next(p for p in plan["plans"] if p["budget"] == what)
                variants[v] = {g: cand(c) for g, c in row["groups"].items()}
            elif kind == "uniform":
                variants[v] = {g.name: cand(what) for g in groups}
            elif v == "none":
                variants[v] = {}
            else:
                raise SystemExit(f"variant {v!r}: use plan:<budget>, uniform:<candidate> or none")
        measured = measure(variants)
        weights = sum(g.weights for g in groups)
        rows = []
        for v, chosen in variants.items():
            size = (
                sum(stored_bytes(c.scheme, n, k, dtype) for g, c in chosen.items() for n, k in by_name[g].shapes)
                if chosen
                else sum(g.weights for g in groups) * (2 if dtype != "float32" else 4)
            )
            pred = {
                e: math.fsum(costs[e][g][c.name] for g, c in chosen.items())
                if all(c.name in costs[e][g] for g, c in chosen.items())
                else None
                for e in costs
            }
            rows.append({"variant": v, "bits": 8 * size / weights, "measured": measured[v], "predicted": pred})
        out["rows"] = rows
        out["per_window"] = [per_window[i] for i in sorted(per_window)]
    out["seconds"] = time.perf_counter() - t0
    out["cpu_seconds"] = time.process_time()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
