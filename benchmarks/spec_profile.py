"""Do `spec-profile`'s predicted speedups hold? The demo pair, measured on this machine.

Runs `infer-tool spec-profile --json` on the demo target with three drafts (an INT4 RTN
copy of the target, made here once with `infer-tool quantize` unless --int4 names one;
`truncated:N`; prompt lookup) `--runs` times, each run in its own process. Every run
predicts the speedup at each k from acceptance and timed round costs, then measures it
in the real loop against plain decoding of the same prompts in the same run. Prints, per
draft and k, the medians over runs of v(k), c, predicted and measured speedup, and the
error of each run's prediction against its own measurement (median and worst), the k
each run recommended, and whether every |error| stays within --goal.

    python benchmarks/spec_profile.py [--runs 3] [--num-prompts 4] [--max-new-tokens 32] [--k 1-3]
        [--int4 DIR] [--threads 1] [--goal 0.15]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

TOOL = [str(Path(sys.executable).parent / "infer-tool")]
TARGET = "smollm2-135m"


def make_int4(out: Path) -> None:
    subprocess.run(
        [
            *TOOL,
            "quantize",
            TARGET,
            "--method",
            "rtn",
            "--group-size",
            "64",
            "--num-samples",
            "4",
            "--seq-len",
            "128",
            "--out",
            str(out),
            "--no-progress",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--k", default="1-3")
    ap.add_argument("--truncated", type=int, default=20, help="layers kept by the truncated draft")
    ap.add_argument("--int4", type=Path, help="an INT4 checkpoint of the target (made if absent)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--goal", type=float, default=0.15)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="spec-bench-"))
    int4 = args.int4 or tmp / "smollm2-int4"
    if not (int4 / "config.json").is_file():
        make_int4(int4)
    cmd = [
        *TOOL,
        "spec-profile",
        "--target",
        TARGET,
        "--draft",
        str(int4),
        "--draft",
        f"truncated:{args.truncated}",
        "--draft",
        "ngram",
        "--num-prompts",
        str(args.num_prompts),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--k",
        args.k,
        "--threads",
        str(args.threads),
        "--device",
        "cpu",
        "--json",
        "--no-progress",
    ]
    reports = []
    for i in range(args.runs):
        t = time.perf_counter()
        done = subprocess.run(cmd, check=True, capture_output=True, text=True)
        reports.append(json.loads(done.stdout))
        print(f"run {i + 1}/{args.runs}: {time.perf_counter() - t:.0f} s", file=sys.stderr)

    first = reports[0]
    med = statistics.median
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end; "
        f"clock {first['settings']['clock']}, {args.threads} torch thread(s)"
    )
    print(
        f"target {TARGET}: {first['settings']['num_prompts']} prompts x {args.max_new_tokens} tokens, T=0, "
        f"median of {args.runs} runs (each its own process); target step "
        f"{med(r['target_step_ms'] for r in reports):.1f} ms"
    )
    print()
    print("| draft | alpha | k | v(k) | c | predicted | measured | error (median) | error (worst) |")
    print("|---|---|---|---|---|---|---|---|---|")
    worst_all = 0.0
    for j, d in enumerate(first["drafts"]):
        name = "INT4 RTN g64" if d["name"] == str(int4) else d["name"]
        for i, k in enumerate(d["per_k"]):
            rows = [r["drafts"][j]["per_k"][i] for r in reports]
            errors = [row["error"] for row in rows]
            worst = max(errors, key=abs)
            worst_all = max(worst_all, abs(worst))
            print(
                f"| {name if i == 0 else ''} | {med(r['drafts'][j]['alpha'] for r in reports):.3f} | {k['k']} "
                f"| {med(row['verify_cost'] for row in rows):.2f} | {med(row['cost_ratio'] for row in rows):.3g} "
                f"| {med(row['predicted_speedup'] for row in rows):.3f}x "
                f"| {med(row['measured_speedup'] for row in rows):.3f}x "
                f"| {med(errors):+.1%} | {worst:+.1%} |"
            )
    print()
    for j, d in enumerate(first["drafts"]):
        picks = Counter(r["drafts"][j]["best_k"] for r in reports)
        print(f"{d['name']}: measured-best k per run {dict(picks)}")
    print(
        f"worst |error| {worst_all:.1%}: {'within' if worst_all <= args.goal else 'OUTSIDE'} the {args.goal:.0%} goal"
    )


if __name__ == "__main__":
    main()
