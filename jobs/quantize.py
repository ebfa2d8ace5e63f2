"""The quantize job as a library function: `quantize(QuantizeOptions) -> QuantizeReport`.

Steps: check every option (before any model is loaded), load the model, round its weights
to the checkpoint dtype, plan, (evaluate), calibrate + quantize layer by layer, (evaluate
as deployed, gate), write the checkpoint atomically with its report. The CLI parses
flags into `QuantizeOptions`, calls this and prints the report; nothing here prints.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from infer_tool.calib.recipe import QuantizeOptions, STATS_NOTE, scheme_from_options, to_dict
from infer_tool.common.errors import BadInput
from infer_tool.common.jsonout import to_json
from infer_tool.common.progress import Progress, no_progress
from infer_tool.jobs.moe_report import MoeSummary, moe_calibration, moe_summary

# Options that do not change the checkpoint: a resumed run may differ in them.
UNKEYED_OPTIONS = ("out", "resume", "stream", "max_shard_size", "max_memory")
# What `--eval`'s "ppl after" measures, per scheme kind.
EVALUATED = {
    "int": "the quantized model in memory, whose linear weights are exactly the checkpoint's dequantized values",
    "fp8": "the FP8 model as deployed: quantized linears run as the kernels' Fp8Linear (W8A8: e4m3 weights, "
           "activations rounded to e4m3 per token or with the static input_scale), KV cache rounded through "
           "e4m3 with the calibrated k_scale/v_scale when --kv-cache fp8",
}


@dataclass
class Calibration:
    """What the statistics were measured on."""

    tokens: int
    corpus: str | None
    num_samples: int | None
    seq_len: int | None
    seed: int | None
    from_stats: str | None = None  # a `calibrate` directory, when reused
    note: str | None = None
    world_size: int | None = None  # processes the calibration ran on (accelerate launch / torchrun)
    samples_per_process: list[int] | None = None  # calibration sequences each process ran, in rank order

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None or k in ("corpus",)}


@dataclass
class EvalSummary:
    corpus: str
    tokens: int
    seq_len: int
    windows: int
    ppl_before: float
    ppl_after: float
    ratio: float
    evaluated: str
    ppl_before_cached: bool = False  # the fp baseline was read from the ppl cache (`evals/ppl_cache.py`)


@dataclass
class QualityGate:
    max_increase: float  # a fraction: 0.05 = 5%
    increase: float
    passed: bool


@dataclass
class QuantizeReport:
    """Everything a run measured; `to_dict()` is `quantize_report.json` and `--json`."""

    model: str
    model_path: str
    model_type: str
    method: str
    scheme: dict[str, Any]
    scheme_description: str
    format: str
    dtype: str
    out: str
    device: str
    recipe: str | None
    options: dict[str, Any]
    notes: list[str]
    calibration: Calibration | None = None
    eval: EvalSummary | None = None
    quality_gate: QualityGate | None = None
    quantized_layers: int = 0
    ignored: list[str] = field(default_factory=list)
    unmatched_ignore: list[str] = field(default_factory=list)  # --ignore patterns that matched no linear
    layer_errors: list[Any] = field(default_factory=list)
    linear_errors: dict[str, float] = field(default_factory=dict)
    fallbacks: list[Any] = field(default_factory=list)
    method_report: dict[str, Any] = field(default_factory=dict)  # the method's own entries (AWQ: "awq")
    kv_cache_scales: dict[str, dict[str, float]] | None = None
    moe: MoeSummary | None = None
    memory: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def layer_error_mean(self) -> float | None:
        errors = [e.relative_output_error for e in self.layer_errors]
        return sum(errors) / len(errors) if errors else None

    @property
    def layer_error_max(self) -> float | None:
        return max((e.relative_output_error for e in self.layer_errors), default=None)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "method_report":
                d.update(value)
                continue
            if value is None and f.name in ("calibration", "eval", "quality_gate", "kv_cache_scales", "moe"):
                continue
            if f.name == "calibration":
                value = value.to_dict()
            elif dataclasses.is_dataclass(value):
                value = dataclasses.asdict(value)
            elif f.name in ("layer_errors", "fallbacks"):
                value = [dataclasses.asdict(v) for v in value]
            d[f.name] = value
            if f.name == "layer_errors":
                d["layer_error_mean"], d["layer_error_max"] = self.layer_error_mean, self.layer_error_max
            if f.name == "fallbacks":
                d["fallback_count"] = len(value)
        return d


def check(opts: QuantizeOptions, overwrite: bool) -> tuple[Any, Any]:
    """Every option checked before any model is loaded or text tokenized: (scheme, format)."""
    from infer_tool.calib.architectures import architecture_for
    from infer_tool.calib.corpora import check_corpus
    from infer_tool.calib.models import classify_model_spec, read_config
    from infer_tool.calib.quantizers import quantizer_for
    from infer_tool.common.device import check_device
    from infer_tool.common.outdir import check_out_dir
    from infer_tool.jobs.preflight import check_processes, parse_limits
    from infer_tool.jobs.run_dir import check_progress
    from infer_tool.packers.checkpoint import REPORT_NAME, get_format
    from infer_tool.packers.shards import parse_size
    from infer_tool.schemes.base import SCALE_DTYPES

    scheme = scheme_from_options(opts)
    fmt = get_format(opts.format, scheme.kind)
    fmt.check(scheme, {})
    if opts.out is None:
        raise BadInput("--out DIR is required when MODEL is given")
    if opts.dtype != "auto" and opts.dtype not in SCALE_DTYPES:
        raise BadInput(f"unknown --dtype {opts.dtype!r}: expected auto, {', '.join(SCALE_DTYPES)}")
    check_device(opts.device or "auto")
    check_patterns(opts.ignore)
    moe_calibration(opts)  # refuses a bad --moe-calibration / --moe-min-tokens
    if opts.max_ppl_increase is not None and opts.eval is None:
        raise BadInput("--max-ppl-increase needs --eval CORPUS (the ppl to compare)")
    if opts.stats is not None:
        refusal = quantizer_for(scheme).stats_refusal(scheme)
        if refusal:
            raise BadInput(refusal)
        if not (Path(opts.stats) / "stats_index.json").is_file():
            raise BadInput(f"--stats {opts.stats!r} is not a statistics directory; make one with `infer-tool calibrate --out DIR`")
    else:
        check_corpus(opts.calib, "--calib")
    if opts.eval is not None:
        check_corpus(opts.eval, "--eval")
    kind, path = classify_model_spec(opts.model, opts.allow_pickle)
    check_out_dir(opts.out, overwrite=overwrite, marker=REPORT_NAME, protected=[path] if kind == "dir" else [])
    parse_size(opts.max_shard_size, "--max-shard-size")
    parse_limits(opts.max_memory)
    check_progress(opts.out, opts.resume)
    check_processes(opts)
    if kind == "dir":  # the architecture table, before the weights are read
        config = read_config(path)
        model_type = config.get("model_type")
        if not isinstance(model_type, str):
            raise BadInput(f"{path / 'config.json'} has no model_type string (got {model_type!r})")
        architecture_for(model_type, SimpleNamespace(**config))
    return scheme, fmt


def quantize(
    opts: QuantizeOptions, *, overwrite: bool = False, recipe: str | None = None, progress: Progress | None = None
) -> QuantizeReport:
    """Open the model, check the memory estimate, calibrate + quantize layer by layer (with
    --eval, the evaluation windows go through each layer before and after), write the
    checkpoint from the finished layers; returns the report.

    The report's quality gate says whether `opts.max_ppl_increase` held; the caller decides
    what a failed gate means (the CLI exits 3). An interrupted run leaves its progress
    beside --out (`jobs/run_dir.py`); `opts.resume` continues it."""
    t_start = time.perf_counter()
    scheme, fmt = check(opts, overwrite)
    progress = progress or no_progress
    from infer_tool.common.device import pick_device

    dev = pick_device(opts.device or "auto")
    import torch

    from infer_tool.calib.corpora import calibration_batch, load_text, tokenize
    from infer_tool.calib.layers import decoder_layers, peak_memory
    from infer_tool.calib.moe import routers
    from infer_tool.calib.pipeline import plan
    from infer_tool.calib.quantizers import quantizer_for
    from infer_tool.calib.streaming import open_model
    from infer_tool.jobs import preflight
    from infer_tool.jobs.run_dir import NoRun, RunDir, model_fingerprint, run_key
    from infer_tool.packers.checkpoint import REPORT_NAME

    seconds: dict[str, float] = {}
    t = time.perf_counter()
    loaded = open_model(opts.model, stream=opts.stream, allow_pickle=opts.allow_pickle, trust_remote_code=opts.trust_remote_code)
    seconds["load"] = time.perf_counter() - t
    lm = loaded.model
    dtype_name = checkpoint_dtype(opts.dtype, loaded.path)
    store_dtype = getattr(torch, dtype_name)
    if dtype_name != "float32" and loaded.stream_plan is None:
        round_to(lm, store_dtype)  # a streamed model is rounded as each tensor is read
    scheme = scheme.for_storage(fmt.scale_dtype or dtype_name)  # scales rounded to what the checkpoint stores
    arch, names = plan(lm, scheme, opts.ignore)  # unknown architecture / bad group size: before any work
    if arch.conv1d:
        raise BadInput(
            f"{lm.config.model_type} stores its linears as Conv1D, which the checkpoint formats "
            "(compressed-tensors, awq, gptq, fp8) do not carry: they quantize nn.Linear modules only"
        )
    unmatched = unmatched_patterns(opts.ignore, [*names, *ignored_linears(lm, arch, names)])
    if not names:
        raise BadInput(f"--ignore {' '.join(opts.ignore)} matches every quantizable linear: nothing would be quantized")
    quantizer = quantizer_for(scheme)
    estimate, spill_note = preflight.plan(lm, arch, loaded, opts, quantizer.needs(scheme), dev)
    eval_ids = tokenize(load_text(opts.eval), loaded.tokenizer, opts.eval_tokens) if opts.eval is not None else None
    calib_ids = None
    if opts.stats is None:
        calib_ids = calibration_batch(loaded.tokenizer, opts.calib, opts.num_samples, opts.seq_len, opts.seed)

    report = QuantizeReport(
        model=opts.model, model_path=str(loaded.path), model_type=lm.config.model_type, method=scheme.method,
        scheme=scheme.to_dict(), scheme_description=scheme.describe(), format=fmt.name, dtype=dtype_name,
        out=opts.out, device=dev, recipe=recipe, options=to_dict(opts), notes=list(loaded.notes),
        unmatched_ignore=unmatched,
    )
    if unmatched:
        report.notes.append(f"--ignore patterns that match no linear: {', '.join(unmatched)}")
    if spill_note:
        report.notes.append(spill_note)
    key = run_key({"model": model_fingerprint(loaded.path), "device": torch.device(dev).type, "calib_ids": calib_ids,
                   "eval_ids": eval_ids, "torch": torch.__version__,
                   "options": {k: v for k, v in to_dict(opts).items() if k not in UNKEYED_OPTIONS}})
    from infer_tool.calib.distributed import finish, stop_on_sigterm, world

    rank, world_size = world()
    if world_size > 1:
        stop_on_sigterm()  # under several processes only process 0 keeps progress (and --resume is refused)
    n_layers = len(decoder_layers(lm, arch))
    run, note = RunDir.open(opts.out, key, n_layers, opts.resume) if rank == 0 else (NoRun(n_layers), None)
    if note:
        report.notes.append(note)
    from infer_tool.jobs.quantize_run import kv_scales_of, kv_tensors, run_layers, write_output

    try:
        result, evaluated, stats_meta = run_layers(lm, arch, loaded, run, opts, scheme, fmt, store_dtype, calib_ids,
                                                   eval_ids, dev, progress, seconds, spill_note is not None)
        seconds["quantize"] -= seconds.get("stream.eval_layers", 0.0)
        if stats_meta is None:
            report.calibration = Calibration(result.tokens, opts.calib, opts.num_samples, opts.seq_len, opts.seed,
                                             world_size=world_size, samples_per_process=result.samples_per_process)
        else:
            meta = stats_meta
            if meta.get("model_path") not in (None, str(loaded.path)):
                report.notes.append(f"statistics were calibrated on {meta.get('model')} ({meta.get('model_path')})")
            report.calibration = Calibration(result.tokens, meta.get("calib"), meta.get("num_samples"), meta.get("seq_len"),
                                             meta.get("seed"), from_stats=opts.stats, note=STATS_NOTE)
        kv_scales = kv_scales_of(result.kv_amax)
        if evaluated is not None:
            before, cache_use, after = evaluated
            report.eval = EvalSummary(opts.eval, after.tokens, after.seq_len, after.windows, before.ppl, after.ppl,
                                      after.ppl / before.ppl, EVALUATED[scheme.kind], cache_use.hit)
            if note := cache_use.note("ppl before (the fp baseline)"):
                report.notes.append(note)
            if opts.max_ppl_increase is not None:
                increase = after.ppl / before.ppl - 1.0
                report.quality_gate = QualityGate(opts.max_ppl_increase, increase, increase <= opts.max_ppl_increase)

        report.quantized_layers = len(result.quantized)
        report.ignored = result.ignored
        report.layer_errors, report.linear_errors, report.fallbacks = result.layer_errors, result.linear_errors, result.fallbacks
        report.method_report = result.method_report
        if result.kv_amax:
            report.kv_cache_scales = {n: {"k_scale": k, "v_scale": v} for n, (k, v) in kv_scales.items()}
        report.notes += quantizer.notes(result, scheme)
        report.moe = moe_summary(result, opts)
        if report.moe is None and (opts.moe_calibration or opts.moe_min_tokens is not None):
            report.notes.append(f"--moe-calibration / --moe-min-tokens have no effect: {lm.config.model_type} has no MoE layer")
        report.memory = {**peak_memory(torch.device(dev)), **estimate.to_dict()}
        report.seconds = seconds
        t = time.perf_counter()
        if rank == 0:
            write_output(run, lm, result.quantized, fmt, scheme, opts, loaded.path, overwrite, store_dtype,
                         extra_files={REPORT_NAME: _to_json(report)}, extra_tensors=kv_tensors(result.kv_amax, fmt.name),
                         rename=arch.checkpoint_name, unquantized=routers(lm, arch))
    except BadInput:
        run.remove()  # the input must change: nothing to resume
        raise
    except BaseException as e:
        if world_size > 1:
            run.remove()  # a run across processes does not resume
        elif run.path.exists():
            e.__notes__ = [*getattr(e, "__notes__", []), resume_hint(run)]
        raise
    seconds["write"] = time.perf_counter() - t
    seconds["total"] = time.perf_counter() - t_start
    report.memory = {**peak_memory(torch.device(dev)), **estimate.to_dict()}
    if rank == 0:
        (Path(opts.out) / REPORT_NAME).write_text(_to_json(report))  # the final timings, write included
    finish()  # the other processes wait until the checkpoint is written
    return report


def resume_hint(run: Any) -> str:
    return (f"progress is kept in {run.path} ({run.layers_done} of {run.state['layers']} layers finished); "
            "run the same command with --resume to continue")


def check_patterns(patterns: tuple[str, ...]) -> None:
    """Refuse an `re:` pattern that is not a regular expression."""
    import re

    for p in patterns:
        if p.startswith("re:"):
            try:
                re.compile(p[3:])
            except re.error as e:
                raise BadInput(f"--ignore {p!r} is not a valid regular expression: {e}") from None


def ignored_linears(model: Any, arch: Any, names: list[str]) -> list[str]:
    from infer_tool.calib.layers import linear_shapes

    return sorted(set(linear_shapes(model, arch)) - set(names))


def unmatched_patterns(patterns: tuple[str, ...], linears: list[str]) -> list[str]:
    """The `--ignore` patterns that match none of `linears`."""
    from infer_tool.calib.layers import matches

    return [p for p in patterns if not any(matches(n, (p,)) for n in linears)]


def checkpoint_dtype(requested: str, model_dir: Path) -> str:
    """`--dtype`, with auto resolved to the source config's dtype (float32 when it names none)."""
    if requested != "auto":
        return requested
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    from infer_tool.schemes.base import SCALE_DTYPES

    name = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
    return name if name in SCALE_DTYPES else "float32"


def round_to(model: Any, dtype: Any) -> None:
    """Round every floating parameter to `dtype`'s values (kept in the compute dtype), so
    calibration, evaluation and the written checkpoint all see the weights as stored."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.copy_(p.to(dtype).to(p.dtype))


def _to_json(report: QuantizeReport) -> str:
    return to_json(report) + "\n"
