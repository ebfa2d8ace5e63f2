"""Cold-start wall time of `infer-tool kv-budget llama-3.1-8b --context 8192 --json`.

Each run is a fresh process (subprocess), so every import is paid again; the bare
interpreter start-up (`python -c pass`) and `infer-tool --help` are measured in the same
run, interleaved, as references. Prints a table of median / min / max wall seconds.

    python benchmarks/cli_startup.py [--runs 20]
"""

from __future__ import annotations

import argparse
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


def _wall(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    tool = _infer_tool()
    cases = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "infer-tool --help": [tool, "--help"],
        "infer-tool kv-budget llama-3.1-8b --context 8192 --json": [
            tool, "kv-budget", "llama-3.1-8b", "--context", "8192", "--json",
        ],
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for cmd in cases.values():  # warm the OS file cache once; not counted
        _wall(cmd)
    for _ in range(args.runs):
        for name, cmd in cases.items():
            times[name].append(_wall(cmd))

    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"CLI cold start, {args.runs} runs each (wall seconds)")
    for col in ("command", "median", "min", "max", "median - python"):
        t.add_column(col, justify="left" if col == "command" else "right")
    base = statistics.median(times["python -c pass"])
    for name, ts in times.items():
        med = statistics.median(ts)
        t.add_row(name, f"{med:.3f}", f"{min(ts):.3f}", f"{max(ts):.3f}", f"{med - base:+.3f}")
    console = Console()
    console.print(t)
    med = statistics.median(times["infer-tool kv-budget llama-3.1-8b --context 8192 --json"])
    verdict = "meets" if med < TARGET_S else "misses"
    console.print(f"kv-budget median {med:.3f} s {verdict} the {TARGET_S} s target")


if __name__ == "__main__":
    main()
