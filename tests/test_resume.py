"""Kill a quantize run at a chosen point (SIGKILL: no cleanup runs), resume it, and get the
checkpoint an uninterrupted run writes, byte for byte; resuming something else is refused.

Each killed run is a subprocess whose driver patches one step of the run directory
(`jobs/run_dir.py`) or of the shard writer to kill the process there: after a layer is
recorded, half-way through writing a layer's tensors or the next layer's inputs, between
the inputs and run.json, and while the checkpoint is assembled; one run is killed at each
point in turn, resumed each time, and must end with the uninterrupted run's bytes.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tiny import TEXT, save_tiny_llama

LAYERS = 4
RUN = (
    "--calib",
    "{w}/calib.txt",
    "--num-samples",
    "8",
    "--seq-len",
    "32",
    "--method",
    "gptq",
    "--group-size",
    "32",
    "--eval",
    "{w}/calib.txt",
    "--eval-tokens",
    "512",
    "--eval-seq-len",
    "64",
    "--no-progress",
    "--device",
    "cpu",
    "--json",
)

DRIVER = textwrap.dedent("""
    import os, signal, sys
    from infer_tool.jobs import run_dir
    from infer_tool.packers import safetensors_stream

    where, k, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    real_finished, real_write = run_dir.RunDir.layer_finished, run_dir.RunDir.write_tensors
    real_json = run_dir._replace_json
    real_streamed = safetensors_stream.write_streamed

    def finished(self, index, inputs, result):
        real_finished(self, index, inputs, result)
        if where == "after-layer" and index + 1 == k:
            die()

    def write(self, name, tensors):
        torn = (where == "mid-inputs" and name == f"inputs-{k:05d}.safetensors") or (
            where == "mid-part" and name == f"layer-{k:05d}.safetensors")
        if torn:  # half of the file under its temporary name, then the kill
            real_write(self, name, dict(list(tensors.items())[: len(tensors) // 2]))
            os.replace(self.path / name, self.path / f"{name}.tmp")
            die()
        real_write(self, name, tensors)

    def replace_json(path, obj):
        if where == "before-state" and obj.get("layers_done") == k:
            die()
        real_json(path, obj)

    def streamed(path, specs, load, metadata=None):
        if where == "assembly" and "checkpoint" in str(path):
            real_streamed(path, list(specs)[:3], load, metadata)
            die()
        real_streamed(path, specs, load, metadata)

    run_dir.RunDir.layer_finished, run_dir.RunDir.write_tensors, run_dir._replace_json = finished, write, replace_json
    safetensors_stream.write_streamed = streamed
    import infer_tool.packers.shards as shards
    shards.write_streamed = streamed
    from infer_tool.cli.app import main
    main(argv)
""")


def _run(argv: list[str], driver: Path | None = None, where: str = "", k: int = 0) -> subprocess.CompletedProcess:
    prefix = (
        [sys.executable, str(driver), where, str(k)] if driver else [str(Path(sys.executable).parent / "infer-tool")]
    )
    return subprocess.run([*prefix, *argv], capture_output=True, text=True, timeout=600)


def _args(w: Path, out: str, *extra: str) -> list[str]:
    return ["quantize", str(w / "model"), "--out", str(w / out), *[a.replace("{w}", str(w)) for a in RUN], *extra]


def _digests(out: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.iterdir())
        if p.name != "quantize_report.json"
    }


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    w = tmp_path_factory.mktemp("resume")
    save_tiny_llama(w / "model", layers=LAYERS)
    (w / "calib.txt").write_text(TEXT * 12)
    (w / "driver.py").write_text(DRIVER)
    return w


@pytest.fixture(scope="module")
def reference(work: Path) -> tuple[dict[str, str], dict]:
    """An uninterrupted run: its files' digests and its report."""
    proc = _run(_args(work, "ref"))
    assert proc.returncode == 0, proc.stderr
    assert not (work / ".ref.partial").exists()  # a finished run leaves no progress behind
    return _digests(work / "ref"), json.loads(proc.stdout)


# Kill points, one after the other on the same run: each resume is killed again further on.
KILLS = [("mid-part", 1), ("after-layer", 2), ("mid-inputs", 3), ("before-state", 4), ("assembly", 0)]


def test_killed_run_resumes_to_the_same_bytes(work, reference):
    out = "out"
    partial = work / f".{out}.partial"
    for i, (where, k) in enumerate(KILLS):
        killed = _run(_args(work, out, *(("--resume",) if i else ())), work / "driver.py", where, k)
        assert killed.returncode == -9, (where, killed.stderr)
        assert partial.is_dir() and not (work / out).exists()
        if i == 0:
            _refusals(work, out)

    resumed = _run(_args(work, out, "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    assert _digests(work / out) == reference[0]
    report = json.loads(resumed.stdout)
    assert report["eval"]["ppl_before"] == reference[1]["eval"]["ppl_before"]
    assert report["eval"]["ppl_after"] == reference[1]["eval"]["ppl_after"]
    assert report["layer_errors"] == reference[1]["layer_errors"]
    assert report["quantized_layers"] == reference[1]["quantized_layers"]
    assert not partial.exists()


def _refusals(work: Path, out: str) -> None:
    """Progress left by a kill: refused without --resume, or with another recipe or text;
    the progress stays for the right command."""
    again = _run(_args(work, out))
    assert again.returncode == 2 and "--resume" in again.stderr
    other_recipe = _run(_args(work, out, "--resume", "--asym"))
    assert other_recipe.returncode == 2 and "another model, recipe or calibration text" in other_recipe.stderr
    (work / "other.txt").write_text(TEXT.replace("union", "nation") * 12)
    argv = _args(work, out, "--resume")
    argv[argv.index(str(work / "calib.txt"))] = str(work / "other.txt")
    other_text = _run(argv)
    assert other_text.returncode == 2 and "another model, recipe or calibration text" in other_text.stderr
    assert (work / f".{out}.partial" / "run.json").is_file()


def test_failed_run_says_how_to_resume(work):
    """An exception in the middle (here: a layer's quantizer) keeps the progress, and the one
    error line says where it is and to pass --resume."""
    driver = work / "fail.py"
    driver.write_text(
        textwrap.dedent("""
        import sys
        from infer_tool.calib.quantizers import gptq
        real = gptq.GPTQQuantizer.quantize_layer
        calls = []
        def failing(self, ctx, scheme):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("simulated failure")
            return real(self, ctx, scheme)
        gptq.GPTQQuantizer.quantize_layer = failing
        from infer_tool.cli.app import main
        main(sys.argv[1:])
    """)
    )
    proc = subprocess.run(
        [sys.executable, str(driver), *_args(work, "out-fail")], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert (
        len(lines) == 1 and "simulated failure" in lines[0] and "--resume" in lines[0] and "2 of 4 layers" in lines[0]
    )
    assert (work / ".out-fail.partial" / "layer-00001.safetensors").is_file()


@pytest.fixture(scope="module")
def killed(work: Path) -> Path:
    """Progress of a run killed after its third layer (of 4): the source each damage test copies."""
    out = "killed"
    proc = _run(_args(work, out), work / "driver.py", "after-layer", 3)
    assert proc.returncode == -9, proc.stderr
    partial = work / f".{out}.partial"
    state = json.loads((partial / "run.json").read_text())
    assert state["layers_done"] == 3 and state["inputs"] == "inputs-00003.safetensors"
    return partial


def _damaged(work: Path, killed: Path, name: str) -> Path:
    """A copy of `killed` beside --out `name`, for one damage."""
    import shutil

    partial = work / f".{name}.partial"
    shutil.copytree(killed, partial)
    return partial


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _edit_state(partial: Path, **changes: object) -> None:
    state = json.loads((partial / "run.json").read_text())
    state.update(changes)
    (partial / "run.json").write_text(json.dumps(state))


# damage -> the note the resumed run reports; each resumes to the uninterrupted run's bytes (every kind
# of damage is found and named in tests/test_run_dir.py, without a model; here the redo itself runs)
REDONE = {
    "truncated-layer": (lambda p: _truncate(p / "layer-00001.safetensors"), "layer-00001.safetensors is"),
    "extra-layers-claimed": (
        lambda p: _edit_state(p, layers_done=4, inputs="inputs-00004.safetensors"),
        "layer-00003.safetensors is missing",
    ),
}


@pytest.mark.parametrize("damage", sorted(REDONE))
def test_damaged_part_is_named_and_redone(work, reference, killed, damage):
    """A damaged or missing finished part is named in the report's notes and the layers are
    redone (only the last layer's inputs are kept): the checkpoint is the uninterrupted run's."""
    out = f"out-{damage}"
    partial = _damaged(work, killed, out)
    harm, needle = REDONE[damage]
    harm(partial)
    proc = _run(_args(work, out, "--resume"))
    assert proc.returncode == 0, proc.stderr
    notes = json.loads(proc.stdout)["notes"]
    assert any(needle in n and "redone from the first" in n for n in notes), notes
    assert _digests(work / out) == reference[0]
    assert not partial.exists()


def test_damaged_rest_is_written_again_and_the_layers_kept(work, reference, killed):
    out = "out-rest"
    partial = _damaged(work, killed, out)
    _truncate(partial / "rest.safetensors")
    proc = _run(_args(work, out, "--resume"))
    assert proc.returncode == 0, proc.stderr
    notes = json.loads(proc.stdout)["notes"]
    assert any("rest.safetensors is" in n and "resumed after layer 2" in n for n in notes), notes
    assert _digests(work / out) == reference[0]


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# damage -> what the one error line says; refused with every file left as it was (every field's
# check: tests/test_run_dir.py)
REFUSED = {
    "record-cut-short": (lambda p: (p / "run.json").write_text((p / "run.json").read_text()[:50]), "cannot be read"),
    "no-record": (lambda p: (p / "run.json").unlink(), "but no run.json"),
}


@pytest.mark.parametrize("damage", sorted(REFUSED))
def test_unreadable_record_is_refused_and_nothing_deleted(work, killed, damage):
    out = f"out-{damage}"
    partial = _damaged(work, killed, out)
    harm, needle = REFUSED[damage]
    harm(partial)
    before = _tree(partial)
    proc = _run(_args(work, out, "--resume"))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert needle in lines[0] and "nothing was deleted" in lines[0], lines[0]
    assert _tree(partial) == before and not (work / out).exists()


def test_bad_input_after_finished_layers_keeps_them(work, reference, killed):
    """A refusal once layers are finished (here: a file of the user's appears in --out while the
    run works) keeps the progress and says so; once the user mends it, --resume finishes the run."""
    out = "out-foreign"
    partial = _damaged(work, killed, out)
    driver = work / "foreign.py"
    driver.write_text(
        textwrap.dedent("""
        import pathlib, sys
        from infer_tool.jobs import quantize_run
        real = quantize_run.write_output
        def write_output(job, result, report_json):
            out = pathlib.Path(job.opts.out)
            out.mkdir()
            (out / "thesis.tex").write_text("mine")
            return real(job, result, report_json)
        quantize_run.write_output = write_output
        from infer_tool.cli.app import main
        main(sys.argv[1:])
    """)
    )
    argv = _args(work, out, "--resume", "--overwrite")
    proc = subprocess.run([sys.executable, str(driver), *argv], capture_output=True, text=True, timeout=600)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "thesis.tex" in lines[0] and "progress is kept" in lines[0] and "4 of 4 layers finished" in lines[0]
    assert (work / out / "thesis.tex").read_text() == "mine" and (partial / "layer-00003.safetensors").is_file()
    (work / out / "thesis.tex").unlink()
    proc = _run(argv)
    assert proc.returncode == 0, proc.stderr
    assert _digests(work / out) == reference[0]
