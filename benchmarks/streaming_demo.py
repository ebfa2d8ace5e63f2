"""Time and peak memory of streaming on the demo model (issue 15), against the code before
it and against llm-compressor, measured in one invocation.

Rows, one process each, repeated --repeats times in turn (ABCD ABCD ...), medians printed:
- `streamed`: this code's default (layers read from disk and freed, progress kept for --resume);
- `streamed, --max-memory M` (with --max-memory M): the same under a host-memory limit that the
  in-memory plan exceeds, so GPTQ keeps its replayed activations in a file (`calib/spill.py`);
- `--no-stream`: this code with the whole model loaded first (the same loop otherwise);
- `before`: the code before streaming, run from a checkout named by --before (a directory
  holding an `infer_tool` package, e.g. `git archive <commit>` laid out as the install
  maps it; see README "Models larger than memory");
- `llm-compressor`: its oneshot on the same token ids (--llmcompressor PYTHON, as in
  benchmarks/quantize.py).
Each row reports the quantize seconds from its report (calibration and solve; streamed
rows include reading and writing each layer), the process wall time, and the peak RSS.

    python benchmarks/streaming_demo.py --before /tmp/base-pkg --llmcompressor /path/to/llmc/bin/python
    python benchmarks/streaming_demo.py --method rtn --repeats 3
    python benchmarks/streaming_demo.py --repeats 2 --max-memory 1.5GiB   # GPTQ: time of streaming, memory of the spill
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quantize import calibration_ids  # noqa: E402 - the sibling benchmark's helper


def run(cmd: list[str], env: dict[str, str] | None = None) -> tuple[dict, float]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1] if cmd[1].endswith("oneshot.py") else proc.stdout), wall


def ours(args: argparse.Namespace, out: Path, extra: list[str], pythonpath: str | None = None) -> dict:
    flags = [
        "--method",
        args.method,
        "--group-size",
        str(args.group_size),
        "--num-samples",
        str(args.num_samples),
        "--seq-len",
        str(args.seq_len),
        "--out",
        str(out),
        "--json",
        "--no-progress",
        "--device",
        "cpu",
    ]
    if args.method == "gptq":
        flags += ["--sym", "--act-order"]
    env = None
    if pythonpath:
        env = {**os.environ, "PYTHONPATH": pythonpath}
    cmd = [
        sys.executable,
        "-P",
        "-c",
        "from infer_tool.cli.app import main; main()",
        "quantize",
        args.model,
        *flags,
        *extra,
    ]
    r, wall = run(cmd, env)
    return {
        "quantize_s": r["seconds"]["quantize"],
        "process_s": wall,
        "peak_rss_mib": r["memory"]["peak_rss_mib"],
        "estimate_mib": r["memory"].get("estimate_host_mib"),
    }


def llmc(args: argparse.Namespace, out: Path, ids: Path, model_dir: str) -> dict:
    cmd = [
        args.llmcompressor,
        str(Path(__file__).with_name("llmcompressor_oneshot.py")),
        "--model-dir",
        model_dir,
        "--ids",
        str(ids),
        "--method",
        args.method,
        "--group-size",
        str(args.group_size),
        "--out",
        str(out),
    ]
    r, wall = run(cmd)
    return {"quantize_s": r["oneshot_s"], "process_s": wall, "peak_rss_mib": r["peak_rss_mib"], "estimate_mib": None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--method", default="gptq", choices=("gptq", "awq", "rtn"))
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--num-samples", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--before", help="directory with the `infer_tool` package of the code before streaming")
    p.add_argument("--llmcompressor", metavar="PYTHON")
    p.add_argument("--json", help="append each run to this JSON-lines file")
    p.add_argument("--max-memory", help="adds a streamed row under this --max-memory (e.g. 1.5GiB)")
    args = p.parse_args()
    args.calib, args.seed = "sotu:calib", 0

    limited = f"streamed, --max-memory {args.max_memory}"
    rows = (
        ["streamed", "--no-stream"]
        + ([limited] if args.max_memory else [])
        + (["before"] if args.before else [])
        + (["llm-compressor"] if args.llmcompressor else [])
    )
    runs: dict[str, list[dict]] = {r: [] for r in rows}
    with tempfile.TemporaryDirectory(prefix="bench-stream-demo-") as tmp:
        work = Path(tmp)
        ids = work / "ids.safetensors"
        model_dir = calibration_ids(args, ids) if args.llmcompressor else ""
        for rep in range(args.repeats):
            for row in rows:
                out = work / f"{row.strip('-').replace(' ', '').replace(',', '-')}-{rep}"
                if row == "streamed":
                    r = ours(args, out, [])
                elif row == limited:
                    r = ours(args, out, ["--max-memory", args.max_memory])
                elif row == "--no-stream":
                    r = ours(args, out, ["--no-stream"])
                elif row == "before":
                    r = ours(args, out, [], pythonpath=args.before)
                else:
                    r = llmc(args, out, ids, model_dir)
                r.update(row=row, repeat=rep, load_avg=os.getloadavg()[0])
                runs[row].append(r)
                print(json.dumps(r), file=sys.stderr, flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(r) + "\n")

    med = {
        row: {k: statistics.median(r[k] for r in rs) for k in ("quantize_s", "process_s", "peak_rss_mib")}
        for row, rs in runs.items()
    }
    print(
        f"{args.model}, {args.method} w4 g{args.group_size}, {args.num_samples} x {args.seq_len} tokens of sotu:calib; "
        f"median of {args.repeats}, {os.cpu_count()} CPUs, load average at the runs "
        f"{min(r['load_avg'] for rs in runs.values() for r in rs):.1f}-"
        f"{max(r['load_avg'] for rs in runs.values() for r in rs):.1f}"
    )
    print("| run | quantize s | process s | peak RSS MiB | estimate MiB |")
    print("|---|---:|---:|---:|---:|")
    for row, rs in runs.items():
        est = rs[0]["estimate_mib"]
        print(
            f"| {row} | {med[row]['quantize_s']:.0f} | {med[row]['process_s']:.0f} | {med[row]['peak_rss_mib']:.0f} | "
            f"{'' if est is None else f'{est:.0f}'} |"
        )
    ref = "before" if "before" in med else "--no-stream"
    for k in ("quantize_s", "process_s"):
        print(f"streamed / {ref} {k}: {med['streamed'][k] / med[ref][k]:.3f}")
        if args.max_memory:
            print(f"{limited} / {ref} {k}: {med[limited][k] / med[ref][k]:.3f}")
    if "llm-compressor" in med:
        print(
            "streamed peak RSS / llm-compressor's: "
            f"{med['streamed']['peak_rss_mib'] / med['llm-compressor']['peak_rss_mib']:.3f}"
        )


if __name__ == "__main__":
    main()
