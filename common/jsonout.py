"""JSON text of reports: NaN/Inf become null (they are not JSON), tensors and numpy
scalars become numbers, tuples and sets lists, dataclasses dicts."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any


def _default(o: Any) -> Any:
    if hasattr(o, "to_dict"):
        return o.to_dict()
    if dataclasses.is_dataclass(o) and not isinstance(o, type):
        return dataclasses.asdict(o)
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _finite(o: Any) -> Any:
    """Replace NaN/Inf (not valid JSON) by None, recursively."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def to_json(obj: Any) -> str:
    """Indented JSON of `obj` (a report dict or an object with `to_dict()`)."""
    if hasattr(obj, "to_dict"):
        obj = obj.to_dict()
    return json.dumps(_finite(obj), indent=2, default=_default)
