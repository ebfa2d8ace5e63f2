"""`--candidates`: the schemes a mixed-precision plan chooses among, by llm-compressor's preset
names (`schemes/presets.py`), each solved by one method (RTN, or GPTQ) for its format.

A name is a preset, optionally with `_G<size>` for another group size (`W4A16_G32`) and then
`_FULL` for symmetric INT groups on the signed full-range grid (`W4A16_G64_FULL`: `--full-range`,
auto-round's `int_sym`; vLLM reads it as any symmetric INT checkpoint), or
`NONE` (the linear stays unquantized, in the checkpoint dtype). Presets that quantize
activations are refused: the plan measures the damage of the weights only. The exception is
`FP8_DYNAMIC`, whose e4m3 per-channel weights are planned as weights (vLLM runs them
weight-only with Marlin on GPUs without FP8 arithmetic; with dynamic per-token FP8
activations elsewhere, which the estimate does not include). `FP8` names FP8_DYNAMIC's
weights here. This module knows nothing about models.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from infer_tool.common.errors import BadInput

UNQUANTIZED = "NONE"
DEFAULT_CANDIDATES = ("W4A16", "W8A16", "FP8")
# names the plan reads differently from --scheme: FP8 is FP8_DYNAMIC's weights (see above)
ALIASES = {"FP8": "FP8_DYNAMIC"}
FULL = "_FULL"  # suffix: symmetric INT groups on the signed full-range grid
_GROUP = re.compile(r"^(?P<base>[A-Z0-9_]+?)_G(?P<g>[0-9]+)$", re.ASCII)


@dataclass(frozen=True)
class Candidate:
    """One choice for a linear group: `name` as the user wrote it (upper case) and its
    scheme (None: unquantized)."""

    name: str
    scheme: Any

    def describe(self) -> str:
        return "unquantized" if self.scheme is None else self.scheme.describe()


METHODS = ("rtn", "gptq")  # the candidates' method: one for every candidate whose format takes it


def parse_candidate(text: str, method: str = "rtn") -> Candidate:
    """The candidate `text` names, solved by `method` (a preset that names its own method, FP8,
    keeps it); BadInput naming it and what is accepted."""
    from infer_tool.schemes.presets import BY_NAME, get_preset
    from infer_tool.schemes.registry import make_scheme

    name = text.strip().upper()
    if name == UNQUANTIZED:
        return Candidate(name, None)
    full = name.endswith(FULL)
    m = _GROUP.match(name.removesuffix(FULL))
    base, group = (
        (m["base"], int(m["g"])) if m and m["base"] in {**BY_NAME, **ALIASES} else (name.removesuffix(FULL), None)
    )
    if base not in BY_NAME and base not in ALIASES:
        try:
            get_preset(text)
        except BadInput as e:  # the closest names, said of this flag
            raise BadInput(str(e).replace("--scheme", "--candidates", 1) + f"; or {UNQUANTIZED}") from None
    preset = get_preset(ALIASES.get(base, base))
    options = dict(preset.options)
    if options.get("int8_activations", "none") != "none" or options.get("fp4_activations", "none") != "none":
        raise BadInput(
            f"--candidates {text!r} quantizes activations, which the plan does not measure; use a weight-only "
            f"preset (W4A16, W4A16_G32, W8A16, FP8, NVFP4A16, MXFP4A16) or {UNQUANTIZED}"
        )
    if options.get("activations") == "static":
        raise BadInput(
            f"--candidates {text!r} needs calibrated static input scales, which the plan does not measure; "
            "use FP8 (FP8_DYNAMIC's per-channel weights)"
        )
    if group is not None:
        if "group_size" not in options:
            raise BadInput(f"--candidates {text!r}: {preset.name} has no group size to change")
        options["group_size"] = group
    if full:
        if "group_size" not in options or not options.get("symmetric", True):
            raise BadInput(
                f"--candidates {text!r}: {FULL} is the full-range grid of symmetric INT groups; {preset.name} has "
                "none (use it on W4A16 or W8A16, with or without _G<size>)"
            )
        options["full_range"] = True
    if method not in METHODS:
        raise BadInput(f"--method {method!r}: the candidates' method is one of {', '.join(METHODS)}")
    return Candidate(name, make_scheme(method if preset.method is None else preset.method, **options))


def parse_candidates(text: str, method: str = "rtn") -> list[Candidate]:
    """A comma-separated list of candidate names, in order, without repeats; at least one."""
    names = [t for t in (p.strip() for p in text.split(",")) if t]
    if not names:
        raise BadInput(f"--candidates {text!r} names no scheme; e.g. {','.join(DEFAULT_CANDIDATES)}")
    found: dict[str, Candidate] = {}
    for t in names:
        c = parse_candidate(t, method)
        if c.name in found:
            raise BadInput(f"--candidates names {c.name} twice")
        found[c.name] = c
    return list(found.values())
