"""Read a JSON file a user gave, bounded before parsing: its size and its nesting depth
(a deeply nested array would otherwise exhaust Python's recursion in `json.loads`)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from infer_tool.common.errors import BadInput

MAX_BYTES = 64 * 2**20  # the largest config.json seen is well under 1 MiB
MAX_DEPTH = 64  # real configs nest 3-4 levels
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def nesting_depth_exceeds(text: str, limit: int = MAX_DEPTH) -> bool:
    """Whether brackets outside strings nest deeper than `limit` (unbalanced text is left
    for the JSON parser to refuse)."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    brackets = brackets.replace("{", "[").replace("}", "]")
    for _ in range(limit):
        if "[]" not in brackets:
            return False
        brackets = brackets.replace("[]", "")
    return "[]" in brackets


def read_json(path: Path, what: str) -> Any:
    """Parse the JSON file at `path`; BadInput naming `path` and the bound it breaks."""
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise BadInput(f"{path}: {size:,} bytes is too large for a {what} (at most {MAX_BYTES:,})")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"{path}: cannot read {what} ({e.__class__.__name__}: {e})") from None
    return loads(text, str(path), what)


def loads(text: str, where: str, what: str) -> Any:
    """Parse JSON `text` read from `where` (already bounded in size); BadInput naming `where`."""
    if nesting_depth_exceeds(text):
        raise BadInput(f"{where}: JSON nests deeper than {MAX_DEPTH} levels; not a {what}")
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise BadInput(f"{where}: cannot read {what} ({e.__class__.__name__}: {e})") from None
