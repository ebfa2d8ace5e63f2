"""The one registry of schemes (`CLASSES`, method name -> its `Scheme` classes, the default
first; `SCHEMES`, method -> default class) and the ways to build one:
`make_scheme(method, **overrides)`, `scheme_from_dict(d)`. A method has one class per number
format it rounds to (INT, FP4): the options given pick the class that takes them all.

A scheme class is declared by its number format (`formats/<format>/__init__.py`, the
`schemes` of its `NumberFormat`); this module collects them in the formats' order
(`formats/registry.FORMATS`). How to add a format or a method: docs/extending.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from infer_tool.common.errors import BadInput
from infer_tool.formats.registry import all_formats
from infer_tool.schemes.base import Scheme

# The schemes `--method` offers, in the order error messages list them; a method's first
# class is its default, the later ones other number formats of the same method (FP4).
BUILTIN: tuple[type[Scheme], ...] = tuple(cls for f in all_formats() for cls in f.schemes)
CLASSES: dict[str, list[type[Scheme]]] = {}  # method -> its classes, the default first
for _cls in BUILTIN:
    CLASSES.setdefault(_cls.method, []).append(_cls)
SCHEMES: dict[str, type[Scheme]] = {method: classes[0] for method, classes in CLASSES.items()}  # method -> default


def register_scheme(cls: type[Scheme]) -> type[Scheme]:
    """Add a scheme class under its `method` (usable as a class decorator): the method's
    default when it is the first, else another number format of it, picked by the options
    only it takes. A class whose options are all another class's of the method is an error
    (it could never be picked)."""
    classes = CLASSES.setdefault(cls.method, [])
    if cls not in classes:
        for other in classes:
            if set(cls.option_names()) <= set(other.option_names()):
                raise ValueError(
                    f"method {cls.method!r} already has {other.__name__}, which takes every option of {cls.__name__}"
                )
        classes.append(cls)
    SCHEMES.setdefault(cls.method, classes[0])
    return cls


def all_schemes() -> Iterator[tuple[str, type[Scheme]]]:
    """(method, class) of every registered scheme class, defaults first within a method."""
    for method, classes in CLASSES.items():
        for cls in classes:
            yield method, cls


def scheme_class(method: str, options: Mapping[str, object] | None = None) -> type[Scheme]:
    """The class of `method` that takes every option named in `options` (the method's default
    when all of them are its); BadInput names the registered methods, or which options go
    together."""
    classes = CLASSES.get(method)
    if not classes:
        raise BadInput(f"method {method!r} is not supported; use one of {', '.join(SCHEMES)}")
    given = set(options or ())
    for cls in classes:
        if given <= set(cls.option_names()):
            return cls
    known = {n for cls in classes for n in cls.option_names()}
    if given - known:
        raise BadInput(f"options {sorted(given - known)} do not apply to method {method!r}; it accepts {sorted(known)}")
    takes = "; ".join(f"{cls.__name__} takes {', '.join(cls.option_names())}" for cls in classes)
    raise BadInput(f"no {method!r} scheme takes all of {', '.join(sorted(given))} together: {takes}")


def scheme_fields(method: str) -> tuple[str, ...]:
    """The option names `make_scheme(method, ...)` accepts (every class of the method's)."""
    scheme_class(method)
    names: dict[str, None] = {}
    for cls in CLASSES[method]:
        names.update(dict.fromkeys(cls.option_names()))
    return tuple(names)


def make_scheme(method: str, **overrides: object) -> Scheme:
    """Build the scheme for `method` (the class taking the options given); overrides equal
    to None keep the dataclass default."""
    given = {k: v for k, v in overrides.items() if v is not None}
    return scheme_class(method, given).from_dict(given)


def scheme_from_dict(data: Mapping[str, Any]) -> Scheme:
    """The scheme a `to_dict()` wrote (its "method" and its fields pick the class)."""
    method = data.get("method")
    if not isinstance(method, str):
        raise BadInput(f"a scheme needs a method string (got {method!r})")
    return scheme_class(method, {k: v for k, v in data.items() if k != "method"}).from_dict(data)
