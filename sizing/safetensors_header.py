"""Real weight bytes of a checkpoint directory from its `*.safetensors` headers
(standard library only; tensor data is never read).

A safetensors file starts with a little-endian u64 N, then N bytes of JSON mapping each
tensor name to `{"dtype", "shape", "data_offsets": [begin, end]}` (plus an optional
`__metadata__`); the tensor's bytes are `end - begin`.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from infer_tool.common.errors import BadInput

_MAX_HEADER = 100 * 2**20  # the format caps headers at 100 MB


@dataclass(frozen=True)
class CheckpointBytes:
    total: int
    tensors: int
    files: int
    by_dtype: dict[str, int]


def checkpoint_bytes(directory: str | Path) -> CheckpointBytes | None:
    """Sum of tensor bytes over `directory/*.safetensors`; None if there are none."""
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        return None
    total = tensors = 0
    by_dtype: dict[str, int] = {}
    for path in files:
        for info in tensor_headers(path)[0].values():
            begin, end = info["data_offsets"]
            total += end - begin
            tensors += 1
            by_dtype[info["dtype"]] = by_dtype.get(info["dtype"], 0) + end - begin
    return CheckpointBytes(total, tensors, len(files), by_dtype)


def tensor_headers(path: str | Path) -> tuple[dict[str, dict], int]:
    """({tensor name: {"dtype", "shape", "data_offsets"}}, the file offset the offsets count
    from) of one safetensors file; only the header is read."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError("file shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER:
                raise ValueError(f"header length {n} exceeds 100 MB")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise BadInput(f"{path}: not a readable safetensors file ({e})") from None
    header.pop("__metadata__", None)
    return header, 8 + n

