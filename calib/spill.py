"""Activation chunks kept in a file instead of in memory (`SpilledChunks`), for the
calibration tensors a layer holds only to read them back in order (GPTQ's replayed
sub-block outputs and down_proj's inputs, `calib/quantizers/gptq.py`).

The file is created in a directory the caller names and unlinked at once: it lives while
the store is open and disappears with the process, even after a kill. Chunks are written
with `pwrite` and read back with `pread` into fresh tensors, so they count in the page
cache (which the kernel may write out and drop), not in the process's resident memory.
The bytes read back are the bytes written: results do not change.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch


def _bytes(t: torch.Tensor) -> memoryview:
    """The tensor's storage as a flat byte view (t contiguous, on the CPU)."""
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


class SpilledChunks:
    """An append-only list of CPU tensors stored in one anonymous file under `directory`."""

    def __init__(self, directory: str | Path) -> None:
        fd, path = tempfile.mkstemp(prefix="infer-tool-spill-", dir=directory)
        os.unlink(path)
        self._fd: int | None = fd
        self._index: list[tuple[int, torch.Size, torch.dtype]] = []  # offset, shape, dtype per chunk
        self._end = 0

    def append(self, x: torch.Tensor) -> None:
        x = x.detach().contiguous()
        view, offset = _bytes(x), self._end
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], offset + done)
        self._index.append((offset, x.shape, x.dtype))
        self._end = offset + len(view)

    def __len__(self) -> int:
        return len(self._index)

    def __getitem__(self, i: int) -> torch.Tensor:
        offset, shape, dtype = self._index[i]
        t = torch.empty(shape, dtype=dtype)
        view = _bytes(t)
        done = 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n == 0:
                raise OSError(f"spill file ended at byte {offset + done}, chunk {i} needs {len(view)} from {offset}")
            done += n
        return t

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[i] for i in range(len(self)))

    @property
    def nbytes(self) -> int:
        return self._end

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.close()


def chunk_store(spill: str | Path | None, device: torch.device) -> list[torch.Tensor] | SpilledChunks:
    """Where a layer keeps chunks it reads back in order: a file under `spill` for CPU
    tensors, else (no directory, or an accelerator's tensors) a list in memory."""
    if spill is None or device.type != "cpu":
        return []
    return SpilledChunks(spill)


def drain(chunks: list[torch.Tensor] | SpilledChunks) -> Iterator[torch.Tensor]:
    """Every chunk in order, each freed once the next is asked for (a list is emptied as it
    goes; a file is closed at the end)."""
    if isinstance(chunks, list):
        while chunks:
            yield chunks.pop(0)
    else:
        yield from chunks
        chunks.close()
