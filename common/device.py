"""The compute device and dtype a user names (`--device`, `--dtype`), resolved or refused.

torch is imported inside the functions: `infer-tool --help` and `kv-budget` never load it.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from typing import Any

from infer_tool.common.errors import BadInput

DTYPES = ("float32", "bfloat16", "float16")


def check_device(device: str) -> None:
    """Refuse a device name that is not auto, cpu, cuda or cuda:N (no torch needed)."""
    if device in ("auto", "cpu", "cuda"):
        return
    if not re.fullmatch(r"cuda:[0-9]{1,4}", device, re.ASCII):
        raise BadInput(f"unknown --device {device!r}: expected auto, cpu, cuda or cuda:N")


def pick_device(device: str) -> str:
    """auto: CUDA when available (under accelerate launch / torchrun, this rank's GPU), else cpu."""
    check_device(device)
    import torch

    if device == "auto":
        if not torch.cuda.is_available():
            return "cpu"
        return f"cuda:{os.environ['LOCAL_RANK']}" if "LOCAL_RANK" in os.environ else "cuda"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise BadInput(f"--device {device} asked but no CUDA device is available")
    return device


@contextlib.contextmanager
def cpu_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op CPU threads set to `n` inside (None: unchanged), the caller's count
    restored after: a library call leaves the process as it found it."""
    if n is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def torch_dtype(name: str) -> Any:
    """The torch dtype named float32, bfloat16 or float16."""
    if name not in DTYPES:
        raise BadInput(f"unknown --dtype {name!r}: expected one of {', '.join(DTYPES)}")
    import torch

    return getattr(torch, name)
