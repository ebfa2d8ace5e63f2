"""The one registry of schemes (`CLASSES`, method name -> its `Scheme` classes, the default
first; `SCHEMES`, method -> default class) and the ways to build one:
`make_scheme(method, **overrides)`, `scheme_from_dict(d)`. A method has one class per number
format it rounds to (INT, FP4): the options given pick the class that takes them all.

How to extend infer-tool (the one place this is written down)
=============================================================

A new number format (e.g. NVFP4 / MXFP4, INT8 W8A8) is one scheme class and one format
writer, plus the pure solver they meet at and a few-line quantizer that calls it:

1. Scheme: a frozen dataclass subclassing `schemes.base.Scheme` in `schemes/<format>.py`:
   `method` (the `--method` value), `kind` (a new kind, e.g. "fp4", unless the formats of
   an existing kind can carry it unchanged), its options as fields with their defaults,
   validation in `__post_init__` (BadInput), `check_shapes`, `for_storage`, `describe`
   (`to_dict` / `from_dict` come from the base). Add the class to `BUILTIN` below. Presets
   under llm-compressor's names (e.g. "W8A8") belong beside it in `schemes/`, as
   (method, {option: value}) resolved through `make_scheme`.
2. Solver, in `packers/`: a pure function `(W (N, K) fp32, LayerStats | None, scheme) ->
   weight`. The weight object holds the packed result in one canonical layout and has
   `shape` (N, K), `dequantize(dtype) -> (N, K)`, `to(device)` and `info` (a dict the
   report reads: "fallback", "reason"); its scale tensors named `scale`, `weight_scale` or
   `input_scale` are checked for NaN / Inf / zero (`calib/quantizers/base.record`). See
   `packers/quantized.QuantizedWeight` and `packers/fp8.Fp8Weight`.
3. Format writer: a `packers/checkpoint.CheckpointFormat` (config, tensors, read, matches,
   check) in `packers/<format>.py`, and one line in `packers/checkpoint._BUILTIN` keyed by
   (`--format` name, kind).
4. Quantizer: a module in `calib/quantizers/` (found there, imported when a quantizer is
   first asked for) whose `LayerQuantizer[TheScheme]` subclass is decorated with
   `@register_quantizer(TheScheme)`; a weights-only format only implements `solve`.
5. Options: each user-facing scheme option is one `option(..., scheme="<field>")` line in
   `calib/recipe.QuantizeOptions` (the CLI flag and the recipe key; `--help` shows the
   scheme's default, `scheme_from_options` refuses it for other methods), and the method
   goes in the `method` option's help.
6. `--eval` measures ppl "as deployed": a kind whose runtime is not its dequantized weights
   (FP8's W8A8 kernels) adds its runtime to `jobs/quantize_run.as_deployed` and a line to
   `jobs/quantize_report.EVALUATED`.

A number format that existing methods round to (FP4: RTN, GPTQ, AWQ and AWQ+GPTQ on the
E2M1 grid) is the same, with one scheme class per method in the format's module: the format's fields
on a base class, each method's options as fields whose defaults are the INT method scheme's
(`GPTQScheme.damp`, ..., never restated values), validated by constructing that scheme.
The classes are registered under the method names; `scheme_class(method, options)` picks
the one that takes every option given (a field only the new format has, e.g. `fp4`,
selects it), and the method's quantizer subclasses the INT one with the format's solver
and hooks (AWQ's `qdq`, GPTQ's per-column quantizer, `LayerContext.rtn` for fallbacks).
`schemes/fp4.py` and `calib/quantizers/fp4.py` are the example.

A new method over an existing format (e.g. `autoround`, `awq+gptq`) is one quantizer
module, plus the scheme subclass that holds the method's options and defaults:

1. Scheme: a subclass of `schemes.integer.QuantScheme` (or of the format's scheme) with
   `method` and the method's fields; add it to `BUILTIN`. The format writers of its kind
   carry it unchanged.
2. Quantizer: `calib/quantizers/<name>.py` with `@register_quantizer(TheScheme)` on a
   `LayerQuantizer[TheScheme]`: `needs` (what the pipeline measures for it), `solve` or
   `quantize_layer` (a whole decoder layer: block outputs, scale folds), `stats_refusal`,
   `notes`. Existing quantizers' steps are public methods to compose (AWQ's
   `search_mapping` and the fold in `awq_fold.fold_scales`; GPTQ's `solve`).
3. Its solver, if new, as a pure function in `packers/`; its options as in step 5 above.

The pipeline (`calib/pipeline.py`), the jobs and the CLI know no method or format by name:
they ask the scheme (`kind`, `check_shapes`, ...), the quantizer registry
(`calib/quantizers.quantizer_for`) and the format registry (`packers/checkpoint.get_format`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from infer_tool.common.errors import BadInput
from infer_tool.schemes.base import Scheme
from infer_tool.schemes.fp4 import FP4_SCHEMES
from infer_tool.schemes.fp8 import Fp8Scheme
from infer_tool.schemes.integer import AutoRoundScheme, AWQGPTQScheme, AWQScheme, GPTQScheme, RTNScheme

# The schemes `--method` offers, in the order error messages list them; a method's first
# class is its default, the later ones other number formats of the same method (FP4).
BUILTIN: tuple[type[Scheme], ...] = (
    RTNScheme,
    GPTQScheme,
    AWQScheme,
    AWQGPTQScheme,
    AutoRoundScheme,
    Fp8Scheme,
    *FP4_SCHEMES,
)
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
