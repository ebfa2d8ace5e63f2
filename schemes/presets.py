"""`--scheme PRESET`: llm-compressor's scheme names (compressed-tensors' `PRESET_SCHEMES`) as
named combinations of our options. Each number format declares its own presets
(`formats/<format>/__init__.py`, `formats/base.Preset`); `PRESETS` is all of them, in the
formats' order.

A preset fixes the number format (weight bits, groups, symmetry, activations), not the
algorithm: llm-compressor pairs any preset with RTN (`QuantizationModifier`), GPTQ or AWQ, and
so do we. Name lookup is case-insensitive; an unknown name is refused with the closest
names (difflib). Standard library only.
"""

from __future__ import annotations

import difflib

from infer_tool.common.errors import BadInput
from infer_tool.formats.base import Preset
from infer_tool.formats.registry import all_formats

PRESETS: tuple[Preset, ...] = tuple(p for f in all_formats() for p in f.presets)
BY_NAME: dict[str, Preset] = {p.name.upper(): p for p in PRESETS}


def get_preset(name: str) -> Preset:
    """The preset called `name` (any case); BadInput with the closest names and every name."""
    found = BY_NAME.get(str(name).upper())
    if found is not None:
        return found
    close = difflib.get_close_matches(str(name).upper(), list(BY_NAME), n=3, cutoff=0.5)
    hint = f"did you mean {' or '.join(BY_NAME[c].name for c in close)}? " if close else ""
    raise BadInput(
        f"--scheme {name!r} is not a preset we support; {hint}presets: {', '.join(p.name for p in PRESETS)} "
        "(infer-tool quantize --list-schemes)"
    )
