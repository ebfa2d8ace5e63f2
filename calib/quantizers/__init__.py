"""Layer quantizers: one module per method, each registered by its scheme's type.

A quantizer module decorates its `LayerQuantizer` subclass (`base.py`) with
`@register_quantizer(TheScheme)` (torchao's `register_quantize_module_handler` pattern).
The pipeline (`calib/pipeline.py`) asks `quantizer_for(scheme)` for the quantizer of a
scheme and calls it on one decoder layer at a time; it knows no method by name.

Nothing is imported until a quantizer is first asked for: then every module of this
package (and each module a number format's `quantizers` names) is imported once, registering
what it defines (the CLI's start-up and the schemes stay free of torch). How to add a method
or a number format: docs/extending.md.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from infer_tool.common.errors import BadInput
from infer_tool.schemes.base import Scheme

if TYPE_CHECKING:
    from infer_tool.calib.quantizers.base import LayerQuantizer

Q = TypeVar("Q", bound=type)

_QUANTIZERS: dict[type[Scheme], type[LayerQuantizer]] = {}  # scheme type -> its quantizer class
_imported = False


def register_quantizer(scheme_type: type[Scheme]) -> Callable[[Q], Q]:
    """Class decorator: the decorated `LayerQuantizer` subclass quantizes schemes of exactly
    `scheme_type` (a subclass of it needs its own registration)."""

    def register(cls: Q) -> Q:
        taken = _QUANTIZERS.get(scheme_type)
        if taken is not None and taken.__qualname__ != cls.__qualname__:
            raise ValueError(f"{scheme_type.__name__} already has the quantizer {taken.__name__}")
        _QUANTIZERS[scheme_type] = cls  # type: ignore[assignment]
        return cls

    return register


def _import_all() -> None:
    """Import every module of this package and every quantizer module a number format names
    (`formats/registry`), once: each registers its quantizers."""
    from infer_tool.formats.registry import all_formats

    global _imported
    if not _imported:
        for module in pkgutil.iter_modules(__path__):
            importlib.import_module(f"{__name__}.{module.name}")
        for f in all_formats():
            for name in f.quantizers:
                importlib.import_module(name)
        _imported = True


def quantizer_for(scheme: Scheme) -> LayerQuantizer:
    """A new instance of the layer quantizer registered for `scheme`'s type: what a quantizer
    keeps while it works on a layer (FP4's global scales) never outlives the run that made it."""
    found = _QUANTIZERS.get(type(scheme))
    if found is None:
        _import_all()
        found = _QUANTIZERS.get(type(scheme))
    if found is None:
        registered = ", ".join(sorted(t.method for t in _QUANTIZERS))
        raise BadInput(
            f"no layer quantizer is registered for method {scheme.method!r} ({type(scheme).__name__}); "
            f"registered: {registered}"
        )
    return found()
