"""The one registry of schemes (`SCHEMES`, method name -> `Scheme` class) and the ways to
build one: `make_scheme(method, **overrides)`, `scheme_from_dict(d)`.

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

from collections.abc import Mapping
from typing import Any

from infer_tool.common.errors import BadInput
from infer_tool.schemes.base import Scheme
from infer_tool.schemes.fp8 import Fp8Scheme
from infer_tool.schemes.integer import AWQScheme, GPTQScheme, RTNScheme

# The schemes `--method` offers, in the order error messages list them.
BUILTIN: tuple[type[Scheme], ...] = (RTNScheme, GPTQScheme, AWQScheme, Fp8Scheme)
SCHEMES: dict[str, type[Scheme]] = {cls.method: cls for cls in BUILTIN}


def register_scheme(cls: type[Scheme]) -> type[Scheme]:
    """Add a scheme class under its `method` (usable as a class decorator); a method that is
    already taken by another class is an error."""
    taken = SCHEMES.get(cls.method)
    if taken is not None and taken is not cls:
        raise ValueError(f"method {cls.method!r} is already registered to {taken.__name__}")
    SCHEMES[cls.method] = cls
    return cls


def scheme_class(method: str) -> type[Scheme]:
    """The scheme class of `method`; BadInput names the registered methods."""
    cls = SCHEMES.get(method)
    if cls is None:
        raise BadInput(f"method {method!r} is not supported; use one of {', '.join(SCHEMES)}")
    return cls


def scheme_fields(method: str) -> tuple[str, ...]:
    """The option names `make_scheme(method, ...)` accepts."""
    return scheme_class(method).option_names()


def make_scheme(method: str, **overrides: object) -> Scheme:
    """Build the scheme for `method`; overrides equal to None keep the dataclass default."""
    return scheme_class(method).from_dict({k: v for k, v in overrides.items() if v is not None})


def scheme_from_dict(data: Mapping[str, Any]) -> Scheme:
    """The scheme a `to_dict()` wrote (its "method" picks the class)."""
    method = data.get("method")
    if not isinstance(method, str):
        raise BadInput(f"a scheme needs a method string (got {method!r})")
    return scheme_class(method).from_dict(data)
