"""Write a safetensors file whose tensors are not known before they are made: each tensor's
bytes are appended as it arrives, and the header, whose size was reserved up front, is
written last.

The safetensors format does not tie the data order to the names, nor forbid spaces after
the JSON header (its reader sorts the entries by offset and checks that they tile the data
with no gap). So the file is: a u64 N (the reserved size, a multiple of 8), the JSON header
padded with spaces to N bytes, then the tensors in the order they were added. The same
tensors added in the same order give the same bytes. `reserve(entries)` is an upper bound of
the header for entries of the given names and ranks.

What this module does not know: checkpoints, formats, models.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from infer_tool.packers.safetensors_stream import COPY_BYTES, DTYPE_ORDER, tensor_bytes

_NAME = dict(DTYPE_ORDER)
_ENTRY_FIXED = len('"":{"dtype":"F8_E4M3","shape":[],"data_offsets":[,]},')
_DIGITS = 20  # a u64 in decimal


def entry_bound(name: str, rank: int) -> int:
    """Most bytes the header entry of a tensor `name` of `rank` dimensions can take."""
    quoted = len(json.dumps(name, ensure_ascii=False).encode("utf-8"))
    return quoted + _ENTRY_FIXED + rank * (_DIGITS + 1) + 2 * _DIGITS


def reserve(entries: Iterable[tuple[str, int]], metadata: Mapping[str, str] | None = None) -> int:
    """Header bytes to reserve (a multiple of 8) for tensors given as (name, rank)."""
    n = 2 + sum(entry_bound(name, rank) for name, rank in entries)
    if metadata is not None:
        n += len(json.dumps({"__metadata__": dict(metadata)}, ensure_ascii=False).encode("utf-8"))
    return n + (-n % 8)


class SequentialWriter:
    """`add(name, tensor)` appends a tensor; `close()` writes the header. `path` is complete
    only after `close()` (write it under a temporary name and rename it)."""

    def __init__(self, path: str | os.PathLike[str], reserved: int, metadata: Mapping[str, str] | None = None):
        self.path = Path(path)
        self.reserved = reserved
        self.metadata = dict(metadata) if metadata is not None else None
        self.entries: dict[str, dict[str, object]] = {}
        self.offset = 0
        self.f = open(self.path, "wb")  # noqa: SIM115 (closed in close())
        self.f.seek(8 + reserved)

    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self.entries:
            raise ValueError(f"{name} is written twice in {self.path.name}")
        if t.dtype not in _NAME:
            raise ValueError(f"safetensors cannot store {name} of dtype {t.dtype}")
        data = tensor_bytes(t)
        for start in range(0, len(data), COPY_BYTES):
            self.f.write(data[start : start + COPY_BYTES])
        end = self.offset + len(data)
        self.entries[name] = {"dtype": _NAME[t.dtype], "shape": list(t.shape), "data_offsets": [self.offset, end]}
        self.offset = end

    def close(self) -> int:
        """Write the header and close; returns the file's size."""
        head: dict[str, object] = {}
        if self.metadata is not None:
            head["__metadata__"] = self.metadata
        head.update(self.entries)
        text = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        if len(text) > self.reserved:
            self.f.close()
            raise ValueError(f"{self.path.name}: header of {len(text)} bytes exceeds the {self.reserved} reserved")
        self.f.seek(0)
        self.f.write(struct.pack("<Q", self.reserved) + text + b" " * (self.reserved - len(text)))
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return 8 + self.reserved + self.offset

    def abort(self) -> None:
        self.f.close()
