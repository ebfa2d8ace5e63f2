"""Streamed quantize runs against whole-model ones: the same bytes from a sharded source
into sharded output, the same --eval numbers as evaluating the whole model, the fallback
when the files do not match the model, and the pre-flight refusal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import TEXT, save_tiny_llama
from typer.testing import CliRunner

from infer_tool.cli.app import app

runner = CliRunner()
BASE = ("--num-samples", "8", "--seq-len", "32", "--no-progress", "--device", "cpu", "--json")


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    w = tmp_path_factory.mktemp("streamq")
    model = save_tiny_llama(w / "model", layers=3, tie=False)
    (w / "calib.txt").write_text(TEXT * 12)
    sharded = w / "sharded"  # the same weights as several shards with an index
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(model).save_pretrained(sharded, max_shard_size="60KB")
    AutoTokenizer.from_pretrained(model).save_pretrained(sharded)
    assert len(list(sharded.glob("*.safetensors"))) > 3 and (sharded / "model.safetensors.index.json").is_file()
    return w


def _quantize(w: Path, model: str, out: str, *extra: str) -> dict:
    result = runner.invoke(
        app, ["quantize", str(w / model), "--out", str(w / out), "--calib", str(w / "calib.txt"), *BASE, *extra]
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_sharded_source_and_output_match_the_whole_model_run(work):
    args = ("--method", "gptq", "--group-size", "32")
    _quantize(work, "model", "whole", *args, "--no-stream")
    streamed = _quantize(work, "sharded", "streamed", *args)
    assert not any("loaded, not streamed" in n for n in streamed["notes"])
    assert (work / "streamed/model.safetensors").read_bytes() == (work / "whole/model.safetensors").read_bytes()
    _quantize(work, "sharded", "shards", *args, "--max-shard-size", "20KB")
    index = json.loads((work / "shards/model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    whole, shards = _tensors(work / "whole"), _tensors(work / "shards")
    assert sorted(shards) == sorted(whole) and all(torch.equal(shards[k], whole[k]) for k in whole)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in whole.values())


@pytest.mark.parametrize(
    "method",
    [
        ("--method", "awq", "--group-size", "32"),
        ("--method", "fp8", "--fp8-activations", "static", "--kv-cache", "fp8"),
    ],
    ids=["awq", "fp8-static-kv"],
)
def test_eval_through_the_layers_equals_the_whole_model(work, method):
    """ppl before equals `evaluate_ppl` on the fp model; streamed and whole runs agree on
    ppl after (FP8: as deployed, W8A8 and FP8 KV cache) and on every byte."""
    from infer_tool.calib.corpora import load_text, tokenize
    from infer_tool.calib.models import load_model
    from infer_tool.evals.ppl import evaluate_ppl

    ev = ("--eval", str(work / "calib.txt"), "--eval-tokens", "600", "--eval-seq-len", "64")
    tag = method[1]
    streamed = _quantize(work, "model", f"ev-s-{tag}", *method, *ev)
    whole = _quantize(work, "model", f"ev-w-{tag}", *method, *ev, "--no-stream")
    loaded = load_model(str(work / "model"))
    ids = tokenize(load_text(str(work / "calib.txt")), loaded.tokenizer, 600)
    reference = evaluate_ppl(loaded.model, ids, 64)
    assert streamed["eval"]["ppl_before"] == pytest.approx(reference.ppl, rel=1e-9)
    assert streamed["eval"]["ppl_after"] == whole["eval"]["ppl_after"]
    assert streamed["eval"]["windows"] == reference.windows == 9
    assert (work / f"ev-s-{tag}/model.safetensors").read_bytes() == (
        work / f"ev-w-{tag}/model.safetensors"
    ).read_bytes()


def test_files_that_do_not_match_the_model_are_loaded_whole(work):
    """Keys saved without the `model.` prefix (a base-model checkpoint): transformers maps
    them, streaming cannot, so the model is loaded whole and the report says why."""
    src = work / "renamed"
    src.mkdir()
    for f in (work / "model").iterdir():
        if f.suffix != ".safetensors":
            (src / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(work / "model/model.safetensors"))
    save_file(
        {k.removeprefix("model."): v for k, v in tensors.items()},
        str(src / "model.safetensors"),
        metadata={"format": "pt"},
    )
    report = _quantize(work, "renamed", "renamed-out", "--method", "rtn", "--group-size", "32")
    assert any("loaded, not streamed" in n and "no tensor" in n for n in report["notes"])


def test_preflight_refuses_with_both_numbers(work):
    result = runner.invoke(
        app,
        [
            "quantize",
            str(work / "model"),
            "--out",
            str(work / "never"),
            "--calib",
            str(work / "calib.txt"),
            *BASE,
            "--group-size",
            "32",
            "--max-memory",
            "100MiB",
        ],
    )
    assert result.exit_code == 2
    assert "GiB of host memory (estimate), more than the 0.10 GiB --max-memory" in result.output
    assert not (work / "never").exists() and not (work / ".never.partial").exists()
    bad = runner.invoke(app, ["quantize", str(work / "model"), "--out", str(work / "never"), "--max-memory", "lots"])
    assert bad.exit_code == 2 and "--max-memory 'lots' is not a size" in bad.output


def test_report_puts_the_estimate_beside_the_peak(work):
    report = _quantize(work, "model", "est", "--method", "rtn", "--group-size", "32")
    mem = report["memory"]
    assert mem["peak_rss_mib"] > 0 and mem["estimate_host_mib"] > 0
    assert mem["estimate_terms_mib"]["runtime"] > 0 and "weights.one_layer_or_rest" in mem["estimate_terms_mib"]


def test_short_of_memory_gptq_keeps_its_replayed_activations_in_a_file(work, monkeypatch):
    """When the estimate does not fit what is available but fits without GPTQ's replayed
    activations, a streamed CPU run keeps those in a file (calib/spill.py), says so, counts
    them out of its estimate, and writes the bytes of the run that kept them in memory."""
    import infer_tool.jobs.preflight as preflight
    from infer_tool.calib.spill import SpilledChunks

    args = ("--method", "gptq", "--group-size", "32")
    in_memory = _quantize(work, "model", "spill-ref", *args)
    assert "calibration.replayed+down_input" in in_memory["memory"]["estimate_terms_mib"]
    assert not any("kept in a file" in n for n in in_memory["notes"])
    hosts: dict[bool, int] = {}
    estimate = preflight.estimate

    def spy(*a, spill=False, **k):
        e = estimate(*a, spill=spill, **k)
        hosts[spill] = e.host
        return e

    monkeypatch.setattr(preflight, "estimate", spy)
    monkeypatch.setattr(preflight, "host_available", lambda: hosts[False] - 1)  # one byte short of the in-memory plan
    written = []
    append = SpilledChunks.append
    monkeypatch.setattr(SpilledChunks, "append", lambda self, t: (written.append(1), append(self, t))[1])
    spilled = _quantize(work, "model", "spill", *args)
    assert hosts[True] < hosts[False] and written
    assert "calibration.replayed+down_input" not in spilled["memory"]["estimate_terms_mib"]
    assert "calibration.hessian" in spilled["memory"]["estimate_terms_mib"]
    assert any("replayed activations are kept in a file" in n for n in spilled["notes"])
    assert (work / "spill/model.safetensors").read_bytes() == (work / "spill-ref/model.safetensors").read_bytes()
    # Not even that fits: refused with both numbers, nothing written.
    monkeypatch.setattr(preflight, "host_available", lambda: hosts[True] - 1)
    result = runner.invoke(
        app,
        [
            "quantize",
            str(work / "model"),
            "--out",
            str(work / "spill-no"),
            "--calib",
            str(work / "calib.txt"),
            *BASE,
            *args,
        ],
    )
    assert result.exit_code == 2 and "GiB of host memory" in result.output and not (work / "spill-no").exists()
