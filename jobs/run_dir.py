"""The progress of a quantize run, kept beside `--out` so that `--resume` continues it.

`.{out name}.partial/` holds:
- `run.json`: the run's key (a hash of the source model, the options and the token ids it
  calibrates and evaluates on), the layer count, how many layers are finished, and the
  pipeline's report entries so far (`PipelineResult` less its tensors);
- `rest.safetensors`: the checkpoint tensors outside the decoder layers (embeddings, final
  norm, an untied lm_head), written first;
- `layer-NNNNN.safetensors`: each finished layer's checkpoint tensors;
- `inputs-NNNNN.safetensors`: the inputs of layer NNNNN (the calibration chunks, and the
  evaluation streams with --eval): what resuming needs besides the finished layers.

Every file is written under a temporary name and renamed, and `run.json` is replaced
last, so a kill at any point (SIGKILL included) leaves the state after the last finished
layer. This module knows file names, hashes and JSON, not models or formats.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from infer_tool.common.errors import BadInput, cause
from infer_tool.common.safetensors_header import tensor_headers

STATE = "run.json"
REST = "rest.safetensors"
_MAX_STATE_BYTES = 64 * 2**20
# The record's fields and their JSON types (more may follow: "baseline", "eval_fp").
_STATE_FIELDS: dict[str, Any] = {
    "key": str,
    "layers": int,
    "layers_done": int,
    "inputs": (str, type(None)),
    "result": (dict, type(None)),
    "rest": bool,
}


def partial_dir(out: str | os.PathLike[str]) -> Path:
    out = Path(out)
    return out.parent / f".{out.name}.partial"


def model_fingerprint(directory: Path) -> str:
    """sha256 of config.json and of every weight file's size and safetensors header (the
    tensor names, shapes, dtypes and offsets; the weights themselves are not read)."""
    h = hashlib.sha256((directory / "config.json").read_bytes())
    for path in sorted(directory.glob("*.safetensors")):
        with path.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            h.update(f"{path.name}|{path.stat().st_size}|".encode())
            h.update(f.read(min(n, 100 * 2**20)))
    return h.hexdigest()


def run_key(parts: dict[str, Any]) -> str:
    """sha256 of a JSON document of what makes the run's output (tensors as their bytes' sha256)."""

    def encode(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return hashlib.sha256(v.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        return v

    return hashlib.sha256(
        json.dumps({k: encode(v) for k, v in parts.items()}, sort_keys=True, default=str).encode()
    ).hexdigest()


def _replace_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f"{path.name}.tmp")
    with tmp.open("w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class RunDir:
    """One run's progress directory (see the module docstring)."""

    def __init__(self, path: Path, state: dict[str, Any]) -> None:
        self.path, self.state = path, state

    @classmethod
    def open(cls, out: str | os.PathLike[str], key: str, n_layers: int, resume: bool) -> tuple[RunDir, str | None]:
        """The run directory beside `out`: a new one, or with `resume` the one an earlier run
        left (refused when its key differs). Damaged parts are named and redone (see
        `check_parts`); a record that cannot be read is refused with the parts left in place.
        Returns (run dir, a note for the report or None)."""
        check_progress(out, resume)
        path = partial_dir(out)
        if path.is_dir() and (path / STATE).exists():
            state = read_state(path, n_layers)
            if state["key"] != key:
                raise BadInput(
                    f"--resume: {path} was made with another model, recipe or calibration text; rerun with "
                    "the options of that run, or delete the directory to start over"
                )
            run = cls(path, state)
            return run, run.check_parts()
        note = None
        if path.is_dir():
            kept = sorted(p.name for p in path.iterdir() if not (p.name.endswith(".tmp") or p.name == "checkpoint"))
            if kept:
                raise BadInput(
                    f"--resume: {path} holds {', '.join(kept[:3])} but no {STATE}, so what they were made with is "
                    "unknown; nothing was deleted: restore it, or delete the directory to start over"
                )
            shutil.rmtree(path)  # killed before its first save: our temporary files only
        if resume:
            note = "--resume: no earlier progress beside --out; started from the first layer"
        path.mkdir(parents=True)
        run = cls(path, _fresh_state(key, n_layers))
        _replace_json(path / STATE, run.state)
        return run, note

    def check_parts(self) -> str | None:
        """Check every finished part the record names (its safetensors header, and its size
        against the header). A damaged or missing `rest.safetensors` is written again; a
        damaged or missing layer or inputs file makes the run redo the layers from the first
        (only the last finished layer's inputs are kept, so no later layer can be started
        without them); the files stay until each is rewritten. Returns the note saying so."""
        k = self.layers_done
        damaged = {}
        if self.state["rest"] and (why := _damage(self.path / REST)):
            damaged[REST] = why
            self.state["rest"] = False
        parts = [self.layer_file(i).name for i in range(k)] + ([self.state["inputs"]] if k else [])
        for name in parts:
            if why := _damage(self.path / name):
                damaged[name] = why
        if not damaged:
            return f"resumed after layer {k - 1} ({k} of {self.state['layers']} were done)" if k else None
        named = "; ".join(f"{n} {why}" for n, why in list(damaged.items())[:3])
        more = f" and {len(damaged) - 3} more" if len(damaged) > 3 else ""
        if set(damaged) == {REST}:
            _replace_json(self.path / STATE, self.state)
            return f"--resume: {named}: written again; resumed after layer {k - 1} ({k} of {self.state['layers']})"
        self.state.update(layers_done=0, inputs=None, result=None)
        _replace_json(self.path / STATE, self.state)
        return (
            f"--resume: {named}{more}; only the last finished layer's inputs are kept, so the {k} finished layers "
            "are redone from the first (their files are replaced as each is redone)"
        )

    @property
    def layers_done(self) -> int:
        return int(self.state["layers_done"])

    def file(self, name: str) -> Path:
        return self.path / name

    def layer_file(self, index: int) -> Path:
        return self.path / f"layer-{index:05d}.safetensors"

    def write_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        """A safetensors file in the run directory, under a temporary name then renamed."""
        from infer_tool.packers.safetensors_stream import spec_of, write_streamed

        tmp = self.path / f"{name}.tmp"
        write_streamed(tmp, [spec_of(n, t) for n, t in tensors.items()], tensors.__getitem__, {"format": "pt"})
        os.replace(tmp, self.path / name)

    def remember(self, key: str, value: Any) -> None:
        """Keep `value` (JSON) in run.json under `key`, for a resumed run."""
        self.state[key] = value
        _replace_json(self.path / STATE, self.state)

    def rest_written(self) -> None:
        self.state["rest"] = True
        _replace_json(self.path / STATE, self.state)

    def layer_finished(self, index: int, inputs: dict[str, torch.Tensor], result: dict[str, Any]) -> None:
        """Record layer `index` finished (its tensors are already in `layer_file(index)`):
        the next layer's inputs, then run.json; the previous inputs are deleted last."""
        name = f"inputs-{index + 1:05d}.safetensors"
        self.write_tensors(name, inputs)
        old = self.state["inputs"]
        self.state.update(layers_done=index + 1, inputs=name, result=result)
        _replace_json(self.path / STATE, self.state)
        if old and old != name:
            (self.path / old).unlink(missing_ok=True)

    def load_inputs(self) -> dict[str, torch.Tensor]:
        from infer_tool.packers.safetensors_stream import read_all

        return read_all(self.path / self.state["inputs"])

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


class NoRun(RunDir):
    """A run directory that writes nothing: every process but the first under `accelerate
    launch` (process 0 keeps the parts and writes the checkpoint)."""

    def __init__(self, n_layers: int) -> None:
        super().__init__(
            Path(f".infer-tool-nothing-written-{os.getpid()}"),
            {"key": "", "layers": n_layers, "layers_done": 0, "inputs": None, "result": None, "rest": False},
        )

    def write_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        pass

    def rest_written(self) -> None:
        self.state["rest"] = True

    def layer_finished(self, index: int, inputs: dict[str, torch.Tensor], result: dict[str, Any]) -> None:
        self.state["layers_done"] = index + 1

    def remove(self) -> None:
        pass


def check_progress(out: str | os.PathLike[str], resume: bool) -> None:
    """Refuse to start over an interrupted run's progress without --resume, and a progress
    path that is not a directory (nothing is changed)."""
    path = partial_dir(out)
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise BadInput(
            f"{path} is where the progress of --out {str(out)!r} is kept, but it is a file, not a directory this "
            "tool wrote; nothing was changed: move it away, or name another --out"
        )
    if path.is_dir() and resume and (path / STATE).exists():
        read_state(path)  # refused before any work when it cannot be read
    if path.exists() and not resume:
        try:
            state = read_state(path)
            done = f"{state['layers_done']} of {state['layers']} layers done"
        except BadInput:
            done = "its progress record cannot be read"
        raise BadInput(
            f"{path} holds the progress of an interrupted run ({done}); pass --resume to continue it, "
            "or delete that directory to start over"
        )


def read_state(path: Path, n_layers: int | None = None) -> dict[str, Any]:
    """The progress record of `path` (a run directory), checked field by field; BadInput
    naming what is wrong (the directory is left as it is)."""
    file = path / STATE

    def bad(why: str) -> BadInput:
        return BadInput(
            f"--resume: {file} cannot be read ({why}); nothing was deleted: restore it, rerun without changing "
            f"anything, or delete {path} to start over"
        )

    try:
        if file.stat().st_size > _MAX_STATE_BYTES:
            raise bad(f"{file.stat().st_size:,} bytes, more than a progress record holds")
        state = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise bad(cause(e)) from None
    if not isinstance(state, dict):
        raise bad("not a JSON object")
    for field, types in _STATE_FIELDS.items():
        if field not in state:
            raise bad(f"no {field!r}")
        if not isinstance(state[field], types) or isinstance(state[field], bool) is not (types is bool):
            raise bad(f"{field!r} is {state[field]!r}")
    layers, done = state["layers"], state["layers_done"]
    if layers < 1 or (n_layers is not None and layers != n_layers):
        raise bad(f"'layers' is {layers}" + (f", the model has {n_layers}" if n_layers is not None else ""))
    if not 0 <= done <= layers:
        raise bad(f"'layers_done' is {done}, outside 0..{layers}")
    if (state["inputs"] is None) != (done == 0) or (done and state["inputs"] != f"inputs-{done:05d}.safetensors"):
        raise bad(f"'inputs' is {state['inputs']!r} after {done} layers")
    if done and not _restorable(state["result"]):
        raise bad("its report entries ('result') are not the ones a run writes")
    return state


def _restorable(snap: Any) -> bool:
    from infer_tool.calib.result import PipelineResult

    try:
        restore(PipelineResult(), snap)
    except (TypeError, KeyError, ValueError, AttributeError):
        return False
    return True


def _damage(path: Path) -> str | None:
    """Why the safetensors part `path` cannot be used ('missing', 'truncated: …'), or None."""
    if not path.is_file():
        return "is missing"
    try:
        headers, start = tensor_headers(path)
        end = max((int(h["data_offsets"][1]) for h in headers.values()), default=0)
    except (BadInput, KeyError, TypeError, ValueError, IndexError):
        return "has no readable safetensors header"
    size = path.stat().st_size
    if size != start + end:
        return f"is {size:,} bytes where its header needs {start + end:,} (truncated or damaged)"
    return None


def _fresh_state(key: str, n_layers: int) -> dict[str, Any]:
    return {"key": key, "layers": n_layers, "layers_done": 0, "inputs": None, "result": None, "rest": False}


def snapshot(result: Any) -> dict[str, Any]:
    """A `PipelineResult`'s report entries as JSON (not its weights or statistics)."""
    return {
        "layer_errors": [dataclasses.asdict(e) for e in result.layer_errors],
        "linear_errors": dict(result.linear_errors),
        "fallbacks": [dataclasses.asdict(f) for f in result.fallbacks],
        "kv_amax": {n: dataclasses.asdict(a) for n, a in result.kv_amax.items()},
        "method_report": result.method_report,
    }


def restore(result: Any, snap: dict[str, Any]) -> None:
    """Put a `snapshot` back into a fresh `PipelineResult`."""
    from infer_tool.calib.kv_scales import KvAmax
    from infer_tool.calib.result import Fallback, LayerError

    result.layer_errors[:] = [LayerError(**e) for e in snap["layer_errors"]]
    result.linear_errors.update(snap["linear_errors"])
    result.fallbacks[:] = [Fallback(**f) for f in snap["fallbacks"]]
    result.kv_amax.update({n: KvAmax(**a) for n, a in snap["kv_amax"].items()})
    result.method_report.update(snap["method_report"])
