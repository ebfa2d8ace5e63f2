"""Write a safetensors file one tensor at a time, byte for byte what
`safetensors.torch.save_file` writes, without holding the file's tensors in memory; read
chosen tensors of one with positioned reads.

Reads copy each tensor into fresh memory with plain file reads, not a memory map:
`safetensors.safe_open` maps the whole file privately writable, which counts the whole
file against a process's data limit (RLIMIT_DATA) and keeps touched pages in its RSS.

Layout (the safetensors format): a little-endian u64 N, N bytes of JSON header padded
with spaces to a multiple of 8, then the tensors' bytes back to back. save_file orders
the tensors by dtype (the Rust enum's order, descending: U64, I64, F64, F32, ... BOOL),
then by name, and writes the header compactly: `__metadata__` first, then each tensor
`{"dtype", "shape", "data_offsets"}` in data order. `tests/test_streaming_write.py`
checks the bytes against save_file for every dtype we write.

What this module does not know: checkpoints, formats, models.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

# safetensors' Dtype enum, in declaration order: save_file sorts by it, descending.
DTYPE_ORDER: tuple[tuple[torch.dtype, str], ...] = (
    (torch.bool, "BOOL"),
    (torch.uint8, "U8"),
    (torch.int8, "I8"),
    (torch.float8_e5m2, "F8_E5M2"),
    (torch.float8_e4m3fn, "F8_E4M3"),
    (torch.int16, "I16"),
    (torch.uint16, "U16"),
    (torch.float16, "F16"),
    (torch.bfloat16, "BF16"),
    (torch.int32, "I32"),
    (torch.uint32, "U32"),
    (torch.float32, "F32"),
    (torch.float64, "F64"),
    (torch.int64, "I64"),
    (torch.uint64, "U64"),
)
_RANK = {dt: i for i, (dt, _) in enumerate(DTYPE_ORDER)}
_NAME = dict(DTYPE_ORDER)
DTYPE_OF_NAME = {name: dt for dt, name in DTYPE_ORDER}
COPY_BYTES = 64 * 2**20  # a tensor is written in slices of this size


@dataclass(frozen=True)
class TensorSpec:
    """What the header says of one tensor."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def spec_of(name: str, t: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, t.dtype, tuple(int(d) for d in t.shape))


def data_order(specs: Iterable[TensorSpec]) -> list[TensorSpec]:
    """The order save_file lays tensors out in: dtype descending, then name."""
    specs = list(specs)
    unknown = sorted({str(s.dtype) for s in specs if s.dtype not in _RANK})
    if unknown:
        raise ValueError(f"safetensors cannot store dtypes {unknown}")
    return sorted(specs, key=lambda s: (-_RANK[s.dtype], s.name))


def header_bytes(specs: Iterable[TensorSpec], metadata: Mapping[str, str] | None) -> tuple[bytes, list[TensorSpec]]:
    """(the u64 length + padded JSON header, the tensors in data order)."""
    ordered = data_order(specs)
    entries: dict[str, object] = {}
    if metadata is not None:
        entries["__metadata__"] = dict(metadata)
    offset = 0
    for s in ordered:
        entries[s.name] = {"dtype": _NAME[s.dtype], "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, ordered


def mapped_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor of `nbytes` in its own anonymous memory map, unmapped
    when the tensor is freed. Weights live a layer long among many smaller allocations;
    from malloc's heap they would leave it fragmented (glibc keeps freed chunks of up to
    32 MB there), and a streamed run's memory would creep up layer after layer."""
    import mmap

    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


def read_tensors(path: str | os.PathLike[str], names: Iterable[str]) -> dict[str, torch.Tensor]:
    """The named tensors of a safetensors file, each read into its own memory (`mapped_empty`)."""
    from infer_tool.common.safetensors_header import tensor_headers

    header, start = tensor_headers(path)
    out = {}
    with open(path, "rb", buffering=0) as f:
        for name in names:
            info = header[name]
            begin, end = info["data_offsets"]
            buf = mapped_empty(end - begin)
            view = memoryview(buf.numpy()) if end > begin else memoryview(b"")
            f.seek(start + begin)
            got = 0
            while got < end - begin:
                n = f.readinto(view[got:])
                if not n:
                    raise ValueError(f"{path}: {name} is cut short ({got} of {end - begin} bytes)")
                got += n
            out[name] = buf.view(DTYPE_OF_NAME[info["dtype"]]).reshape(info["shape"])
    return out


def read_all(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file (`read_tensors`)."""
    from infer_tool.common.safetensors_header import tensor_headers

    return read_tensors(path, list(tensor_headers(path)[0]))


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes in memory order (little-endian on every machine we run on)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write_streamed(
    path: str | os.PathLike[str],
    specs: Iterable[TensorSpec],
    load: Callable[[str], torch.Tensor],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write `path` holding the tensors `specs`; `load(name)` returns each one when its
    bytes are due (then it is dropped), so at most one tensor is in memory at a time."""
    head, ordered = header_bytes(specs, metadata)
    with open(path, "wb") as f:
        f.write(head)
        for s in ordered:
            t = load(s.name)
            if t.dtype != s.dtype or tuple(t.shape) != s.shape:
                raise ValueError(f"{s.name}: got {t.dtype} {tuple(t.shape)}, the header says {s.dtype} {s.shape}")
            data = tensor_bytes(t)
            for start in range(0, len(data), COPY_BYTES):
                f.write(data[start : start + COPY_BYTES])
            del t, data
