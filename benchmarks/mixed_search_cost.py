"""The cost of a mixed-precision search (issue 62's goal: sensitivity + assignment <= 1.5x one
uniform calibration of the most expensive candidate method), CPU seconds beside wall.

    python benchmarks/mixed_search_cost.py --candidates W4A16_G64,W8A16_G64,FP8 --repeats 3 \
        --uniform "--method rtn --group-size 64" [--plan-args "--num-samples 4 --seq-len 512"]

Each repeat runs, as child processes of this one (`nice -n 5`), `infer-tool quantize-plan MODEL
--candidates ... --target-bits 4.5 --json` (load, sensitivity pass, assignment; nothing
written) and `infer-tool quantize MODEL <uniform args> --out TMP --json` (one uniform run of
the candidates' method, written, no eval). CPU seconds are the children's user + system time
(`resource.getrusage(RUSAGE_CHILDREN)`), wall is measured around each child; the table gives
the median of the repeats of each and their ratio. The sensitivity pass's own wall time, as the
plan reports it, is shown too. Prints one JSON document; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TOOL = str(Path(sys.executable).with_name("infer-tool"))


def timed(cmd: list[str]) -> tuple[float, float, str]:
    """(wall s, CPU s of the child, its stdout); raises on a non-zero exit."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(["nice", "-n", "5", *cmd], capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise SystemExit(f"{shlex.join(cmd)} exited {r.returncode}: {r.stderr.strip().splitlines()[-1:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, r.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--candidates", default="W4A16_G64,W8A16_G64,FP8")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--plan-args", default="--num-samples 4 --seq-len 512")
    ap.add_argument("--uniform", default="--method rtn --group-size 64")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    plan_cmd = [TOOL, "quantize-plan", args.model, "--candidates", args.candidates, "--target-bits", "4.5"]
    plan_cmd += ["--dtype", args.dtype, *shlex.split(args.plan_args), "--no-progress", "--json"]
    runs: dict[str, list[dict[str, float]]] = {"search": [], "uniform": []}
    with tempfile.TemporaryDirectory(prefix="mixed-cost-") as tmp:
        uniform_cmd = [TOOL, "quantize", args.model, *shlex.split(args.uniform), "--dtype", args.dtype]
        uniform_cmd += ["--out", os.path.join(tmp, "uniform"), "--overwrite", "--no-progress", "--json"]
        for i in range(args.repeats):
            wall, cpu, out = timed(plan_cmd)
            runs["search"].append(
                {"wall": wall, "cpu": cpu, "sensitivity_wall": json.loads(out)["sensitivity_seconds"]}
            )
            print(f"[{time.strftime('%H:%M:%S')}] search {i + 1}: {runs['search'][-1]}", file=sys.stderr, flush=True)
            wall, cpu, _ = timed(uniform_cmd)
            runs["uniform"].append({"wall": wall, "cpu": cpu})
            print(f"[{time.strftime('%H:%M:%S')}] uniform {i + 1}: {runs['uniform'][-1]}", file=sys.stderr, flush=True)
    med: dict[str, Any] = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items()}
    print(
        json.dumps(
            {
                "search_command": shlex.join(plan_cmd),
                "uniform_command": shlex.join(uniform_cmd),
                "repeats": args.repeats,
                "runs": runs,
                "median": med,
                "ratio_cpu": med["search"]["cpu"] / med["uniform"]["cpu"],
                "ratio_wall": med["search"]["wall"] / med["uniform"]["wall"],
                "load_average_end": os.getloadavg(),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
