"""The restructure guard: the checkpoints `quantize` and `calibrate` write do not change.

A matrix of runs (every method x symmetry x format, FP8 granularities, static activations
with KV scales, `calibrate` + `--stats`) on a tiny random Llama, and GPTQ / AWQ on the
demo model at small settings. `tests/guard_hashes.json` holds, per run, the sha256 of
every written safetensors file and a per-tensor summary (float64 mean and root mean
square of its values), with the machine it was recorded on.

Byte-exact results hold on one torch build and one CPU kernel family: where the running
torch version and CPU capability equal the recorded ones, the hashes must match exactly;
elsewhere each tensor's summary must match within a relative tolerance of 1e-3 (a
different BLAS summation order moves a quantized code here and there, not the tensor).

Re-record (only when a change is meant to alter the output, in its own commit):
    INFER_TOOL_RECORD_GUARD=1 pytest tests/test_guard.py
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from infer_tool.cli.app import app

GUARD = Path(__file__).with_name("guard_hashes.json")
RECORD = os.environ.get("INFER_TOOL_RECORD_GUARD") == "1"
SUMMARY_RTOL = 1e-3
WORDS = [f"w{i}" for i in range(90)]
TINY = ("--num-samples", "8", "--seq-len", "32", "--no-progress", "--device", "cpu")

# name -> extra quantize arguments (tiny model)
TINY_RUNS: dict[str, tuple[str, ...]] = {}
for _method in ("rtn", "gptq", "awq"):
    for _sym in ("--sym", "--asym"):
        for _fmt in ("compressed-tensors", "awq", "gptq"):
            if _fmt == "gptq" and _sym == "--asym":
                continue  # GPTQ v1 is written symmetric only
            order = ("--no-act-order",) if _method == "gptq" else ()  # explicit: the default changes
            TINY_RUNS[f"{_method}-{_sym[2:]}-{_fmt}"] = ("--method", _method, _sym, "--group-size", "32", "--format", _fmt, *order)
TINY_RUNS["gptq-actorder-sym-compressed-tensors"] = ("--method", "gptq", "--act-order", "--sym", "--group-size", "32")
TINY_RUNS["gptq-actorder-asym-compressed-tensors"] = ("--method", "gptq", "--act-order", "--asym", "--group-size", "32")
TINY_RUNS["gptq-actorder-sym-gptq"] = ("--method", "gptq", "--act-order", "--sym", "--group-size", "32", "--format", "gptq")
for _gran in ("tensor", "channel", "block"):
    TINY_RUNS[f"fp8-{_gran}"] = ("--method", "fp8", "--fp8-granularity", _gran)
    if _gran != "channel":  # native FP8 holds per-tensor or block scales only
        TINY_RUNS[f"fp8-{_gran}-native"] = ("--method", "fp8", "--fp8-granularity", _gran, "--format", "fp8")
TINY_RUNS["fp8-static-kv"] = ("--method", "fp8", "--fp8-activations", "static", "--kv-cache", "fp8")
TINY_RUNS["fp8-static-kv-native"] = ("--method", "fp8", "--fp8-granularity", "tensor", "--fp8-activations", "static",
                                     "--kv-cache", "fp8", "--format", "fp8")
TINY_RUNS["fp8-clip"] = ("--method", "fp8", "--fp8-clip-search")
TINY_RUNS["rtn-g-1"] = ("--method", "rtn", "--group-size", "-1")
TINY_RUNS["gptq-ignore-down"] = ("--method", "gptq", "--act-order", "--group-size", "32", "--ignore", "*.down_proj")
TINY_RUNS["awq-bf16"] = ("--method", "awq", "--group-size", "32", "--dtype", "bfloat16")
TINY_RUNS["autoround-sym"] = ("--method", "autoround", "--sym", "--group-size", "32", "--iters", "5", "--batch", "4")
TINY_RUNS["autoround-asym-awq"] = ("--method", "autoround", "--asym", "--group-size", "32", "--iters", "5", "--batch", "4",
                                   "--format", "awq")
TINY_RUNS["awq+gptq-asym"] = ("--method", "awq+gptq", "--asym", "--group-size", "32")
# From saved statistics (calibrate first): the key names the quantize arguments.
STATS_RUNS: dict[str, tuple[str, ...]] = {
    "stats-gptq-sym": ("--method", "gptq", "--no-act-order", "--sym", "--group-size", "32"),
    "stats-gptq-actorder": ("--method", "gptq", "--act-order", "--group-size", "32"),
    "stats-rtn-asym": ("--method", "rtn", "--asym", "--group-size", "32"),
    "stats-fp8-static": ("--method", "fp8", "--fp8-activations", "static"),
}
DEMO = ("--num-samples", "4", "--seq-len", "128", "--group-size", "64", "--no-progress", "--device", "cpu")
DEMO_RUNS: dict[str, tuple[str, ...]] = {
    "demo-gptq-sym-actorder": ("--method", "gptq", "--sym", "--act-order"),
    "demo-awq-asym": ("--method", "awq", "--asym"),
}

runner = CliRunner()


def environment() -> dict[str, str]:
    """What byte-exact results depend on."""
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def summarise(directory: Path) -> dict[str, object]:
    """{file: sha256} of every safetensors file and {tensor: [mean, rms]} of every tensor."""
    from safetensors.torch import load_file

    files, tensors = {}, {}
    for path in sorted(directory.glob("*.safetensors")):
        files[path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
        for name, t in sorted(load_file(str(path)).items()):
            v = t.double() if t.dtype != torch.float8_e4m3fn else t.float().double()
            tensors[name] = [float(v.mean()), float(v.pow(2).mean().sqrt())]
    return {"files": files, "tensors": tensors}


@pytest.fixture(scope="module", autouse=True)
def one_thread():  # noqa: ANN201
    """One thread: BLAS results then do not depend on how many cores the runner has."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A random-initialised tiny Llama (no training: bit-stable), a word-level tokenizer
    and a Markov-chain corpus, all from fixed seeds."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("guard")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=96, max_position_embeddings=128, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(root / "model")
    fast.save_pretrained(root / "model")
    rng = random.Random(0)
    w, words = 0, []
    for _ in range(3000):
        w = (w * 7 + rng.choice((1, 2, 3, 5))) % len(WORDS)
        words.append(WORDS[w])
    (root / "calib.txt").write_text(" ".join(words))
    return {"root": root, "model": root / "model", "calib": root / "calib.txt"}


def _quantize(model: str, out: Path, *args: str) -> dict[str, object]:
    r = runner.invoke(app, ["quantize", model, "--out", str(out), *args])
    assert r.exit_code == 0, (r.stdout + r.stderr)[-3000:]
    return summarise(out)


def _check(name: str, got: dict[str, object]) -> None:
    if RECORD:
        doc = json.loads(GUARD.read_text()) if GUARD.is_file() else {"environment": environment(), "runs": {}}
        doc["environment"] = environment()
        doc["runs"][name] = got
        GUARD.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        return
    doc = json.loads(GUARD.read_text())
    want = doc["runs"][name]
    assert sorted(got["tensors"]) == sorted(want["tensors"]), f"{name}: tensor names changed"
    if doc["environment"] == environment():
        assert got["files"] == want["files"], f"{name}: safetensors bytes changed (same torch build and CPU as recorded)"
        return
    for t, (mean, rms) in want["tensors"].items():
        g_mean, g_rms = got["tensors"][t]
        assert math.isclose(g_rms, rms, rel_tol=SUMMARY_RTOL, abs_tol=1e-12), (name, t, g_rms, rms)
        assert math.isclose(g_mean, mean, rel_tol=SUMMARY_RTOL, abs_tol=SUMMARY_RTOL * max(rms, 1e-12)), (name, t, g_mean, mean)


@pytest.mark.parametrize("name", sorted(TINY_RUNS))
def test_tiny_checkpoint_unchanged(tiny: dict[str, Path], tmp_path: Path, name: str) -> None:
    got = _quantize(str(tiny["model"]), tmp_path / "out", "--calib", str(tiny["calib"]), *TINY, *TINY_RUNS[name])
    _check(name, got)


@pytest.fixture(scope="module")
def saved_stats(tiny: dict[str, Path]) -> Path:
    out = tiny["root"] / "stats"
    r = runner.invoke(app, ["calibrate", str(tiny["model"]), "--out", str(out), "--calib", str(tiny["calib"]),
                            "--num-samples", "8", "--seq-len", "32", "--no-progress", "--device", "cpu"])
    assert r.exit_code == 0, r.stderr[-3000:]
    return out


@pytest.mark.parametrize("name", sorted(STATS_RUNS))
def test_checkpoint_from_stats_unchanged(tiny: dict[str, Path], saved_stats: Path, tmp_path: Path, name: str) -> None:
    got = _quantize(str(tiny["model"]), tmp_path / "out", "--stats", str(saved_stats), "--no-progress", "--device", "cpu",
                    *STATS_RUNS[name])
    _check(name, got)


def test_saved_stats_unchanged(saved_stats: Path) -> None:
    _check("calibrate-stats", summarise(saved_stats))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(DEMO_RUNS))
def test_demo_checkpoint_unchanged(tmp_path: Path, name: str) -> None:
    got = _quantize("smollm2-135m", tmp_path / "out", *DEMO, *DEMO_RUNS[name])
    _check(name, got)
