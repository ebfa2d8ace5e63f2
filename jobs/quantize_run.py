"""The quantize job once its options are checked: open the model (`open_job` -> `QuantizeJob`),
run the layer loop with the --eval scores (`run_layers` -> `LayersRun`), build the report
from the run (`report_of`) and write the checkpoint (`run_job`).

1. The model is opened (streamed: its weights stay in the files), its weights rounded to the
   checkpoint dtype, planned, the memory estimate checked, the text tokenized; the progress
   directory beside --out is opened (or resumed).
2. The tensors outside the decoder layers are loaded (streamed: read from the files) and
   written as the run's first part; the calibration batch and the --eval windows go
   through the embeddings (capture); then those tensors are freed.
3. The pipeline runs layer by layer with `jobs/layer_stream.LayerStream` around each layer.
4. With --eval, the head scores the windows' fp and quantized hidden states.
5. The parts become the checkpoint (`packers/checkpoint_parts.write_from_parts`) with its
   report, renamed into place; then the progress directory is removed.
"""

from __future__ import annotations

import json
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from infer_tool.calib.architectures import Architecture
from infer_tool.calib.corpora import calibration_batch, load_text, tokenize
from infer_tool.calib.distributed import finish, stop_on_sigterm, world
from infer_tool.calib.layers import capture_inputs, decoder_layers, linear_shapes, matches, peak_memory
from infer_tool.calib.models import LoadedModel
from infer_tool.calib.moe import routers
from infer_tool.calib.pipeline import plan, quantize_from_stats, quantize_model
from infer_tool.calib.quantizers import quantizer_for
from infer_tool.calib.recipe import STATS_NOTE, QuantizeOptions, to_dict
from infer_tool.calib.result import PipelineResult
from infer_tool.calib.stats import load_stats
from infer_tool.calib.streaming import open_model
from infer_tool.common.device import pick_device
from infer_tool.common.errors import BadInput
from infer_tool.common.jsonout import to_json
from infer_tool.common.progress import Progress
from infer_tool.common.sizes import parse_size
from infer_tool.evals.ppl import PplResult, make_windows
from infer_tool.evals.ppl_cache import CacheUse, has_hidden, hidden_path, load_hidden, store_hidden, stored
from infer_tool.formats.registry import format_of_kind
from infer_tool.jobs import preflight
from infer_tool.jobs.baseline import from_state, lookup, to_state
from infer_tool.jobs.layer_stream import EvalStreams, LayerStream, StreamedWeights, kld_of_streams, ppl_of_streams
from infer_tool.jobs.moe_report import moe_calibration, moe_summary
from infer_tool.jobs.quantize_report import (
    Calibration,
    EvalSummary,
    KldGate,
    QualityGate,
    QuantizeReport,
)
from infer_tool.jobs.run_dir import REST, NoRun, RunDir, model_fingerprint, run_key
from infer_tool.packers.checkpoint import REPORT_NAME, CheckpointFormat, checkpoint_tensors
from infer_tool.packers.checkpoint_parts import write_from_parts
from infer_tool.packers.codecs.fp8_formats import kv_scale_tensors
from infer_tool.packers.fp8 import scale_from_amax
from infer_tool.schemes.base import SCALE_DTYPES, Scheme

# Options that do not change the checkpoint: a resumed run may differ in them.
UNKEYED_OPTIONS = ("out", "resume", "stream", "max_shard_size", "max_memory", "model_free", "default_ignore")


@dataclass(kw_only=True)
class QuantizeJob:
    """A quantize run with its model open and planned: what the layer loop, the report and
    the writer read. `notes` and `seconds` fill as the run goes."""

    opts: QuantizeOptions
    loaded: LoadedModel
    arch: Architecture
    scheme: Scheme  # with scales rounded to what the checkpoint stores
    fmt: CheckpointFormat
    dtype: str  # the checkpoint dtype of unquantized tensors (and INT scales)
    device: str
    estimate: preflight.MemoryEstimate
    unmatched: list[str]  # --ignore patterns that match no linear
    calib_ids: torch.Tensor | None  # (B, T) calibration tokens; None with --stats or --no-layer-error
    eval_ids: torch.Tensor | None  # (E,) --eval tokens
    spill: bool  # GPTQ's replayed activations go to a file in the run directory
    run: RunDir  # the progress beside --out (NoRun on processes other than 0)
    rank: int
    world_size: int
    started: float  # perf_counter() when the job began
    overwrite: bool
    recipe: str | None
    progress: Progress
    notes: list[str]
    seconds: dict[str, float]

    @property
    def model(self) -> nn.Module:
        return self.loaded.model

    @property
    def store_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass
class Evaluated:
    """--eval's scores: the fp baseline (measured or from the ppl cache, `cache_use`) and the
    quantized model's; with --kld, the KL divergence of the quantized model from the fp one
    (`evals.kld.KldResult`), or None with a note saying why it was not computed."""

    before: PplResult
    cache_use: CacheUse
    after: PplResult
    kld: Any = None
    notes: list[str] = field(default_factory=list)


@dataclass
class LayersRun:
    """What `run_layers` returns."""

    result: PipelineResult
    evaluated: Evaluated | None  # None without --eval
    stats_meta: dict[str, Any] | None  # with --stats: what the saved statistics were measured on


def open_job(
    opts: QuantizeOptions,
    scheme: Scheme,
    fmt: CheckpointFormat,
    *,
    started: float,
    overwrite: bool,
    recipe: str | None,
    progress: Progress,
) -> QuantizeJob:
    """Step 1 (module docstring): everything `run_job` needs, checked before any layer runs."""
    dev = pick_device(opts.device or "auto")
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    loaded = open_model(
        opts.model, stream=opts.stream, allow_pickle=opts.allow_pickle, trust_remote_code=opts.trust_remote_code
    )
    seconds["load"] = time.perf_counter() - t
    lm = loaded.model
    dtype_name = checkpoint_dtype(opts.dtype, loaded.path)
    if dtype_name != "float32" and loaded.stream_plan is None:
        round_to(lm, getattr(torch, dtype_name))  # a streamed model is rounded as each tensor is read
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
    estimate, spill_note = preflight.plan(lm, arch, loaded, opts, quantizer_for(scheme).needs(scheme), dev)
    eval_ids = tokenize(load_text(opts.eval), loaded.tokenizer, opts.eval_tokens) if opts.eval is not None else None
    calib_ids = None  # with --stats, or data-free with --no-layer-error: no calibration text
    if opts.stats is None and opts.layer_error:
        calib_ids = calibration_batch(loaded.tokenizer, opts.calib, opts.num_samples, opts.seq_len, opts.seed)
    notes = list(loaded.notes)
    if unmatched:
        notes.append(f"--ignore patterns that match no linear: {', '.join(unmatched)}")
    if spill_note:
        notes.append(spill_note)
    key = run_key(
        {
            "model": model_fingerprint(loaded.path),
            "device": torch.device(dev).type,
            "calib_ids": calib_ids,
            "eval_ids": eval_ids,
            "torch": torch.__version__,
            "options": {k: v for k, v in to_dict(opts).items() if k not in UNKEYED_OPTIONS},
        }
    )
    rank, world_size = world()
    if world_size > 1:
        stop_on_sigterm()  # under several processes only process 0 keeps progress (and --resume is refused)
    n_layers = len(decoder_layers(lm, arch))
    run, note = RunDir.open(opts.out, key, n_layers, opts.resume) if rank == 0 else (NoRun(n_layers), None)
    if note:
        notes.append(note)
    return QuantizeJob(
        opts=opts,
        loaded=loaded,
        arch=arch,
        scheme=scheme,
        fmt=fmt,
        dtype=dtype_name,
        device=dev,
        estimate=estimate,
        unmatched=unmatched,
        calib_ids=calib_ids,
        eval_ids=eval_ids,
        spill=spill_note is not None,
        run=run,
        rank=rank,
        world_size=world_size,
        started=started,
        overwrite=overwrite,
        recipe=recipe,
        progress=progress,
        notes=notes,
        seconds=seconds,
    )


def run_job(job: QuantizeJob) -> QuantizeReport:
    """Steps 2-5: the layer loop, the report, the checkpoint (process 0 writes it); the report
    is written again at the end with the final timings. A failure of a one-process run keeps
    the finished layers for --resume and says so (a BadInput before the first layer finished
    removes the progress: nothing in it is worth keeping)."""
    seconds, run = job.seconds, job.run
    try:
        ran = run_layers(job)
        seconds["quantize"] -= seconds.get("stream.eval_layers", 0.0)
        report = report_of(job, ran)
        t = time.perf_counter()
        if job.rank == 0:
            write_output(job, ran.result, _to_json(report))
    except BadInput as e:
        if run.layers_done == 0 or job.world_size > 1:
            run.remove()  # nothing finished worth keeping (or a run across processes, which does not resume)
            raise
        raise BadInput(
            f"{e}; progress is kept in {run.path} ({run.layers_done} of {run.state['layers']} layers finished): "
            "--resume continues it if what is mended is not the model, the options or the text; else delete it"
        ) from None
    except BaseException as e:
        if job.world_size > 1:
            run.remove()  # a run across processes does not resume
        elif run.path.exists():
            e.__notes__ = [*getattr(e, "__notes__", []), resume_hint(run)]
        raise
    seconds["write"] = time.perf_counter() - t
    seconds["total"] = time.perf_counter() - job.started
    report.memory = {**peak_memory(torch.device(job.device)), **job.estimate.to_dict()}
    if job.rank == 0:
        (Path(job.opts.out) / REPORT_NAME).write_text(_to_json(report))  # the final timings, write included
    finish()  # the other processes wait until the checkpoint is written
    return report


def report_of(job: QuantizeJob, ran: LayersRun) -> QuantizeReport:
    """The report of a finished layer loop (its `seconds` is the job's, still filling)."""
    opts, scheme, result, lm = job.opts, job.scheme, ran.result, job.model
    notes = list(job.notes)
    if job.calib_ids is None and ran.stats_meta is None:  # --no-layer-error on a data-free scheme
        calibration = None
        notes.append("no calibration text read and no layer errors measured (--no-layer-error, a data-free scheme)")
    elif ran.stats_meta is None:
        calibration = Calibration(
            tokens=result.tokens,
            corpus=opts.calib,
            num_samples=opts.num_samples,
            seq_len=opts.seq_len,
            seed=opts.seed,
            world_size=job.world_size,
            samples_per_process=result.samples_per_process,
        )
    else:
        meta = ran.stats_meta
        if meta.get("model_path") not in (None, str(job.loaded.path)):
            notes.append(f"statistics were calibrated on {meta.get('model')} ({meta.get('model_path')})")
        calibration = Calibration(
            tokens=result.tokens,
            corpus=meta.get("calib"),
            num_samples=meta.get("num_samples"),
            seq_len=meta.get("seq_len"),
            seed=meta.get("seed"),
            from_stats=opts.stats,
            note=STATS_NOTE,
        )
    summary, gate, kld_gate = None, None, None
    if ran.evaluated is not None:
        before, cache_use, after = ran.evaluated.before, ran.evaluated.cache_use, ran.evaluated.after
        kld = ran.evaluated.kld
        runtime = format_of_kind(scheme.kind).runtime()
        summary = EvalSummary(
            corpus=opts.eval,
            tokens=after.tokens,
            seq_len=after.seq_len,
            windows=after.windows,
            ppl_before=before.ppl,
            ppl_after=after.ppl,
            ratio=after.ppl / before.ppl,
            evaluated=runtime.evaluated(scheme, opts.eval_activations),
            activations=runtime.eval_activations(
                scheme, opts.eval_activations, result.quantized, torch.device(job.device).type
            ),
            ppl_before_cached=cache_use.hit,
            kld=None if kld is None else kld.to_dict(),
        )
        if note := cache_use.note("ppl before (the fp baseline)"):
            notes.append(note)
        notes += ran.evaluated.notes
        if opts.max_ppl_increase is not None:
            increase = after.ppl / before.ppl - 1.0
            gate = QualityGate(opts.max_ppl_increase, increase, increase <= opts.max_ppl_increase)
        if opts.max_kld is not None:
            # no measurement (the cached fp hidden states vanished) fails the gate: it cannot be shown to hold
            mean = None if kld is None else kld.kld.mean.mean
            kld_gate = KldGate(opts.max_kld, mean, mean is not None and mean <= opts.max_kld)
    kv_cache_scales = None
    if result.kv_amax:
        kv_cache_scales = {n: {"k_scale": k, "v_scale": v} for n, (k, v) in kv_scales_of(result.kv_amax).items()}
    notes += quantizer_for(scheme).notes(result, scheme)
    moe = moe_summary(result, opts)
    if moe is None and (opts.moe_calibration or opts.moe_min_tokens is not None):
        notes.append(f"--moe-calibration / --moe-min-tokens have no effect: {lm.config.model_type} has no MoE layer")
    return QuantizeReport(
        model=opts.model,
        model_path=str(job.loaded.path),
        model_type=lm.config.model_type,
        method=scheme.method,
        scheme=scheme.to_dict(),
        scheme_description=scheme.describe(),
        format=job.fmt.name,
        dtype=job.dtype,
        out=opts.out,
        device=job.device,
        recipe=job.recipe,
        options=to_dict(opts),
        notes=notes,
        calibration=calibration,
        eval=summary,
        quality_gate=gate,
        kld_gate=kld_gate,
        quantized_layers=len(result.quantized),
        ignored=result.ignored,
        unmatched_ignore=job.unmatched,
        layer_errors=result.layer_errors,
        linear_errors=result.linear_errors,
        fallbacks=result.fallbacks,
        method_report=result.method_report,
        kv_cache_scales=kv_cache_scales,
        moe=moe,
        memory={**peak_memory(torch.device(job.device)), **job.estimate.to_dict()},
        seconds=job.seconds,
    )


def _labelled(progress: Progress, label: str) -> Progress:
    return lambda task, done, total, **info: progress(label, done, total, **info)


def as_deployed(
    module: nn.Module,
    quantized: dict[str, Any],
    scheme: Any,
    kv_scales: dict[str, tuple[float, float]],
    activations: str = "auto",
    device_type: str = "cpu",
) -> AbstractContextManager:
    """Where `--eval` measures ppl after quantizing (names relative to `module`): the model run
    as its number format is deployed (`formats/<format>/deployed.py`)."""
    runtime = format_of_kind(scheme.kind).runtime()
    return runtime.as_deployed(module, quantized, scheme, kv_scales, activations, device_type)


def kv_scales_of(kv_amax: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """{attention name: (k_scale, v_scale)} from the calibrated KV amax."""

    def s(amax: float) -> float:
        return float(scale_from_amax(torch.tensor(amax)))

    return {n: (s(a.k_amax), s(a.v_amax)) for n, a in kv_amax.items()}


def kv_tensors(kv_amax: dict[str, Any], fmt_name: str) -> dict[str, Any] | None:
    """The k_scale / v_scale tensors to store, or None without a calibrated KV cache."""
    if not kv_amax:
        return None
    return kv_scale_tensors(kv_amax, fmt_name)


def run_layers(job: QuantizeJob) -> LayersRun:
    """Steps 2-4 (module docstring). The fp baseline comes from the ppl cache when this model,
    text and window protocol were evaluated before (`jobs/baseline.py`); its windows then
    skip the fp layers. With `job.spill`, GPTQ's replayed activations go to a file in the run
    directory (`jobs/preflight.plan` decides; a process without one keeps them in memory)."""
    lm, arch, run, opts, scheme, fmt, seconds = job.model, job.arch, job.run, job.opts, job.scheme, job.fmt, job.seconds
    store_dtype, eval_ids, progress = job.store_dtype, job.eval_ids, job.progress
    device = torch.device(job.device)
    layers = decoder_layers(lm, arch)
    weights = None
    if job.loaded.stream_plan is not None:
        round_dtype = None if store_dtype == torch.float32 else store_dtype
        weights = StreamedWeights(lm, job.loaded.files, job.loaded.stream_plan, round_dtype)
        weights.load(weights.names(None, arch.layers), torch.device("cpu"))  # the capture runs on the CPU, as before

    def part_tensors(prefix: str | None, quantized: dict[str, Any]) -> dict[str, torch.Tensor]:
        if prefix is None:
            return checkpoint_tensors(
                lm, {}, fmt, dtype=store_dtype, within=lambda n: not n.startswith(f"{arch.layers}.")
            )
        fmt.check(scheme, quantized)
        return checkpoint_tensors(lm, quantized, fmt, dtype=store_dtype, within=lambda n: n.startswith(f"{prefix}."))

    def read_part(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        return fmt.read(tensors, fmt.config(scheme, []))

    def deployed(layer: nn.Module, prefix: str, result: Any) -> AbstractContextManager:
        strip = len(prefix) + 1
        mine = {n[strip:]: w for n, w in result.quantized.items() if n.startswith(f"{prefix}.")}
        kv = {n[strip:]: s for n, s in kv_scales_of(result.kv_amax).items() if n.startswith(f"{prefix}.")}
        return as_deployed(layer, mine, scheme, kv, opts.eval_activations, device.type)

    evals = None
    seq_len = 0
    ident, baseline = None, None  # the ppl cache's key; (PplResult, CacheUse) of the fp baseline when known
    baseline_use = CacheUse(False, None)
    hidden = None  # --kld with a cached baseline: the entry whose fp final hidden states stand in for the fp pass
    eval_notes: list[str] = []
    if eval_ids is not None:
        context = getattr(lm.config, "max_position_embeddings", None)
        seq_len = min(opts.eval_seq_len, context or opts.eval_seq_len)
        windows = torch.stack([eval_ids[w.begin : w.end] for w in make_windows(eval_ids.numel(), seq_len)])
        if run.state.get("baseline") is not None:
            baseline = from_state(run.state["baseline"])
        elif run.layers_done == 0:
            t = time.perf_counter()
            ident, cached, use = lookup(lm, weights, arch.layers, eval_ids, seq_len, device=device, corpus=opts.eval)
            seconds["eval_cache_lookup"] = time.perf_counter() - t
            baseline = (cached, use) if cached is not None else None
            if baseline is not None:
                run.remember("baseline", to_state(cached, use))
            elif use.skipped:
                baseline_use = use
        if baseline is not None and opts.kld:
            hidden = Path(baseline[1].path)  # its fp hidden states stand in for the fp pass, when kept
        if run.layers_done == 0:  # whether the fp windows go through the layers: kept for a resumed run
            run.remember("eval_fp", baseline is None or (hidden is not None and not has_hidden(hidden, len(windows))))
        X, calls = capture_inputs(lm, arch, windows, 1, device)
        evals = EvalStreams(calls, X if run.state["eval_fp"] else None, list(X))
    stream = LayerStream(
        lm,
        arch.layers,
        run,
        part_tensors=part_tensors,
        read_part=read_part,
        weights=weights,
        evals=evals,
        deployed=deployed,
        trim_above=job.estimate.host,  # the memory the run was planned with
    )
    stream.write_rest()
    t = time.perf_counter()
    meta = None
    if job.calib_ids is None:
        stream.release_rest()  # no capture: the tensors outside the layers are not needed
    if opts.stats is not None:
        saved, meta = load_stats(Path(opts.stats))
        result = quantize_from_stats(
            lm, saved, scheme, ignore=opts.ignore, device=job.device, progress=progress, layer_io=stream
        )
    else:
        result = quantize_model(
            lm,
            job.calib_ids,
            scheme,
            ignore=opts.ignore,
            device=job.device,
            moe=moe_calibration(opts),
            progress=progress,
            layer_io=stream,
            spill=run.path if job.spill and run.path.is_dir() else None,
        )
    seconds["quantize"] = time.perf_counter() - t
    seconds.update({f"quantize.{k}": v for k, v in result.seconds.items()})
    seconds.update({f"stream.{k}": v for k, v in stream.seconds_spent.items()})
    if evals is None:
        return LayersRun(result, None, meta)
    t = time.perf_counter()
    if weights is not None:
        weights.load(weights.names(None, arch.layers), torch.device("cpu"))
    kld = None
    try:
        reference = evals.fp
        if reference is None and hidden is not None:
            reference = load_hidden(hidden, len(evals.q))
            if reference is None:
                eval_notes.append(
                    f"KL divergence not computed: the fp hidden states cached at {hidden_path(hidden)} "
                    "could not be read (deleted during the run?)"
                )
        if opts.kld and reference is not None:
            kld, before, after = kld_of_streams(
                lm,
                layers,
                eval_ids,
                seq_len,
                ref_outputs=reference,
                outputs=evals.q,
                device=device,
                progress=_labelled(progress, "kl divergence"),
            )
        else:
            if baseline is None:
                before = ppl_of_streams(
                    lm, layers, eval_ids, seq_len, evals.fp, device, progress=_labelled(progress, "ppl before")
                )
            after = ppl_of_streams(
                lm, layers, eval_ids, seq_len, evals.q, device, progress=_labelled(progress, "ppl after")
            )
        if baseline is None:
            baseline = (before, stored(ident, before) if ident is not None else baseline_use)
        entry = baseline[1].path
        if opts.kld and evals.fp is not None and entry is not None:  # keep the fp hidden states beside the ppl
            refused = store_hidden(Path(entry), evals.fp)
            if refused:
                eval_notes.append(
                    f"the fp hidden states were not cached ({refused}): a later run's KL divergence "
                    "needs the fp pass again"
                )
    finally:
        if weights is not None:
            weights.release(weights.names(None, arch.layers))
    seconds["eval"] = time.perf_counter() - t + seconds.get("stream.eval_layers", 0.0)
    return LayersRun(result, Evaluated(*baseline, after, kld, eval_notes), meta)


def write_output(job: QuantizeJob, result: PipelineResult, report_json: str) -> None:
    """Step 5: the checkpoint from the run's parts, with `report_json` as its report, renamed to
    --out; the progress removed."""
    run, opts, lm, arch = job.run, job.opts, job.model, job.arch
    parts = [run.file(REST)] + [run.layer_file(i) for i in range(run.state["layers"])]
    write_from_parts(
        parts,
        opts.out,
        lm,
        result.quantized,
        job.fmt.name,
        job.scheme,
        dtype=job.store_dtype,
        tmp=run.file("checkpoint"),
        src_dir=job.loaded.path,
        overwrite=job.overwrite,
        extra_files={REPORT_NAME: report_json},
        extra_tensors=kv_tensors(result.kv_amax, job.fmt.name),
        max_shard_bytes=parse_size(opts.max_shard_size, "--max-shard-size"),
        rename=arch.checkpoint_name,
        unquantized=routers(lm, arch),
    )
    run.remove()


def resume_hint(run: RunDir) -> str:
    return (
        f"progress is kept in {run.path} ({run.layers_done} of {run.state['layers']} layers finished); "
        "run the same command with --resume to continue"
    )


def ignored_linears(model: nn.Module, arch: Architecture, names: list[str]) -> list[str]:
    return sorted(set(linear_shapes(model, arch)) - set(names))


def unmatched_patterns(patterns: tuple[str, ...], linears: list[str]) -> list[str]:
    """The `--ignore` patterns that match none of `linears`."""
    return [p for p in patterns if not any(matches(n, (p,)) for n in linears)]


def checkpoint_dtype(requested: str, model_dir: Path) -> str:
    """`--dtype`, with auto resolved to the source config's dtype (float32 when it names none)."""
    if requested != "auto":
        return requested
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    name = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
    return name if name in SCALE_DTYPES else "float32"


def round_to(model: nn.Module, dtype: torch.dtype) -> None:
    """Round every floating parameter to `dtype`'s values (kept in the compute dtype), so
    calibration, evaluation and the written checkpoint all see the weights as stored."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.copy_(p.to(dtype).to(p.dtype))


def _to_json(report: QuantizeReport) -> str:
    return to_json(report) + "\n"
