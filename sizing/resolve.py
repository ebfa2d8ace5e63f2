"""MODEL argument -> `ModelShape` (+ real weight bytes where files tell them): a model
directory (config.json, and *.safetensors headers if present), a config.json file, a
GGUF file (metadata header; weights = the file's tensor bytes), a built-in preset by
name or Hugging Face id, or another hub id (its config.json: `sizing/hub.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from infer_tool.common.errors import BadInput
from infer_tool.sizing.hf_config import load_config, shape_from_config
from infer_tool.sizing.hub import is_repo_id
from infer_tool.sizing.presets import find_model_preset, model_presets, suggest
from infer_tool.sizing.shape import ModelShape


@dataclass(frozen=True)
class ResolvedModel:
    shape: ModelShape
    file_weight_bytes: int | None  # bytes the checkpoint files hold, if read from disk
    file_weight_note: str = ""


def resolve_model(spec: str) -> ResolvedModel:
    # File readers are imported only when MODEL is a file (keeps preset start-up small).
    path = Path(spec).expanduser()
    if path.is_dir():
        from infer_tool.sizing.safetensors_header import checkpoint_bytes

        shape = shape_from_config(load_config(path), name=path.name, source=str(path / "config.json"))
        ck = checkpoint_bytes(path)
        if ck is None:
            return ResolvedModel(shape, None)
        dtypes = ", ".join(f"{k} {v:,} B" for k, v in sorted(ck.by_dtype.items()))
        return ResolvedModel(shape, ck.total, f"{ck.tensors} tensors in {ck.files} safetensors files ({dtypes})")
    if path.is_file() and path.suffix.lower() == ".gguf":
        from infer_tool.sizing.gguf import config_from_gguf, read_gguf_header

        header = read_gguf_header(path)
        shape = shape_from_config(config_from_gguf(header), name=path.stem, source=str(path))
        data = header.file_size - header.metadata_end
        return ResolvedModel(shape, data, f"GGUF tensor data ({header.tensor_count} tensors)")
    if path.is_file():
        name = path.parent.name or path.stem
        return ResolvedModel(shape_from_config(load_config(path), name=name, source=str(path)), None)
    preset = find_model_preset(spec)
    if preset is not None:
        return ResolvedModel(shape_from_config(preset.config, name=preset.key, source=preset.source), None)
    if is_repo_id(spec):
        return _from_hub(spec)
    raise BadInput(
        f"MODEL {spec!r} is not a directory, config.json, .gguf file, preset or hub id; "
        f"{suggest(spec, list(model_presets()))} (see --list-models)"
    )


def _from_hub(repo_id: str) -> ResolvedModel:
    """A hub id that is no preset: its config.json from the local hub cache, else the hub
    (`sizing/hub.py`); a refusal keeps the presets' "did you mean"."""
    from infer_tool.sizing.hub import cached_config, fetch_config

    cached = cached_config(repo_id)
    if cached is not None:
        shape = shape_from_config(load_config(cached), name=repo_id, source=str(cached))
        return ResolvedModel(shape, None, f"config.json from the local hub cache ({cached})")
    try:
        config = fetch_config(repo_id)
    except BadInput as e:
        raise BadInput(f"{e}; or a preset: {suggest(repo_id, list(model_presets()))}") from None
    shape = shape_from_config(config, name=repo_id, source=f"hub {repo_id}")
    return ResolvedModel(shape, None, f"config.json from the hub ({repo_id})")
