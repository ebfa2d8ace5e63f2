"""Parse the counts users type: token / sequence counts (`32k`, lists `4k,8k`, ranges `4k..128k` doubling or
`1..64:8` stepped). Memory sizes: `common/sizes.py`."""

from __future__ import annotations

import re

from infer_tool.common.errors import BadInput

_COUNT_SUFFIX = {"": 1, "k": 1024, "m": 1024**2}
_MAX_ITEMS = 64
_MAX_COUNT = 2**40  # tokens or sequences; anything larger is a typo


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


def human_size(n: int) -> str:
    """Bytes in the largest binary unit that keeps the number at least 1: 500 TiB, 79.19 GiB."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{n:,} B"
