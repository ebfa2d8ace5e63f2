"""`infer-tool kv-budget MODEL`: what fits (by vLLM's KV-cache accounting or the plain
per-token arithmetic), the smallest deployment that does (`--solve`) and how fast it
serves, per context x concurrency. The library job is `sizing.budget.plan`; this module
parses text into its `PlanRequest` and prints the `Report`. At import it loads only typer
and `sizing.defaults`."""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING, Annotated, Any, Callable, Optional

import typer

from infer_tool.cli.options import HbmEfficiency, Json, LinkEfficiency, Mfu, efficiency
from infer_tool.sizing.defaults import (
    DEFAULT_ACCOUNTING,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CONCURRENCY,
    DEFAULT_GPU,
    DEFAULT_MEM_UTIL,
    DEFAULT_OUTPUT_LEN,
    DEFAULT_RESERVE_BYTES,
    VLLM_VERSION,
)

if TYPE_CHECKING:
    from infer_tool.sizing.budget import Report

Opt = typer.Option


def register(app: typer.Typer) -> None:
    app.command(name="kv-budget", no_args_is_help=True)(kv_budget)


def kv_budget(
    model: Annotated[Optional[str], typer.Argument(help="HF model directory or config.json, a .gguf file, or a preset (--list-models).")] = None,
    gpu: Annotated[Optional[str], Opt(help=f"GPU preset (--list-gpus; default {DEFAULT_GPU}).")] = None,
    gpu_mem: Annotated[Optional[str], Opt(help="GPU memory instead of a preset: 80GiB, 80GB, 24G.")] = None,
    num_gpus: Annotated[Optional[int], Opt(help="GPUs in all (default tp x pp); extra ones are data-parallel replicas.")] = None,
    tp: Annotated[Optional[int], Opt(help="Tensor-parallel size (default num-gpus / pp).")] = None,
    pp: Annotated[Optional[int], Opt(help="Pipeline-parallel size (default 1).")] = None,
    mem_util: Annotated[Optional[float], Opt(help=f"Fraction of GPU memory usable (default {DEFAULT_MEM_UTIL}, as vLLM).")] = None,
    weights: Annotated[Optional[str], Opt(help="bf16|fp16|fp8|int8|int4 (default: the model files' real bytes if any, else bf16).")] = None,
    group_size: Annotated[Optional[int], Opt(help="int4 group size, -1 per channel (default 128).")] = None,
    kv_dtype: Annotated[Optional[str], Opt(help="KV cache dtype: bf16|fp16|fp8 (int8|int4 with --accounting plain); default bf16.")] = None,
    block_size: Annotated[Optional[int], Opt(help=f"Tokens per cache block (default {DEFAULT_BLOCK_SIZE}, as vLLM).")] = None,
    context: Annotated[Optional[list[str]], Opt(help="Contexts (vLLM's --max-model-len): 8192, 32k, lists 4k,8k, ranges 4k..128k (doubling) or 1k..8k:1k; default 4k doubling to the model's limit.")] = None,
    concurrency: Annotated[Optional[list[str]], Opt(help=f"Concurrent sequences, same syntax (default {','.join(map(str, DEFAULT_CONCURRENCY))}).")] = None,
    shared_prefix: Annotated[Optional[int], Opt(help="Prompt-prefix tokens shared by all sequences (prefix caching); below every context.")] = None,
    reserve: Annotated[Optional[str], Opt(help=f"Activation/workspace memory kept aside per GPU (default {DEFAULT_RESERVE_BYTES / 2**30:g}GiB).")] = None,
    kv_cache_memory: Annotated[Optional[str], Opt(help="KV cache size per GPU, as vLLM's --kv-cache-memory-bytes (ignores --mem-util): 12GiB.")] = None,
    accounting: Annotated[Optional[str], Opt(help=f"vllm: vLLM {VLLM_VERSION}'s block accounting; plain: bytes per token (default {DEFAULT_ACCOUNTING}).")] = None,
    max_num_batched_tokens: Annotated[Optional[int], Opt(help="vLLM's --max-num-batched-tokens (default: vllm serve's for the GPU); sizes sliding-window reservations.")] = None,
    async_scheduling: Annotated[Optional[bool], Opt("--async-scheduling/--no-async-scheduling", help="vLLM async scheduling (default on): 2 batches in flight.")] = None,
    prefix_caching: Annotated[Optional[bool], Opt("--prefix-caching/--no-prefix-caching", help="vLLM prefix caching (default on): 2 state blocks per request on hybrid models.")] = None,
    prompt_len: Annotated[Optional[int], Opt(help="Prompt tokens for TTFT and TPOT (default: the row's context less --output-len).")] = None,
    output_len: Annotated[Optional[int], Opt(help=f"Output tokens per request (default {DEFAULT_OUTPUT_LEN}).")] = None,
    spec: Annotated[Optional[str], Opt(help="Speculative decoding ALPHA,K,C (acceptance, drafts per pass, draft/target cost): 0.8,4,0.05.")] = None,
    spec_profile: Annotated[Optional[str], Opt(help="Speculative decoding from a `spec-profile --json` report (its top-ranked draft).")] = None,
    hbm_efficiency: HbmEfficiency = None,
    mfu: Mfu = None,
    link_efficiency: LinkEfficiency = None,
    solve: Annotated[bool, Opt("--solve", help="List the smallest deployments (GPU x count x TP/PP x weights x KV dtype) serving the largest context x concurrency asked.")] = False,
    solve_gpu: Annotated[Optional[list[str]], Opt(help="GPU presets --solve may use (default: all).")] = None,
    max_tpot: Annotated[Optional[float], Opt(help="--solve latency target: time per output token, ms.")] = None,
    max_ttft: Annotated[Optional[float], Opt(help="--solve latency target: time to first token, ms.")] = None,
    require_fit: Annotated[bool, Opt("--require-fit", help="Exit 3 when a requested row does not fit (capacity check in CI).")] = False,
    json_out: Json = False,
    list_models: Annotated[bool, Opt("--list-models", help="List model presets and exit.")] = False,
    list_gpus: Annotated[bool, Opt("--list-gpus", help="List GPU presets and exit.")] = False,
) -> None:
    opts = {k: v for k, v in locals().items() if v is not None}
    from infer_tool.cli.output import cli_command

    cli_command(_run)(opts)


kv_budget.__doc__ = f"Fits, smallest deployment and speed of MODEL per context x concurrency (vLLM {VLLM_VERSION} KV-cache accounting)."


def _parsers() -> dict[str, tuple[str, Callable[[Any], Any]]]:
    """CLI option -> (PlanRequest field, parser of its text)."""
    from infer_tool.sizing import units
    from infer_tool.spec.report import parse_spec

    return {
        "gpu_mem": ("gpu_mem_bytes", lambda t: units.parse_bytes(t, "--gpu-mem")),
        "reserve": ("reserve_bytes", lambda t: units.parse_bytes(t, "--reserve", allow_zero=True)),
        "kv_cache_memory": ("kv_cache_memory_bytes", lambda t: units.parse_bytes(t, "--kv-cache-memory")),
        "context": ("contexts", lambda v: tuple(units.parse_counts(v, "--context"))),
        "concurrency": ("concurrencies", lambda v: tuple(units.parse_counts(v, "--concurrency"))),
        "spec": ("spec", parse_spec),
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
    from infer_tool.sizing.budget import PlanRequest
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
    if "model" not in opts:
        raise BadInput("MODEL is required (a model directory, config.json, .gguf file or a preset from --list-models)")
    request, notes = build_request(opts)
    from infer_tool.cli.commands import kv_budget_render as render
    from infer_tool.sizing.budget import plan

    report = plan(request)
    report.notes[:0] = notes
    if json_out:
        from infer_tool.cli.output import emit_json

        emit_json(render.document(report))
    else:
        render.human(report)
    if require_fit and not report.all_fit:
        bad = [f"{r.context}x{r.concurrency} ({r.fit.binding})" for r in report.rows if not r.fit.fits]
        raise QualityGateFailed(f"--require-fit: {len(bad)} of {len(report.rows)} rows do not fit: {', '.join(bad[:6])}")


def _print_lists(models: bool, gpus: bool, json_out: bool, model_presets: dict, gpu_presets: dict) -> None:
    from rich.table import Table

    from infer_tool.cli.output import emit_json, out

    if json_out:
        doc: dict[str, Any] = {}
        if models:
            doc["models"] = {k: {"hf_id": p.hf_id, "source": p.source} for k, p in model_presets.items()}
        if gpus:
            doc["gpus"] = {
                k: {"name": p.name, "memory_bytes": p.memory_bytes, "source": p.source,
                    "hbm_bytes_per_s": p.hbm_bytes_per_s, "bf16_flops": p.bf16_flops, "fp8_flops": p.fp8_flops,
                    "link_bytes_per_s": p.link_bytes_per_s, "spec_source": p.spec_source}
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
        t = Table(title="GPU presets (driver-reported memory; datasheet bandwidth and dense FLOP/s)")
        for col in ("preset", "memory", "HBM TB/s", "BF16 TF/s", "FP8 TF/s", "link GB/s"):
            t.add_column(col, justify="left" if col == "preset" else "right")

        def num(v: float | None, scale: float) -> str:
            return "-" if v is None else f"{v / scale:,.4g}"

        for k, p in gpu_presets.items():
            t.add_row(k, f"{p.memory_bytes / 2**30:,.2f} GiB", num(p.hbm_bytes_per_s, 1e12), num(p.bf16_flops, 1e12),
                      num(p.fp8_flops, 1e12), num(p.link_bytes_per_s, 1e9))
        out().print(t)
