"""Options shared by several commands, declared once: the common flags as `Annotated`
types, and the typer parameters of the quantize options built from their one
declaration in `calib/recipe.py`.

Imports only typer and the stdlib-only option declarations: `--help` stays fast.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Annotated, Any

import typer

from infer_tool.calib.recipe import DEFAULTS, OPTIONS
from infer_tool.schemes.registry import all_schemes
from infer_tool.sizing.roofline import Efficiency

Json = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]
NoProgress = Annotated[bool, typer.Option("--no-progress", help="No progress bars (ours, transformers' or datasets').")]
Overwrite = Annotated[
    bool, typer.Option("--overwrite", help="Replace an existing --out directory (an empty one or one we wrote).")
]
Device = Annotated[str, typer.Option(help="auto, cpu, cuda or cuda:N (auto: CUDA when available).")]
AllowPickle = Annotated[bool, typer.Option("--allow-pickle", help=OPTIONS["allow_pickle"].metadata["help"])]
TrustRemoteCode = Annotated[
    bool, typer.Option("--trust-remote-code", help=OPTIONS["trust_remote_code"].metadata["help"])
]

# The roofline's efficiencies (kv-budget's speed model, spec-profile's projection); the
# defaults are `Efficiency`'s.
HbmEfficiency = Annotated[
    float | None, typer.Option(help=f"Achieved / peak HBM bandwidth in decode (default {Efficiency.hbm}).")
]
Mfu = Annotated[float | None, typer.Option(help=f"Achieved / peak dense tensor FLOP/s (default {Efficiency.mfu}).")]
LinkEfficiency = Annotated[
    float | None, typer.Option(help=f"Achieved / peak interconnect bandwidth (default {Efficiency.link}).")
]
_EFFICIENCY_FIELDS = {"hbm_efficiency": "hbm", "mfu": "mfu", "link_efficiency": "link"}


def efficiency(opts: dict[str, Any]) -> Efficiency:
    """`Efficiency` from the options above that were given (removed from `opts`); BadInput
    for a value outside (0, 1]."""
    given = {f: v for flag, f in _EFFICIENCY_FIELDS.items() if (v := opts.pop(flag, None)) is not None}
    return Efficiency(**given)


_CLI_TYPES = {bool: bool, int: int, float: float, str: str, list: list[str]}


def _shown(value: Any, name: str) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return ("sym" if value else "asym") if name == "symmetric" else ("on" if value else "off")
    return str(value)


def default_text(name: str) -> str:
    """' (default: X)' for option `name`: its declared default, or for a scheme option the
    default of each method's scheme that has the field (`Scheme.option_defaults`)."""
    target = OPTIONS[name].metadata["scheme"]
    if target:
        found = {}
        for method, cls in all_schemes():
            defaults = cls.option_defaults()
            if target in defaults and method not in found:  # a method's first class with the field
                found[method] = _shown(defaults[target], name)
        if len(set(found.values())) == 1:
            return f" (default: {next(iter(found.values()))})"
        return " (default: " + ", ".join(f"{m} {v}" for m, v in found.items()) + ")"
    value = getattr(DEFAULTS, name)
    return "" if value in (None, (), False) else f" (default: {_shown(value, name)})"


def option_parameter(name: str, help: str | None = None) -> inspect.Parameter:
    """The typer parameter of declared option `name` (default None: "not given")."""
    meta = OPTIONS[name].metadata
    text = (help or meta["help"]) + default_text(name)
    kind = str if name == "max_ppl_increase" else meta["kind"]  # "5%" is parsed by the recipe module
    if meta["argument"]:
        info: Any = typer.Argument(help=text, show_default=False, metavar=name.upper())
    else:
        decl = meta["flag"] or f"--{name.replace('_', '-')}"
        info = typer.Option(decl, help=text, show_default=False, rich_help_panel=meta["panel"])
    annotation = Annotated[_CLI_TYPES[kind] | None, info]
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)


def with_parameters(fn: Callable[..., Any], params: list[inspect.Parameter]) -> Callable[..., Any]:
    """`fn(**kwargs)` presented to typer with the signature `params`."""
    fn.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    fn.__annotations__ = {p.name: p.annotation for p in params}
    return fn


def plain_parameter(name: str, annotation: Any, default: Any) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
