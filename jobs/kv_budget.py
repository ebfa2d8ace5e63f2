"""The kv-budget job as a library call: `plan(PlanRequest) -> Report`.

`PlanRequest` declares every option once, with its default (None where vLLM's release or
`vllm serve` decides); the CLI only parses text into it. What a GPU keeps beside weights
and KV cache is vLLM's start-up profile for the chosen release (`sizing.vllm_memory`),
unless `reserve_bytes` gives a flat figure. Not fitting is an answer: every requested row
comes back with `fits` and, when false, what binds (the weights alone, or the KV cache at
that context x concurrency) and the smallest deployment on the same GPU that would serve
the largest failing row.

Also here, built on `plan`: `replay_log` (a vLLM start-up log, `sizing.vllm_log`, replayed
with its own settings and compared term by term), `reach_target` (the engine arguments that
serve a concurrency x context target), and speculative decoding's drafter
(`PlanRequest.speculative_config`, `sizing.speculative`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

from infer_tool.common.errors import BadInput
from infer_tool.sizing import capacity, kv, roofline, solve, vllm_kv
from infer_tool.sizing.defaults import (
    DEFAULT_ACCOUNTING,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CONCURRENCY,
    DEFAULT_GPU,
    DEFAULT_OUTPUT_LEN,
    VLLM_VERSION,
)
from infer_tool.sizing.fit import Fit, FitRow
from infer_tool.sizing.hf_config import STATE_DTYPE_BYTES
from infer_tool.sizing.kv import ceil_div
from infer_tool.sizing.presets import GpuPreset, gpu_preset, gpu_presets
from infer_tool.sizing.resolve import ResolvedModel, resolve_model
from infer_tool.sizing.shape import FULL, MLA, SLIDING, STATE, ModelShape
from infer_tool.sizing.speculative import SpeculativeConfig
from infer_tool.sizing.units import human_size
from infer_tool.sizing.vllm_memory import MemoryProfile
from infer_tool.sizing.vllm_versions import policy
from infer_tool.sizing.weights import weight_bytes

MODEL_RUNNERS = ("v1", "v2")
DEFAULT_CONTEXT_START = 4096
DEFAULT_CONTEXT_END = 131072  # when the model states no max_position_embeddings


@dataclass(frozen=True)
class PlanRequest:
    """Everything `kv-budget` can be asked (sizes in bytes, lengths in tokens)."""

    model: str
    gpu: str = DEFAULT_GPU
    gpu_mem_bytes: int | None = None  # instead of a preset
    gpu_compute_capability: str = ""  # of a --gpu-mem device ("9.0", "gfx942"); "" = unknown
    num_gpus: int | None = None  # default tp x pp; extra GPUs are data-parallel replicas
    tp: int | None = None  # default num_gpus / pp
    pp: int = 1
    mem_util: float | None = None  # None: the vLLM release's --gpu-memory-utilization default
    weights: str | None = None  # None: the files' real bytes if any, else bf16
    weights_per_gpu_bytes: int | None = None  # as vLLM logs "Model loading took" (overrides the split)
    group_size: int = 128
    kv_dtype: str = "bf16"
    block_size: int = DEFAULT_BLOCK_SIZE
    contexts: tuple[int, ...] | None = None  # None: 4K doubling to max_position_embeddings
    concurrencies: tuple[int, ...] = DEFAULT_CONCURRENCY
    shared_prefix: int = 0
    reserve_bytes: int | None = None  # None: vLLM's start-up profile, modelled
    kv_cache_memory_bytes: int | None = None  # like vLLM --kv-cache-memory-bytes
    accounting: str = DEFAULT_ACCOUNTING
    vllm_version: str = VLLM_VERSION
    max_num_batched_tokens: int | None = None  # None: vllm serve's default for the GPU
    max_num_seqs: int | None = None  # None: vllm serve's default for the GPU
    enforce_eager: bool = False
    cudagraph_capture_sizes: tuple[int, ...] | None = None  # None: vLLM's default list
    max_cudagraph_capture_size: int | None = None
    mamba_ssm_cache_dtype: str | None = None  # None: the config hook's (vLLM's "auto")
    model_runner: str | None = None  # "v1" / "v2"; None: the release's default for the model
    async_scheduling: bool | None = None  # None: the release's default
    prefix_caching: bool = True
    prompt_len: int | None = None  # None: the row's context less the output
    output_len: int = DEFAULT_OUTPUT_LEN
    spec: roofline.Speculation | None = None
    speculative_config: SpeculativeConfig | None = None  # vLLM's --speculative-config (memory)
    efficiency: roofline.Efficiency = roofline.Efficiency()
    solve: bool = False
    solve_gpus: tuple[str, ...] | None = None  # None: every preset
    max_tpot_s: float | None = None
    max_ttft_s: float | None = None


@dataclass
class ReportRow:
    context: int
    concurrency: int
    fit: FitRow
    speed: roofline.StepTimes | None


@dataclass
class Report:
    request: PlanRequest
    resolved: ResolvedModel
    gpu: GpuPreset
    fit: Fit
    engine: vllm_kv.EngineArgs
    weights_total: int
    weights_how: str
    weights_from_files: bool
    rows: list[ReportRow]
    max_concurrency: dict[int, int]
    max_context: dict[int, tuple[int, str]]
    notes: list[str] = field(default_factory=list)
    drafter: Drafter | None = None  # speculative decoding's memory, with --speculative-config
    # smallest deployment on the same GPU for the smallest and the largest failing row
    fixes: list[tuple[solve.Target, solve.Candidate | None]] = field(default_factory=list)
    solutions: list[solve.Candidate] = field(default_factory=list)
    solve_target: solve.Target | None = None

    @property
    def shape(self) -> ModelShape:
        return self.fit.shape

    @property
    def profiles(self) -> list[MemoryProfile] | None:
        """vLLM's start-up profile per pipeline stage (None with a flat --reserve)."""
        return self.fit.profiles

    @property
    def all_fit(self) -> bool:
        return all(r.fit.fits for r in self.rows)


@dataclass(frozen=True)
class Drafter:
    """What --speculative-config adds per GPU: the drafter's weights, its KV layers (added
    to the model's block tables) and the lookahead slots each request reserves."""

    method: str
    k: int
    source: str  # where the drafter's shape came from
    layers: int  # attention layers added to the KV cache
    kv_bytes_per_token: int  # all GPUs of a replica together
    weight_bytes_per_gpu: int
    weights_how: str
    lookahead_tokens: int


def _drafter(
    req: PlanRequest, resolved: ResolvedModel, shape: ModelShape, tp: int, pp: int
) -> tuple[ModelShape, Drafter, list[str]]:
    """The target shape with the drafter's KV layers appended, and what the drafter adds."""
    sc = req.speculative_config
    assert sc is not None
    notes: list[str] = []
    kv_kinds = (FULL, SLIDING, MLA)
    if sc.method == "mtp":
        if shape.mtp_layers < 1:
            raise BadInput(
                f"--speculative-config method 'mtp': {shape.name}'s config has no num_nextn_predict_layers / "
                "mtp_num_hidden_layers (it carries no MTP layers)"
            )
        last = next(l for l in reversed(shape.layers) if l.kind in kv_kinds)
        added = (last,) * shape.mtp_layers
        source = f"{shape.mtp_layers} MTP layer(s) of {shape.name} (its last attention layer's shape)"
        if resolved.file_weight_bytes is not None and req.weights is None:
            wbytes, how = 0, "in the target's checkpoint (counted with its weights)"
        elif shape.params is not None:
            per_layer = (shape.params.total - shape.params.tied_head) // max(1, shape.num_layers)
            wbytes = shape.mtp_layers * (per_layer + 2 * shape.hidden_size * shape.hidden_size) * 2
            how = "one decoder layer + the 2h x h projection per MTP layer, 16-bit (estimated)"
        else:
            wbytes, how = 0, "unknown (parameter count unknown)"
        dtp = tp
    elif sc.method in ("ngram", "suffix", "medusa", "ngram_gpu"):
        added, source, wbytes, how, dtp = (), f"method {sc.method!r} (no drafter KV)", 0, "none", tp
        if sc.method == "medusa":
            notes.append("--speculative-config medusa: the Medusa heads' weights are not counted")
    else:
        assert sc.model is not None
        draft = resolve_model(sc.model)
        added = tuple(l for l in draft.shape.layers if l.kind in kv_kinds)
        if any(l.kind == STATE for l in draft.shape.layers):
            notes.append("the drafter's recurrent-state layers are not added to the KV cache")
        source = f"{sc.model} ({len(added)} attention layer(s))"
        if draft.file_weight_bytes is not None:
            wbytes, how = draft.file_weight_bytes, f"the drafter's files: {draft.file_weight_note}"
        elif draft.shape.params is not None:
            wb = weight_bytes(draft.shape.params, "bf16", req.group_size)
            wbytes, how = wb.total, f"the drafter's config, {wb.how}"
        else:
            wbytes, how = 0, "unknown (the drafter's parameter count is unknown)"
        dtp = sc.draft_tensor_parallel_size or tp
        if dtp not in (1, tp):
            raise BadInput(f"--speculative-config draft_tensor_parallel_size {dtp} must be 1 or --tp {tp}")
        for l in added:
            if l.kv_heads and l.kv_heads % dtp and dtp % l.kv_heads:
                raise BadInput(
                    f"draft_tensor_parallel_size {dtp} neither divides nor is a multiple of the drafter's "
                    f"{l.kv_heads} KV heads"
                )
    if pp > 1 and added:
        notes.append("the drafter's KV layers are split over the pipeline stages here; vLLM keeps them on the last")
    from infer_tool.sizing.kv import token_bytes

    kv = kv_dtype_of(req)
    per_token = sum(token_bytes(l, kv, tp) * tp for l in added if l.kind != SLIDING)
    notes.append(
        f"speculative decoding ({sc.method}, k={sc.num_speculative_tokens}): the drafter's activations in vLLM's "
        "profile run are not added"
    )
    out = replace(shape, layers=shape.layers + added)
    per_gpu = ceil_div(wbytes, dtp)
    return (
        out,
        Drafter(sc.method, sc.num_speculative_tokens, source, len(added), per_token, per_gpu, how, sc.lookahead_tokens),
        notes,
    )


def kv_dtype_of(req: PlanRequest) -> kv.KvDtype:
    return kv.kv_dtype(req.kv_dtype)


def resolve_gpu(req: PlanRequest) -> GpuPreset:
    if req.gpu_mem_bytes is not None:  # the total as CUDA reports it, given by the user
        return GpuPreset(
            "custom",
            f"custom {req.gpu_mem_bytes / 2**30:g} GiB",
            req.gpu_mem_bytes,
            "--gpu-mem",
            cuda_memory_bytes=req.gpu_mem_bytes,
            cuda_source="--gpu-mem",
            compute_capability=req.gpu_compute_capability,
        )
    return gpu_preset(req.gpu)


def default_contexts(limit: int | None) -> tuple[int, ...]:
    end = limit or DEFAULT_CONTEXT_END
    out, v = [], min(DEFAULT_CONTEXT_START, end)
    while v < end:
        out.append(v)
        v *= 2
    return (*out, end)


def _deployment(req: PlanRequest, gpu: GpuPreset, mem_util: float) -> capacity.Deployment:
    if req.pp < 1:
        raise BadInput(f"--pp {req.pp} must be at least 1")
    tp = req.tp if req.tp is not None else max(1, (req.num_gpus or req.pp) // req.pp)
    return capacity.Deployment(
        gpu_memory_bytes=gpu.total_bytes,
        num_gpus=req.num_gpus if req.num_gpus is not None else tp * req.pp,
        tp=tp,
        pp=req.pp,
        kv=kv.kv_dtype(req.kv_dtype),
        mem_util=mem_util,
        reserve_bytes=req.reserve_bytes,
        block_size=req.block_size,
        shared_prefix=req.shared_prefix,
        kv_cache_memory_bytes=req.kv_cache_memory_bytes,
    )


def _weights(req: PlanRequest, resolved: ResolvedModel, dep: capacity.Deployment) -> tuple[int, str, bool]:
    if req.weights_per_gpu_bytes is not None:
        return (
            req.weights_per_gpu_bytes * dep.tp * dep.pp,
            f"{req.weights_per_gpu_bytes:,} B per GPU as given (--weights-memory)",
            False,
        )
    if req.weights is None and resolved.file_weight_bytes is not None:
        return resolved.file_weight_bytes, resolved.file_weight_note, True
    shape = resolved.shape
    if shape.params is None:  # the KV arithmetic is still answered; what fits is an upper bound
        missing = dict(shape.unknown).get("parameter count", "a layer width")
        return (
            0,
            f"unknown: the config lacks '{missing}'; give --weights-memory SIZE (per GPU, as vLLM logs "
            "'Model loading took') or a directory with *.safetensors",
            False,
        )
    wb = weight_bytes(shape.params, req.weights or "bf16", req.group_size)
    return wb.total, wb.how, False


def _validate(req: PlanRequest, contexts: tuple[int, ...]) -> None:
    if req.shared_prefix and req.shared_prefix >= min(contexts):
        raise BadInput(
            f"--shared-prefix {req.shared_prefix} must be below every --context (smallest {min(contexts)}): "
            "each sequence needs at least one token of its own beyond the shared prefix"
        )
    if req.output_len < 1 or (req.prompt_len is not None and req.prompt_len < 1):
        raise BadInput(f"--prompt-len / --output-len must be at least 1 (got {req.prompt_len}, {req.output_len})")
    for flag, value in (
        ("--max-num-batched-tokens", req.max_num_batched_tokens),
        ("--max-num-seqs", req.max_num_seqs),
        ("--max-cudagraph-capture-size", req.max_cudagraph_capture_size),
    ):
        if value is not None and value < 1:
            raise BadInput(f"{flag} {value} must be at least 1")
    if req.cudagraph_capture_sizes is not None and (
        not req.cudagraph_capture_sizes or min(req.cudagraph_capture_sizes) < 1
    ):
        raise BadInput(f"--cudagraph-capture-sizes {list(req.cudagraph_capture_sizes)} must list sizes of at least 1")
    if req.mamba_ssm_cache_dtype is not None and req.mamba_ssm_cache_dtype not in STATE_DTYPE_BYTES:
        raise BadInput(
            f"--mamba-ssm-cache-dtype {req.mamba_ssm_cache_dtype!r} not known; accepted: {', '.join(STATE_DTYPE_BYTES)}"
        )
    if req.model_runner is not None and req.model_runner not in MODEL_RUNNERS:
        raise BadInput(f"--model-runner {req.model_runner!r} not known; accepted: {', '.join(MODEL_RUNNERS)}")
    if req.weights_per_gpu_bytes is not None and req.weights is not None:
        raise BadInput("give --weights or --weights-memory, not both")


def _speed(
    req: PlanRequest,
    gpu: GpuPreset,
    shape: ModelShape,
    dep: capacity.Deployment,
    *,
    weights: str,
    weight_total: int,
    context: int,
    concurrency: int,
) -> roofline.StepTimes | None:
    if not gpu.has_speed or shape.params is None or "active parameters" in dict(shape.unknown):
        return None
    target = solve.Target(context, concurrency, prompt_len=req.prompt_len, output_len=req.output_len)
    return solve.speed_of(
        shape,
        gpu,
        target,
        weights=weights,
        kv=dep.kv,
        tp=dep.tp,
        pp=dep.pp,
        dp=dep.dp,
        weight_total=weight_total,
        spec=req.spec,
        eff=req.efficiency,
    )


def _with_ssm_dtype(shape: ModelShape, dtype: str | None) -> ModelShape:
    """`shape` with its recurrent states in --mamba-ssm-cache-dtype (vLLM: the user's
    value wins over the config hook's; "auto" keeps the model dtype)."""
    if dtype is None:
        return shape
    layers = tuple(replace(l, ssm_dtype_bytes=STATE_DTYPE_BYTES[dtype]) if l.kind == STATE else l for l in shape.layers)
    return replace(shape, layers=layers)


def engine_args(req: PlanRequest) -> vllm_kv.EngineArgs:
    sc = req.speculative_config
    return vllm_kv.EngineArgs(
        decode_query_len=sc.decode_query_len if sc else 1,
        speculative_method=sc.method if sc else None,
        block_size=req.block_size,
        max_num_batched_tokens=req.max_num_batched_tokens,
        async_scheduling=req.async_scheduling,
        enable_prefix_caching=req.prefix_caching,
        max_num_seqs=req.max_num_seqs,
        enforce_eager=req.enforce_eager,
        cudagraph_capture_sizes=req.cudagraph_capture_sizes,
        max_cudagraph_capture_size=req.max_cudagraph_capture_size,
        vllm_version=req.vllm_version,
        model_runner=req.model_runner,
    )


def plan(req: PlanRequest, *, fixes: bool = True) -> Report:
    """Size `req.model` on the requested deployment; with `req.solve`, also list the
    smallest deployments serving the largest requested context x concurrency. `fixes`
    False skips the search for a deployment serving the failing rows."""
    release = policy(req.vllm_version)  # refuse an unknown release first
    gpu = resolve_gpu(req)
    dep = _deployment(req, gpu, req.mem_util if req.mem_util is not None else release.default_mem_util)
    kv_fixed = req.kv_cache_memory_bytes
    if kv_fixed is not None and kv_fixed > gpu.total_bytes:
        raise BadInput(
            f"--kv-cache-memory {human_size(kv_fixed)} ({kv_fixed:,} bytes) is more than the whole GPU: "
            f"{gpu.name} has {human_size(gpu.total_bytes)} ({gpu.total_bytes:,} bytes); accepted: at most the GPU's "
            "memory less the weights and what vLLM keeps beside them"
        )
    resolved = resolve_model(req.model)
    contexts = req.contexts or default_contexts(resolved.shape.max_position_embeddings)
    _validate(req, contexts)
    shape = _with_ssm_dtype(resolved.shape, req.mamba_ssm_cache_dtype)
    notes = list(shape.notes)
    drafter = None
    if req.speculative_config is not None:
        shape, drafter, dnotes = _drafter(req, resolved, shape, dep.tp, dep.pp)
        notes += dnotes
    if gpu.cuda_memory_bytes is None:
        notes.append(
            f"{gpu.key}: no CUDA-reported total found; planning with the driver's {gpu.memory_bytes / 2**30:.2f} "
            "GiB (vLLM sees a few hundred MiB less)"
        )
    limit = shape.max_position_embeddings
    if limit and max(contexts) > limit:
        notes.append(f"context {max(contexts)} exceeds the model's max_position_embeddings {limit}")
    total, how, from_files = _weights(req, resolved, dep)
    if drafter is not None and drafter.weight_bytes_per_gpu:
        total += drafter.weight_bytes_per_gpu * dep.tp * dep.pp
        how += f" + the drafter's {human_size(drafter.weight_bytes_per_gpu)}/GPU ({drafter.weights_how})"
    if how.startswith("unknown"):
        notes.append(f"weights {how}: every row is sized without them, so 'fits' is an upper bound")
    engine = engine_args(req)
    fit = Fit(
        shape, dep, total, accounting=req.accounting, engine=engine, gpu=gpu, weights_per_gpu=req.weights_per_gpu_bytes
    )
    if fit.layout is not None:
        notes += fit.layout.notes
    for p in fit.profiles or ():
        notes += [n for n in p.notes if n not in notes]
    speed_dtype = req.weights or "bf16"
    rows = []
    for c in contexts:
        for n in req.concurrencies:
            row = fit.row(c, n)  # speed only where it would run
            rows.append(
                ReportRow(
                    c,
                    n,
                    row,
                    _speed(req, gpu, shape, dep, weights=speed_dtype, weight_total=total, context=c, concurrency=n)
                    if row.fits
                    else None,
                )
            )
    report = Report(
        request=req,
        resolved=resolved,
        gpu=gpu,
        fit=fit,
        engine=engine,
        weights_total=total,
        weights_how=how,
        weights_from_files=from_files,
        rows=rows,
        max_concurrency={c: fit.max_concurrency(c) for c in contexts},
        max_context={n: fit.max_context(n) for n in req.concurrencies},
        notes=notes,
        drafter=drafter,
    )
    if not gpu.has_speed:
        notes.append(f"no speed model for {gpu.name}: its datasheet figures are not in the presets")
    capped = [r for r in rows if r.fit.binding == "max-num-seqs"]
    if capped:
        most = max(r.concurrency for r in capped)
        notes.append(
            f"{len(capped)} row(s) ask for more sequences than max_num_seqs {fit.max_num_seqs()} per replica "
            f"runs at once (the rest wait in the queue): give --max-num-seqs {ceil_div(most, dep.dp)} or more"
        )
    failing = [r for r in rows if not r.fit.fits and r.fit.binding != "max-num-seqs"]
    if failing and fixes and shape.params is not None:
        ends = {(r.context, r.concurrency) for r in (failing[0], failing[-1])}
        for c, n in sorted(ends):
            target = solve.Target(c, n, prompt_len=req.prompt_len, output_len=req.output_len)
            found = _solve(req, shape, [gpu], target, dep, engine, limit=1)
            report.fixes.append((target, found[0] if found else None))
    if req.solve:
        report.solve_target = solve.Target(
            max(contexts), max(req.concurrencies), req.max_tpot_s, req.max_ttft_s, req.prompt_len, req.output_len
        )
        gpus = [gpu_preset(g) for g in req.solve_gpus] if req.solve_gpus else list(gpu_presets().values())
        report.solutions = _solve(req, shape, gpus, report.solve_target, dep, engine, limit=10)
    return report


def _solve(
    req: PlanRequest,
    shape: ModelShape,
    gpus: list[GpuPreset],
    target: solve.Target,
    dep: capacity.Deployment,
    engine: vllm_kv.EngineArgs,
    *,
    limit: int,
) -> list[solve.Candidate]:
    kv_dtypes = solve.SOLVE_KV if req.accounting == "vllm" else (*solve.SOLVE_KV, "int8", "int4")
    return solve.solve(
        shape,
        gpus,
        target,
        replace(dep, kv_cache_memory_bytes=None),
        accounting=req.accounting,
        engine=engine,
        kv_dtypes=kv_dtypes,
        group_size=req.group_size,
        spec=req.spec,
        eff=req.efficiency,
        limit=limit,
    )


# --- replaying a vLLM start-up log ------------------------------------------------------
GiB = 2**30
EXPLAIN_ABOVE = 0.02  # a difference in available KV above this share is explained term by term


@dataclass(frozen=True)
class LogTerm:
    """One term of the start-up arithmetic, per GPU, in bytes (None: not logged / not modelled)."""

    term: str
    logged: float | None
    predicted: float | None
    why: str

    @property
    def difference(self) -> float | None:
        if self.logged is None or self.predicted is None:
            return None
        return self.predicted - self.logged


@dataclass
class Replay:
    """A start-up log replayed through `plan` with the log's own settings."""

    log: Any
    report: Report
    settings: dict[str, tuple[Any, str]]  # setting -> (value, where it came from)
    terms: list[LogTerm]
    kv_tokens_at_logged: int | None
    concurrency_at_logged: float | None
    explanation: list[str]
    notes: list[str]


def _nearest_release(version: str | None, given: str | None) -> tuple[str, str | None]:
    """(the modelled release to replay with, a note when it is not the logged one)."""
    from infer_tool.sizing.vllm_versions import NEWEST, OLDEST

    if given is not None:
        return given, None if version is None else f"replayed as vLLM {given} (--vllm-version; the log says {version})"
    if version is None:
        return VLLM_VERSION, f"the log names no vLLM version: replayed as {VLLM_VERSION} (give --vllm-version)"
    m = re.match(r"0\.([0-9]+)", version, re.ASCII)
    if m is None or re.match(r"0\.1\.dev", version):  # an untagged build says 0.1.devN
        return VLLM_VERSION, (
            f"vLLM {version} is not a release this tool models: replayed as {VLLM_VERSION} (give --vllm-version)"
        )
    minor = int(m.group(1))
    near = min(max(minor, OLDEST), NEWEST)
    if near != minor:
        return f"0.{near}", f"vLLM {version} is not modelled: replayed as the nearest modelled release, 0.{near}"
    if not re.fullmatch(r"0\.[0-9]+(\.[0-9]+)?(\.post[0-9]+)?", version, re.ASCII):
        return f"0.{minor}", f"vLLM {version} (a development build) replayed as release 0.{minor}"
    return version, None


def _log_speculative(raw: Any) -> tuple[SpeculativeConfig | None, str | None]:
    """The log's speculative config, if its drafter can be read here (a local directory
    or a preset); else None and a note saying the replay leaves it out."""
    import json
    from pathlib import Path

    from infer_tool.sizing.presets import find_model_preset
    from infer_tool.sizing.speculative import parse_speculative_config

    if not isinstance(raw, dict):
        return None, None
    keep = {k: v for k, v in raw.items() if k in ("method", "model", "num_speculative_tokens") and v is not None}
    try:
        sc = parse_speculative_config(json.dumps(keep))
    except BadInput as e:
        return None, f"the log's speculative config is not modelled ({e}); replayed without it"
    if sc.model and not (Path(sc.model).expanduser().exists() or find_model_preset(sc.model)):
        return None, (
            f"the log's drafter {sc.model!r} is not a local directory nor a preset: replayed without speculative "
            "decoding (its weights and KV are missing from the prediction)"
        )
    return sc, None


def _log_model(log: Any, model: str | None) -> tuple[str, str | None]:
    """MODEL for the replay: the one given, the log's path when it is a local directory, the
    built-in preset of the log's hub name, or that hub id (`sizing/hub.py`)."""
    from pathlib import Path

    from infer_tool.sizing.hub import is_repo_id
    from infer_tool.sizing.presets import find_model_preset

    if model is not None:
        return model, None
    named = log.model
    if named is None:
        raise BadInput("the log names no model: give MODEL (a directory with config.json, or a preset)")
    if Path(named).expanduser().is_dir():
        return named, None
    preset = find_model_preset(named) or find_model_preset(Path(named).name)
    if preset is not None:
        return preset.key, f"model config: built-in preset {preset.key} ({preset.hf_id}) for the log's {named!r}"
    if is_repo_id(named):
        return named, f"model config: the hub id the log names, {named!r} (local hub cache, else the hub)"
    raise BadInput(
        f"the log's model {named!r} is not a local directory, a built-in preset nor a hub id: give MODEL (a "
        "directory with its config.json)"
    )


def _log_gpu(log: Any, req_gpu: str | None, req_mem: int | None) -> tuple[dict[str, Any], str]:
    """PlanRequest GPU fields, and where the total came from."""
    from infer_tool.sizing.presets import gpu_presets

    device = None
    if log.device:
        want = re.sub(r"[^a-z0-9]", "", log.device.lower())
        for p in gpu_presets().values():
            name = re.sub(r"[^a-z0-9]", "", p.name.lower())
            if name.startswith(want) or want.startswith(name):
                device = p
                break
    cc = device.compute_capability if device else ""
    if req_mem is not None:
        return {"gpu_mem_bytes": req_mem, "gpu_compute_capability": cc}, "--gpu-mem"
    if req_gpu is not None:
        return {"gpu": req_gpu}, "--gpu"
    if log.total_gib is not None:
        return {"gpu_mem_bytes": round(log.total_gib * GiB), "gpu_compute_capability": cc}, "the log's total"
    if device is not None:
        return {"gpu": device.key}, f"preset {device.key} (the log names {log.device})"
    if log.util_pair and log.graph_estimate_gib:
        delta = abs(log.util_pair[0] - log.util_pair[1])
        if delta > 0:
            total = log.graph_estimate_gib / delta
            return (
                {"gpu_mem_bytes": round(total * GiB), "gpu_compute_capability": cc},
                "derived: CUDA-graph estimate / the two --gpu-memory-utilization figures' difference (about +-2%)",
            )
    raise BadInput("the log shows no GPU total ('Free memory on device') nor a GPU name: give --gpu or --gpu-mem")


def replay_log(
    text: str,
    *,
    model: str | None = None,
    gpu: str | None = None,
    gpu_mem_bytes: int | None = None,
    vllm_version: str | None = None,
) -> Replay:
    """Parse a vLLM start-up log, plan with exactly its settings, and compare term by term."""
    from infer_tool.sizing.vllm_log import parse_log

    log = parse_log(text)
    if log.recognised == 0:
        raise BadInput("no vLLM start-up line found in the log (expected e.g. 'Available KV cache memory')")
    notes: list[str] = []
    version, vnote = _nearest_release(log.version, vllm_version)
    notes += [vnote] if vnote else []
    name, mnote = _log_model(log, model)
    notes += [mnote] if mnote else []
    gpu_fields, gpu_from = _log_gpu(log, gpu, gpu_mem_bytes)
    settings: dict[str, tuple[Any, str]] = {"vllm_version": (version, "log" if not vnote else "nearest")}
    settings["gpu_total"] = (gpu_fields.get("gpu_mem_bytes") or gpu_fields.get("gpu"), gpu_from)

    def pick(key: str, *alts: Any) -> tuple[Any, str]:
        v = log.setting(key)
        if v is not None:
            return v, "log"
        for alt in alts:
            if alt is not None:
                return alt, "log"
        return None, "default"

    tp, _ = pick("tensor_parallel_size")
    pp, _ = pick("pipeline_parallel_size")
    mml, mml_from = pick("max_model_len", log.max_model_len, log.engine.get("max_seq_len"))
    if mml is None and log.concurrency:
        mml, mml_from = log.concurrency[0], "log"
    if mml is None:
        raise BadInput("the log shows no max model len ('Using max model len N'): it cannot be replayed")
    util_logged = log.mem_util if log.mem_util is not None else (log.util_pair[0] if log.util_pair else None)
    util, util_from = pick("gpu_memory_utilization", util_logged)
    mnbt, mnbt_from = pick("max_num_batched_tokens", log.max_num_batched_tokens)
    seqs, seqs_from = pick("max_num_seqs")
    sizes = log.engine.get("cudagraph_capture_sizes")
    if seqs is None and log.full_largest and sizes and log.full_largest in sizes and log.full_largest < max(sizes):
        # FULL (decode) graphs stop at max_num_seqs, which vLLM adds to the capture list
        seqs, seqs_from = log.full_largest, "log (its largest FULL CUDA graph)"
    eager, _ = pick("enforce_eager")
    kv_dtype_raw, _ = pick("kv_cache_dtype")
    kv_dtype = {"auto": "bf16" if log.engine.get("dtype") != "float16" else "fp16", None: "bf16"}.get(
        kv_dtype_raw, "fp8" if str(kv_dtype_raw).startswith("fp8") else str(kv_dtype_raw)
    )
    block, block_from = pick("block_size")
    prefix, _ = pick("enable_prefix_caching")
    kv_fixed, _ = pick("kv_cache_memory_bytes")
    async_arg = log.args.get("async_scheduling")
    spec_cfg, spec_note = _log_speculative(log.setting("speculative_config"))
    notes += [spec_note] if spec_note else []
    req = PlanRequest(
        name,
        **gpu_fields,
        tp=int(tp or 1),
        pp=int(pp or 1),
        mem_util=float(util) if util is not None else None,
        weights_per_gpu_bytes=round(log.weights_gib * GiB) if log.weights_gib else None,
        kv_dtype=kv_dtype,
        block_size=int(block or DEFAULT_BLOCK_SIZE),
        contexts=(int(mml),),
        concurrencies=(1,),
        kv_cache_memory_bytes=int(kv_fixed) if kv_fixed else None,
        vllm_version=version,
        max_num_batched_tokens=int(mnbt) if mnbt else None,
        max_num_seqs=int(seqs) if seqs else None,
        enforce_eager=bool(eager),
        cudagraph_capture_sizes=tuple(sizes) if sizes and not eager else None,
        async_scheduling=True if (async_arg or log.async_logged) else None,
        prefix_caching=True if prefix is None else bool(prefix),
        speculative_config=spec_cfg,
    )
    for key, value, where in (
        ("tp", req.tp, "log" if tp else "default"),
        ("pp", req.pp, "log" if pp else "default"),
        ("max_model_len", mml, mml_from),
        ("gpu_memory_utilization", req.mem_util, util_from),
        ("max_num_batched_tokens", req.max_num_batched_tokens, mnbt_from),
        ("max_num_seqs", req.max_num_seqs, seqs_from),
        ("enforce_eager", req.enforce_eager, "log" if eager is not None else "default"),
        ("kv_cache_dtype", kv_dtype, "log" if kv_dtype_raw else "default"),
        ("block_size", req.block_size, block_from),
        ("enable_prefix_caching", req.prefix_caching, "log" if prefix is not None else "default"),
        ("cudagraph_capture_sizes", len(sizes) if sizes else None, "log" if sizes else "default"),
        ("weights_per_gpu", req.weights_per_gpu_bytes, "log" if log.weights_gib else "predicted"),
    ):
        settings[key] = (value, where)
    report = plan(req, fixes=False)
    terms, explanation = _compare(log, report, version)
    kv_at, conc_at = None, None
    stages = log.stage_available_gib(req.pp, req.tp)
    if stages and report.fit.layout is not None and min(stages) > 0:
        cap = report.fit.vllm_at([round(g * GiB) for g in stages], int(mml))
        kv_at, conc_at = cap.kv_cache_tokens, cap.max_concurrency_log
    missing = log.missing
    if missing:
        notes.append("not in the log: " + ", ".join(missing))
    kept = [n for n in report.notes if not n.startswith("no speed model")]  # the replay shows no speed
    return Replay(log, report, settings, terms, kv_at, conc_at, explanation, notes + kept)


def _compare(log: Any, r: Report, version: str) -> tuple[list[LogTerm], list[str]]:
    """Logged against predicted, term by term, for the last pipeline stage's worker (the
    one running the sampler), and which term carries the difference in available KV."""
    rel = policy(version)
    p = r.profiles[-1] if r.profiles else None
    terms: list[LogTerm] = []

    def gib(v: float | None) -> float | None:
        return None if v is None else v * GiB

    total_pred = r.fit.dep.gpu_memory_bytes
    terms.append(LogTerm("GPU total", gib(log.total_gib), total_pred, "as CUDA reports it"))
    requested = p.requested if p else r.fit.dep.usable_bytes
    terms.append(LogTerm("requested", gib(log.requested_gib), requested, "ceil(total x gpu_memory_utilization)"))
    weights_pred = _config_weights(r)
    terms.append(
        LogTerm(
            "weights",
            gib(log.weights_gib),
            weights_pred,
            "'Model loading took'; predicted from the config"
            + (" (the replay uses the logged figure)" if log.weights_gib else ""),
        )
    )
    graphs_in = p.cudagraphs.subtracted_bytes if p else 0
    act = p.activation.bytes if p and p.activation.known else None
    peak_pred = None if act is None else act + graphs_in
    peak_why = "torch peak of the profile run"
    if rel.cudagraph_in_budget:
        peak_why += " + the CUDA-graph estimate (0.21+)"
    non_torch = p.non_torch_bytes if p else None
    if "consumed" in log.usage:
        w = r.fit.planner.weight_bytes_per_gpu
        terms.append(
            LogTerm(
                "consumed (weights + non-torch)",
                gib(log.usage["consumed"]),
                None if non_torch is None else w + non_torch,
                "0.27+: what the process holds after the profile",
            )
        )
    elif "non-torch" in log.usage:
        terms.append(LogTerm("non-torch", gib(log.usage["non-torch"]), non_torch, "workspaces, NCCL, CUDA context"))
    else:
        terms.append(LogTerm("non-torch", None, non_torch, "workspaces (not broken down in the log)"))
    terms.append(LogTerm("peak activation", gib(log.usage.get("peak activation")), peak_pred, peak_why))
    est_pred = p.cudagraphs.estimate_bytes if p else None
    terms.append(
        LogTerm(
            "CUDA-graph estimate",
            gib(log.graph_estimate_gib),
            est_pred,
            "subtracted from the KV cache" if rel.cudagraph_in_budget else "computed, not subtracted (before 0.21)",
        )
    )
    actual = log.usage.get("CUDA graphs", log.graph_actual_gib)
    terms.append(
        LogTerm(
            "CUDA graphs captured",
            gib(actual),
            None,
            "logged after the KV cache is sized; vLLM does not subtract it (outside --gpu-memory-utilization)",
        )
    )
    stages = log.stage_available_gib(r.fit.dep.pp, r.fit.dep.tp)
    logged_avail = gib(stages[-1]) if stages else None
    pred_avail = p.available if p else r.fit.planner.kv_budget_per_gpu
    overhead_logged = None
    if logged_avail is not None and log.weights_gib is not None:
        req_logged = gib(log.requested_gib) if log.requested_gib is not None else requested
        overhead_logged = req_logged - gib(log.weights_gib) - logged_avail
    terms.append(
        LogTerm(
            "overhead (activation + non-torch + graphs)",
            overhead_logged,
            p.overhead if p else r.fit.planner.reserve_bytes,
            "requested - weights - available KV, as logged",
        )
    )
    terms.append(LogTerm("available KV", logged_avail, pred_avail, "'Available KV cache memory'"))
    return terms, _explain(terms, logged_avail, pred_avail, rel, r)


def _config_weights(r: Report) -> int | None:
    """Weights per GPU as the config (or the files) predict them, without the log."""
    req = replace(r.request, weights_per_gpu_bytes=None)
    try:
        total, how, _ = _weights(req, r.resolved, r.fit.dep)
    except BadInput:
        return None
    if how.startswith("unknown"):
        return None
    return ceil_div(total, r.fit.dep.tp * r.fit.dep.pp)


def _explain(terms: list[LogTerm], logged: float | None, predicted: float, rel: Any, r: Report) -> list[str]:
    """Which term carries the difference in available KV: each logged term's share of it
    (available = requested - weights - overhead, the replay subtracting the logged weights),
    the overhead's unbroken rest as one term."""
    if logged is None:
        return ["the log has no 'Available KV cache memory' line: only the prediction is shown"]
    by = {t.term: t for t in terms}
    diff = predicted - logged
    share = diff / abs(logged) if logged else float("inf")
    out = [f"available KV: predicted {predicted / GiB:.2f} GiB, logged {logged / GiB:.2f} GiB ({share:+.1%})"]
    if abs(share) <= EXPLAIN_ABOVE:
        return [*out, f"within {EXPLAIN_ABOVE:.0%}: no term needs explaining"]
    parts: dict[str, float] = {}  # term -> its contribution to predicted - logged available
    if (d := by["requested"].difference) is not None:
        parts["requested (the GPU total x utilization)"] = d
    over = by["overhead (activation + non-torch + graphs)"].difference
    if over is not None:
        rest = -over
        for name in ("consumed (weights + non-torch)", "non-torch", "peak activation"):
            t = by.get(name)
            if t is not None and t.difference is not None:
                d = t.difference
                parts[name] = -d
                rest += d
        if (est := by["CUDA-graph estimate"]).difference is not None and rel.cudagraph_in_budget:
            if "peak activation" not in parts:  # 0.21+ folds the estimate into "peak activation"
                parts["CUDA-graph estimate"] = -est.difference
                rest += est.difference
        parts["overhead not broken down in the log (activation peak, non-torch, graphs)"] = rest
    if not parts:
        return [*out, "the log breaks down no term and has no weights line: the difference is not attributed"]
    name, value = max(parts.items(), key=lambda kv: abs(kv[1]))
    out.append(
        f"carried by {name}: {value / GiB:+.2f} GiB of the {diff / GiB:+.2f} GiB"
        + (f" ({by[name].why})" if name in by else "")
    )
    if by["GPU total"].logged is None:
        step = 0.01 * r.fit.dep.gpu_memory_bytes * r.fit.dep.mem_util
        out.append(f"the GPU total is not in the log: each 1% of it moves the available KV by {step / GiB:.2f} GiB")
    if not rel.cudagraph_in_budget:
        out.append(f"vLLM {rel.version} does not subtract its CUDA graphs (captured after the KV cache is sized)")
    if rel.nccl_in_budget and r.fit.dep.tp > 1:
        out.append(f"vLLM {rel.version} counts NCCL buffers against the budget at TP > 1; they are not modelled")
    return out


# --- what reaches a target ---------------------------------------------------------------
@dataclass(frozen=True)
class Suggestion:
    """The engine arguments that serve `concurrency` sequences of `context` tokens on the
    requested deployment, and what they cost. `feasible` False: not on this GPU count at
    any utilization (`limit` then says what does fit)."""

    context: int
    concurrency: int
    feasible: bool
    max_model_len: int
    max_num_seqs: int
    kv_cache_memory_bytes: int  # per GPU, as --kv-cache-memory-bytes
    mem_util: float | None  # the smallest --gpu-memory-utilization (two decimals) that reaches it
    before: Report
    after: Report | None  # the plan with the suggested --gpu-memory-utilization
    costs: list[str]
    limit: str = ""

    def serve_flags(self) -> str:
        """A ready-to-paste `vllm serve` flags line (the utilization form)."""
        d = self.before.fit.dep
        parts = [f"--max-model-len {self.max_model_len}", f"--max-num-seqs {self.max_num_seqs}"]
        if d.tp > 1:
            parts.insert(0, f"--tensor-parallel-size {d.tp}")
        if d.pp > 1:
            parts.insert(1 if d.tp > 1 else 0, f"--pipeline-parallel-size {d.pp}")
        if d.kv.name != "bf16":
            parts.append(f"--kv-cache-dtype {d.kv.name}")
        if self.mem_util is not None:
            parts.append(f"--gpu-memory-utilization {self.mem_util:.2f}")
        return " ".join(parts)

    def serve_flags_fixed_kv(self) -> str:
        """The same with the KV cache size given directly (`--kv-cache-memory-bytes`)."""
        base = self.serve_flags().split(" --gpu-memory-utilization")[0]
        return f"{base} --kv-cache-memory-bytes {self.kv_cache_memory_bytes}"


def _kv_bytes_needed(fit: Fit, context: int, concurrency: int) -> int:
    """The smallest KV cache per GPU (each stage the same) at which `concurrency`
    sequences of `context` tokens fit vLLM's blocks: whole blocks, plus the null block."""
    n = ceil_div(concurrency, fit.dep.dp)
    per_block = fit.bytes_per_block()
    cap = fit.vllm_at([per_block * 2] * len(fit.stages), context)
    blocks = cap.shared_blocks + n * (cap.blocks_per_request - cap.shared_blocks) + 1
    budget = blocks * per_block
    for _ in range(64):  # vLLM's layout may round a block more per group; step until it fits
        if fit.vllm_at([budget] * len(fit.stages), context).fits(n):
            return budget
        budget += per_block
    raise BadInput(f"no KV cache size found for {concurrency} x {context:,} tokens")  # pragma: no cover


def reach_target(req: PlanRequest, concurrency: int | None, context: int | None) -> Suggestion:
    """--target-concurrency / --target-context: the --max-model-len, --max-num-seqs,
    --kv-cache-memory-bytes and --gpu-memory-utilization that serve the target on the
    requested deployment, checked by planning with them."""
    if req.accounting != "vllm":
        raise BadInput("--target-concurrency / --target-context need --accounting vllm (vLLM's blocks)")
    for flag, v in (("--target-concurrency", concurrency), ("--target-context", context)):
        if v is not None and v < 1:
            raise BadInput(f"{flag} {v} must be at least 1")
    first = plan(replace(req, concurrencies=(1,)), fixes=False)
    ctx = context or (req.contexts[-1] if req.contexts else None) or first.shape.max_position_embeddings
    if ctx is None:
        raise BadInput("give --target-context (or --context): the model states no max_position_embeddings")
    conc = concurrency or 1  # a context target alone: one sequence of that length
    before = plan(replace(req, contexts=(ctx,), concurrencies=(conc,)), fixes=False)
    seqs = max(before.fit.max_num_seqs(), ceil_div(conc, before.fit.dep.dp))
    sized = plan(
        replace(req, contexts=(ctx,), concurrencies=(conc,), max_num_seqs=seqs, kv_cache_memory_bytes=None), fixes=False
    )
    fit = sized.fit
    need = _kv_bytes_needed(fit, ctx, conc)
    costs: list[str] = []
    if fit.profiles is None:  # a flat --reserve
        overhead, weights = fit.planner.reserve_bytes, fit.planner.weight_bytes_per_gpu
    else:
        worst = max(range(len(fit.profiles)), key=lambda i: fit.profiles[i].weights + fit.profiles[i].overhead)
        overhead, weights = fit.profiles[worst].overhead, fit.profiles[worst].weights
    total = fit.dep.gpu_memory_bytes
    util = None
    after = None
    for step in range(100):
        u = math.ceil((need + weights + overhead) / total * 100) / 100 + step / 100
        if u > 1:
            break
        trial = plan(replace(sized.request, mem_util=u), fixes=False)
        if trial.rows[0].fit.fits:
            util, after = round(u, 2), trial
            break
    feasible = util is not None
    limit = ""
    if feasible:
        old = before.fit.dep.mem_util
        kept_out = total - math.ceil(total * util)
        if util > old:
            costs.append(
                f"--gpu-memory-utilization {old:g} -> {util:.2f}: {human_size(kept_out)} of the GPU stays outside vLLM "
                f"(was {human_size(total - math.ceil(total * old))}) for other processes and fragmentation"
            )
        else:
            costs.append(
                f"--gpu-memory-utilization {util:.2f} is enough (now {old:g}): "
                f"{human_size(math.ceil(total * (old - util)))} per GPU could go elsewhere"
            )
        if seqs != before.fit.max_num_seqs():
            costs.append(
                f"--max-num-seqs {before.fit.max_num_seqs()} -> {seqs}: a larger sampler buffer and more CUDA graphs "
                "in vLLM's profile (included above)"
            )
        spare = after.fit.planner.kv_budget_per_gpu - need
        costs.append(f"the KV cache holds the target with {human_size(max(0, spare))} per GPU to spare")
    else:
        at_full = plan(replace(sized.request, mem_util=0.95), fixes=False)
        mc = at_full.fit.max_concurrency(ctx)
        mx, why = at_full.fit.max_context(conc)
        limit = (
            f"{conc} x {ctx:,} tokens does not fit on {fit.dep.num_gpus} x {sized.gpu.name} even at "
            f"--gpu-memory-utilization 1.0; at 0.95 it serves {mc:,} sequences of {ctx:,} tokens, or {conc} of "
            f"{mx:,} tokens ({why})"
        )
    return Suggestion(ctx, conc, feasible, ctx, seqs, need, util, before, after, costs, limit)
