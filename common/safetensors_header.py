"""The header of a safetensors file (standard library only; tensor data is never read).

A safetensors file starts with a little-endian u64 N, then N bytes of JSON mapping each
tensor name to `{"dtype", "shape", "data_offsets": [begin, end]}` (plus an optional
`__metadata__`); offsets count from byte 8 + N.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from infer_tool.common.errors import BadInput

_MAX_HEADER = 100 * 2**20  # the format caps headers at 100 MB


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
