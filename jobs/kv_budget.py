"""The kv-budget job as a library call: `plan(PlanRequest) -> Report`.

`PlanRequest` declares every option once, with its default (None where vLLM's release or
`vllm serve` decides); the CLI only parses text into it. What a GPU keeps beside weights
and KV cache is vLLM's start-up profile for the chosen release (`sizing.vllm_memory`),
unless `reserve_bytes` gives a flat figure. Not fitting is an answer: every requested row
comes back with `fits` and, when false, what binds (the weights alone, or the KV cache at
that context x concurrency) and the smallest deployment on the same GPU that would serve
the largest failing row.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

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
from infer_tool.sizing.shape import STATE, ModelShape
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
    return vllm_kv.EngineArgs(
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


def plan(req: PlanRequest) -> Report:
    """Size `req.model` on the requested deployment; with `req.solve`, also list the
    smallest deployments serving the largest requested context x concurrency."""
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
    if gpu.cuda_memory_bytes is None:
        notes.append(
            f"{gpu.key}: no CUDA-reported total found; planning with the driver's {gpu.memory_bytes / 2**30:.2f} "
            "GiB (vLLM sees a few hundred MiB less)"
        )
    limit = shape.max_position_embeddings
    if limit and max(contexts) > limit:
        notes.append(f"context {max(contexts)} exceeds the model's max_position_embeddings {limit}")
    total, how, from_files = _weights(req, resolved, dep)
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
    if failing and shape.params is not None:
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
