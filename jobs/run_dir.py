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

from infer_tool.common.errors import BadInput

STATE = "run.json"
REST = "rest.safetensors"


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
        left (refused when its key differs). Returns (run dir, a note for the report or None)."""
        check_progress(out, resume)
        path = partial_dir(out)
        state = _read_state(path)
        note = None
        if path.exists() and state is not None:
            if state["key"] != key:
                raise BadInput(
                    f"--resume: {path} was made with another model, recipe or calibration text; rerun with "
                    "the options of that run, or delete the directory to start over"
                )
            note = (
                f"resumed after layer {state['layers_done'] - 1} "
                f"({state['layers_done']} of {state['layers']} were done)"
                if state["layers_done"]
                else None
            )
            return cls(path, state), note
        if resume:
            note = "--resume: no earlier progress beside --out; started from the first layer"
        shutil.rmtree(path, ignore_errors=True)  # a directory without run.json: killed before its first save
        path.mkdir(parents=True)
        run = cls(
            path, {"key": key, "layers": n_layers, "layers_done": 0, "inputs": None, "result": None, "rest": False}
        )
        _replace_json(path / STATE, run.state)
        return run, note

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
    """Refuse to start over an interrupted run's progress without --resume."""
    path = partial_dir(out)
    if path.exists() and not resume:
        state = _read_state(path)
        done = f"{state['layers_done']} of {state['layers']} layers done" if state else "no layer finished"
        raise BadInput(
            f"{path} holds the progress of an interrupted run ({done}); pass --resume to continue it, "
            "or delete that directory to start over"
        )


def _read_state(path: Path) -> dict[str, Any] | None:
    try:
        state = json.loads((path / STATE).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and "key" in state else None


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
