"""The formats infer-tool knows, one line each (`FORMATS`), and lookups by kind.

Adding a number format is its package under `formats/` and one line here: the scheme
registry, the presets, the checkpoint formats, the quantizers and the evaluation all read
this list. Standard library only; descriptors are imported when first asked for.
"""

from __future__ import annotations

import importlib
from functools import cache

from infer_tool.common.errors import BadInput
from infer_tool.formats.base import NumberFormat

FORMATS: tuple[str, ...] = (
    "infer_tool.formats.integer:FORMAT",
    "infer_tool.formats.fp8:FORMAT",
    "infer_tool.formats.fp4:FORMAT",
    "infer_tool.formats.mxfp8:FORMAT",
    "infer_tool.formats.w4afp8:FORMAT",
)


@cache
def all_formats() -> tuple[NumberFormat, ...]:
    """Every registered format, in `FORMATS` order."""
    found = []
    for spec in FORMATS:
        module, attr = spec.split(":")
        found.append(getattr(importlib.import_module(module), attr))
    kinds = [k for f in found for k in f.kinds]
    if len(kinds) != len(set(kinds)):
        raise ValueError(f"a scheme kind belongs to one format; {kinds} repeat one")
    return tuple(found)


def format_of_kind(kind: str) -> NumberFormat:
    """The format that owns scheme kind `kind`."""
    for f in all_formats():
        if kind in f.kinds:
            return f
    known = ", ".join(k for f in all_formats() for k in f.kinds)
    raise BadInput(f"no number format owns kind {kind!r}; known kinds: {known}")
