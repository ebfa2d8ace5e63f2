"""`--scheme PRESET`: llm-compressor's scheme names (compressed-tensors' `PRESET_SCHEMES`) as
named combinations of our options, in one table (`PRESETS`).

A preset fixes the number format (weight bits, groups, symmetry, activations), not the
algorithm: llm-compressor pairs any preset with RTN (`QuantizationModifier`), GPTQ or AWQ, and
so do we. Each entry is

    Preset(name, method, options, summary)

- `options`: {scheme field: value}, the scheme options the preset sets (`schemes/` field
  names, e.g. "bits", "granularity"; `calib/recipe.py` maps them to flags);
- `method`: the `--method` it implies when none is given, or None for the `--method`
  default; a format only one method carries (FP8) names it;
- `summary`: what the preset means in llm-compressor's words, one line for `--list-schemes`.

Explicit options (recipe keys, flags) override a preset's. Adding a preset is one entry in
`PRESETS`. Name lookup is case-insensitive; an unknown name is refused with the closest
names (difflib). Standard library only.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from infer_tool.common.errors import BadInput


@dataclass(frozen=True)
class Preset:
    name: str
    method: str | None
    options: Mapping[str, Any] = field(default_factory=dict)
    summary: str = ""


PRESETS: tuple[Preset, ...] = (
    Preset(
        "W4A16",
        None,
        {"bits": 4, "group_size": 128, "symmetric": True},
        "int4 symmetric weights, one scale per 128 inputs; activations unquantized",
    ),
    Preset(
        "W4A16_ASYM",
        None,
        {"bits": 4, "group_size": 128, "symmetric": False},
        "int4 asymmetric weights (scale and zero point per 128 inputs); activations unquantized",
    ),
    Preset(
        "W8A16",
        None,
        {"bits": 8, "group_size": 128, "symmetric": True},
        "int8 symmetric weights, one scale per 128 inputs; activations unquantized",
    ),
    Preset(
        "W8A8",
        "gptq",
        {"bits": 8, "group_size": -1, "symmetric": True, "int8_activations": "dynamic"},
        "int8 symmetric weights per output channel; int8 symmetric activations per token, dynamic",
    ),
    Preset(
        "INT8",
        "gptq",
        {"bits": 8, "group_size": -1, "symmetric": True, "int8_activations": "dynamic"},
        "llm-compressor's alias of W8A8",
    ),
    Preset(
        "FP8",
        "fp8",
        {"granularity": "tensor", "activations": "static"},
        "fp8 e4m3 weights per tensor; fp8 activations per tensor, static (calibrated)",
    ),
    Preset(
        "FP8_DYNAMIC",
        "fp8",
        {"granularity": "channel", "activations": "dynamic"},
        "fp8 e4m3 weights per output channel; fp8 activations per token, dynamic",
    ),
    Preset(
        "FP8_BLOCK",
        "fp8",
        {"granularity": "block", "activations": "dynamic"},
        "fp8 e4m3 weights per 128x128 block; fp8 activations dynamic "
        "(ours written per token, llm-compressor's per 128-channel group)",
    ),
    Preset(
        "NVFP4A16",
        None,
        {"fp4": "nvfp4", "fp4_activations": "none"},
        "fp4 e2m1 weights, an e4m3 scale per 16 inputs and a float32 global scale; activations unquantized",
    ),
    Preset(
        "NVFP4",
        None,
        {"fp4": "nvfp4", "fp4_activations": "fp4"},
        "NVFP4A16's weights; fp4 activations per 16 inputs, dynamic, with a calibrated global scale",
    ),
    Preset(
        "MXFP4A16",
        None,
        {"fp4": "mxfp4", "fp4_activations": "none"},
        "fp4 e2m1 weights, an e8m0 (power of two) scale per 32 inputs; activations unquantized",
    ),
    Preset(
        "MXFP4",
        None,
        {"fp4": "mxfp4", "fp4_activations": "fp4"},
        "MXFP4A16's weights; fp4 activations per 32 inputs, dynamic",
    ),
)
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
