"""Where this process stands under `accelerate launch` / `torchrun`, read from the
launcher's environment (no torch): only process 0 reports."""

from __future__ import annotations

import os


def rank0() -> bool:
    """True on process 0 (and when no launcher started this process)."""
    return int(os.environ.get("RANK", "0")) == 0
