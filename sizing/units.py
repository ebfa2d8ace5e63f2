"""Parse the sizes and counts users type: memory (`80GiB`, `80GB`, `1.5G`, bytes) and
token / sequence counts (`32k`, lists `4k,8k`, ranges `4k..128k` doubling or
`1..64:8` stepped)."""

from __future__ import annotations

import re

from infer_tool.common.errors import BadInput

_MEM_UNITS = {
    "": 2**30,  # a bare number is GiB
    "b": 1,
    "k": 2**10,
    "kib": 2**10,
    "kb": 10**3,
    "m": 2**20,
    "mib": 2**20,
    "mb": 10**6,
    "g": 2**30,
    "gib": 2**30,
    "gb": 10**9,
    "t": 2**40,
    "tib": 2**40,
    "tb": 10**12,
}
_COUNT_SUFFIX = {"": 1, "k": 1024, "m": 1024**2}
_MAX_ITEMS = 64
_MAX_COUNT = 2**40  # tokens or sequences; anything larger is a typo


def parse_bytes(text: str, what: str, *, allow_zero: bool = False) -> int:
    """`80GiB` / `80GB` / `80G` / `85899345920B` / `80` (GiB) -> bytes (> 0, or >= 0
    with `allow_zero`)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _MEM_UNITS:
        raise BadInput(f"{what} {text!r} is not a size; accepted: e.g. 80GiB, 80GB, 24G, 1.5GiB, 1073741824B")
    value = int(float(m.group(1)) * _MEM_UNITS[unit])
    if value < 0 or (value == 0 and not allow_zero):
        raise BadInput(f"{what} {text!r} must be greater than zero")
    return value


def parse_count(text: str, what: str) -> int:
    m = re.fullmatch(r"\s*([0-9]+)\s*([kKmM]?)\s*", text)
    if not m:
        raise BadInput(f"{what} {text!r} is not a positive count; accepted: e.g. 8192, 32k, 1m")
    value = int(m.group(1)) * _COUNT_SUFFIX[m.group(2).lower()]
    if value <= 0:
        raise BadInput(f"{what} {text!r} must be at least 1")
    if value > _MAX_COUNT:
        raise BadInput(f"{what} {text!r} is too large; accepted: at most {_MAX_COUNT:,}")
    return value


def parse_counts(values: list[str], what: str) -> list[int]:
    """Each value: a count, a comma list, `A..B` (doubling from A up to B, B included)
    or `A..B:S` (step S). Returns sorted unique counts."""
    out: set[int] = set()
    for value in values:
        items = value.split(",")
        if len(items) > _MAX_ITEMS:
            raise BadInput(f"{what} lists {len(items)} values; at most {_MAX_ITEMS} are accepted")
        for item in items:
            item = item.strip()
            if not item:
                continue
            if ".." not in item:
                out.add(parse_count(item, what))
                continue
            lo_s, _, rest = item.partition("..")
            hi_s, _, step_s = rest.partition(":")
            lo, hi = parse_count(lo_s, what), parse_count(hi_s, what)
            if hi < lo:
                raise BadInput(f"{what} range {item!r} ends below its start")
            step = parse_count(step_s, what) if step_s else 0
            if step:  # sized before it is expanded: `1..16m:1` must not build 16M values
                n = (hi - lo) // step + 1
                if len(out) + n > _MAX_ITEMS:
                    raise BadInput(
                        f"{what} {item!r} gives {n:,} values; at most {_MAX_ITEMS} are accepted (use a coarser step)"
                    )
                out.update(range(lo, hi + 1, step))
            else:  # doubling: log2(hi / lo) values
                v = lo
                while v < hi:
                    out.add(v)
                    v *= 2
                out.add(hi)
        if len(out) > _MAX_ITEMS:
            raise BadInput(f"{what} {value!r} gives more than {_MAX_ITEMS} values; use a coarser step")
    if not out:
        raise BadInput(f"{what} needs at least one value")
    return sorted(out)
