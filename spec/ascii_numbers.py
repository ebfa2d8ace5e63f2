"""Numbers read from text (flags, draft specs): ASCII digits only, finite, no surprises.

Python's own parsers are too kind for a command line: `"²".isdigit()` is True, `int("١٢")` is
12, `int("1_0")` is 10 and `float("nan")` is a number. These accept only what a user means
by a number written in ASCII. Standard library only: the CLI imports it at start-up.
"""

from __future__ import annotations

import math
import re

INT_RE = re.compile(r"[0-9]{1,100}", re.ASCII)
SIGNED_INT_RE = re.compile(r"[+-]?[0-9]{1,100}", re.ASCII)
FLOAT_RE = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", re.ASCII)


def ascii_int(text: str, signed: bool = False) -> int | None:
    """The integer written in ASCII digits (surrounding blanks allowed; a sign if `signed`),
    else None."""
    t = text.strip()
    return int(t) if (SIGNED_INT_RE if signed else INT_RE).fullmatch(t) else None


def ascii_float(text: str) -> float | None:
    """The number written with ASCII digits (e.g. 0.7, 1e-3, -2), else None. NaN and inf
    are not numbers here."""
    t = text.strip()
    x = float(t) if FLOAT_RE.fullmatch(t) else None
    return x if x is not None and math.isfinite(x) else None
