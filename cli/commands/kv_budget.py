"""`infer-tool kv-budget MODEL`: what fits (by vLLM's KV-cache accounting or the plain
per-token arithmetic), the smallest deployment that does (`--solve`) and how fast it
serves, per context x concurrency. The library job is `jobs.kv_budget.plan`; this module
parses text into its `PlanRequest` and prints the `Report`. At import it loads only typer
and `sizing.defaults`."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import fields
from typing import TYPE_CHECKING, Annotated, Any

import typer

from infer_tool.cli.options import HbmEfficiency, Json, LinkEfficiency, Mfu, efficiency
from infer_tool.sizing.defaults import (
    DEFAULT_ACCOUNTING,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CONCURRENCY,
    DEFAULT_GPU,
    DEFAULT_OUTPUT_LEN,
    VLLM_VERSION,
)

if TYPE_CHECKING:
    pass

Opt = typer.Option
MODEL, DEPLOY, ENGINE, SWITCHES, WORKLOAD, SPEED, SOLVE, TARGET, OUTPUT = (
    "Model",
    "Deployment",
    "vLLM engine",
    "vLLM switches",
    "Workload",
    "Speed",
    "Solve",
    "Target",
    "Output",
)


def _in_panel(option: Any, panel: str) -> Any:
    """A shared `Annotated` option (cli/options.py) shown in this command's `panel`."""
    info = copy.copy(option.__metadata__[0])
    info.rich_help_panel = panel
    return Annotated[option.__origin__, info]


def register(app: typer.Typer) -> None:
    app.command(name="kv-budget", no_args_is_help=True)(kv_budget)


def kv_budget(
    model: Annotated[
        str | None, typer.Argument(help="HF model directory or config.json, a .gguf file, or a preset (--list-models).")
    ] = None,
    from_log: Annotated[
        str | None,
        Opt(
            "--from-log",
            help="A vLLM start-up log (a file, or - for stdin): replay it term by term (logged vs predicted).",
            rich_help_panel=MODEL,
        ),
    ] = None,
    weights: Annotated[
        str | None,
        Opt(
            help=(
                "bf16, fp16, fp8, int8, int4, nvfp4, nvfp4a16, mxfp4 or mxfp4a16 "
                "(default: the files' real bytes, else bf16)."
            ),
            rich_help_panel=MODEL,
        ),
    ] = None,
    weights_memory: Annotated[
        str | None,
        Opt(help='Weights per GPU as vLLM logs them ("Model loading took"): 14.99GiB.', rich_help_panel=MODEL),
    ] = None,
    group_size: Annotated[
        int | None, Opt(help="int4 group size, -1 per channel (default 128).", rich_help_panel=MODEL)
    ] = None,
    gpu: Annotated[
        str | None, Opt(help=f"GPU preset (--list-gpus; default {DEFAULT_GPU}).", rich_help_panel=DEPLOY)
    ] = None,
    gpu_mem: Annotated[
        str | None, Opt(help="GPU total as CUDA reports it, instead of a preset: 79.2GiB.", rich_help_panel=DEPLOY)
    ] = None,
    num_gpus: Annotated[
        int | None, Opt(help="GPUs in all (default tp x pp); the rest are replicas.", rich_help_panel=DEPLOY)
    ] = None,
    tp: Annotated[int | None, Opt(help="Tensor-parallel size (default num-gpus / pp).", rich_help_panel=DEPLOY)] = None,
    pp: Annotated[int | None, Opt(help="Pipeline-parallel size (default 1).", rich_help_panel=DEPLOY)] = None,
    vllm_version: Annotated[
        str | None,
        Opt(help=f"vLLM release whose policies apply, 0.10 to 0.32 (default {VLLM_VERSION}).", rich_help_panel=ENGINE),
    ] = None,
    mem_util: Annotated[
        float | None,
        Opt(help="--gpu-memory-utilization (default: the release's, 0.92 since 0.21).", rich_help_panel=ENGINE),
    ] = None,
    max_num_batched_tokens: Annotated[
        int | None, Opt(help="Tokens per step (default: vllm serve's for the GPU).", rich_help_panel=ENGINE)
    ] = None,
    max_num_seqs: Annotated[
        int | None, Opt(help="Sequences per step (default: vllm serve's for the GPU).", rich_help_panel=ENGINE)
    ] = None,
    cudagraph_capture_sizes: Annotated[
        str | None, Opt(help="CUDA-graph sizes, e.g. 1,2,4,8 (default vLLM's list).", rich_help_panel=ENGINE)
    ] = None,
    max_cudagraph_capture_size: Annotated[
        int | None, Opt(help="Largest CUDA-graph size (default 2 x max-num-seqs, <= 512).", rich_help_panel=ENGINE)
    ] = None,
    speculative_config: Annotated[
        str | None,
        Opt(
            help='vLLM\'s --speculative-config JSON: {"method": "eagle3", "model": DIR, "num_speculative_tokens": 3}.',
            rich_help_panel=ENGINE,
        ),
    ] = None,
    kv_cache_memory: Annotated[
        str | None, Opt(help="KV cache per GPU, as --kv-cache-memory-bytes: 12GiB.", rich_help_panel=ENGINE)
    ] = None,
    reserve: Annotated[
        str | None,
        Opt(help="Flat memory beside weights and KV per GPU, instead of vLLM's profile.", rich_help_panel=ENGINE),
    ] = None,
    kv_dtype: Annotated[
        str | None, Opt(help="KV cache dtype bf16|fp16|fp8 (int8|int4: plain accounting).", rich_help_panel=ENGINE)
    ] = None,
    mamba_ssm_cache_dtype: Annotated[
        str | None, Opt(help="Recurrent-state dtype auto|float32|bfloat16|float16.", rich_help_panel=ENGINE)
    ] = None,
    model_runner: Annotated[
        str | None,
        Opt(
            help="v1|v2, as VLLM_USE_V2_MODEL_RUNNER=0|1 (default: the release's choice for the model).",
            rich_help_panel=ENGINE,
        ),
    ] = None,
    block_size: Annotated[
        int | None, Opt(help=f"Tokens per cache block (default {DEFAULT_BLOCK_SIZE}).", rich_help_panel=ENGINE)
    ] = None,
    accounting: Annotated[
        str | None,
        Opt(
            help=f"vllm: vLLM's blocks; plain: bytes per token (default {DEFAULT_ACCOUNTING}).", rich_help_panel=ENGINE
        ),
    ] = None,
    enforce_eager: Annotated[
        bool, Opt("--enforce-eager", help="No CUDA graphs (no graph memory).", rich_help_panel=SWITCHES)
    ] = False,
    async_scheduling: Annotated[
        bool | None,
        Opt("--async-scheduling/--no-async-scheduling", help="Default: on since 0.14.", rich_help_panel=SWITCHES),
    ] = None,
    prefix_caching: Annotated[
        bool | None, Opt("--prefix-caching/--no-prefix-caching", help="Default on.", rich_help_panel=SWITCHES)
    ] = None,
    context: Annotated[
        list[str] | None,
        Opt(
            help=(
                "--max-model-len values: 32k, 4k,8k, 4k..128k (doubling), 1k..8k:1k; "
                "default 4k doubling to the model's limit."
            ),
            rich_help_panel=WORKLOAD,
        ),
    ] = None,
    concurrency: Annotated[
        list[str] | None,
        Opt(
            help=f"Concurrent sequences, same syntax (default {','.join(map(str, DEFAULT_CONCURRENCY))}).",
            rich_help_panel=WORKLOAD,
        ),
    ] = None,
    shared_prefix: Annotated[
        int | None, Opt(help="Prompt-prefix tokens all sequences share; below every context.", rich_help_panel=WORKLOAD)
    ] = None,
    prompt_len: Annotated[
        int | None, Opt(help="Prompt tokens for TTFT/TPOT (default: context - output).", rich_help_panel=WORKLOAD)
    ] = None,
    output_len: Annotated[
        int | None, Opt(help=f"Output tokens per request (default {DEFAULT_OUTPUT_LEN}).", rich_help_panel=WORKLOAD)
    ] = None,
    spec: Annotated[str | None, Opt(help="Speculative decoding ALPHA,K,C: 0.8,4,0.05.", rich_help_panel=SPEED)] = None,
    spec_profile: Annotated[
        str | None, Opt(help="Speculation from a spec-profile --json report.", rich_help_panel=SPEED)
    ] = None,
    hbm_efficiency: _in_panel(HbmEfficiency, SPEED) = None,
    mfu: _in_panel(Mfu, SPEED) = None,
    link_efficiency: _in_panel(LinkEfficiency, SPEED) = None,
    solve: Annotated[
        bool,
        Opt(
            "--solve",
            help="List the smallest deployments serving the largest context x concurrency.",
            rich_help_panel=SOLVE,
        ),
    ] = False,
    solve_gpu: Annotated[
        list[str] | None, Opt(help="GPU presets --solve may use (default: all).", rich_help_panel=SOLVE)
    ] = None,
    max_tpot: Annotated[
        float | None, Opt(help="Latency target: time per output token, ms.", rich_help_panel=SOLVE)
    ] = None,
    max_ttft: Annotated[
        float | None, Opt(help="Latency target: time to first token, ms.", rich_help_panel=SOLVE)
    ] = None,
    require_fit: Annotated[
        bool, Opt("--require-fit", help="Exit 3 when a row does not fit (a CI check).", rich_help_panel=SOLVE)
    ] = False,
    target_concurrency: Annotated[
        int | None,
        Opt(help="Sequences to serve at once: the vllm serve flags that reach it.", rich_help_panel=TARGET),
    ] = None,
    target_context: Annotated[
        str | None,
        Opt(help="Tokens per sequence to serve (32k): the vllm serve flags that reach it.", rich_help_panel=TARGET),
    ] = None,
    json_out: _in_panel(Json, OUTPUT) = False,
    list_models: Annotated[
        bool, Opt("--list-models", help="List model presets and exit.", rich_help_panel=OUTPUT)
    ] = False,
    list_gpus: Annotated[bool, Opt("--list-gpus", help="List GPU presets and exit.", rich_help_panel=OUTPUT)] = False,
) -> None:
    opts = {k: v for k, v in locals().items() if v is not None}
    from infer_tool.cli.output import cli_command

    cli_command(_run)(opts)


kv_budget.__doc__ = (
    f"Fits, smallest deployment and speed of MODEL per context x concurrency, with vLLM's KV-cache "
    f"accounting and start-up memory profile (default release {VLLM_VERSION})."
)


def _parsers() -> dict[str, tuple[str, Callable[[Any], Any]]]:
    """CLI option -> (PlanRequest field, parser of its text)."""
    from infer_tool.common.sizes import parse_size
    from infer_tool.sizing import units
    from infer_tool.sizing.speculative import parse_speculative_config
    from infer_tool.spec.report import parse_spec

    return {
        "gpu_mem": ("gpu_mem_bytes", lambda t: parse_size(t, "--gpu-mem", minimum=2**20)),
        "weights_memory": ("weights_per_gpu_bytes", lambda t: parse_size(t, "--weights-memory")),
        "cudagraph_capture_sizes": (
            "cudagraph_capture_sizes",
            lambda t: tuple(units.parse_counts([t], "--cudagraph-capture-sizes")),
        ),
        "reserve": ("reserve_bytes", lambda t: parse_size(t, "--reserve", minimum=0)),
        "kv_cache_memory": ("kv_cache_memory_bytes", lambda t: parse_size(t, "--kv-cache-memory")),
        "context": ("contexts", lambda v: tuple(units.parse_counts(v, "--context"))),
        "concurrency": ("concurrencies", lambda v: tuple(units.parse_counts(v, "--concurrency"))),
        "spec": ("spec", parse_spec),
        "speculative_config": ("speculative_config", parse_speculative_config),
        "solve_gpu": ("solve_gpus", tuple),
        "max_tpot": ("max_tpot_s", lambda ms: _ms(ms, "--max-tpot")),
        "max_ttft": ("max_ttft_s", lambda ms: _ms(ms, "--max-ttft")),
    }


def _ms(value: float, flag: str) -> float:
    from infer_tool.common.errors import BadInput

    if not 0 < value < 1e9:
        raise BadInput(f"{flag} {value} must be a positive number of milliseconds")
    return value / 1e3


def build_request(opts: dict[str, Any]) -> tuple[Any, list[str]]:
    """PlanRequest from the given CLI options (absent ones keep the library defaults)."""
    from infer_tool.common.errors import BadInput
    from infer_tool.jobs.kv_budget import PlanRequest
    from infer_tool.spec.report import from_report

    opts, notes = dict(opts), []
    report = opts.pop("spec_profile", None)
    if report is not None and "spec" in opts:
        raise BadInput("give --spec or --spec-profile, not both")
    kwargs: dict[str, Any] = {"efficiency": efficiency(opts)}
    parsers = _parsers()
    for name, value in opts.items():
        field_name, parse = parsers.get(name, (name, None))
        kwargs[field_name] = parse(value) if parse else value
    if report is not None:
        kwargs["spec"], note = from_report(report)
        notes.append(note)
    unknown = set(kwargs) - {f.name for f in fields(PlanRequest)}
    assert not unknown, unknown  # every CLI option maps onto a PlanRequest field
    return PlanRequest(**kwargs), notes


def _run(opts: dict[str, Any]) -> None:
    from infer_tool.common.errors import BadInput, QualityGateFailed

    json_out, require_fit = opts.pop("json_out"), opts.pop("require_fit")
    list_models, list_gpus = opts.pop("list_models"), opts.pop("list_gpus")
    if list_models or list_gpus:
        from infer_tool.sizing.presets import gpu_presets, model_presets

        _print_lists(list_models, list_gpus, json_out, model_presets(), gpu_presets())
        return
    targets = _targets(opts)
    if "from_log" in opts:
        _replay(opts, json_out, targets)
        return
    if "model" not in opts:
        raise BadInput("MODEL is required (a model directory, config.json, .gguf file or a preset from --list-models)")
    request, notes = build_request(opts)
    from infer_tool.cli.commands import kv_budget_render as render
    from infer_tool.jobs.kv_budget import plan

    if targets is not None:
        _suggest(request, targets, json_out)
        return

    report = plan(request)
    report.notes[:0] = notes
    if json_out:
        from infer_tool.cli.output import emit_json

        emit_json(render.document(report))
    else:
        render.human(report)
    if require_fit and not report.all_fit:
        bad = [f"{r.context}x{r.concurrency} ({r.fit.binding})" for r in report.rows if not r.fit.fits]
        raise QualityGateFailed(
            f"--require-fit: {len(bad)} of {len(report.rows)} rows do not fit: {', '.join(bad[:6])}"
        )


# options --from-log takes beside the log (the rest of the settings come from the log)
_REPLAY_OPTIONS = {"from_log", "model", "gpu", "gpu_mem", "vllm_version"}


def _targets(opts: dict[str, Any]) -> tuple[int | None, int | None] | None:
    """(--target-concurrency, --target-context), popped from `opts`; None if neither."""
    from infer_tool.common.errors import BadInput
    from infer_tool.sizing.units import parse_count

    conc, ctx = opts.pop("target_concurrency", None), opts.pop("target_context", None)
    if conc is None and ctx is None:
        return None
    if conc is not None and conc < 1:
        raise BadInput(f"--target-concurrency {conc} must be at least 1")
    return conc, (parse_count(ctx, "--target-context") if ctx is not None else None)


def _suggest(request: Any, targets: tuple[int | None, int | None], json_out: bool) -> None:
    from infer_tool.cli.commands import kv_budget_render as render
    from infer_tool.jobs.kv_budget import reach_target

    s = reach_target(request, *targets)
    if json_out:
        from infer_tool.cli.output import emit_json

        emit_json(render.suggestion_document(s))
    else:
        render.suggestion_human(s)


def _read_log(path: str) -> str:
    import sys
    from pathlib import Path

    from infer_tool.common.errors import BadInput
    from infer_tool.sizing.vllm_log import MAX_LOG_BYTES

    if path == "-":
        text = sys.stdin.read(MAX_LOG_BYTES + 1)
    else:
        p = Path(path).expanduser()
        if not p.is_file():
            raise BadInput(f"--from-log {path!r}: no such file (give a vLLM start-up log, or - for stdin)")
        if p.stat().st_size > MAX_LOG_BYTES:
            raise BadInput(f"--from-log {path!r}: {p.stat().st_size:,} bytes; at most {MAX_LOG_BYTES:,} are read")
        with p.open("rb") as f:
            text = f.read(MAX_LOG_BYTES + 1).decode("utf-8", errors="replace")
    if len(text) > MAX_LOG_BYTES:
        raise BadInput(f"--from-log {path!r}: more than {MAX_LOG_BYTES:,} bytes; give the start-up part")
    return text


def _replay(opts: dict[str, Any], json_out: bool, targets: tuple[int | None, int | None] | None = None) -> None:
    from infer_tool.common.errors import BadInput
    from infer_tool.common.sizes import parse_size
    from infer_tool.jobs.kv_budget import replay_log

    extra = sorted(k for k, v in opts.items() if k not in _REPLAY_OPTIONS and v not in (False, None))
    if extra:
        flags = ", ".join("--" + k.replace("_", "-") for k in extra)
        raise BadInput(
            f"--from-log replays the log's own settings; drop {flags} (accepted beside it: MODEL, --gpu, "
            "--gpu-mem, --vllm-version)"
        )
    gpu_mem = parse_size(opts["gpu_mem"], "--gpu-mem", minimum=2**20) if "gpu_mem" in opts else None
    rep = replay_log(
        _read_log(opts["from_log"]),
        model=opts.get("model"),
        gpu=opts.get("gpu"),
        gpu_mem_bytes=gpu_mem,
        vllm_version=opts.get("vllm_version"),
    )
    from infer_tool.cli.commands import kv_budget_render as render

    if targets is not None:  # what to change on the logged server
        from infer_tool.jobs.kv_budget import reach_target

        s = reach_target(rep.report.request, *targets)
        if json_out:
            from infer_tool.cli.output import emit_json

            emit_json({**render.replay_document(rep), "target": render.suggestion_document(s)})
        else:
            render.replay_human(rep)
            render.suggestion_human(s)
        return
    if json_out:
        from infer_tool.cli.output import emit_json

        emit_json(render.replay_document(rep))
    else:
        render.replay_human(rep)


def _print_lists(models: bool, gpus: bool, json_out: bool, model_presets: dict, gpu_presets: dict) -> None:
    from rich.table import Table

    from infer_tool.cli.output import emit_json, out

    if json_out:
        doc: dict[str, Any] = {}
        if models:
            doc["models"] = {k: {"hf_id": p.hf_id, "source": p.source} for k, p in model_presets.items()}
        if gpus:
            doc["gpus"] = {
                k: {
                    "name": p.name,
                    "memory_bytes": p.memory_bytes,
                    "source": p.source,
                    "cuda_memory_bytes": p.cuda_memory_bytes,
                    "cuda_source": p.cuda_source,
                    "compute_capability": p.compute_capability,
                    "hbm_bytes_per_s": p.hbm_bytes_per_s,
                    "bf16_flops": p.bf16_flops,
                    "fp8_flops": p.fp8_flops,
                    "link_bytes_per_s": p.link_bytes_per_s,
                    "spec_source": p.spec_source,
                }
                for k, p in gpu_presets.items()
            }
        emit_json(doc)
        return
    if models:
        t = Table(title="Model presets (config.json facts)")
        for col in ("preset", "Hugging Face id", "source"):
            t.add_column(col)
        for k, p in model_presets.items():
            t.add_row(k, p.hf_id, p.source)
        out().print(t)
    if gpus:
        t = Table(title="GPU presets (driver and CUDA totals; datasheet bandwidth and dense FLOP/s)")
        for col in ("preset", "memory", "CUDA total", "HBM TB/s", "BF16 TF/s", "FP8 TF/s", "link GB/s"):
            t.add_column(col, justify="left" if col == "preset" else "right")

        def num(v: float | None, scale: float) -> str:
            return "-" if v is None else f"{v / scale:,.4g}"

        for k, p in gpu_presets.items():
            cuda = "-" if p.cuda_memory_bytes is None else f"{p.cuda_memory_bytes / 2**30:,.2f} GiB"
            t.add_row(
                k,
                f"{p.memory_bytes / 2**30:,.2f} GiB",
                cuda,
                num(p.hbm_bytes_per_s, 1e12),
                num(p.bf16_flops, 1e12),
                num(p.fp8_flops, 1e12),
                num(p.link_bytes_per_s, 1e9),
            )
        out().print(t)
