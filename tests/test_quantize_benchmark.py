"""benchmarks/quantize.py's `--repeat`: the medians of the runs, and the bytes check across
runs, on fake quantize processes (no model is loaded)."""

import argparse
import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "quantize.py"


def load(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_quantize", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_quantize", bench)
    spec.loader.exec_module(bench)
    return bench


def fake_runs(bench, monkeypatch, times: dict[str, list[float]], payload: dict[str, list[bytes]]):
    """run_quantize writes `payload[label][k]` and reports `times[label][k]` on its k-th call."""
    calls: dict[str, int] = {}

    def run_quantize(label, args, out, ids_file, model_dir):
        k = calls.get(label, 0)
        calls[label] = k + 1
        out.mkdir(parents=True)
        (out / "model.safetensors").write_bytes(payload[label][k])
        t = times[label][k]
        return {"report": {}, "process_s": t + 10, "quantize_s": t, "peak_rss_mib": 1.0, "layer_error_mean": None}

    monkeypatch.setattr(bench, "run_quantize", run_quantize)
    return calls


def first_rows(bench, tmp_path, labels):
    rows = []
    for label in labels:
        q = bench.run_quantize(label, None, bench.out_dir(label, tmp_path), None, "")
        out = bench.out_dir(label, tmp_path)
        rows.append(
            {
                "config": label,
                "quantize_s": q["quantize_s"],
                "process_s": q["process_s"],
                "quantize_s_runs": [q["quantize_s"]],
                "process_s_runs": [q["process_s"]],
                "checkpoint_sha256": bench.checkpoint_digest(out),
            }
        )
    return rows


def test_repeat_takes_medians_and_checks_bytes(tmp_path, monkeypatch):
    bench = load(monkeypatch)
    labels = ["NVFP4A16 GPTQ", "llmc NVFP4A16 GPTQ"]
    times = {labels[0]: [200.0, 230.0, 190.0], labels[1]: [400.0, 380.0, 450.0]}
    payload = {labels[0]: [b"a", b"a", b"a"], labels[1]: [b"b", b"b", b"c"]}
    calls = fake_runs(bench, monkeypatch, times, payload)
    rows = first_rows(bench, tmp_path, labels)
    bench.repeat_rows(rows, argparse.Namespace(repeat=3), tmp_path, None, "")
    assert calls == {labels[0]: 3, labels[1]: 3}
    ours, theirs = rows
    assert ours["quantize_s"] == 200.0 and ours["quantize_s_runs"] == [200.0, 230.0, 190.0]
    assert theirs["quantize_s"] == 400.0 and theirs["process_s"] == 410.0
    assert ours["same_bytes"] is True and theirs["same_bytes"] is False  # its third run wrote other bytes
    assert bench.seconds_cell(ours) == "200 (190-230)"
    assert not any(p.name.endswith(("-run2", "-run3")) for p in tmp_path.iterdir())  # repeats' outputs removed


def test_digest_covers_names_and_bytes(tmp_path, monkeypatch):
    bench = load(monkeypatch)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "model.safetensors").write_bytes(b"xy")
    (b / "model.safetensors").write_bytes(b"xz")
    assert bench.checkpoint_digest(a) != bench.checkpoint_digest(b)
    (b / "model.safetensors").write_bytes(b"xy")
    assert bench.checkpoint_digest(a) == bench.checkpoint_digest(b)
    (b / "model.safetensors").rename(b / "model-00001.safetensors")
    assert bench.checkpoint_digest(a) != bench.checkpoint_digest(b)
    assert bench.seconds_cell({"quantize_s": 12.4}) == "12"
