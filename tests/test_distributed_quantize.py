"""Calibration across processes (issue 16): `torchrun --nproc_per_node 2 infer-tool quantize`
on CPU (gloo on loopback, one thread per process) writes the same checkpoint, byte for
byte, as one process with one thread; `calibrate` the same statistics; a failing process
stops the run with its message and nothing written. Plus the reduction order itself,
without processes: every split of the chunks into contiguous ranges gives the one-process
pairwise sum's bits."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from infer_tool.calib.distributed import Shard, _fold, _push, plan_shard
from infer_tool.cli.app import app
from infer_tool.common.errors import BadInput

sys.path.insert(0, str(Path(__file__).parent))
from tiny import save_tiny_llama  # noqa: E402
from tiny_moe import save_moe  # noqa: E402

INFER_TOOL = str(Path(sys.executable).parent / "infer-tool")
# 40 sequences of 256 tokens: chunks of 8 on a CPU, so 5 chunks, split 3 + 2 (AWQ's 16
# search samples and the 16 error samples are process 0's first two chunks).
CALIB = ("--num-samples", "40", "--seq-len", "256", "--device", "cpu", "--no-progress")
NVFP4_W4A4 = ("--fp4", "nvfp4", "--fp4-activations", "fp4")
CASES = {
    "rtn": ("--method", "rtn", "--group-size", "32"),
    "gptq-act-order": ("--method", "gptq", "--act-order", "--group-size", "32"),
    # the fp chain's inputs pair with each process's own chunks; dXX^T is reduced as H is
    "gptq-gptaq": ("--method", "gptq", "--act-order", "--group-size", "32", "--gptaq", "0.25"),
    "awq": ("--method", "awq", "--group-size", "32"),
    # batches of two chunks: a step's two units may sit on different processes (their gradients are summed in order)
    "autoround": ("--method", "autoround", "--group-size", "32", "--iters", "6", "--batch", "16"),
    # the same on the FP4 grid, W4A4: each fused group's global scale and the input scales' max |x| over processes
    "autoround-nvfp4-w4a4": ("--method", "autoround", *NVFP4_W4A4, "--iters", "6", "--batch", "16"),
    "fp8-static-kv": ("--method", "fp8", "--fp8-activations", "static", "--kv-cache", "fp8"),
    # SmoothQuant's statistics are reduced across processes before its scales are folded
    "w8a8-smoothquant-gptq": ("--scheme", "W8A8", "--smoothquant", "0.5"),
}
TIMINGS = ("seconds", "memory", "out")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dist")
    rng = random.Random(0)
    words = [f"w{i}" for i in range(90)]
    (root / "calib.txt").write_text(" ".join(rng.choice(words) for _ in range(40000)))
    return {
        "model": save_tiny_llama(root / "model", seed=0),
        "moe": save_moe(root / "moe", "qwen2_moe", seed=0),
        "calib": root / "calib.txt",
    }


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    return {**env, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", **extra}


def _two(args: list[str], **env: str) -> subprocess.CompletedProcess:
    """`infer-tool ARGS` in two processes under torchrun (gloo on loopback, a free port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
        INFER_TOOL,
        *args,
    ]
    return subprocess.run(cmd, env=_env(**env), capture_output=True, text=True, timeout=300)


def _one(args: list[str]) -> None:
    """`infer-tool ARGS` in this process, with one thread (the two processes' kernels)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        r = CliRunner().invoke(app, args)
    finally:
        torch.set_num_threads(threads)
    assert r.exit_code == 0, r.output


def _report(out: Path) -> tuple[dict, dict]:
    """(the report less timings, memory and paths; calibration's process fields)."""
    report = json.loads((out / "quantize_report.json").read_text())
    for k in TIMINGS:
        report.pop(k)
    report["options"].pop("out")
    cal = report["calibration"]
    return report, {"world_size": cal.pop("world_size"), "samples": cal.pop("samples_per_process")}


def _same_files(a: Path, b: Path, skip: tuple[str, ...] = ()) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        if name not in skip:
            assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.parametrize("case", [*CASES, "moe-gptq-routed"])
def test_two_processes_write_the_one_process_checkpoint(tiny, tmp_path, case):
    model = tiny["moe"] if case.startswith("moe") else tiny["model"]
    extra = (
        ("--method", "gptq", "--group-size", "32", "--moe-calibration", "routed", "--moe-min-tokens", "1")
        if case.startswith("moe")
        else CASES[case]
    )
    args = ["quantize", str(model), "--calib", str(tiny["calib"]), *CALIB, *extra]
    _one([*args, "--out", str(tmp_path / "one")])
    proc = _two([*args, "--out", str(tmp_path / "two"), "--json"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["calibration"]["world_size"] == 2  # process 0 alone prints
    _same_files(tmp_path / "one", tmp_path / "two", skip=("quantize_report.json",))
    one, one_procs = _report(tmp_path / "one")
    two, two_procs = _report(tmp_path / "two")
    assert one == two
    assert one_procs == {"world_size": 1, "samples": [40 if case != "rtn" else 16]}
    # RTN reads no calibration data: its 16 error samples stay on process 0
    assert two_procs == {"world_size": 2, "samples": [24, 16] if case != "rtn" else [16, 0]}
    if case == "fp8-static-kv":
        assert one["kv_cache_scales"]
    if case.startswith("moe"):
        assert one["moe"]["tokens"], "the MoE report lists routed tokens per expert"


def test_two_processes_without_calibration_text_write_the_rtn_checkpoint(tiny, tmp_path):
    """Data-free RTN with --no-layer-error: no tokens to share; both processes quantize every
    layer alone and process 0 writes the one-process checkpoint (with text) byte for byte."""
    args = ["quantize", str(tiny["model"]), "--calib", str(tiny["calib"]), *CALIB, *CASES["rtn"]]
    _one([*args, "--out", str(tmp_path / "one")])
    proc = _two([*args, "--no-layer-error", "--out", str(tmp_path / "two"), "--json"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report.get("calibration") is None and report["layer_errors"] == []
    _same_files(tmp_path / "one", tmp_path / "two", skip=("quantize_report.json",))


def test_two_processes_calibrate_the_one_process_statistics(tiny, tmp_path):
    args = ["calibrate", str(tiny["model"]), "--calib", str(tiny["calib"]), *CALIB]
    _one([*args, "--out", str(tmp_path / "one")])
    proc = _two([*args, "--out", str(tmp_path / "two"), "--json"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert (report["world_size"], report["samples_per_process"]) == (2, [24, 16])
    _same_files(tmp_path / "one", tmp_path / "two")


def test_a_failing_process_stops_every_process_and_writes_nothing(tiny, tmp_path):
    out = tmp_path / "out"
    proc = _two(
        [
            "quantize",
            str(tiny["model"]),
            "--calib",
            str(tiny["calib"]),
            *CALIB,
            *CASES["gptq-act-order"],
            "--out",
            str(out),
        ],
        INFER_TOOL_TEST_FAIL_RANK="1",
    )
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert ours[0] == "error: process 1 failed on purpose (INFER_TOOL_TEST_FAIL_RANK)", proc.stderr[-3000:]
    assert sum("failed on purpose" in line for line in ours) == 1
    assert all("another process of this run failed" in line for line in ours[1:])
    assert not out.exists() and not list(tmp_path.glob(".out*")), list(tmp_path.iterdir())


def test_refusals_name_the_flag_and_the_process_count(tiny, tmp_path, monkeypatch):
    with pytest.raises(BadInput, match=r"--num-samples 8 makes 1 chunks of 8 sequences, too few for 2 processes"):
        plan_shard(8, 8, True, 0, where=(0, 2))
    with pytest.raises(BadInput, match=r"--num-samples 16 .* use --num-samples >= 32 or fewer processes"):
        plan_shard(16, 8, True, 2, where=(1, 2))  # process 0's one chunk cannot hold AWQ's two search chunks
    assert plan_shard(16, 8, False, 0, where=(1, 2)).stop == 0  # data-free: process 1 runs nothing
    monkeypatch.setenv("WORLD_SIZE", "2")  # refused by the option checks, before the process group is joined
    for flag in ("--eval", "--resume"):
        value = [str(tiny["calib"])] if flag == "--eval" else []
        r = CliRunner().invoke(
            app,
            [
                "quantize",
                str(tiny["model"]),
                "--calib",
                str(tiny["calib"]),
                *CALIB,
                flag,
                *value,
                "--out",
                str(tmp_path / "out"),
            ],
        )
        assert r.exit_code == 2, r.output
        assert f"{flag} does not work across 2 processes" in r.output


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 8, 13])
def test_every_split_gives_the_pairwise_sum_bits(n):
    """Each process's stack over its own chunks, then every node through one stack in chunk
    order (what `TreeSum.total` exchanges), equals one process's stack, bit for bit; absent
    chunks (an expert routed nothing there) are exact zeros in both."""
    g = torch.Generator().manual_seed(n)
    leaves = [
        None if i % 4 == 3 else (torch.randn(16, generator=g, dtype=torch.float64) * 10 ** (i % 5)) for i in range(n)
    ]

    def stack_of(first: int, stop: int) -> list:
        stack: list = []
        for i in range(first, stop):
            if leaves[i] is not None:
                _push(stack, 0, i, leaves[i].clone(), origin=first)
        return stack

    reference = _fold(stack_of(0, n))
    sequential = sum(x for x in leaves if x is not None)
    for world in range(2, n + 1):
        merged: list = []
        for rank in range(world):
            s = Shard.split(n, rank, world)
            for level, index, value in stack_of(s.first, s.stop):
                _push(merged, level, index, value)
        total = _fold(merged)
        assert (total is None) == (reference is None)
        if reference is not None:
            assert torch.equal(total, reference), (n, world)
            torch.testing.assert_close(total, sequential, rtol=1e-12, atol=0)
