"""Quantization recipes: the options of `infer-tool quantize` as one dataclass, read from a
YAML or TOML file and overridden by command-line flags.

A recipe file holds the same names as the flags (dashes or underscores), for example::

    method: gptq
    group_size: 128
    act_order: true
    calib: sotu:calib
    num_samples: 128
    format: compressed-tensors
    ignore: ["re:.*down_proj"]
    eval: sotu:eval
    max_ppl_increase: 5%

Algorithm defaults (group size, symmetry, damping) are not restated here: `None` keeps the
default of the method's scheme in `packers/scheme.py`. This module imports only the
standard library (PyYAML lazily, for .yaml files).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infer_tool.common.errors import BadInput

DEMO_MODEL = "smollm2-135m"
DEMO_METHOD = "awq"
DEMO_GROUP_SIZE = 64
DEMO_EVAL = "sotu:eval"
# Sized so the demo finishes in minutes on a 2-core CPU: 32 x 512 calibration tokens
# (AWQ's searches use 16 sequences anyway) and the first 8,192 eval tokens.
DEMO_NUM_SAMPLES = 32
DEMO_EVAL_TOKENS = 8192


@dataclass
class QuantizeOptions:
    model: str | None = None
    method: str = "awq"
    bits: int | None = None
    group_size: int | None = None
    symmetric: bool | None = None
    act_order: bool | None = None
    damp: float | None = None
    calib: str = "sotu:calib"
    num_samples: int = 128
    seq_len: int = 512
    format: str = "compressed-tensors"
    out: str | None = None
    ignore: tuple[str, ...] = ()
    seed: int = 0
    eval: str | None = None
    eval_tokens: int = 40960
    eval_seq_len: int = 2048
    max_ppl_increase: float | None = None  # a fraction: 0.05 = 5 %
    stats: str | None = None
    device: str | None = None
    dtype: str = "auto"  # of the checkpoint's unquantized tensors and INT scales; auto: the source's
    allow_pickle: bool = False  # load .bin/.pt weights (pickle can run code)
    trust_remote_code: bool = False  # run the model repository's own Python code
    # --method fp8 (defaults in packers/fp8.py's Fp8Scheme; see cli/fp8_options.py)
    fp8_granularity: str | None = None
    fp8_activations: str | None = None
    kv_cache: str | None = None
    fp8_clip_search: bool | None = None


FIELDS = {f.name for f in dataclasses.fields(QuantizeOptions)}
DEFAULTS = QuantizeOptions()


def parse_percent(value: str | float | int) -> float:
    """'5%', '5' or 5 -> 0.05 (a percentage); BadInput for anything else."""
    text = str(value).strip()
    try:
        pct = float(text.removesuffix("%"))
    except ValueError:
        raise BadInput(f"--max-ppl-increase {value!r} is not a percentage; use e.g. 5% or 2.5") from None
    if not pct >= 0 or pct == float("inf"):
        raise BadInput(f"--max-ppl-increase {value!r} must be a finite percentage >= 0")
    return pct / 100.0


def load_recipe(path: str | Path) -> dict[str, Any]:
    """The options in a YAML (.yaml/.yml) or TOML (.toml) file, or JSON (.json), as a dict
    of QuantizeOptions field names; BadInput for unknown keys or unreadable files."""
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"recipe {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    text = path.read_text()
    try:
        if suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise BadInput(f"recipe {path.name!r}: use a .yaml, .yml, .toml or .json file")
    except BadInput:
        raise
    except Exception as e:  # parser errors of three libraries: all mean a malformed file
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise BadInput(f"recipe {path.name!r} is not valid {suffix[1:].upper()}: {first}") from None
    if not isinstance(data, dict):
        raise BadInput(f"recipe {path.name!r} must be a mapping of option names to values")
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in ("sym", "asym"):
            out["symmetric"] = bool(value) if name == "sym" else not bool(value)
            continue
        if name not in FIELDS:
            raise BadInput(f"recipe {path.name!r}: unknown option {key!r}; accepted: {', '.join(sorted(FIELDS))}")
        out[name] = value
    return out


def merge(recipe: dict[str, Any], flags: dict[str, Any]) -> QuantizeOptions:
    """Recipe values, overridden by the flags that were given (not None / not empty)."""
    values = dict(recipe)
    for name, value in flags.items():
        if value is None or (name == "ignore" and not value):
            continue
        values[name] = value
    if "ignore" in values:
        ig = values["ignore"]
        values["ignore"] = (ig,) if isinstance(ig, str) else tuple(str(p) for p in ig)
    if values.get("max_ppl_increase") is not None:
        values["max_ppl_increase"] = parse_percent(values["max_ppl_increase"])
    opts = QuantizeOptions(**values)
    _check_types(opts)
    return opts


def _check_types(opts: QuantizeOptions) -> None:
    for name in ("bits", "group_size", "num_samples", "seq_len", "seed", "eval_tokens", "eval_seq_len"):
        v = getattr(opts, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise BadInput(f"{name}={v!r} must be an integer")
    for name in ("symmetric", "act_order", "allow_pickle", "trust_remote_code"):
        v = getattr(opts, name)
        if v is not None and not isinstance(v, bool):
            raise BadInput(f"{name}={v!r} must be true or false")
    for name, low in (("num_samples", 1), ("seq_len", 2), ("eval_tokens", 2), ("eval_seq_len", 2)):
        if getattr(opts, name) < low:
            raise BadInput(f"{name}={getattr(opts, name)} must be >= {low}")


def apply_demo(opts: QuantizeOptions, given: set[str]) -> QuantizeOptions:
    """No MODEL: the built-in demo model, AWQ, group size 64, 32 calibration samples,
    evaluated on the first 8,192 tokens of sotu:eval, unless the recipe or a flag (`given`) says otherwise."""
    changes: dict[str, Any] = {"model": DEMO_MODEL}
    if "method" not in given:
        changes["method"] = DEMO_METHOD
    if "group_size" not in given:
        changes["group_size"] = DEMO_GROUP_SIZE
    if "eval" not in given:
        changes["eval"] = DEMO_EVAL
    if "num_samples" not in given:
        changes["num_samples"] = DEMO_NUM_SAMPLES
    if "eval_tokens" not in given:
        changes["eval_tokens"] = DEMO_EVAL_TOKENS
    return dataclasses.replace(opts, **changes)


def fresh_dir(base: str) -> str:
    """`base`, or `base-2`, `base-3`, ... : the first name that does not exist."""
    if not Path(base).exists():
        return base
    i = 2
    while Path(f"{base}-{i}").exists():
        i += 1
    return f"{base}-{i}"


def to_dict(opts: QuantizeOptions) -> dict[str, Any]:
    d = dataclasses.asdict(opts)
    d["ignore"] = list(opts.ignore)
    return d

