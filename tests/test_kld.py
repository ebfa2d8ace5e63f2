"""KL divergence (`evals/kld.py`, `eval kld`): per-token values against an independent float64
sum, the direction of the divergence, exact zero for a model against itself, percentiles
against numpy, the interval against tabulated t quantiles, the two-process gather, refused
tokenizers, and the CLI's JSON contract."""

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny import TEXT, make_llama, make_tokenizer, save_tiny_llama
from typer.testing import CliRunner

from infer_tool.cli.app import app
from infer_tool.evals.intervals import mean_ci95, t_quantile
from infer_tool.evals.kld import evaluate_kld, quantiles, same_top, token_kl
from infer_tool.evals.ppl import evaluate_ppl

runner = CliRunner()
SEQ = 128


def _independent_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> np.ndarray:
    """Σ_v p·(log p − log q) per row, float64, with softmax written out (no log_softmax)."""

    def probs(x: np.ndarray) -> np.ndarray:
        e = np.exp(x - x.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)

    p = probs(p_logits.double().numpy())
    q = probs(q_logits.double().numpy())
    assert (p > 0).all() and (q > 0).all()
    return (p * (np.log(p) - np.log(q))).sum(axis=1)


def _window_logits(model, ids, seq_len):
    """Independent: every non-overlapping window's next-token logits, windows back to back."""
    out = []
    for b in range(0, ids.numel() - seq_len + 1, seq_len):
        with torch.no_grad():
            out.append(model(input_ids=ids[b : b + seq_len].unsqueeze(0)).logits[0, :-1].float())
    return torch.cat(out)


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    a, b = make_llama(300, seed=0), make_llama(300, seed=1)
    ids = torch.randint(0, 300, (SEQ * 5 + 17,))
    return a, b, ids


@pytest.fixture(scope="module")
def independent(pair):
    """Per-token KL(b ‖ a) and KL(a ‖ b), float64, by the written-out sum."""
    a, b, ids = pair
    la, lb = _window_logits(a, ids, SEQ), _window_logits(b, ids, SEQ)
    return _independent_kl(lb, la), _independent_kl(la, lb), la, lb


def test_token_kl_equals_the_written_out_sum(independent):
    kl_ba, _, la, lb = independent
    ours = token_kl(lb, la).numpy()
    assert ours.dtype == np.float64 and ours.shape == kl_ba.shape
    np.testing.assert_allclose(ours, kl_ba, rtol=1e-9, atol=1e-13)
    assert (kl_ba > 1e-3).all()  # random models disagree: not a test on zeros


def test_token_kl_row_chunks_change_nothing(independent, monkeypatch):
    _, _, la, lb = independent
    whole = token_kl(lb, la)
    from infer_tool.evals import kld

    monkeypatch.setattr(kld, "CHUNK_ELEMENTS", 300 * 7)  # 7 rows per chunk
    assert torch.equal(kld.token_kl(lb, la), whole)


def test_evaluate_kld_direction_summary_and_ppl(pair, independent):
    a, b, ids = pair
    kl_ba, kl_ab, la, lb = independent
    r = evaluate_kld(a, b, ids, SEQ)  # model a, reference b: KL(P_b ‖ P_a)
    assert r.windows == 5 and r.tokens == 5 * (SEQ - 1) == kl_ba.size
    assert math.isclose(r.kld.mean.mean, kl_ba.mean(), rel_tol=1e-9)
    # the swap is caught: KL is not symmetric on these models
    assert abs(kl_ab.mean() - kl_ba.mean()) > 100 * 1e-9 * kl_ba.mean()
    assert not math.isclose(r.kld.mean.mean, kl_ab.mean(), rel_tol=1e-6)
    got = [r.kld.median, r.kld.p90, r.kld.p99, r.kld.p99_9]
    np.testing.assert_allclose(got, np.quantile(kl_ba, [0.5, 0.9, 0.99, 0.999]), rtol=1e-9)
    assert math.isclose(r.kld.max, kl_ba.max(), rel_tol=1e-9) and math.isclose(r.kld.min, kl_ba.min(), rel_tol=1e-9)
    agree = (la.argmax(-1) == lb.argmax(-1)).double().mean().item()
    assert r.same_top_token.mean == agree and 0 < agree < 1
    # the perplexities are eval ppl's own, bit for bit
    assert r.ppl == evaluate_ppl(a, ids, SEQ).ppl and r.reference_ppl == evaluate_ppl(b, ids, SEQ).ppl
    # the interval holds the mean and is the t interval over the five window means
    m = r.kld.mean
    w = kl_ba.reshape(5, SEQ - 1).mean(axis=1)
    half = 2.7764451051977987 * w.std(ddof=1) / math.sqrt(5)  # t_0.975 with 4 degrees of freedom (tables)
    assert math.isclose(m.ci95_low, w.mean() - half, rel_tol=1e-9) and math.isclose(
        m.ci95_high, w.mean() + half, rel_tol=1e-9
    )
    assert math.isclose(m.se_tokens, kl_ba.std(ddof=1) / math.sqrt(kl_ba.size), rel_tol=1e-9)


def test_model_against_itself_is_exactly_zero(pair):
    a, _, ids = pair
    twin = make_llama(300, seed=0)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), twin.state_dict().values()))
    r = evaluate_kld(a, twin, ids, SEQ, stride=64)
    assert r.kld.mean.mean == 0.0 and r.kld.max == 0.0 and r.kld.min == 0.0 and r.kld.p99_9 == 0.0
    assert r.same_top_token.mean == 1.0 and r.ppl == r.reference_ppl
    assert r.tokens == ids.numel() - 1  # sliding windows: every token after the first once


def test_same_top_ties_and_shape_refused():
    x = torch.tensor([[1.0, 3.0, 3.0], [0.0, 0.0, 5.0]])
    assert same_top(x, x.flip(0).flip(0)).tolist() == [True, True]
    assert same_top(x, torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 5.0]])).tolist() == [False, True]
    from infer_tool.common.errors import BadInput

    with pytest.raises(BadInput, match="differ in shape"):
        token_kl(x, torch.zeros(2, 4))


@pytest.mark.parametrize("n", [1, 2, 7, 1000])
def test_quantiles_match_numpy_and_torch(n):
    g = torch.Generator().manual_seed(n)
    v = torch.rand(n, generator=g, dtype=torch.float64) ** 3
    v[: n // 3] = v[0]  # ties
    qs = [0.0, 0.5, 0.9, 0.99, 0.999, 1.0]
    ours = quantiles(v, qs)
    np.testing.assert_allclose(ours, np.quantile(v.numpy(), qs), rtol=1e-12, atol=0)
    np.testing.assert_allclose(ours, torch.quantile(v, torch.tensor(qs, dtype=torch.float64)).numpy(), rtol=1e-12)


def test_t_quantiles_against_tables_and_one_window():
    for df, table in [
        (1, 12.7062047362),
        (2, 4.30265272975),
        (4, 2.7764451052),
        (19, 2.09302405441),
        (30, 2.04227245630),
        (100, 1.98397151845),
        (1000, 1.96233908082),
    ]:
        assert math.isclose(t_quantile(0.975, df), table, rel_tol=1e-9), df
    assert math.isclose(t_quantile(0.025, 4), -2.7764451052, rel_tol=1e-9)
    assert math.isclose(t_quantile(0.995, 10), 3.16927267262, rel_tol=1e-9)
    assert mean_ci95([3.0], [10]) is None


def test_two_processes_equal_one(tmp_path):
    script = Path(__file__).with_name("kld_dist_worker.py")
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
        str(tmp_path / "two.json"),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    single = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "one.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert single.returncode == 0, single.stderr[-2000:]
    two, one = (json.loads((tmp_path / f).read_text()) for f in ("two.json", "one.json"))
    assert two.pop("world") == 2 and one.pop("world") == 1
    for d in (two, one):
        d.pop("seconds"), d.pop("tokens_per_second")
    assert two == one  # every percentile and the interval too: the per-token values are gathered
    assert one["kld"]["mean"]["mean"] > 0 and one["windows"] == 7


# --- the CLI -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_kld")
    save_tiny_llama(d / "m", seed=0)
    save_tiny_llama(d / "b", seed=1)
    (d / "corpus.txt").write_text(TEXT)
    return d


def _kld(*args):
    r = runner.invoke(app, ["eval", "kld", *[str(a) for a in args], "--no-progress", "--device", "cpu"])
    return r.exit_code, r.stdout, r.stderr


def _ppl(model, corpus):
    r = runner.invoke(
        app,
        [
            "eval",
            "ppl",
            str(model),
            "--data",
            str(corpus),
            "--seq-len",
            "64",
            "--json",
            "--no-progress",
            "--device",
            "cpu",
        ],
    )
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)["ppl"]


def test_cli_json_contract(tiny_dir):
    code, stdout, stderr = _kld(
        tiny_dir / "m", "--reference", tiny_dir / "b", "--data", tiny_dir / "corpus.txt", "--seq-len", "64", "--json"
    )
    assert code == 0, stderr
    doc = json.loads(stdout)  # exactly one document
    for key in (
        "model",
        "reference",
        "corpus",
        "kld",
        "same_top_token",
        "ppl",
        "nll",
        "reference_ppl",
        "reference_nll",
        "tokens",
        "seq_len",
        "windows",
        "seconds",
        "tokens_per_second",
        "backend",
        "reference_backend",
        "protocol",
        "notes",
        "dtype",
        "device",
    ):
        assert key in doc, key
    k = doc["kld"]
    assert set(k) == {"mean", "median", "p90", "p99", "p99_9", "max", "min"}
    assert set(k["mean"]) == {"mean", "ci95_low", "ci95_high", "se_windows", "se_tokens"}
    assert k["mean"]["ci95_low"] < k["mean"]["mean"] < k["mean"]["ci95_high"]
    assert 0 < k["median"] <= k["p90"] <= k["p99"] <= k["p99_9"] <= k["max"]
    assert doc["tokens"] == doc["windows"] * 63 and doc["windows"] >= 2
    assert 0 <= doc["same_top_token"]["mean"] <= 1
    assert doc["ppl"] == _ppl(tiny_dir / "m", tiny_dir / "corpus.txt")
    assert doc["reference_ppl"] == _ppl(tiny_dir / "b", tiny_dir / "corpus.txt")


def test_cli_table_and_self_reference(tiny_dir):
    code, stdout, stderr = _kld(
        tiny_dir / "m", "--reference", tiny_dir / "m", "--data", tiny_dir / "corpus.txt", "--seq-len", "64"
    )
    assert code == 0, stderr
    assert "KL divergence" in stdout and "100.00%" in stdout and "same top token" in stdout
    code, stdout, _ = _kld(
        tiny_dir / "m", "--reference", tiny_dir / "m", "--data", tiny_dir / "corpus.txt", "--seq-len", "64", "--json"
    )
    doc = json.loads(stdout)
    assert doc["kld"]["mean"]["mean"] == 0.0 and doc["kld"]["max"] == 0.0 and doc["same_top_token"]["mean"] == 1.0


def test_cli_quantized_checkpoint(tiny_dir, tmp_path):
    q = tmp_path / "q"
    r = runner.invoke(
        app,
        [
            "quantize",
            str(tiny_dir / "m"),
            "--method",
            "rtn",
            "--group-size",
            "32",
            "--calib",
            str(tiny_dir / "corpus.txt"),
            "--num-samples",
            "4",
            "--seq-len",
            "32",
            "--out",
            str(q),
            "--no-progress",
            "--device",
            "cpu",
        ],
    )
    assert r.exit_code == 0, r.output
    code, stdout, stderr = _kld(
        q, "--reference", tiny_dir / "m", "--data", tiny_dir / "corpus.txt", "--seq-len", "64", "--json"
    )
    assert code == 0, stderr
    doc = json.loads(stdout)
    assert doc["backend"] != doc["reference_backend"]  # the checkpoint ran through the quantized modules
    assert 0 < doc["kld"]["mean"]["mean"] < 0.5  # INT4 RTN on a random model: close, not equal
    assert doc["ppl"] == _ppl(q, tiny_dir / "corpus.txt")


def _save_with_tokenizer(path, tok, vocab_size):
    make_llama(vocab_size, seed=0).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)


def test_cli_refuses_another_vocabulary_naming_the_token(tiny_dir, tmp_path):
    from transformers import AutoTokenizer

    mine = AutoTokenizer.from_pretrained(tiny_dir / "m")
    other = make_tokenizer(vocab_size=280)
    _save_with_tokenizer(tmp_path / "o", other, 300)
    # the expected token, found independently: the lowest id the two tokenizers map differently
    ids = [
        i
        for i in range(300)
        if mine.convert_ids_to_tokens(i) != (other.convert_ids_to_tokens(i) if i < len(other) else None)
    ]
    token = mine.convert_ids_to_tokens(ids[0])
    code, _, stderr = _kld(
        tiny_dir / "m", "--reference", tmp_path / "o", "--data", tiny_dir / "corpus.txt", "--seq-len", "64"
    )
    assert code == 2, stderr
    assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr
    assert f"token id {ids[0]} is {token!r}" in stderr


def test_cli_refuses_another_tokenization_and_vocab_size(tiny_dir, tmp_path):
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir / "m")
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    _save_with_tokenizer(tmp_path / "p", tok, 300)
    code, _, stderr = _kld(
        tiny_dir / "m", "--reference", tmp_path / "p", "--data", tiny_dir / "corpus.txt", "--seq-len", "64"
    )
    assert code == 2 and "tokenizes" in stderr and "token 0 is" in stderr, stderr
    assert len(stderr.strip().splitlines()) == 1
    _save_with_tokenizer(tmp_path / "v", AutoTokenizer.from_pretrained(tiny_dir / "m"), 320)
    code, _, stderr = _kld(
        tiny_dir / "m", "--reference", tmp_path / "v", "--data", tiny_dir / "corpus.txt", "--seq-len", "64"
    )
    assert code == 2 and "vocab_size 320" in stderr, stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--seq-len", "1"], "--seq-len must be >= 2"),
        (["--stride", "99"], "--stride 99"),
        (["--data", "nope:corpus:x"], "unknown corpus"),
    ],
)
def test_cli_bad_options_exit_2(tiny_dir, args, message, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    base = [tiny_dir / "m", "--reference", tiny_dir / "b", "--seq-len", "64"]
    if "--data" not in args:
        base += ["--data", tiny_dir / "corpus.txt"]
    code, _, stderr = _kld(*base, *args)
    assert code == 2 and message in stderr, stderr
    assert len(stderr.strip().splitlines()) == 1
