"""A scheme field that is also an option of `infer-tool quantize`, declared once, on the field.

`option(default, help, ...)` is a dataclass field whose metadata says how the user sets it: its
option name (the recipe key and `--flag`, the field's own name unless `name` says otherwise),
its help, its value type and its `--help` panel. The configs of the methods
(`schemes/methods.py`) and the number formats (`schemes/integer.py`, `schemes/fp8.py`, ...)
declare their options this way; `declared_options(classes)` collects them for the CLI and
recipe files (`calib/recipe.QuantizeOptions`). A field without `option()` (GPTQ's
`block_size`, AWQ's `grid`, ...) is a default the user does not set from the command line.
Standard library only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

KINDS = (bool, int, float, str, list)


@dataclass(frozen=True)
class Declared:
    """One declared option: `name` (recipe key, `--name-with-dashes`), `target` (the scheme field
    it sets), `help`, `kind` (one of KINDS), `flag` (its spelling when not `--name`, e.g.
    "--sym/--asym"), `panel` (its `--help` panel; None: by the CLI's rule)."""

    name: str
    target: str
    help: str
    kind: type
    flag: str | None
    panel: str | None


def option(
    default: Any,
    help: str,
    *,
    kind: type | None = None,
    flag: str | None = None,
    name: str | None = None,
    panel: str | None = None,
) -> Any:
    """A scheme field with its option declared (see the module docstring); `kind` defaults to the
    type of `default`, and must be given when the default is None."""
    kind = kind or type(default)
    if kind not in KINDS:
        raise TypeError(f"option kind {kind!r}: give one of {KINDS}")
    meta = {"option": {"help": help, "kind": kind, "flag": flag, "name": name, "panel": panel}}
    return dataclasses.field(default=default, metadata=meta)


def declared_options(classes: Iterable[type]) -> dict[str, Declared]:
    """{option name: Declared} of every `option()` field of `classes` (dataclasses), in the order
    first met. One option name has one declaration: a field restated without `option()` (a
    method's own default) sets the same option; two declarations of one name are an error."""
    found: dict[str, tuple[dataclasses.Field, Declared]] = {}
    for cls in classes:
        for f in dataclasses.fields(cls):
            meta = f.metadata.get("option")
            if meta is None:
                continue
            d = Declared(meta["name"] or f.name, f.name, meta["help"], meta["kind"], meta["flag"], meta["panel"])
            seen = found.get(d.name)
            if seen is not None and seen[0] is not f:
                raise ValueError(f"option {d.name!r} is declared twice (fields {seen[1].target!r} and {f.name!r})")
            found.setdefault(d.name, (f, d))
    return {name: d for name, (_, d) in found.items()}
