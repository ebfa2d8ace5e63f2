"""The options of `infer-tool quantize`, declared once: `QuantizeOptions`, the run's own
options (`RunOptions`, declared here) and the scheme options, declared on the methods'
configs and the formats' scheme fields (`schemes/options.option`) and collected from the
registry. Each carries its help text and its command-line flag; for scheme options, the
scheme field it sets. The CLI builds its flags from these declarations and recipe files use
the same names (dashes or underscores), for example::

    method: gptq
    group_size: 128
    act_order: true
    calib: sotu:calib
    num_samples: 128
    format: compressed-tensors
    ignore: ["re:.*down_proj"]
    eval: sotu:eval
    max_ppl_increase: 5%

A two-way flag such as `--sym/--asym` is also a recipe key under either name (`asym:
true` is `sym: false`). Values are typed strictly: booleans are true/false, numbers are
numbers, lists are lists (a single string is one pattern).

Algorithm defaults (group size, symmetry, damping) are not restated here: `None` keeps the
default of the method's scheme (`schemes/`). This module imports only the standard library
and `schemes/` (PyYAML lazily, for .yaml files).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infer_tool.common.errors import BadInput
from infer_tool.formats.registry import all_formats
from infer_tool.schemes.base import Scheme
from infer_tool.schemes.options import Declared, declared_options
from infer_tool.schemes.presets import get_preset
from infer_tool.schemes.registry import BUILTIN, CLASSES, SCHEMES, make_scheme, scheme_fields

DEMO_MODEL = "smollm2-135m"
DEMO_METHOD = "awq"
DEMO_GROUP_SIZE = 64
DEMO_EVAL = "sotu:eval"
# Sized so the demo finishes in minutes on a 2-core CPU: 32 x 512 calibration tokens
# (AWQ's searches use 16 sequences anyway) and the first 8,192 eval tokens.
DEMO_NUM_SAMPLES = 32
DEMO_EVAL_TOKENS = 8192

STATS_NOTE = (
    "Reused statistics (--stats) were measured on the fp model: layer i's Hessian and "
    "activation magnitudes come from inputs that did not pass through quantized layers "
    "0..i-1 nor through the quantized earlier groups of layer i (q/k/v before o, gate/up "
    "before down). A live GPTQ run measures them after quantizing those (true-sequential), "
    "so it compensates upstream error; reuse gives that up. AWQ needs live block outputs "
    "and cannot reuse statistics."
)


def option(default: Any, help: str, kind: type, *, flag: str | None = None, argument: bool = False) -> Any:
    """A declared run option: `kind` is the value's type (bool, int, float, str, list); `flag`
    its command-line spelling (default --name-with-dashes, or "--on/--off"); `argument` for the
    positional MODEL."""
    return field(
        default=default,
        metadata={"help": help, "kind": kind, "flag": flag, "scheme": None, "argument": argument, "panel": None},
    )


@dataclass
class RunOptions:
    """The run's own options (model, method, data, output, evaluation, memory, processes);
    `QuantizeOptions` adds the scheme options the methods and formats declare."""

    model: str | None = option(None, "Model directory, .gguf file, demo name or hub name.", str, argument=True)
    method: str = option(
        "awq",
        "awq, gptq, rtn, awq+gptq (AWQ's scales, then GPTQ's rounding; these four round INT "
        "weights, or FP4 with --fp4), autoround (rounding and clipping learned by signed gradient descent per "
        "block), or fp8 (e4m3 weights and activations).",
        str,
    )
    scheme: str | None = option(
        None,
        "A preset named as llm-compressor names it (W4A16, W4A16_ASYM, W8A16, W8A8, FP8, "
        "FP8_DYNAMIC, FP8_BLOCK, ...; --list-schemes shows what each sets); options given "
        "explicitly override the preset's.",
        str,
    )
    moe_calibration: str | None = option(
        None,
        "MoE models: all (every expert computes on every calibration token for its statistics; the layer output "
        "still combines only the routed experts; the default) or routed (experts see only their tokens).",
        str,
    )
    moe_min_tokens: int | None = option(
        None,
        "MoE models: experts routed fewer calibration tokens are listed in the report and, with "
        "--moe-calibration routed, quantized with RTN (named as fallbacks).",
        int,
    )
    calib: str = option(
        "sotu:calib", "Calibration corpus: sotu:calib, a .txt, .jsonl, .json or .parquet file, or a HF dataset.", str
    )
    num_samples: int = option(128, "Calibration sequences.", int)
    seq_len: int = option(512, "Tokens per calibration sequence.", int)
    format: str = option(
        "compressed-tensors",
        "compressed-tensors, awq or gptq (symmetric only); fp8 (native) for --method fp8; "
        "FP4 is compressed-tensors only (nvfp4- / mxfp4-pack-quantized).",
        str,
    )
    out: str | None = option(None, "Output checkpoint directory (must not exist unless --overwrite).", str)
    ignore: tuple[str, ...] = option(
        (),
        "Leave matching linears unquantized: a glob on the module name (*.down_proj, "
        "model.layers.0.*) or re:REGEX. Repeatable.",
        list,
    )
    seed: int = option(0, "Seed of the calibration windows.", int)
    layer_error: bool = option(
        True,
        "Measure each layer's output error on calibration text (the report's layer errors). Off: a "
        "data-free scheme (RTN without --smoothquant or static activations, FP8 dynamic, FP4 weights "
        "only) reads no calibration text and runs no forward pass.",
        bool,
        flag="--layer-error/--no-layer-error",
    )
    eval: str | None = option(None, "Evaluate ppl before and after on this corpus (e.g. sotu:eval).", str)
    eval_tokens: int = option(40960, "Evaluate on the first N tokens of the --eval corpus.", int)
    eval_seq_len: int = option(2048, "Evaluation window length.", int)
    eval_activations: str = option(
        "auto",
        "--eval's activations: auto (as the scheme is served: int8 for W8A8, e4m3 for FP8, unquantized for "
        "weight-only INT) or int8 (weight-only INT4 as vLLM's CPU build serves it on AMX CPUs: W4A8, "
        "activations int8 per token).",
        str,
    )
    max_ppl_increase: float | None = option(
        None, "Quality gate: exit 3 when ppl rises by more than this (5%). Needs --eval.", float
    )
    kld: bool = option(
        True,
        "With --eval, also the per-token KL divergence of the quantized model from the fp model "
        "(its fp pass is then run, or read from the cache of its final hidden states).",
        bool,
        flag="--kld/--no-kld",
    )
    max_kld: float | None = option(
        None,
        "Quality gate: exit 3 when the mean KL divergence from the fp model (nats per "
        "token) exceeds this (e.g. 0.05). Needs --eval and --kld.",
        float,
    )
    stats: str | None = option(
        None,
        "Reuse statistics saved by `infer-tool calibrate` (gptq, rtn): measured on the fp "
        "model, they give up GPTQ's compensation of upstream error (calibrate's note says "
        "why); AWQ cannot reuse them.",
        str,
    )
    device: str | None = option(None, "auto, cpu, cuda or cuda:N (default: auto: CUDA when available).", str)
    dtype: str = option(
        "auto",
        "Checkpoint dtype of unquantized tensors and INT scales: auto (the source model's), "
        "float32, bfloat16 or float16. Calibration sees the weights as stored.",
        str,
    )
    stream: bool = option(
        True,
        "Read each decoder layer from the model's safetensors when it is calibrated and free it "
        "after (memory independent of the layer count); --no-stream loads the whole model first.",
        bool,
        flag="--stream/--no-stream",
    )
    resume: bool = option(
        False,
        "Continue the run an interruption left beside --out (its finished layers are kept); "
        "refused if the model, options or calibration text differ. Without earlier progress: "
        "start from the first layer.",
        bool,
        flag="--resume",
    )
    max_shard_size: str = option(
        "5GB",
        "Largest safetensors file of the checkpoint (5GB = 5e9 bytes, 5GiB = 5*2^30); "
        "more are written as model-0000i-of-0000N with an index.",
        str,
    )
    max_memory: str | None = option(
        None,
        "Memory this run may use: HOST or HOST,DEVICE (e.g. 20GiB,70GiB); the estimate "
        "before the run is checked against it instead of what the machine has free.",
        str,
    )
    allow_pickle: bool = option(
        False, "Allow pickle-based weight files (.bin/.pt); they can run code.", bool, flag="--allow-pickle"
    )
    trust_remote_code: bool = option(
        False, "Run the model repository's own Python code.", bool, flag="--trust-remote-code"
    )
    # ---- quantize --model-free (jobs/model_free.py): one block, kept together
    model_free: bool = option(
        False,
        "Quantize the safetensors shards tensor by tensor without building the model (any architecture, any "
        "size): data-free schemes only (rtn INT, FP8 dynamic, FP4 weights only; --method rtn when not given). "
        "--ignore adds to the default kept tensors (embeddings, lm_head, norms, routers, MTP, vision).",
        bool,
        flag="--model-free",
    )
    default_ignore: bool = option(
        True,
        "--model-free: keep embeddings, lm_head, norms, routers and their gates, MTP / next-n layers and "
        "vision / audio towers unquantized (--no-default-ignore quantizes every 2-D weight not --ignore'd).",
        bool,
        flag="--default-ignore/--no-default-ignore",
    )
    # ---- quantize --target-bits / --candidates (jobs/mixed_quantize.py): mixed precision, one block
    target_bits: float | None = option(
        None,
        "Mixed precision: the average stored bits per weight of the decoder linears (scales and zero points "
        "counted); each fused unit gets the --candidates scheme that keeps the predicted KL least "
        "(`quantize-plan` prints the table first). With --max-kld (and --eval): the measured gate.",
        float,
    )
    candidates: str | None = option(
        None,
        "Mixed precision: the schemes to choose among, by preset name, each solved by --method rtn (default) "
        "or gptq: W4A16, W4A16_G32 "
        "(_G<n>: group size), W4A16_G64_FULL (_FULL: the signed full-range grid), W8A16, FP8, NVFP4A16, "
        "MXFP4A16, NONE (default W4A16,W8A16,FP8). Alone with "
        "--max-kld X --eval CORPUS: the smallest plan predicted under X, measured and gated.",
        str,
    )


def _scheme_option(d: Declared) -> tuple[str, Any, dataclasses.Field]:
    """The QuantizeOptions field of a declared scheme option: None when not given."""
    meta = {"help": d.help, "kind": d.kind, "flag": d.flag, "scheme": d.target, "argument": False, "panel": d.panel}
    return d.name, d.kind | None, field(default=None, metadata=meta)


# The run's options, then one field per option a method's config or a format declares
# (`schemes/options.option`, collected from every registered scheme class), None when not given.
QuantizeOptions = dataclasses.make_dataclass(
    "QuantizeOptions",
    [_scheme_option(d) for d in declared_options(BUILTIN).values()],
    bases=(RunOptions,),
    namespace={
        "__module__": __name__,
        "__doc__": "Every option of `infer-tool quantize`, flat: RunOptions and the scheme options.",
    },
)

OPTIONS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(QuantizeOptions)}
# scheme field -> the option that sets it (each scheme field has one option)
SCHEME_OPTIONS: dict[str, str] = {f.metadata["scheme"]: name for name, f in OPTIONS.items() if f.metadata["scheme"]}
EVAL_ACTIVATIONS = ("auto", "int8")
DEFAULTS = QuantizeOptions()
# name -> (lowest, highest) accepted value
NUMBER_LIMITS = {
    "num_samples": (1, 2**20),
    "seq_len": (2, 2**20),
    "eval_tokens": (2, 2**40),
    "eval_seq_len": (2, 2**20),
    "seed": (0, 2**63 - 1),
}


def flag(name: str, value: object = None) -> str:
    """The command-line spelling of option `name`: of a two-way flag the side `value` picks
    (the second for False, else the first)."""
    declared = OPTIONS[name].metadata["flag"]
    sides = (declared or f"--{name.replace('_', '-')}").split("/")
    return sides[-1] if value is False else sides[0]


def _aliases() -> dict[str, tuple[str, bool]]:
    """Recipe key -> (option, inverted): every field name, and both sides of two-way flags."""
    out = {name: (name, False) for name in OPTIONS}
    for name, f in OPTIONS.items():
        declared = f.metadata["flag"] or ""
        if "/" in declared:
            on, off = (s.removeprefix("--").replace("-", "_") for s in declared.split("/"))
            out[on], out[off] = (name, False), (name, True)
    return out


def parse_percent(value: str | float | int) -> float:
    """'5%', '5' or 5 -> 0.05 (a percentage); BadInput for anything else."""
    text = str(value).strip()
    if not re.fullmatch(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?%?|inf%?|nan%?", text, re.ASCII):
        raise BadInput(f"--max-ppl-increase {value!r} is not a percentage; use e.g. 5% or 2.5")
    pct = float(text.removesuffix("%"))
    if not pct >= 0 or pct == float("inf"):
        raise BadInput(f"--max-ppl-increase {value!r} must be a finite percentage >= 0")
    return pct / 100.0


def load_recipe(path: str | Path) -> dict[str, Any]:
    """The options in a YAML (.yaml/.yml), TOML (.toml) or JSON (.json) file, as a dict of
    QuantizeOptions field names; BadInput for unknown keys or unreadable files."""
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"recipe {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".yaml", ".yml", ".json"):
        raise BadInput(f"recipe {path.name!r}: use a .yaml, .yml, .toml or .json file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise BadInput(f"recipe {path.name!r} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise BadInput(f"recipe {path.name!r} cannot be read: {e.strerror}") from None
    try:
        if suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            data = json.loads(text)
    except Exception as e:  # parser errors of three libraries: all mean a malformed file
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise BadInput(f"recipe {path.name!r} is not valid {suffix[1:].upper()}: {first}") from None
    if not isinstance(data, dict):
        raise BadInput(f"recipe {path.name!r} must be a mapping of option names to values")
    aliases = _aliases()
    out: dict[str, Any] = {}
    for key, value in data.items():
        name, inverted = aliases.get(str(key).replace("-", "_"), (None, False))
        if name is None:
            raise BadInput(f"recipe {path.name!r}: unknown option {key!r}; accepted: {', '.join(sorted(aliases))}")
        _check_value(name, value, f"recipe key {key!r}")
        out[name] = not value if inverted else value
    return out


def _check_value(name: str, value: Any, where: str) -> None:
    """Refuse a value whose type is not the option's declared kind."""
    kind = OPTIONS[name].metadata["kind"]
    if kind is bool:
        ok = isinstance(value, bool)
        expected = "true or false"
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        expected = "an integer"
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        expected = "a finite number"
        if name == "max_ppl_increase":
            ok, expected = ok or isinstance(value, str), "a percentage such as 5% or 2.5"
    elif kind is list:
        ok = isinstance(value, str) or (isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value))
        expected = "a list of strings"
    else:
        ok = isinstance(value, str)
        expected = "a string"
    if not ok:
        raise BadInput(f"{where} = {value!r} must be {expected}")


def merge(recipe: dict[str, Any], flags: dict[str, Any]) -> QuantizeOptions:
    """Recipe values, overridden by the flags that were given (not None / not empty)."""
    values = dict(recipe)
    for name, value in flags.items():
        if value is None or (name == "ignore" and not value):
            continue
        values[name] = value
    for name, value in values.items():
        if value is not None:
            _check_value(
                name,
                value,
                f"{flag(name)}" if name in flags and flags[name] not in (None, ()) else f"recipe key {name!r}",
            )
    if values.get("scheme") is not None:
        values = with_preset(values)
    if "ignore" in values:
        ig = values["ignore"]
        values["ignore"] = (ig,) if isinstance(ig, str) else tuple(ig)
    if values.get("max_ppl_increase") is not None:
        values["max_ppl_increase"] = parse_percent(values["max_ppl_increase"])
    opts = QuantizeOptions(**values)
    for name, (low, high) in NUMBER_LIMITS.items():
        if not low <= getattr(opts, name) <= high:
            raise BadInput(f"{flag(name)} {getattr(opts, name)} is out of range; use {low}..{high}")
    return opts


def with_preset(values: dict[str, Any]) -> dict[str, Any]:
    """`values` (option name -> value) with the options of preset `values["scheme"]` that
    were not given, and its method when none was; BadInput for an unknown preset or a
    --method that does not take the preset's options."""
    preset = get_preset(values["scheme"])
    out = dict(values)
    for target, value in preset.options.items():
        if out.get(SCHEME_OPTIONS[target]) is None:
            out[SCHEME_OPTIONS[target]] = value
    method = out.get("method")
    if method is None:
        if preset.method:
            out["method"] = preset.method
    elif method in SCHEMES and not any(set(preset.options) <= set(c.option_names()) for c in CLASSES[method]):
        foreign = [t for t in preset.options if t not in SCHEMES[method].option_names()] or [
            t for t in preset.options if t not in scheme_fields(method)
        ]
        if foreign:
            sets = ", ".join(flag(SCHEME_OPTIONS[t], preset.options[t]) for t in foreign)
            raise BadInput(
                f"--scheme {preset.name} sets {sets}, which --method "
                f"{method} does not take; use --method {preset.method or DEFAULTS.method} or another preset"
            )
    return out


def preset_flags(name: str) -> list[str]:
    """The command-line flags preset `name` stands for, e.g. ["--bits", "8", "--sym"] (its
    method first when it names one)."""
    preset = get_preset(name)
    out = ["--method", preset.method] if preset.method else []
    for target, value in preset.options.items():
        option = SCHEME_OPTIONS[target]
        declared = OPTIONS[option].metadata["flag"] or ""
        if "/" in declared:
            on, off = declared.split("/")
            out.append(on if value else off)
        else:
            out += [flag(option), str(value)]
    return out


def preset_option_names(name: str | None) -> set[str]:
    """The options preset `name` sets (with "method" when it names one); empty for None."""
    if name is None:
        return set()
    preset = get_preset(name)
    return {SCHEME_OPTIONS[t] for t in preset.options} | ({"method"} if preset.method else set())


def origin(opts: QuantizeOptions, name: str, value: object = None) -> str:
    """How the user set scheme option `name` to `value`, in their words: the flag as typed,
    `--scheme PRESET` when the preset sets it, or `--method M's default` when nothing did."""
    value = getattr(opts, name) if value is None else value
    if getattr(opts, name) is None:
        return f"--method {opts.method}'s default ({flag(name, value)})"
    if opts.scheme is not None:
        preset = get_preset(opts.scheme)
        target = OPTIONS[name].metadata["scheme"]
        if target in preset.options and preset.options[target] == value:
            return f"--scheme {preset.name}"
    return flag(name, value)


def _typed(opts: QuantizeOptions, names: list[str]) -> str:
    """`origin` of each option, each spelling once, comma-separated."""
    return ", ".join(dict.fromkeys(origin(opts, n) for n in names))


def scheme_from_options(opts: QuantizeOptions) -> Scheme:
    """The scheme of `opts.method` with the scheme options that were given; options of
    another method are refused, naming the methods they apply to, and options of two number
    formats of the method (INT's --bits with FP4's --fp4) are refused together. Every
    refusal names the options as the user set them (`origin`)."""
    if opts.method not in SCHEMES:
        raise BadInput(f"--method {opts.method!r} is not supported; use one of {', '.join(SCHEMES)}")
    accepted = set(scheme_fields(opts.method))
    given = {
        name: f.metadata["scheme"]
        for name, f in OPTIONS.items()
        if f.metadata["scheme"] and getattr(opts, name) is not None
    }
    wrong = [name for name, target in given.items() if target not in accepted]
    if wrong:
        owners = sorted({m for m in SCHEMES for name in wrong if given[name] in scheme_fields(m)})
        takes = [OPTIONS[n].metadata["flag"] or flag(n) for n, f in OPTIONS.items() if f.metadata["scheme"] in accepted]
        raise BadInput(
            f"{_typed(opts, wrong)} do{'es' if len(wrong) == 1 else ''} not apply to --method {opts.method} "
            f"(only to --method {' / '.join(owners)}); "
            f"--method {opts.method} takes {', '.join(takes) or 'no scheme options'}"
        )
    _refuse_mixed_formats(opts, given)
    if opts.observer is not None and opts.fp4 is None and "observer" not in CLASSES[opts.method][0].option_names():
        raise BadInput(
            f"--observer applies to --method {opts.method} only with --fp4 (its INT search chooses the scales); "
            "INT takes it with --method rtn / gptq / awq+gptq"
        )
    _refuse_asymmetric_full_range(opts)
    try:
        return make_scheme(opts.method, **{target: getattr(opts, name) for name, target in given.items()})
    except BadInput as e:
        if opts.scheme is None:
            raise
        preset = get_preset(opts.scheme)
        raise BadInput(f"{e} (--scheme {preset.name} stands for {' '.join(preset_flags(preset.name))})") from None


def _refuse_asymmetric_full_range(opts: QuantizeOptions) -> None:
    """--full-range with asymmetric groups, naming what made them asymmetric (a flag, a
    preset, or the method's default)."""
    if not opts.full_range or opts.fp4 is not None:
        return
    default = next((f.default for f in dataclasses.fields(SCHEMES[opts.method]) if f.name == "symmetric"), True)
    if (opts.symmetric if opts.symmetric is not None else default) is False:
        raise BadInput(
            f"--full-range is a grid of symmetric groups, and {origin(opts, 'symmetric', False)} makes them asymmetric "
            "(an asymmetric group already uses every level); add --sym, or drop --full-range"
        )


def _refuse_mixed_formats(opts: QuantizeOptions, given: dict[str, str]) -> None:
    """BadInput when no one class of the method takes every given option ({option name:
    scheme field}), naming the options of the class that takes the most of them as typed."""
    classes = CLASSES[opts.method]
    if any(set(given.values()) <= set(c.option_names()) for c in classes):
        return
    best = max(classes, key=lambda c: sum(t in c.option_names() for t in given.values()))
    mine = [name for name, t in given.items() if t not in best.option_names()]
    other = max((c for c in classes if c is not best), key=lambda c: sum(given[n] in c.option_names() for n in mine))
    theirs = [name for name, t in given.items() if t in best.option_names() and t not in other.option_names()]
    fixed, chosen = (next(f for f in all_formats() if c in f.schemes) for c in (other, best))
    raise BadInput(
        f"{_typed(opts, mine)} does not go with {_typed(opts, theirs)}: they set two number formats of --method "
        f"{opts.method} ({fixed.name.upper()} fixes the bits, groups, symmetry and scale dtypes that "
        f"{chosen.name.upper()} options choose); {fixed.name.upper()} alone: {_typed(opts, mine)}, or --scheme "
        f"{' / '.join(p.name for p in fixed.presets)}"
    )


def apply_demo(opts: QuantizeOptions, given: set[str]) -> QuantizeOptions:
    """No MODEL: the built-in demo model, AWQ, group size 64, 32 calibration samples,
    evaluated on the first 8,192 tokens of sotu:eval, unless the recipe or a flag (`given`) says otherwise."""
    changes: dict[str, Any] = {"model": DEMO_MODEL}
    if "method" not in given:
        changes["method"] = DEMO_METHOD
    if "group_size" not in given and opts.fp4 is None:  # FP4 fixes its groups
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
