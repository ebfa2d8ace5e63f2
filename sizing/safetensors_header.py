"""Real weight bytes of a checkpoint directory from its `*.safetensors` headers
(standard library only; tensor data is never read; the header reader is
`common/safetensors_header.py`): a tensor's bytes are `end - begin` of its data offsets.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from infer_tool.common.safetensors_header import tensor_headers


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
