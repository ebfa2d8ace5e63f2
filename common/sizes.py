"""The one parser of the memory sizes users type, for every size flag of every command.

Accepted: a number (ASCII digits, optionally with a fraction) and a unit —
`B`; decimal `KB MB GB TB` (10³ steps, as Hugging Face's `max_shard_size`); binary
`KiB MiB GiB TiB`, also written `Ki Mi Gi Ti` or `K M G T` (2¹⁰ steps). A bare number
counts bytes, as `max_shard_size=1000` and vLLM's `kv_cache_memory_bytes` do; a flag that
needs at least `minimum` bytes refuses a smaller value and says what a unit would make of it
(`--gpu-mem 80` is 80 bytes: "did you mean 80GiB?").
"""

from __future__ import annotations

import math
import re

from infer_tool.common.errors import BadInput

UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 2**10,
    "ki": 2**10,
    "kib": 2**10,
    "m": 2**20,
    "mi": 2**20,
    "mib": 2**20,
    "g": 2**30,
    "gi": 2**30,
    "gib": 2**30,
    "t": 2**40,
    "ti": 2**40,
    "tib": 2**40,
}
ACCEPTED = "a number and a unit, e.g. 20GiB, 20G, 20GB, 512MiB, 1.5TiB, or a bare byte count (1073741824)"
MAX_BYTES = 2**60  # an exbibyte: anything larger is a typo
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*", re.ASCII)


def parse_size(text: str | int, flag: str, *, minimum: int = 1) -> int:
    """`text` -> bytes (an int, `minimum` <= bytes <= 2⁶⁰; `minimum` 0 allows zero).
    Raises BadInput naming `flag`, the value and the accepted forms."""
    if isinstance(text, bool):
        raise BadInput(f"{flag} {text!r} is not a size; accepted: {ACCEPTED}")
    if isinstance(text, int):
        value, unit, digits = float(text), "", str(text)
    else:
        m = _SIZE.fullmatch(str(text))
        if m is None or m.group(2).lower() not in UNITS:
            raise BadInput(f"{flag} {text!r} is not a size; accepted: {ACCEPTED}")
        digits, unit = m.group(1), m.group(2).lower()
        value = float(digits)
    size = value * UNITS[unit]
    if not math.isfinite(size) or size > MAX_BYTES:
        raise BadInput(f"{flag} {text!r} is too large; accepted: at most {MAX_BYTES:,} bytes (1 EiB)")
    size = int(size)
    if size < minimum:
        if minimum <= 1:
            raise BadInput(f"{flag} {text!r} must be at least {max(minimum, 1)} byte")
        hint = f"; did you mean {digits}GiB?" if unit == "" else ""
        raise BadInput(
            f"{flag} {text!r} is {size:,} bytes (a bare number counts bytes), below the {minimum:,} bytes this flag "
            f"needs{hint} accepted: {ACCEPTED}"
        )
    return size
