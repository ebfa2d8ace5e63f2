"""Cold-start wall time of `infer-tool kv-budget llama-3.1-8b --context 8192 --json`.

Each run is a fresh process (subprocess), so every import is paid again; the bare
interpreter start-up (`python -c pass`) and `infer-tool --help` are measured in the same
run, interleaved, as references. Prints median / min / max wall seconds and the median
CPU seconds (user + sys of the child), which a busy shared machine inflates less than
wall time; the system load average is printed with them.

    python benchmarks/cli_startup.py [--runs 20]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

TARGET_S = 0.3


def _infer_tool() -> str:
    beside = Path(sys.executable).with_name("infer-tool")
    found = str(beside) if beside.exists() else shutil.which("infer-tool")
    if not found:
        sys.exit("infer-tool is not installed in this environment (pip install -e .)")
    return found


def _run(cmd: list[str]) -> tuple[float, float]:
    """(wall, cpu) seconds of one run of `cmd`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    tool = _infer_tool()
    cases = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "infer-tool --help": [tool, "--help"],
        "infer-tool kv-budget llama-3.1-8b --context 8192 --json": [
            tool,
            "kv-budget",
            "llama-3.1-8b",
            "--context",
            "8192",
            "--json",
        ],
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    cpu: dict[str, list[float]] = {name: [] for name in cases}
    for cmd in cases.values():  # warm the OS file cache once; not counted
        _run(cmd)
    load_before = os.getloadavg()[0]
    for _ in range(args.runs):
        for name, cmd in cases.items():
            wall, used = _run(cmd)
            times[name].append(wall)
            cpu[name].append(used)

    from rich.console import Console
    from rich.table import Table

    t = Table(
        title=f"CLI cold start, {args.runs} runs each (seconds)",
        caption=f"{os.cpu_count()} CPUs, 1-min load average {load_before:.1f} before / {os.getloadavg()[0]:.1f} after",
    )
    for col in ("command", "wall median", "wall min", "wall max", "wall median - python", "CPU median"):
        t.add_column(col, justify="left" if col == "command" else "right")
    base = statistics.median(times["python -c pass"])
    for name, ts in times.items():
        med = statistics.median(ts)
        t.add_row(
            name,
            f"{med:.3f}",
            f"{min(ts):.3f}",
            f"{max(ts):.3f}",
            f"{med - base:+.3f}",
            f"{statistics.median(cpu[name]):.3f}",
        )
    console = Console()
    console.print(t)
    med = statistics.median(times["infer-tool kv-budget llama-3.1-8b --context 8192 --json"])
    verdict = "meets" if med < TARGET_S else "misses"
    console.print(f"kv-budget median {med:.3f} s {verdict} the {TARGET_S} s target")


if __name__ == "__main__":
    main()
