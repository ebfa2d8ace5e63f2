"""The `Scheme` contract: what every quantization scheme (a number format with a method's
options) is, for the CLI, the pipeline, the quantizers, the format writers and the report.

A scheme is a frozen dataclass subclassing `Scheme`. Its dataclass fields are its options,
each with its default, and nothing else in the project restates those defaults: the CLI,
recipes and tests build one with `registry.make_scheme(method, **overrides)` (an override
of None keeps the default). What a caller needs to know of a scheme is a member of it,
never a test of its method name:

- `method` (class attribute): the `--method` value, the key of `registry.SCHEMES`;
- `kind` (class attribute, or a property where an option changes the family: an INT
  scheme with int8 activations is "w8a8"): the family of number formats, which picks the
  checkpoint formats that can carry it (`packers/checkpoint.get_format(name, kind)`);
- `check_shapes(shapes)`: refuse, before any work, linears ({name: (N, K)}) it cannot
  quantize;
- `for_storage(scale_dtype)`: the scheme with its scales rounded to the dtype the
  checkpoint stores, so what the solver evaluates is exactly what is written;
- `describe()`: one line for the report table;
- `to_dict()` / `from_dict(d)`: the JSON form (the report's "scheme": the method and
  every field), and back.
Validation belongs in `__post_init__`, raising `BadInput` naming the bad value and what is
accepted. This package imports the standard library only (torch inside functions); it
knows nothing about models, files or tensors beyond their shapes.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

from infer_tool.common.errors import BadInput

# The dtypes a checkpoint stores scales (and unquantized tensors) in.
SCALE_DTYPES = ("float32", "bfloat16", "float16")

S = TypeVar("S", bound="Scheme")


class Scheme(abc.ABC):
    """The base of every scheme (see the module docstring); subclasses are frozen dataclasses."""

    method: ClassVar[str]
    kind: ClassVar[str]

    @abc.abstractmethod
    def check_shapes(self, shapes: Mapping[str, tuple[int, int]]) -> None:
        """Raise BadInput for the linears ({name: (N, K)}) this scheme cannot quantize."""

    @abc.abstractmethod
    def for_storage(self: S, scale_dtype: str) -> S:
        """This scheme with scales rounded to `scale_dtype` (one of SCALE_DTYPES), the dtype the
        checkpoint stores them in; a scheme whose format fixes the scale dtype returns itself."""

    @abc.abstractmethod
    def describe(self) -> str:
        """One line for the report table, e.g. 'gptq w4 g128 sym act-order'."""

    def to_dict(self) -> dict[str, object]:
        """{"method": ..., field: value, ...}, JSON-able (tuples become lists)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        return {"method": self.method, **{k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}}

    @classmethod
    def from_dict(cls: type[S], data: Mapping[str, Any]) -> S:
        """The scheme `to_dict` wrote; BadInput for another method or an unknown field."""
        values = dict(data)
        method = values.pop("method", cls.method)
        if method != cls.method:
            raise BadInput(f"a {method!r} scheme is not a {cls.method!r} scheme")
        names = cls.option_names()
        unknown = sorted(k for k in values if k not in names)
        if unknown:
            raise BadInput(f"options {unknown} do not apply to method {cls.method!r}; it accepts {sorted(names)}")
        return cls(**values)

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """The scheme's options: its dataclass fields, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    @classmethod
    def option_defaults(cls) -> dict[str, object]:
        """{option: default} for every option with a default."""
        return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}  # type: ignore[arg-type]


def check_group_size(shapes: Mapping[str, tuple[int, int]], group_size: int) -> None:
    """Refuse, before any work, layers whose K (`shapes[name] = (N, K)`) the group size does not divide.

    The message lists the offending layers and the group sizes (powers of two >= 16, or -1)
    that divide every layer's K.
    """
    if group_size == -1:
        return
    bad = {name: k for name, (_, k) in shapes.items() if k % group_size}
    if not bad:
        return
    ks = {k for _, k in shapes.values()}
    candidates = [g for g in (16, 32, 64, 128, 256, 512, 1024) if all(k % g == 0 for k in ks)]
    listed = ", ".join(f"{n} (K={k})" for n, k in sorted(bad.items())[:8])
    more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
    works = ", ".join(str(g) for g in candidates + [-1])
    raise BadInput(
        f"group size {group_size} does not divide the input features of {listed}{more}; "
        f"group sizes that work for every layer: {works}"
    )
