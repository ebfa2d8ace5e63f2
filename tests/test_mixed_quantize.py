"""`quantize MODEL --target-bits B --candidates ...` / `--max-kld X`, and `quantize-plan --out`:
the written mixed checkpoint against its oracles (the stored bytes in the safetensors header,
`eval kld` run on it by the CLI, a model holding the dequantized weights for `eval ppl`), the
measured gate (exit 3), refusals (exit 2) and the output-ownership rule."""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
from tiny import TEXT, save_tiny_llama  # noqa: E402

from infer_tool.cli.app import app  # noqa: E402

runner = CliRunner()
HELD_OUT = (
    "Four score and seven years ago our fathers brought forth on this continent a new nation, conceived in "
    "liberty, and dedicated to the proposition that all men are created equal. Now we are engaged in a great "
    "civil war, testing whether that nation, or any nation so conceived and so dedicated, can long endure. "
) * 6
CANDIDATES = "W4A16_G32,W8A16_G32,FP8"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("mixed")
    corpus = d / "c.txt"
    corpus.write_text(TEXT)
    return save_tiny_llama(d / "m", tie=False), corpus


def invoke(*args: Any) -> Any:
    return runner.invoke(app, [str(a) for a in args])


def mixed(files: tuple[Path, Path], out: Path, *args: Any) -> Any:
    model, corpus = files
    return invoke(
        "quantize", model, "--calib", corpus, "--num-samples", "2", "--seq-len", "16", "--dtype", "bfloat16",
        "--out", out, "--no-progress", *args,
    )  # fmt: skip


def header_bytes(path: Path) -> dict[str, int]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


@pytest.mark.slow
def test_target_bits_writes_the_plan_and_measures_it_as_eval_kld_does(files: tuple[Path, Path], tmp_path: Path) -> None:
    model, corpus = files
    out = tmp_path / "o"
    ev = ("--eval", corpus, "--eval-tokens", "256", "--eval-seq-len", "64")
    r = mixed(files, out, "--target-bits", "5.5", "--candidates", CANDIDATES, *ev, "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep == json.loads((out / "quantize_report.json").read_text())
    assert len(rep["linears"]) == 14 and sum(rep["counts"].values()) == 8  # 2 layers x (qkv, o, gate_up, down)
    assert len([c for c, n in rep["counts"].items() if n]) >= 2  # a mix, not one scheme
    # bits as stored: every linear's from the header's bytes; the plan's total within the budget
    sizes = header_bytes(out / "model.safetensors")
    cfg = json.loads((model / "config.json").read_text())
    for lin in rep["linears"]:
        stored = sum(b for k, b in sizes.items() if k.rpartition(".")[0] == lin["name"])
        mod = lin["name"].rsplit(".", 1)[1]
        n, k = {
            "q_proj": (cfg["hidden_size"], cfg["hidden_size"]),
            "k_proj": (cfg["hidden_size"] // 2, cfg["hidden_size"]),
            "v_proj": (cfg["hidden_size"] // 2, cfg["hidden_size"]),
            "o_proj": (cfg["hidden_size"], cfg["hidden_size"]),
            "gate_proj": (cfg["intermediate_size"], cfg["hidden_size"]),
            "up_proj": (cfg["intermediate_size"], cfg["hidden_size"]),
            "down_proj": (cfg["hidden_size"], cfg["intermediate_size"]),
        }[mod]
        assert lin["bits"] == pytest.approx(8 * stored / (n * k), rel=1e-12), lin["name"]
    assert rep["bits_planned"] <= 5.5
    assert rep["bits_plan"] == pytest.approx(rep["bits_planned"], rel=1e-12)  # planned sizes = written sizes
    params = sum(t.numel() for t in load_file(str(model / "model.safetensors")).values())
    assert rep["bits_model"] == pytest.approx(8 * sum(sizes.values()) / params, rel=1e-12)
    # fused units share one group of the config; the groups are the planned candidates
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision"
    plan = {lin["name"]: lin["candidate"] for lin in rep["linears"]}
    for g in qc["config_groups"].values():
        assert len({plan[t] for t in g["targets"]}) == 1
    # measured: what `eval kld` says of the written checkpoint against the source model
    assert rep["measured_kld"] is not None and rep["measured_kld"] > 0
    k = invoke("eval", "kld", out, "--reference", model, "--data", corpus, "--max-tokens", 256, "--seq-len", 64,
               "--json", "--no-progress")  # fmt: skip
    assert k.exit_code == 0, k.output
    assert json.loads(k.stdout)["kld"]["mean"]["mean"] == pytest.approx(rep["measured_kld"], rel=1e-9)


@pytest.mark.slow
def test_max_kld_gate_is_measured_exit_3_and_keeps_the_checkpoint(files: tuple[Path, Path], tmp_path: Path) -> None:
    _, corpus = files
    ev = ("--eval", corpus, "--eval-tokens", "128", "--eval-seq-len", "64")
    r = mixed(files, tmp_path / "a", "--target-bits", "5", "--candidates", CANDIDATES, "--max-kld", "1e-9", *ev)
    assert r.exit_code == 3, r.output
    assert "above --max-kld 1e-09" in r.output and "Traceback" not in r.output
    assert (tmp_path / "a" / "config.json").exists()
    report = json.loads((tmp_path / "a" / "quantize_report.json").read_text())
    assert report["kld_gate"]["passed"] is False and report["kld_gate"]["kld"] > 1e-9
    # --max-kld alone: the smallest plan predicted under it, then measured against the same limit
    r = mixed(files, tmp_path / "b", "--candidates", CANDIDATES, "--max-kld", "10", *ev, "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["budget"] == "kld <= 10" and rep["predicted_kld"] <= 10
    assert rep["kld_gate"] == {"max_kld": 10.0, "kld": rep["measured_kld"], "passed": True}


@pytest.mark.slow
def test_gptq_candidates_beat_rtn_candidates_at_the_same_bits(files: tuple[Path, Path], tmp_path: Path) -> None:
    """--method gptq: each candidate solved by GPTQ with H from the fp model's inputs; at the same
    budget the written checkpoint's measured KL is below the RTN one's."""
    held_out = tmp_path / "held_out.txt"  # not the calibration text: GPTQ must not win by fitting it
    held_out.write_text(HELD_OUT)
    ev = ("--eval", held_out, "--eval-tokens", "256", "--eval-seq-len", "64", "--json")
    reps = {}
    for method in ("rtn", "gptq"):
        args = ("--target-bits", "5", "--candidates", "W4A16_G32,W8A16_G32", "--method", method, *ev)
        r = mixed(files, tmp_path / method, *args, "--num-samples", "8", "--seq-len", "64")  # H of full rank
        assert r.exit_code == 0, r.output
        reps[method] = json.loads(r.stdout)
    assert reps["gptq"]["method"] == "gptq" and reps["rtn"]["method"] == "rtn"
    for rep in reps.values():
        assert rep["bits_planned"] <= 5 and rep["bits_plan"] == pytest.approx(rep["bits_planned"], rel=1e-12)
    assert reps["gptq"]["measured_kld"] < reps["rtn"]["measured_kld"], (
        reps["gptq"]["measured_kld"],
        reps["rtn"]["measured_kld"],
    )
    assert reps["gptq"]["predicted_kld"] < reps["rtn"]["predicted_kld"]
    fit_note = [n for n in reps["gptq"]["notes"] if "fitted to the calibration windows" in n]
    assert len(fit_note) == 1 and "--num-samples 128" in fit_note[0]
    assert not any("fitted to the calibration windows" in n for n in reps["rtn"]["notes"])


@pytest.mark.slow
def test_eval_ppl_reads_it_as_a_model_holding_the_dequantized_weights(files: tuple[Path, Path], tmp_path: Path) -> None:
    """INT only (weight-only layers): `eval ppl` of the checkpoint against a model holding our
    reader's dequantized weights (float32), relative 1e-4."""
    from transformers import AutoModelForCausalLM

    from infer_tool.calib.corpora import tokenize
    from infer_tool.calib.models import load_tokenizer
    from infer_tool.evals.ppl import evaluate_ppl
    from infer_tool.packers.checkpoint import read_checkpoint

    model, corpus = files
    out = tmp_path / "o"
    r = mixed(files, out, "--target-bits", "6", "--candidates", "W4A16_G32,W8A16_G32", "--dtype", "float32")
    assert r.exit_code == 0, r.output
    e = invoke("eval", "ppl", out, "--data", corpus, "--max-tokens", 256, "--seq-len", 64, "--json", "--no-progress")
    assert e.exit_code == 0, e.output
    ours = json.loads(e.stdout)["ppl"]
    _, layers, _ = read_checkpoint(out)
    assert {type(w).__name__ for w in layers.values()} == {"QuantizedWeight"} and len(layers) == 14
    assert {w.bits for w in layers.values()} == {4, 8}
    ref = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    for n, w in layers.items():
        ref.get_submodule(n).weight.data = w.dequantize(torch.float32)
    ids = tokenize(corpus.read_text(), load_tokenizer(model, False), 256)
    want = evaluate_ppl(ref, ids, 64).ppl
    assert math.isclose(ours, want, rel_tol=1e-4), (ours, want)


@pytest.mark.slow
def test_quantize_plan_out_writes_one_budget(files: tuple[Path, Path], tmp_path: Path) -> None:
    model, corpus = files
    base = ("quantize-plan", model, "--calib", corpus, "--num-samples", "2", "--seq-len", "16", "--no-progress",
            "--candidates", CANDIDATES, "--dtype", "bfloat16")  # fmt: skip
    r = invoke(*base, "--target-bits", "5,6", "--out", tmp_path / "two")
    assert r.exit_code == 2 and "one budget" in r.output and not (tmp_path / "two").exists()
    r = invoke(*base, "--target-bits", "6", "--out", tmp_path / "one", "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["measured_kld"] is None and rep["bits_planned"] <= 6
    qc = json.loads((tmp_path / "one" / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision"
    # ownership: a user's directory is never replaced, ours is
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "mine.txt").write_text("keep")
    r = invoke(*base, "--target-bits", "6", "--out", tmp_path / "user", "--overwrite")
    assert r.exit_code == 2 and (tmp_path / "user" / "mine.txt").read_text() == "keep"
    (tmp_path / "file").write_text("keep")
    r = invoke(*base, "--target-bits", "6", "--out", tmp_path / "file", "--overwrite")
    assert r.exit_code == 2 and (tmp_path / "file").read_text() == "keep"
    r = invoke(*base, "--target-bits", "5", "--out", tmp_path / "one", "--overwrite")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "one" / "quantize_report.json").read_text())["budget"] == "5 bits"


@pytest.mark.parametrize(
    "args,says",
    [
        (["--target-bits", "5", "--scheme", "W4A16"], "--scheme"),
        (["--target-bits", "5", "--group-size", "32"], "--group-size does not apply to mixed precision"),
        (["--target-bits", "5", "--method", "awq"], "--method awq: mixed precision solves every candidate with rtn"),
        (["--candidates", "W4A16_G32,W8A16_G32"], "give the budget"),
        (["--candidates", "W4A16_G32,FP8", "--max-kld", "0.1"], "--max-kld needs --eval"),
        (["--target-bits", "5", "--candidates", "W4A16,INT3"], "--candidates 'INT3' is not a preset"),
        (["--target-bits", "-1"], "--target-bits -1: expected a positive number"),
        (["--target-bits", "5", "--candidates", "NVFP4A16,FP8", "--method", "gptq"], "share one global scale"),
    ],
)
def test_refusals_are_one_line_exit_2_and_write_nothing(
    files: tuple[Path, Path], tmp_path: Path, args: list[str], says: str
) -> None:
    r = invoke("quantize", files[0], "--out", tmp_path / "o", "--no-progress", *args)
    assert r.exit_code == 2, r.output
    assert says in r.output and "Traceback" not in r.output
    assert not (tmp_path / "o").exists()
