"""Hostile input, table-driven, through the real entry point (`infer_tool.cli.app.main`).

Every case is a bad request a user could make. Each must end with:
- the stated exit code (2 for bad input);
- exactly one line on stderr, naming the bad value (the case's needle), no traceback;
- nothing written: the whole working area (models, corpora, outputs, the tool's cache)
  is identical before and after;
- within a time bound (the cases fail before any real work: a tiny model at most).
"""

from __future__ import annotations

import json
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tiny import TEXT, save_tiny_llama

from infer_tool.cli.app import main

TIME_BOUND_S = 30.0  # per case, generous for a loaded 2-core machine; most take well under 1 s


@dataclass(frozen=True)
class Case:
    argv: tuple[str, ...]  # "{w}" is replaced by the working area's path
    needle: str  # the stderr line must contain it
    code: int = 2


def q(*args: str) -> tuple[str, ...]:
    """quantize the tiny model into a fresh output, quietly."""
    return (
        "quantize",
        "{w}/model",
        "--out",
        "{w}/out",
        "--calib",
        "{w}/calib.txt",
        "--no-progress",
        "--device",
        "cpu",
        "--group-size",
        "32",
        "--num-samples",
        "4",
        "--seq-len",
        "16",
        *args,
    )


def qf(*args: str) -> tuple[str, ...]:
    """quantize --method fp8 (no group size)."""
    return (
        "quantize",
        "{w}/model",
        "--out",
        "{w}/out",
        "--calib",
        "{w}/calib.txt",
        "--no-progress",
        "--device",
        "cpu",
        "--method",
        "fp8",
        *args,
    )


def cal(*args: str) -> tuple[str, ...]:
    return (
        "calibrate",
        "{w}/model",
        "--out",
        "{w}/stats-out",
        "--calib",
        "{w}/calib.txt",
        "--no-progress",
        "--device",
        "cpu",
        *args,
    )


def ev(*args: str) -> tuple[str, ...]:
    return ("eval", "ppl", "{w}/model", "--data", "{w}/calib.txt", "--no-progress", "--device", "cpu", *args)


def quant_model(model: str, *args: str) -> tuple[str, ...]:
    return (
        "quantize",
        model,
        "--out",
        "{w}/out",
        "--calib",
        "{w}/calib.txt",
        "--no-progress",
        "--device",
        "cpu",
        "--group-size",
        "32",
        *args,
    )


def ev_model(model: str, *args: str) -> tuple[str, ...]:
    return ("eval", "ppl", model, "--data", "{w}/calib.txt", "--no-progress", "--device", "cpu", *args)


CASES: dict[str, Case] = {
    # -- quantize: scheme options
    "method unknown": Case(q("--method", "magic"), "--method 'magic'"),
    "bits 9": Case(q("--bits", "9"), "bits=9"),
    "group size 0": Case(q("--group-size", "0"), "group_size=0"),
    "group size not dividing K": Case(q("--group-size", "48"), "group size 48 does not divide"),
    "format unknown": Case(q("--format", "gguf"), "format 'gguf'"),
    "gptq format asym": Case(q("--method", "gptq", "--format", "gptq", "--asym"), "gptq"),
    "act-order with awq": Case(q("--method", "awq", "--act-order"), "--act-order does not apply to --method awq"),
    "kv-cache with rtn": Case(q("--method", "rtn", "--kv-cache", "fp8"), "--kv-cache does not apply to --method rtn"),
    "group size with fp8": Case(qf("--group-size", "64"), "--group-size does not apply to --method fp8"),
    "fp8 granularity row": Case(qf("--fp8-granularity", "row"), "granularity 'row'"),
    "fp8 block static": Case(
        qf("--fp8-granularity", "block", "--fp8-activations", "static"), "dynamic activations only"
    ),
    "fp8 activations lazy": Case(qf("--fp8-activations", "lazy"), "activations 'lazy'"),
    "fp8 kv int8": Case(qf("--kv-cache", "int8"), "kv cache 'int8'"),
    "fp8 channel native": Case(qf("--format", "fp8"), "compressed-tensors"),
    "damp 0": Case(q("--method", "gptq", "--damp", "0"), "damp=0"),
    "damp nan": Case(q("--method", "gptq", "--damp", "nan"), "--damp = nan"),
    "damp inf": Case(q("--method", "gptq", "--damp", "inf"), "--damp = inf"),
    # -- quantize: numbers
    "num samples 0": Case(q("--num-samples", "0"), "--num-samples 0"),
    "seq len 1": Case(q("--seq-len", "1"), "--seq-len 1"),
    "seed negative": Case(q("--seed", "-1"), "--seed -1"),
    "seed 10**30": Case(q("--seed", str(10**30)), "--seed 1000000000000000000000000000000"),
    "seed not a number": Case(q("--seed", "abc"), "'abc' is not a valid int"),
    "eval tokens 1": Case(q("--eval", "{w}/calib.txt", "--eval-tokens", "1"), "--eval-tokens 1"),
    "gate without eval": Case(q("--max-ppl-increase", "5%"), "--eval"),
    "gate not a percentage": Case(
        q("--eval", "{w}/calib.txt", "--max-ppl-increase", "lots"), "'lots' is not a percentage"
    ),
    "gate negative": Case(q("--eval", "{w}/calib.txt", "--max-ppl-increase", "-5"), "'-5' must be a finite percentage"),
    "gate nan": Case(q("--eval", "{w}/calib.txt", "--max-ppl-increase", "nan%"), "'nan%' must be a finite percentage"),
    "dtype int8": Case(q("--dtype", "int8"), "--dtype 'int8'"),
    "device tpu": Case(q("--device", "tpu"), "--device 'tpu'"),
    "device cuda without GPU": Case(q("--device", "cuda"), "no CUDA device"),
    "unknown flag": Case(q("--nope"), "No such option: --nope"),
    # -- quantize: --ignore
    "ignore bad regex": Case(q("--ignore", "re:("), "--ignore 're:('"),
    "ignore everything": Case(q("--ignore", "*"), "nothing would be quantized"),
    # -- quantize: corpora and statistics
    "calib split": Case(q("--calib", "sotu:train"), "sotu split 'train'"),
    "calib missing file": Case(q("--calib", "{w}/missing.txt"), "missing.txt' does not exist"),
    "calib a directory": Case(q("--calib", "{w}/model"), "unsupported corpus file"),
    "calib not UTF-8": Case(q("--calib", "{w}/latin1.txt"), "latin1.txt"),
    "calib empty": Case(q("--calib", "{w}/empty.txt"), "empty.txt' is empty"),
    "eval split": Case(q("--eval", "sotu:test"), "sotu split 'test'"),
    "stats missing": Case(q("--method", "gptq", "--stats", "{w}/missing"), "is not a statistics directory"),
    "stats with awq": Case(q("--method", "awq", "--stats", "{w}/stats"), "--stats works with"),
    "stats with kv cache": Case(qf("--kv-cache", "fp8", "--stats", "{w}/stats"), "--kv-cache fp8 needs"),
    "stats corrupt": Case(q("--method", "gptq", "--stats", "{w}/stats-corrupt"), "stats-corrupt"),
    # -- quantize: --out
    "no out": Case(("quantize", "{w}/model", "--no-progress"), "--out DIR is required"),
    "out exists": Case(q()[:3] + ("{w}/unrelated",) + q()[4:], "already exists"),
    "overwrite unrelated dir": Case(q()[:3] + ("{w}/unrelated",) + q()[4:] + ("--overwrite",), "did not write"),
    "overwrite a file": Case(q()[:3] + ("{w}/calib.txt",) + q()[4:] + ("--overwrite",), "is a file"),
    "overwrite cwd": Case(q()[:3] + (".",) + q()[4:] + ("--overwrite",), "current directory"),
    "overwrite source model": Case(q()[:3] + ("{w}/model",) + q()[4:] + ("--overwrite",), "holds the source model"),
    "out unwritable": Case(q()[:3] + ("/proc/infer-tool-out",) + q()[4:], "cannot write in /proc"),
    # -- quantize: models
    "model missing": Case(quant_model("{w}/missing-model"), "does not exist"),
    "model demo typo": Case(quant_model("smolm2-135m"), "did you mean: smollm2-135m"),
    "model no config": Case(quant_model("{w}/no-config"), "has no config.json"),
    "model pickle only": Case(quant_model("{w}/pickle-only"), "pickle-based"),
    "config truncated": Case(quant_model("{w}/config-truncated"), "config.json: JSONDecodeError"),
    "config a list": Case(quant_model("{w}/config-list"), "holds a JSON list"),
    "config no model_type": Case(quant_model("{w}/config-no-type"), "no model_type"),
    "model_type not in table": Case(quant_model("{w}/bert-type"), "'bert' is not in the quantization table"),
    "model_type unknown": Case(quant_model("{w}/foo-type"), "'foo_lm' is not in the quantization table"),
    "zero heads": Case(quant_model("{w}/zero-heads"), "could not be loaded"),
    "safetensors random": Case(quant_model("{w}/random-weights"), "could not be loaded"),
    "safetensors truncated": Case(quant_model("{w}/truncated-weights"), "could not be loaded"),
    "gguf random": Case(quant_model("{w}/random.gguf"), "GGUF file"),
    "a pickle file": Case(quant_model("{w}/pickle-only/pytorch_model.bin"), "pickle-based weight file"),
    # -- quantize: recipes
    "recipe missing": Case(q("--recipe", "{w}/missing.yaml"), "does not exist"),
    "recipe suffix": Case(q("--recipe", "{w}/recipe.ini"), "use a .yaml"),
    "recipe not UTF-8": Case(q("--recipe", "{w}/latin1.yaml"), "not UTF-8"),
    "recipe invalid YAML": Case(q("--recipe", "{w}/invalid.yaml"), "not valid YAML"),
    "recipe invalid TOML": Case(q("--recipe", "{w}/invalid.toml"), "not valid TOML"),
    "recipe a list": Case(q("--recipe", "{w}/list.yaml"), "must be a mapping"),
    "recipe unknown key": Case(q("--recipe", "{w}/unknown-key.yaml"), "unknown option 'methd'"),
    "recipe asym string": Case(q("--recipe", "{w}/asym-string.toml"), "'false' must be true or false"),
    "recipe sym string": Case(q("--recipe", "{w}/sym-string.yaml"), "must be true or false"),
    "recipe ignore 5": Case(q("--recipe", "{w}/ignore-5.yaml"), "= 5 must be a list of strings"),
    "recipe damp abc": Case(q("--recipe", "{w}/damp-abc.yaml"), "'abc' must be a finite number"),
    "recipe out 123": Case(
        ("quantize", "{w}/model", "--recipe", "{w}/out-123.yaml", "--no-progress"), "= 123 must be a string"
    ),
    "recipe num_samples 1.5": Case(q("--recipe", "{w}/samples-float.json"), "must be an integer"),
    # -- calibrate
    "calibrate no out": Case(("calibrate", "{w}/model", "--no-progress"), "--out DIR"),
    "calibrate out exists": Case(cal()[:3] + ("{w}/unrelated",) + cal()[4:], "already exists"),
    "calibrate overwrite unrelated": Case(
        cal()[:3] + ("{w}/unrelated",) + cal()[4:] + ("--overwrite",), "did not write"
    ),
    "calibrate samples 0": Case(cal("--num-samples", "0"), "--num-samples 0"),
    "calibrate split": Case(cal("--calib", "sotu:x"), "sotu split 'x'"),
    "calibrate missing model": Case(
        ("calibrate", "{w}/missing-model", "--out", "{w}/s", "--no-progress"), "does not exist"
    ),
    "calibrate unknown type": Case(
        ("calibrate", "{w}/bert-type", "--out", "{w}/s", "--calib", "{w}/calib.txt", "--no-progress"),
        "'bert' is not in the quantization table",
    ),
    # -- eval ppl
    "eval seq len 1": Case(ev("--seq-len", "1"), "--seq-len must be >= 2"),
    "eval max tokens 0": Case(ev("--max-tokens", "0"), "--max-tokens must be >= 1"),
    "eval stride 0": Case(ev("--stride", "0"), "--stride 0"),
    "eval stride above seq len": Case(ev("--stride", "5000", "--seq-len", "64"), "--stride 5000"),
    "eval dtype int4": Case(ev("--dtype", "int4"), "--dtype 'int4'"),
    "eval kv dtype int8": Case(ev("--kv-cache-dtype", "int8"), "--kv-cache-dtype 'int8'"),
    "eval data split": Case(ev("--data", "sotu:foo"), "sotu split 'foo'"),
    "eval data missing": Case(ev("--data", "{w}/missing.jsonl"), "missing.jsonl' does not exist"),
    "eval data not UTF-8": Case(ev("--data", "{w}/latin1.txt"), "latin1.txt"),
    "eval text field": Case(ev("--data", "{w}/corpus.jsonl", "--text-field", "body"), "no text field 'body'"),
    "eval baseline typo": Case(ev("--baseline", "smolm2-135m"), "did you mean: smollm2-135m"),
    "eval baseline missing": Case(ev("--baseline", "{w}/missing-model"), "does not exist"),
    "eval device tpu": Case(ev("--device", "tpu"), "--device 'tpu'"),
    "eval remote code": Case(ev_model("{w}/remote-code"), "--trust-remote-code"),
    "eval unknown model_type": Case(ev_model("{w}/foo-type"), "'foo_lm' in"),
    "eval zero heads": Case(ev_model("{w}/zero-heads"), "could not be loaded"),
    "eval fp8 kv on plain model": Case(ev("--kv-cache-dtype", "fp8"), "needs a quantized checkpoint"),
    "eval missing model argument": Case(("eval", "ppl"), "Missing argument"),
    # -- kv-budget
    "kv crafted gguf": Case(("kv-budget", "{w}/crafted.gguf"), "crafted.gguf"),
    "kv context range too long": Case(("kv-budget", "llama-3.1-8b", "--context", "1..16m:1"), "1..16m:1"),
    "kv concurrency 0": Case(("kv-budget", "llama-3.1-8b", "--concurrency", "0"), "0"),
    "kv unknown gpu": Case(("kv-budget", "llama-3.1-8b", "--gpu", "H999"), "H999"),
    "kv mem util 1.5": Case(("kv-budget", "llama-3.1-8b", "--mem-util", "1.5"), "1.5"),
    "kv dtype fp4": Case(("kv-budget", "llama-3.1-8b", "--kv-dtype", "fp4"), "fp4"),
    "kv preset typo": Case(("kv-budget", "lama-3.1-70b"), "did you mean"),
    "kv shared prefix above context": Case(
        ("kv-budget", "llama-3.1-8b", "--context", "1k..8k", "--shared-prefix", "8192"), "shared"
    ),
    "kv config a list": Case(("kv-budget", "{w}/config-list"), "config-list"),
    # -- issue 58: ownership, progress, sizes, refusals in the user's words
    "overwrite thesis beside a fake report": Case(
        q()[:3] + ("{w}/thesis",) + q()[4:] + ("--overwrite",), "did not write (thesis.tex)"
    ),
    "overwrite a fake report alone": Case(
        q()[:3] + ("{w}/fake-report",) + q()[4:] + ("--overwrite",), "not a document this tool wrote"
    ),
    "progress path is a file": Case(q("--resume")[:3] + ("{w}/pf",) + q("--resume")[4:], "is a file"),
    "progress path is a file, no resume": Case(q()[:3] + ("{w}/pf",) + q()[4:], "is a file"),
    "progress record cut short": Case(q("--resume")[:3] + ("{w}/pc",) + q("--resume")[4:], "cannot be read"),
    "progress field of the wrong type": Case(
        q("--resume")[:3] + ("{w}/pt",) + q("--resume")[4:], "'layers_done' is '3'"
    ),
    "max-memory bare number": Case(q("--max-memory", "20"), "'20' is 20 bytes"),
    "max-memory not a size": Case(q("--max-memory", "20 apples"), "accepted: a number and a unit"),
    "max-shard-size non-ASCII digit": Case(q("--max-shard-size", "²GB"), "'²GB' is not a size"),
    "device non-ASCII digit": Case(q("--device", "cuda:²"), "cuda:²"),
    "num-samples in Arabic-Indic digits": Case(q("--num-samples", "١٢"), "'١٢' is not a number written in ASCII"),
    "max-ppl-increase in Arabic-Indic digits": Case(
        q("--eval", "{w}/calib.txt", "--max-ppl-increase", "٥%"), "'٥%' is not a percentage"
    ),
    "W8A8 with awq names the preset": Case(q("--scheme", "W8A8", "--method", "awq"), "--scheme W8A8 stands for"),
    "W4A16 with fp4 names the preset": Case(
        q("--scheme", "W4A16", "--fp4", "nvfp4", "--method", "gptq"), "--scheme W4A16"
    ),
    "W4A16_ASYM full range names the preset": Case(
        q("--scheme", "W4A16_ASYM", "--full-range", "--method", "gptq"), "--scheme W4A16_ASYM makes them asymmetric"
    ),
    "awq full range names the default": Case(q("--method", "awq", "--full-range"), "--method awq's default (--asym)"),
    "fp4 preset with bits": Case(
        q("--scheme", "NVFP4A16", "--bits", "4", "--method", "gptq"), "--scheme NVFP4A16 does not go with --bits"
    ),
}


def _write_model_variant(
    root: Path, name: str, config: object | str | None, weights: bytes | None = b"", pickle: bool = False
) -> None:
    d = root / name
    d.mkdir()
    if config is not None:
        (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if weights is not None:
        (d / "model.safetensors").write_bytes(weights)
    if pickle:
        (d / "pytorch_model.bin").write_bytes(b"\x80\x04not really")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The working area: a tiny model and its broken variants, corpora, recipes, outputs."""
    w = tmp_path_factory.mktemp("hostile")
    model = save_tiny_llama(w / "model", layers=1, hidden=64)
    config = json.loads((model / "config.json").read_text())
    weights = (model / "model.safetensors").read_bytes()
    (w / "calib.txt").write_text(TEXT)
    (w / "empty.txt").write_text("  \n")
    (w / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 50)
    (w / "corpus.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in TEXT.split(". ")))
    (w / "unrelated").mkdir()
    (w / "unrelated" / "notes.txt").write_text("not ours")
    _write_model_variant(w, "no-config", None, weights)
    _write_model_variant(w, "pickle-only", config, None, pickle=True)
    _write_model_variant(w, "config-truncated", json.dumps(config)[:40], weights)
    _write_model_variant(w, "config-list", "[1, 2, 3]", weights)
    _write_model_variant(w, "config-no-type", {k: v for k, v in config.items() if k != "model_type"}, weights)
    _write_model_variant(w, "bert-type", {**config, "model_type": "bert"}, weights)
    _write_model_variant(w, "foo-type", {**config, "model_type": "foo_lm"}, weights)
    _write_model_variant(w, "zero-heads", {**config, "num_attention_heads": 0, "num_key_value_heads": 0}, weights)
    _write_model_variant(w, "random-weights", config, os.urandom(4096))
    _write_model_variant(w, "truncated-weights", config, weights[: len(weights) // 3])
    _write_model_variant(
        w, "remote-code", {**config, "model_type": "custom_lm", "auto_map": {"AutoConfig": "x.Config"}}, weights
    )
    for variant in ("zero-heads", "random-weights", "truncated-weights", "remote-code", "foo-type"):
        for f in model.iterdir():
            if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
                (w / variant / f.name).write_bytes(f.read_bytes())
    (w / "random.gguf").write_bytes(b"GGUF" + os.urandom(200))
    (w / "crafted.gguf").write_bytes(
        b"GGUF"
        + struct.pack("<IQQ", 3, 0, 1)
        + struct.pack("<Q", 1)
        + b"k"
        + struct.pack("<I", 9)
        + struct.pack("<IQ", 9, 2**60)
        + struct.pack("<IQ", 0, 2**62)
    )
    (w / "thesis").mkdir()
    (w / "thesis" / "thesis.tex").write_text("\\documentclass{article}")
    (w / "thesis" / "quantize_report.json").write_text("notes about my report")
    (w / "fake-report").mkdir()
    (w / "fake-report" / "quantize_report.json").write_text("notes about my report")
    (w / ".pf.partial").write_text("not a directory")
    for name, record in (("pc", '{"key": "ab'), ("pt", json.dumps({"key": "ab", "layers": 2, "layers_done": "3"}))):
        (w / f".{name}.partial").mkdir()
        (w / f".{name}.partial" / "run.json").write_text(record)
        (w / f".{name}.partial" / "layer-00000.safetensors").write_bytes(b"finished work")
    (w / "stats").mkdir()
    (w / "stats" / "stats_index.json").write_text(json.dumps({"version": 1, "meta": {}, "layers": {}}))
    (w / "stats-corrupt").mkdir()
    (w / "stats-corrupt" / "stats_index.json").write_text('{"version": 1, "layers": {"a": {}}')
    recipes = {
        "recipe.ini": "method = gptq\n",
        "invalid.yaml": "method: [gptq\n",
        "invalid.toml": "method = \n",
        "list.yaml": "- method\n- gptq\n",
        "unknown-key.yaml": "methd: gptq\n",
        "asym-string.toml": 'asym = "false"\n',
        "sym-string.yaml": 'sym: "yes"\n',
        "ignore-5.yaml": "ignore: 5\n",
        "damp-abc.yaml": "method: gptq\ndamp: abc\n",
        "out-123.yaml": "out: 123\n",
        "samples-float.json": '{"num_samples": 1.5}',
    }
    for name, text in recipes.items():
        (w / name).write_text(text)
    (w / "latin1.yaml").write_bytes("method: gptq # caf\xe9\n".encode("latin-1"))
    (w / "cache" / "gguf").mkdir(parents=True)
    return w


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path with its size and mtime (directories: existence only; a temporary entry
    made and removed inside one changes its mtime, not its contents)."""
    return {
        str(p.relative_to(root)): (0, 0) if p.is_dir() else (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch, world: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("INFER_TOOL_CACHE", str(world / "cache"))
    monkeypatch.delenv("INFER_TOOL_DEBUG", raising=False)
    monkeypatch.chdir(world)


def test_there_are_enough_cases() -> None:
    assert len(CASES) >= 80
    commands = {c.argv[0] for c in CASES.values()}
    assert {"quantize", "calibrate", "eval", "kv-budget"} <= commands


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_input(name: str, world: Path, capfd: pytest.CaptureFixture[str]) -> None:
    case = CASES[name]
    argv = [a.replace("{w}", str(world)) for a in case.argv]
    before = snapshot(world)
    capfd.readouterr()
    t0 = time.perf_counter()
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    elapsed = time.perf_counter() - t0
    out, err = capfd.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert exit_info.value.code == case.code, (name, exit_info.value.code, err[-2000:])
    assert len(lines) == 1, (name, err[-2000:])
    assert case.needle in lines[0], (name, lines[0])
    assert "Traceback" not in err + out
    assert snapshot(world) == before, f"{name} wrote into the working area"
    assert elapsed < TIME_BOUND_S, (name, elapsed)


def test_unexpected_error_is_one_line_and_exit_1(
    world: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last-resort handler: a bug of ours (simulated) is one line, exit 1, no traceback;
    INFER_TOOL_DEBUG=1 shows the traceback."""
    import infer_tool.jobs.quantize as job

    def boom(*a: object, **k: object) -> None:
        raise KeyError("simulated bug")

    monkeypatch.setattr(job, "check_patterns", boom)
    argv = [a.replace("{w}", str(world)) for a in q()]
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capfd.readouterr().err
    assert e.value.code == 1 and err.strip().count("\n") == 0
    assert "internal error: KeyError: 'simulated bug'; set INFER_TOOL_DEBUG=1" in err and "Traceback" not in err
    monkeypatch.setenv("INFER_TOOL_DEBUG", "1")
    with pytest.raises(KeyError):
        main(argv)


def test_checkpoint_files_are_readable_by_others(
    world: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Every written file gets the mode a plain file gets under the umask (0644 under 022);
    safetensors alone would make model.safetensors 0600. Overwriting our own output works."""
    out = tmp_path / "ckpt"
    argv = [
        a.replace("{w}", str(world)).replace(str(world / "out"), str(out))
        for a in q("--method", "rtn", "--group-size", "32")
    ]
    old = os.umask(0o022)
    try:
        for extra in ([], ["--overwrite"]):
            with pytest.raises(SystemExit) as e:
                main(argv + extra)
            assert e.value.code == 0, capfd.readouterr().err[-2000:]
    finally:
        os.umask(old)
    assert (out.stat().st_mode & 0o777) == 0o755
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes and all(m == 0o644 for m in modes.values()), modes


def test_concurrent_cache_entry_keeps_the_winner(tmp_path: Path) -> None:
    """Two runs converting the same GGUF: the second rename finds the first's complete entry,
    keeps it and drops its own, instead of failing with 'Directory not empty'."""
    from infer_tool.calib.models import publish

    target, mine = tmp_path / "entry", tmp_path / ".convert-mine"
    for d, text in ((target, "theirs"), (mine, "mine")):
        d.mkdir()
        (d / "config.json").write_text(text)
        (d / "model.safetensors").write_text(text)
    publish(mine, target)
    assert (target / "config.json").read_text() == "theirs" and not mine.exists()
    fresh = tmp_path / ".convert-fresh"
    fresh.mkdir()
    (fresh / "config.json").write_text("fresh")
    publish(fresh, tmp_path / "new-entry")
    assert (tmp_path / "new-entry" / "config.json").read_text() == "fresh"


def test_no_progress_silences_library_bars(world: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """--no-progress: nothing on stderr from transformers' own bars (weight loading) either;
    with progress on, transformers' bar is drawn as ours (its description appears)."""
    out = tmp_path / "o"
    base = [
        a.replace("{w}", str(world)).replace(str(world / "out"), str(out))
        for a in q("--method", "rtn", "--group-size", "32")
    ]
    with pytest.raises(SystemExit) as e:
        main(base)
    assert e.value.code == 0
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "it/s" not in err, err[-1000:]
    assert torch.get_num_threads() >= 1


def test_ignore_pattern_matching_nothing_is_reported(
    world: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "o"
    argv = [
        a.replace("{w}", str(world)).replace(str(world / "out"), str(out))
        for a in q("--method", "rtn", "--ignore", "*.nothing_like_this", "--ignore", "*.down_proj", "--json")
    ]
    with pytest.raises(SystemExit) as e:
        main(argv)
    captured = capfd.readouterr()
    assert e.value.code == 0, captured.err[-2000:]
    report = json.loads(captured.out)
    assert report["unmatched_ignore"] == ["*.nothing_like_this"]
    assert "*.nothing_like_this" in captured.err and "*.down_proj" not in captured.err
    assert report["ignored"] == ["model.layers.0.mlp.down_proj"]


def test_full_disk_is_one_line_keeps_progress_and_resumes(
    world: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that fills while the checkpoint is written (simulated ENOSPC): one line that says
    so (not "internal error"), exit 1, no --out, the finished layers kept; --resume completes."""
    import errno

    import infer_tool.jobs.quantize_run as run

    def full(*a: object, **k: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    argv = [a.replace("{w}", str(world)) for a in q()]
    with monkeypatch.context() as m:
        m.setattr(run, "write_from_parts", full)
        with pytest.raises(SystemExit) as e:
            main(argv)
    err = capfd.readouterr().err
    assert e.value.code == 1 and err.strip().count("\n") == 0, err
    assert "no space left on the device (No space left on device)" in err and "internal error" not in err, err
    assert "--resume" in err and "layers finished" in err, err
    assert not (world / "out").exists()
    with pytest.raises(SystemExit) as e:
        main(argv + ["--resume"])
    assert e.value.code == 0, capfd.readouterr().err[-2000:]
    assert (world / "out" / "model.safetensors").exists()
