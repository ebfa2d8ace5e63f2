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
