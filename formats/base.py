"""`NumberFormat`: the one declaration of a number format (see the package docstring);
`Preset`, a `--scheme` name it answers to; `Deployed`, what its `deployed` module provides.
Standard library only.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from infer_tool.schemes.base import Scheme


@dataclass(frozen=True)
class Preset:
    """A `--scheme` name (llm-compressor's, compressed-tensors' `PRESET_SCHEMES`) as options.

    method: the `--method` it implies when none is given, or None for the `--method` default
        (a format only one method carries, FP8, names it).
    options: {scheme field: value} it sets (`calib/recipe.py` maps them to flags); explicit
        options override them.
    summary: what it means in llm-compressor's words, one line for `--list-schemes`.
    """

    name: str
    method: str | None
    options: Mapping[str, Any] = field(default_factory=dict)
    summary: str = ""


class Deployed(Protocol):
    """A format's activations as deployed (the module `NumberFormat.deployed` names)."""

    def as_deployed(
        self,
        module: Any,
        quantized: Mapping[str, Any],
        scheme: Scheme,
        kv_scales: Mapping[str, tuple[float, float]],
        activations: str,
        device_type: str,
    ) -> AbstractContextManager:
        """`module` (quantized linears named relative to it) run as the checkpoint is served."""

    def evaluated(self, scheme: Scheme, activations: str) -> str:
        """What `quantize --eval`'s "ppl after" measures, for the report."""

    def eval_activations(self, scheme: Scheme, activations: str, quantized: Mapping[str, Any], device_type: str) -> str:
        """What that evaluation did to activations, e.g. "int8 per token (onednn, 30 linears)"."""

    def eval_activation_modes(self, scheme: Scheme) -> tuple[str, ...]:
        """The `--eval-activations` values the scheme takes ("auto" always)."""


@dataclass(frozen=True)
class NumberFormat:
    """One number format.

    name: its name in messages and docs ("int", "fp8", "fp4", "mxfp8").
    kinds: the scheme kinds it owns (`Scheme.kind`: an INT scheme with int8 activations is
        "w8a8"); a kind belongs to one format.
    schemes: its scheme classes, each method's default class first (`schemes/registry.py`).
    presets: the `--scheme` names it answers to (llm-compressor's).
    codecs: {(`--format` name, kind): "module:attribute" of a `packers/checkpoint.CheckpointFormat`}.
    quantizers: modules whose import registers its layer quantizers (`calib/quantizers`).
    deployed: the module implementing `Deployed`.
    kernel: the module of its kernel (documentation; the evaluation modules import it).
    """

    name: str
    kinds: tuple[str, ...]
    schemes: tuple[type[Scheme], ...]
    presets: tuple[Preset, ...] = ()
    codecs: Mapping[tuple[str, str], str] = field(default_factory=dict)
    quantizers: tuple[str, ...] = ()
    deployed: str = ""
    kernel: str = ""

    def runtime(self) -> Deployed:
        """The `deployed` module, imported."""
        return importlib.import_module(self.deployed)  # type: ignore[return-value]
