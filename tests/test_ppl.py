"""Perplexity protocol: windows, exact NLL sums against an independent computation with
transformers' own loss, determinism, the two-process reduction, and the CLI."""

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny import TEXT, make_llama, save_tiny_llama
from typer.testing import CliRunner

from infer_tool.cli.app import app
from infer_tool.common.errors import BadInput
from infer_tool.evals.ppl import evaluate_ppl, make_windows

runner = CliRunner()


def test_windows_non_overlapping_and_sliding():
    w = make_windows(10, 4)
    assert [(x.begin, x.end, x.scored) for x in w] == [(0, 4, 3), (4, 8, 3)]
    s = make_windows(10, 4, stride=2)
    # every token after the first is scored exactly once
    scored = [t for x in s for t in range(x.end - x.scored, x.end)]
    assert scored == list(range(1, 10))
    assert all(x.end - x.begin <= 4 for x in s)
    with pytest.raises(BadInput, match="shorter than one 8-token window"):
        make_windows(5, 8)
    with pytest.raises(BadInput, match="--stride"):
        make_windows(10, 4, stride=5)


def _reference_nll(model, ids, seq_len):
    """Independent: transformers' own shifted loss (mean over L-1) times L-1, per window."""
    total, count = 0.0, 0
    for b in range(0, ids.numel() - seq_len + 1, seq_len):
        x = ids[b : b + seq_len].unsqueeze(0)
        with torch.no_grad():
            loss = model(input_ids=x, labels=x).loss.double().item()
        total += loss * (seq_len - 1)
        count += seq_len - 1
    return total, count


def test_ppl_matches_transformers_loss_and_is_deterministic():
    torch.manual_seed(0)
    model = make_llama(300)
    ids = torch.randint(0, 300, (1000,))
    r = evaluate_ppl(model, ids, 128)
    total, count = _reference_nll(model, ids, 128)
    assert r.windows == 7 and r.tokens == count == 7 * 127
    assert math.isclose(r.nll_sum, total, rel_tol=1e-6)
    assert math.isclose(r.ppl, math.exp(total / count), rel_tol=1e-6)
    r2 = evaluate_ppl(model, ids, 128)
    assert r2.nll_sum == r.nll_sum


def test_sliding_window_matches_hf_guide_loop():
    torch.manual_seed(0)
    model = make_llama(300)
    ids = torch.randint(0, 300, (700,))
    r = evaluate_ppl(model, ids, 128, stride=64)
    # the loop of the transformers perplexity guide, written independently
    nll, n, prev_end = 0.0, 0, 0
    for begin in range(0, ids.numel(), 64):
        end = min(begin + 128, ids.numel())
        trg = end - prev_end
        x = ids[begin:end].unsqueeze(0)
        labels = x.clone()
        labels[:, :-trg] = -100
        with torch.no_grad():
            loss = model(input_ids=x, labels=labels).loss.double().item()
        k = (labels[:, 1:] != -100).sum().item()
        nll += loss * k
        n += k
        prev_end = end
        if end == ids.numel():
            break
    assert r.tokens == n == 699
    assert math.isclose(r.nll_sum, nll, rel_tol=1e-6)


def test_two_process_reduction_is_exact(tmp_path):
    # accelerate's --multi_gpu launcher is torchrun underneath; without GPUs the
    # processes join a gloo (CPU) process group.
    # Loopback only and a free port: gloo otherwise picks the interface the host name
    # resolves to, and a fixed port can still be held by an earlier run.
    script = Path(__file__).with_name("ppl_dist_worker.py")
    out = tmp_path / "dist.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        str(port),
        str(script),
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[:3000]
    dist = json.loads(out.read_text())
    assert dist["world"] == 2
    single = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "one.json")], env=env, capture_output=True, text=True, timeout=300
    )
    assert single.returncode == 0, single.stderr[-2000:]
    one = json.loads((tmp_path / "one.json").read_text())
    assert one["world"] == 1
    assert dist["nll_sum"] == one["nll_sum"] and dist["tokens"] == one["tokens"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    save_tiny_llama(d / "m", seed=0)
    save_tiny_llama(d / "b", seed=1)
    (d / "corpus.txt").write_text(TEXT)
    return d


def test_cli_json_is_one_document_with_the_contract(tiny_dir):
    r = runner.invoke(
        app,
        [
            "eval",
            "ppl",
            str(tiny_dir / "m"),
            "--data",
            str(tiny_dir / "corpus.txt"),
            "--seq-len",
            "64",
            "--json",
            "--no-progress",
            "--device",
            "cpu",
        ],
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    for key in (
        "ppl",
        "nll",
        "tokens",
        "seq_len",
        "windows",
        "seconds",
        "tokens_per_second",
        "backend",
        "model",
        "corpus",
        "protocol",
    ):
        assert key in doc
    assert doc["seq_len"] == 64 and doc["tokens"] == doc["windows"] * 63
    assert math.isclose(doc["ppl"], math.exp(doc["nll"]), rel_tol=1e-12)


def test_cli_baseline_uses_identical_windows(tiny_dir):
    r = runner.invoke(
        app,
        [
            "eval",
            "ppl",
            str(tiny_dir / "m"),
            "--baseline",
            str(tiny_dir / "b"),
            "--data",
            str(tiny_dir / "corpus.txt"),
            "--seq-len",
            "64",
            "--json",
            "--no-progress",
            "--device",
            "cpu",
        ],
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    base = doc["baseline"]
    assert base["tokens"] == doc["tokens"] and base["windows"] == doc["windows"]
    assert base["ppl"] != doc["ppl"]
    assert math.isclose(doc["ppl_ratio"], doc["ppl"] / base["ppl"])
    assert math.isclose(doc["ppl_delta"], doc["ppl"] - base["ppl"])


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data", "nope:corpus:x"], "unknown corpus"),
        (["--seq-len", "100000", "--max-tokens", "50"], "shorter than one"),
        (["--seq-len", "1"], "--seq-len must be >= 2"),
        (["--dtype", "int3"], "unknown --dtype 'int3'"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(tiny_dir, args, message, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    base = ["eval", "ppl", str(tiny_dir / "m"), "--no-progress", "--device", "cpu"]
    if "--data" not in args:
        base += ["--data", str(tiny_dir / "corpus.txt")]
    r = runner.invoke(app, base + args)
    assert r.exit_code == 2, r.output
    assert message in r.stderr
    assert "Traceback" not in r.output and len(r.stderr.strip().splitlines()) == 1


def test_cli_vocab_mismatch_exits_2(tiny_dir, tmp_path):
    # a model whose embedding is smaller than the tokenizer's ids
    from transformers import AutoTokenizer

    model = make_llama(50)
    model.save_pretrained(tmp_path / "small", safe_serialization=True)
    AutoTokenizer.from_pretrained(tiny_dir / "m").save_pretrained(tmp_path / "small")
    r = runner.invoke(
        app,
        [
            "eval",
            "ppl",
            str(tmp_path / "small"),
            "--data",
            str(tiny_dir / "corpus.txt"),
            "--seq-len",
            "64",
            "--no-progress",
            "--device",
            "cpu",
        ],
    )
    assert r.exit_code == 2
    assert "do not match" in r.stderr
