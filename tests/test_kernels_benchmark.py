"""benchmarks/kernel_speed.py stays runnable: its CPU dry run (interpreter, tiny shape)
checks every kernel against the reference and writes the markdown and JSON tables."""

import importlib.machinery
import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_speed.py"


def test_dry_run_writes_tables(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # restored after the test; main sets it too
    spec = importlib.util.spec_from_file_location("bench_kernels", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_kernels", bench)  # dataclasses look it up
    spec.loader.exec_module(bench)
    rc = bench.main(["--dry-run", "--shapes", "160x72", "--ms", "1", "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "kernels_dry_run.json").read_text())
    kernels = {r["kernel"]: r for r in doc["rows"]}
    assert set(kernels) == {"fp16", "w4a16", "fp8-w8a8", "fp8-w8a16", "nvfp4-a16", "mxfp4-a16"}
    for name in ("w4a16", "fp8-w8a8", "fp8-w8a16", "nvfp4-a16", "mxfp4-a16"):
        assert kernels[name]["correct"] is True and kernels[name]["rel_err"] < 2e-3
    assert kernels["w4a16"]["config"].startswith("gemv")
    assert kernels["nvfp4-a16"]["config"].startswith("gemv")
    md = (tmp_path / "kernels_dry_run.md").read_text()
    assert "| w4a16 | 160x72 | 1 |" in md and "| nvfp4-a16 | 160x72 | 1 |" in md


def test_no_benchmark_script_shadows_an_installed_module():
    """`python benchmarks/X.py` puts benchmarks/ first on sys.path, so a script named like a
    module the environment provides (transformers 5.25 imports the PyPI package `kernels`)
    would be imported in its place and break every in-process model load."""
    scripts = SCRIPT.parent
    clean = [p for p in sys.path if Path(p or ".").resolve() != scripts]
    shadowing = [
        f.stem for f in sorted(scripts.glob("*.py")) if importlib.machinery.PathFinder.find_spec(f.stem, clean)
    ]
    assert shadowing == []


GPU_CHECK = SCRIPT.with_name("gpu_check.py")


def _gpu_check(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = importlib.util.spec_from_file_location("bench_gpu_check", GPU_CHECK)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_gpu_check", mod)
    spec.loader.exec_module(mod)
    return mod


def test_gpu_check_dry_run_checks_every_kernel_family(tmp_path, monkeypatch):
    """The GPU run's correctness step, rehearsed on the interpreter at M = 1: every kernel
    family is checked and passes against the float64 product built from the codes."""
    mod = _gpu_check(monkeypatch)
    rc = mod.main(["--dry-run", "--out", str(tmp_path), "--steps", "correct", "--correct-only", "M1 float32"])
    assert rc == 0
    rows = json.loads((tmp_path / "correct.json").read_text())["rows"]
    families = {r["case"].split(" K")[0] for r in rows}
    assert {"w4a16 asym act-order g32", "fp8 w8a8 static per-block", "fp8 w8a16 per-channel"} <= families
    assert {"nvfp4-a16", "mxfp4-a16"} <= families
    assert all(r["ok"] and r["rel_err"] < 2e-5 for r in rows)


def test_gpu_check_fails_a_kernel_that_is_off(tmp_path, monkeypatch):
    """A kernel off by one part in 10^4 fails the fp32 bound, and the run exits 1."""
    import infer_tool.kernels.fp4 as fp4

    mod = _gpu_check(monkeypatch)
    real = fp4.fp4_matmul
    monkeypatch.setattr(fp4, "fp4_matmul", lambda *a, **k: real(*a, **k) * (1 + 1e-4))
    rc = mod.main(["--dry-run", "--out", str(tmp_path), "--steps", "correct", "--correct-only", "fp4-a16&M1 float32"])
    assert rc == 1
    summary = json.loads((tmp_path / "summary.json").read_text())["correct"]
    assert summary["failed"] and all("fp4-a16" in name for name in summary["failed"])


def test_tune_dry_run_writes_a_table_the_launchers_accept(tmp_path, monkeypatch):
    """The tuning sweep, rehearsed on the interpreter: one winner per kernel family and M
    bucket, written as the table `kernels/tuning.py` reads, each a valid launch config."""
    from infer_tool.kernels import fp4, fp8, tuning, w4a16

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = importlib.util.spec_from_file_location("bench_kernels_tune", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_kernels_tune", bench)
    spec.loader.exec_module(bench)
    table = tmp_path / "tuned"
    rc = bench.main(
        ["--dry-run", "--tune", str(table), "--shapes", "160x72", "--ms", "1", "--tune-max", "2"]
        + ["--out", str(tmp_path)]
    )
    assert rc == 0
    tuning.load_table.cache_clear()
    configs = tuning.load_table("cpu-dry-run", table)
    assert set(configs) == {
        "w4a16|m1|n72|k160|g128", "fp8-w8a8|m1|n72|k160|g0", "fp8-w8a16|m1|n72|k160|g0",
        "nvfp4|m1|n72|k160|g16", "mxfp4|m1|n72|k160|g32",
    }  # fmt: skip
    assert w4a16.config_from(configs["w4a16|m1|n72|k160|g128"]).path == "gemv"
    fp8.Fp8Config(**configs["fp8-w8a8|m1|n72|k160|g0"])
    fp4.Fp4Config(**configs["nvfp4|m1|n72|k160|g16"])
    tuning.load_table.cache_clear()
