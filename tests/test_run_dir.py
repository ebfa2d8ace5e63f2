"""The progress directory `--resume` reads (jobs/run_dir.py), without a model: every damage
to a part is found from its header and size and named, and the run is set back to redo the
layers; a record that cannot be read is refused naming the field, with every file left as it
was. (tests/test_resume.py runs the same damages through a real quantize run and checks the
resumed checkpoint's bytes.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from infer_tool.common.errors import BadInput
from infer_tool.jobs.run_dir import REST, RunDir, check_progress, partial_dir

KEY = "k" * 64
SNAP = {"layer_errors": [], "linear_errors": {}, "fallbacks": [], "kv_amax": {}, "method_report": {}}


def _progress(tmp_path: Path, done: int = 3, layers: int = 4) -> Path:
    """--out `tmp_path/out` with `done` of `layers` layers finished, as a run leaves them."""
    out = tmp_path / "out"
    run, note = RunDir.open(out, KEY, layers, resume=False)
    assert note is None
    run.write_tensors(REST, {"embed": torch.ones(4, 3)})
    run.rest_written()
    for i in range(done):
        run.write_tensors(run.layer_file(i).name, {f"l{i}.w": torch.full((8, 8), float(i))})
        run.layer_finished(i, {"x.0": torch.randn(2, 5)}, SNAP)
    return out


def _tree(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


def test_intact_progress_resumes_after_the_last_layer(tmp_path):
    out = _progress(tmp_path)
    run, note = RunDir.open(out, KEY, 4, resume=True)
    assert run.layers_done == 3 and note == "resumed after layer 2 (3 of 4 were done)"
    assert sorted(_tree(partial_dir(out))) == [
        "inputs-00003.safetensors",
        "layer-00000.safetensors",
        "layer-00001.safetensors",
        "layer-00002.safetensors",
        "rest.safetensors",
        "run.json",
    ]  # the previous layers' inputs were removed as each next one was recorded


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        (lambda p: _truncate(p / "layer-00001.safetensors"), "layer-00001.safetensors is 3"),
        (lambda p: (p / "layer-00002.safetensors").unlink(), "layer-00002.safetensors is missing"),
        (lambda p: _truncate(p / "inputs-00003.safetensors"), "inputs-00003.safetensors is"),
        (lambda p: (p / "layer-00000.safetensors").write_bytes(b"\xff" * 64), "has no readable safetensors header"),
        (lambda p: (p / "layer-00000.safetensors").write_bytes(b"\x10" + b"\0" * 7 + b"[1, 2, 3]" * 2), "header"),
        (
            lambda p: (p / "run.json").write_text(
                json.dumps(
                    {**json.loads((p / "run.json").read_text()), "layers_done": 4, "inputs": "inputs-00004.safetensors"}
                )
            ),
            "layer-00003.safetensors is missing",
        ),
    ],
    ids=["truncated-layer", "missing-layer", "truncated-inputs", "garbage", "header-not-a-dict", "claims-more"],
)
def test_a_damaged_part_is_named_and_the_layers_redone(tmp_path, damage, needle):
    out = _progress(tmp_path)
    damage(partial_dir(out))
    run, note = RunDir.open(out, KEY, 4, resume=True)
    assert needle in note and "redone from the first" in note, note
    assert run.layers_done == 0 and run.state["inputs"] is None and run.state["rest"] is True
    assert json.loads((partial_dir(out) / "run.json").read_text())["layers_done"] == 0  # recorded


def test_a_damaged_rest_is_written_again_and_the_layers_kept(tmp_path):
    out = _progress(tmp_path)
    _truncate(partial_dir(out) / REST)
    run, note = RunDir.open(out, KEY, 4, resume=True)
    assert run.layers_done == 3 and run.state["rest"] is False
    assert "rest.safetensors is" in note and "written again; resumed after layer 2" in note


def _edit(p: Path, **changes: object) -> None:
    state = json.loads((p / "run.json").read_text())
    state.update(changes)
    (p / "run.json").write_text(json.dumps(state))


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        (lambda p: (p / "run.json").write_text('{"key": "kkk'), "cannot be read (JSONDecodeError"),
        (lambda p: (p / "run.json").write_text("[1, 2]"), "not a JSON object"),
        (lambda p: (p / "run.json").write_text("[" * 100_000), "RecursionError"),
        (lambda p: _edit(p, layers_done="3"), "'layers_done' is '3'"),
        (lambda p: _edit(p, layers_done=2.0), "'layers_done' is 2.0"),
        (lambda p: _edit(p, layers=True), "'layers' is True"),
        (lambda p: _edit(p, rest=1), "'rest' is 1"),
        (lambda p: _edit(p, key=None), "'key' is None"),
        (lambda p: _edit(p, layers_done=-1), "'layers_done' is -1, outside 0..4"),
        (lambda p: _edit(p, layers=7), "'layers' is 7, the model has 4"),
        (lambda p: _edit(p, inputs="../../etc/passwd"), "'inputs' is '../../etc/passwd' after 3 layers"),
        (lambda p: _edit(p, result={"layer_errors": 5}), "report entries"),
        (lambda p: _edit(p, result=None), "report entries"),
        (lambda p: (p / "run.json").unlink(), "holds inputs-00003.safetensors, layer-00000.safetensors"),
    ],
)
def test_an_unreadable_record_is_refused_and_nothing_is_deleted(tmp_path, damage, needle):
    out = _progress(tmp_path)
    damage(partial_dir(out))
    before = _tree(partial_dir(out))
    with pytest.raises(BadInput, match="nothing was deleted") as e:
        RunDir.open(out, KEY, 4, resume=True)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert _tree(partial_dir(out)) == before


def test_a_run_killed_before_its_first_record_starts_over(tmp_path):
    """Only temporary files there (killed before run.json was first written): nothing of value."""
    out = tmp_path / "out"
    partial_dir(out).mkdir()
    (partial_dir(out) / "run.json.tmp").write_text("{")
    run, note = RunDir.open(out, KEY, 4, resume=True)
    assert run.layers_done == 0 and "no earlier progress" in note
    assert sorted(_tree(partial_dir(out))) == ["run.json"]


def test_a_file_of_the_users_in_a_progress_directory_without_record_is_kept(tmp_path):
    out = tmp_path / "out"
    partial_dir(out).mkdir()
    (partial_dir(out) / "notes.txt").write_text("mine")
    (partial_dir(out) / "run.json.tmp").write_text("{")
    with pytest.raises(BadInput, match="holds notes.txt but no run.json"):
        RunDir.open(out, KEY, 4, resume=True)
    assert sorted(_tree(partial_dir(out))) == ["notes.txt", "run.json.tmp"]


def test_a_progress_path_that_is_not_a_directory_is_refused(tmp_path):
    out = tmp_path / "out"
    partial_dir(out).write_text("my notes")
    for resume in (False, True):
        with pytest.raises(BadInput, match="is a file, not a directory this tool wrote"):
            check_progress(out, resume)
    (tmp_path / "elsewhere").mkdir()
    partial_dir(out).unlink()
    partial_dir(out).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(BadInput, match="nothing was changed"):
        RunDir.open(out, KEY, 4, resume=True)
    assert partial_dir(out).is_symlink() and (tmp_path / "elsewhere").is_dir()


def test_another_key_is_refused(tmp_path):
    out = _progress(tmp_path)
    with pytest.raises(BadInput, match="another model, recipe or calibration text"):
        RunDir.open(out, "other", 4, resume=True)
