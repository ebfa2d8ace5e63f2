"""A checkpoint's tensors as safetensors shards, written one tensor at a time.

Sharding follows Hugging Face's `split_torch_state_dict_into_shards` (huggingface_hub):
tensors in order (here: sorted by name) fill a shard until the next would take it over
`max_shard_bytes`; a tensor larger than that gets a shard of its own. One shard is
`model.safetensors`; more are `model-00001-of-0000N.safetensors` with
`model.safetensors.index.json` ({"metadata": {"total_parameters", "total_size"},
"weight_map"}, indented, sorted keys), as `save_pretrained` writes them. Sizes are
Hugging Face's: "5GB" is 5·10⁹ bytes, "5GiB" 5·2³⁰.

Tensors come from a `load(name)` callable (memory, or finished part files on disk), so at
most one tensor is in memory while a shard is written; the bytes are save_file's.
This module knows nothing about models or quantization formats.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch

from infer_tool.packers.safetensors_stream import DTYPE_OF_NAME, TensorSpec, read_tensors, spec_of, write_streamed

SAFETENSORS_INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
METADATA = {"format": "pt"}


def plan_shards(specs: Iterable[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """The shards (lists of specs, in name order) Hugging Face's split would make."""
    shards: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
    for s in sorted(specs, key=lambda s: s.name):
        if s.nbytes > max_shard_bytes:
            shards.append([s])
            continue
        if current and size + s.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(s)
        size += s.nbytes
    if current or not shards:
        shards.append(current)
    return shards


def write_shards(
    directory: Path,
    specs: Iterable[TensorSpec],
    load: Callable[[str], torch.Tensor],
    max_shard_bytes: int,
    total_parameters: int | None = None,
) -> list[str]:
    """Write the shards (and the index when there are several) into `directory`; returns the file names."""
    specs = list(specs)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError("duplicate tensor names in a checkpoint")
    shards = plan_shards(specs, max_shard_bytes)
    if len(shards) == 1:
        write_streamed(directory / SINGLE_FILE, shards[0], load, METADATA)
        return [SINGLE_FILE]
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, shard in zip(files, shards):
        write_streamed(directory / fname, shard, load, METADATA)
        weight_map.update({s.name: fname for s in shard})
    metadata: dict[str, int] = {"total_size": sum(s.nbytes for s in specs)}
    if total_parameters is not None:
        metadata["total_parameters"] = total_parameters
    index = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
    (directory / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return files


def in_memory(tensors: Mapping[str, torch.Tensor]) -> tuple[list[TensorSpec], Callable[[str], torch.Tensor]]:
    """(specs, load) over tensors already in memory."""
    return [spec_of(n, t) for n, t in tensors.items()], tensors.__getitem__


class PartFiles:
    """Tensors spread over finished safetensors files (a run's parts), read one at a time.

    `specs()` comes from the headers; `load(name)` reads one tensor into memory."""

    def __init__(self, paths: Iterable[str | os.PathLike[str]]) -> None:
        from infer_tool.common.safetensors_header import tensor_headers

        self.where: dict[str, Path] = {}
        self._specs: list[TensorSpec] = []
        for path in map(Path, paths):
            for name, info in tensor_headers(path)[0].items():
                if name in self.where:
                    raise ValueError(f"{name} is in both {self.where[name]} and {path}")
                self.where[name] = path
                self._specs.append(TensorSpec(name, DTYPE_OF_NAME[info["dtype"]], tuple(info["shape"])))

    def specs(self) -> list[TensorSpec]:
        return list(self._specs)

    def load(self, name: str) -> torch.Tensor:
        return read_tensors(self.where[name], [name])[name]
