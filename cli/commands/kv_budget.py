"""`infer-tool kv-budget MODEL`: KV-cache memory budgets per model / context /
concurrency on a GPU deployment. Pure arithmetic over the model's shape (`sizing/`);
imports only typer and the stdlib-only `sizing` constants at module import; rich and
the rest of sizing inside the command."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from infer_tool.sizing.capacity import DEFAULT_BLOCK_SIZE, DEFAULT_MEM_UTIL, DEFAULT_RESERVE_BYTES

if TYPE_CHECKING:
    from infer_tool.sizing.capacity import Planner, Row

_DEFAULT_GPU = "H100-80GB"
_DEFAULT_CONCURRENCY = ["1,8,32,128"]
_DEFAULT_CONTEXT_START = 4096
_DEFAULT_CONTEXT_END = 131072  # when the model states no max_position_embeddings


def register(app: typer.Typer) -> None:
    app.command(name="kv-budget", no_args_is_help=True)(kv_budget)


def kv_budget(
    model: Annotated[
        Optional[str],
        typer.Argument(help="HF model directory or config.json, a .gguf file, or a preset (--list-models)."),
    ] = None,
    gpu: Annotated[str, typer.Option(help="GPU preset (--list-gpus).")] = _DEFAULT_GPU,
    gpu_mem: Annotated[Optional[str], typer.Option(help="GPU memory instead of a preset: 80GiB, 80GB, 24G.")] = None,
    num_gpus: Annotated[
        Optional[int], typer.Option(help="GPUs in all (default: tp x pp); extra ones are replicas.")
    ] = None,
    tp: Annotated[Optional[int], typer.Option(help="Tensor-parallel size (default: num-gpus / pp).")] = None,
    pp: Annotated[int, typer.Option(help="Pipeline-parallel size.")] = 1,
    mem_util: Annotated[
        Optional[float], typer.Option(help=f"Fraction of GPU memory usable (default: {DEFAULT_MEM_UTIL}, as vLLM).")
    ] = None,
    weights: Annotated[
        Optional[str],
        typer.Option(help="bf16|fp16|fp8|int8|int4 (default: real bytes of the model's files if any, else bf16)."),
    ] = None,
    group_size: Annotated[int, typer.Option(help="int4 group size (-1: per channel).")] = 128,
    kv_dtype: Annotated[str, typer.Option(help="KV cache dtype: bf16|fp16|fp8|int8|int4.")] = "bf16",
    block_size: Annotated[
        Optional[int], typer.Option(help=f"Tokens per cache block (default: {DEFAULT_BLOCK_SIZE}, as vLLM).")
    ] = None,
    context: Annotated[
        Optional[list[str]],
        typer.Option(
            help="Context lengths: 8192, 32k, lists 4k,8k, ranges 4k..128k (doubling) or 1k..8k:1k "
            "(default: 4k doubling up to the model's max_position_embeddings)."
        ),
    ] = None,
    concurrency: Annotated[
        Optional[list[str]],
        typer.Option(help=f"Concurrent sequences, same syntax as --context (default: {_DEFAULT_CONCURRENCY[0]})."),
    ] = None,
    shared_prefix: Annotated[
        int, typer.Option(help="Prompt-prefix tokens shared by all sequences (prefix caching).")
    ] = 0,
    reserve: Annotated[
        Optional[str],
        typer.Option(help=f"Activation/workspace memory kept aside per GPU (default: {DEFAULT_RESERVE_BYTES / 2**30:g}GiB)."),
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")] = False,
    list_models: Annotated[bool, typer.Option("--list-models", help="List model presets and exit.")] = False,
    list_gpus: Annotated[bool, typer.Option("--list-gpus", help="List GPU presets and exit.")] = False,
) -> None:
    """KV-cache memory budget of MODEL per context and concurrency on a GPU deployment."""
    args = dict(locals())
    from infer_tool.cli.output import cli_command

    cli_command(_run)(**args)


def _run(
    model: str | None,
    gpu: str,
    gpu_mem: str | None,
    num_gpus: int | None,
    tp: int | None,
    pp: int,
    mem_util: float | None,
    weights: str | None,
    group_size: int,
    kv_dtype: str,
    block_size: int | None,
    context: list[str] | None,
    concurrency: list[str] | None,
    shared_prefix: int,
    reserve: str | None,
    json_out: bool,
    list_models: bool,
    list_gpus: bool,
) -> None:
    from infer_tool.common.errors import BadInput
    from infer_tool.sizing import capacity, kv, units
    from infer_tool.sizing.presets import gpu_preset, gpu_presets, model_presets
    from infer_tool.sizing.resolve import resolve_model
    from infer_tool.sizing.weights import weight_bytes

    if list_models or list_gpus:
        _print_lists(list_models, list_gpus, json_out, model_presets(), gpu_presets())
        return
    if model is None:
        raise BadInput("MODEL is required (a model directory, config.json, .gguf file or a preset from --list-models)")

    if gpu_mem is not None:
        gpu_name, gpu_bytes = f"custom {gpu_mem}", units.parse_bytes(gpu_mem, "--gpu-mem")
    else:
        preset = gpu_preset(gpu)
        gpu_name, gpu_bytes = preset.key, preset.memory_bytes
    if pp < 1:
        raise BadInput(f"--pp {pp} must be at least 1")
    if tp is None:
        tp = max(1, (num_gpus or pp) // pp)
    if num_gpus is None:
        num_gpus = tp * pp
    dep = capacity.Deployment(
        gpu_memory_bytes=gpu_bytes,
        num_gpus=num_gpus,
        tp=tp,
        pp=pp,
        kv=kv.kv_dtype(kv_dtype),
        mem_util=DEFAULT_MEM_UTIL if mem_util is None else mem_util,
        reserve_bytes=(
            DEFAULT_RESERVE_BYTES if reserve is None else units.parse_bytes(reserve, "--reserve", allow_zero=True)
        ),
        block_size=DEFAULT_BLOCK_SIZE if block_size is None else block_size,
        shared_prefix=shared_prefix,
    )

    resolved = resolve_model(model)
    shape = resolved.shape
    notes = list(shape.notes)
    if weights is None and resolved.file_weight_bytes is not None:
        weights_total, weights_how = resolved.file_weight_bytes, resolved.file_weight_note
    else:
        if shape.params is None:
            raise BadInput(
                f"cannot count {shape.name}'s parameters for --weights {weights or 'bf16'} "
                f"({'; '.join(notes)}); pass a directory with *.safetensors"
            )
        wb = weight_bytes(shape.params, weights or "bf16", group_size)
        weights_total, weights_how = wb.total, wb.how

    contexts = units.parse_counts(context or [_default_contexts(shape.max_position_embeddings)], "--context")
    concurrencies = units.parse_counts(concurrency or _DEFAULT_CONCURRENCY, "--concurrency")
    limit = shape.max_position_embeddings
    if limit and contexts[-1] > limit:
        notes.append(f"context {contexts[-1]} exceeds the model's max_position_embeddings {limit}")

    planner = capacity.Planner(shape, dep, weights_total)
    rows = [planner.row(c, n) for c in contexts for n in concurrencies]
    max_conc = {c: planner.max_concurrency(c) for c in contexts}
    max_ctx = {n: planner.max_context(n) for n in concurrencies}
    doc = _document(planner, resolved, gpu_name, weights_total, weights_how, rows, max_conc, max_ctx, notes)
    if json_out:
        from infer_tool.cli.output import emit_json

        emit_json(doc)
    else:
        _print_human(planner, doc, rows, contexts, concurrencies, max_conc, max_ctx)


def _default_contexts(limit: int | None) -> str:
    end = limit or _DEFAULT_CONTEXT_END
    start = min(_DEFAULT_CONTEXT_START, end)
    return f"{start}..{end}"


def _document(
    planner: Planner,
    resolved: Any,
    gpu_name: str,
    weights_total: int,
    weights_how: str,
    rows: list[Row],
    max_conc: dict[int, int],
    max_ctx: dict[int, tuple[int, str]],
    notes: list[str],
) -> dict[str, Any]:
    shape, dep = planner.shape, planner.dep
    per_token = planner.bytes_per_token_by_kind()
    return {
        "model": shape.name,
        "source": shape.source,
        "layers": {k: shape.count(k) for k in ("full_attention", "sliding_attention", "mla", "linear_state")},
        "params": shape.params.total if shape.params else None,
        "gpu": {"name": gpu_name, "memory_bytes": dep.gpu_memory_bytes},
        "deployment": {
            "num_gpus": dep.num_gpus,
            "tp": dep.tp,
            "pp": dep.pp,
            "dp": dep.dp,
            "mem_util": dep.mem_util,
            "usable_bytes_per_gpu": dep.usable_bytes,
            "reserve_bytes_per_gpu": dep.reserve_bytes,
            "kv_dtype": dep.kv.name,
            "kv_scales": dep.kv.scales,
            "block_size": dep.block_size,
            "shared_prefix": dep.shared_prefix,
        },
        "weights": {
            "bytes_total": weights_total,
            "bytes_per_gpu": planner.weight_bytes_per_gpu,
            "how": weights_how,
            "from_files": resolved.file_weight_bytes is not None and weights_total == resolved.file_weight_bytes,
        },
        "kv_bytes_per_token": sum(per_token.values()),
        "kv_bytes_per_token_by_kind": per_token,
        "state_bytes_per_sequence": planner.state_bytes_per_sequence(),
        "rows": [
            {
                "context": r.context,
                "concurrency": r.concurrency,
                "kv_bytes_per_sequence": r.kv_bytes_per_sequence,
                "kv_bytes_total": r.kv_bytes_total,
                "kv_bytes_per_gpu": r.kv_bytes_per_gpu,
                "weight_bytes_per_gpu": r.weight_bytes_per_gpu,
                "reserve_bytes_per_gpu": r.reserve_bytes_per_gpu,
                "used_bytes_per_gpu": r.used_bytes_per_gpu,
                "usable_bytes_per_gpu": r.usable_bytes_per_gpu,
                "headroom_bytes_per_gpu": r.headroom_bytes,
                "fits": r.fits,
                "kv_bytes_per_sequence_by_kind": planner.sequence_by_kind(r.context),
            }
            for r in rows
        ],
        "max_concurrency": {str(c): n for c, n in max_conc.items()},
        "max_context": {str(n): c for n, (c, _) in max_ctx.items()},
        "max_context_limited_by": {str(n): why for n, (_, why) in max_ctx.items()},
        "notes": notes,
    }


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,} B"


def _print_lists(models: bool, gpus: bool, json_out: bool, model_presets: dict, gpu_presets: dict) -> None:
    from rich.table import Table

    from infer_tool.cli.output import emit_json, out

    if json_out:
        doc: dict[str, Any] = {}
        if models:
            doc["models"] = {k: {"hf_id": p.hf_id, "source": p.source} for k, p in model_presets.items()}
        if gpus:
            doc["gpus"] = {
                k: {"name": p.name, "memory_bytes": p.memory_bytes, "source": p.source} for k, p in gpu_presets.items()
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
        t = Table(title="GPU presets (driver-reported memory)")
        for col in ("preset", "name", "memory", "source"):
            t.add_column(col, justify="right" if col == "memory" else "left")
        for k, p in gpu_presets.items():
            t.add_row(k, p.name, _size(p.memory_bytes), p.source)
        out().print(t)


def _print_human(
    planner: Planner,
    doc: dict[str, Any],
    rows: list[Row],
    contexts: list[int],
    concurrencies: list[int],
    max_conc: dict[int, int],
    max_ctx: dict[int, tuple[int, str]],
) -> None:
    from rich.table import Table

    from infer_tool.cli.output import err, out
    from infer_tool.sizing.capacity import KIND_LABELS

    console = out()
    dep, shape = planner.dep, planner.shape
    layers = ", ".join(f"{n} {KIND_LABELS[k]}" for k, n in doc["layers"].items() if n)
    params = f"{doc['params'] / 1e9:,.2f}B params" if doc["params"] else "params unknown"
    console.print(f"[bold]{shape.name}[/]: {shape.num_layers} layers ({layers}), {params}")
    console.print(
        f"GPU {doc['gpu']['name']} x {dep.num_gpus} (tp {dep.tp}, pp {dep.pp}, replicas {dep.dp}); usable "
        f"{_size(dep.usable_bytes)}/GPU = {dep.mem_util:g} x {_size(dep.gpu_memory_bytes)}; "
        f"reserve {_size(dep.reserve_bytes)}/GPU (activations/workspace, --reserve)"
    )
    console.print(
        f"weights {_size(doc['weights']['bytes_total'])} ({doc['weights']['how']}) = "
        f"{_size(planner.weight_bytes_per_gpu)}/GPU; KV {dep.kv.name} (scales: {dep.kv.scales}), "
        f"block {dep.block_size}, shared prefix {dep.shared_prefix} tokens"
    )

    t = Table(title="KV cache per token and per sequence (all GPUs of a replica)")
    t.add_column("layer kind")
    t.add_column("layers", justify="right")
    t.add_column("per token", justify="right")
    for c in contexts:
        t.add_column(f"per seq @ {c:,}", justify="right")
    per_seq = {c: planner.sequence_by_kind(c) for c in contexts}
    for kind, label in KIND_LABELS.items():
        if not doc["layers"][kind]:
            continue
        tok = doc["kv_bytes_per_token_by_kind"].get(kind)
        t.add_row(
            label,
            str(doc["layers"][kind]),
            f"{tok:,} B" if tok is not None else "constant",
            *(_size(per_seq[c].get(kind, 0)) for c in contexts),
        )
    t.add_row(
        "[bold]total[/]",
        str(shape.num_layers),
        f"[bold]{doc['kv_bytes_per_token']:,} B[/]",
        *(f"[bold]{_size(sum(per_seq[c].values()))}[/]" for c in contexts),
    )
    console.print(t)

    t = Table(title=f"Memory per GPU (busiest GPU; usable {_size(dep.usable_bytes)})")
    for col in ("context", "seqs", "KV / seq", "KV total", "KV / GPU", "weights / GPU", "used", "fits", "headroom"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            f"{r.context:,}",
            str(r.concurrency),
            _size(r.kv_bytes_per_sequence),
            _size(r.kv_bytes_total),
            _size(r.kv_bytes_per_gpu),
            _size(r.weight_bytes_per_gpu),
            _size(r.used_bytes_per_gpu),
            "[green]yes[/]" if r.fits else "[red]no[/]",
            f"[green]{_size(r.headroom_bytes)}[/]" if r.fits else f"[red]{_size(r.headroom_bytes)}[/]",
        )
    console.print(t)

    t = Table(title="Limits")
    t.add_column("context", justify="right")
    t.add_column("max concurrency", justify="right")
    t.add_column("concurrency", justify="right")
    t.add_column("max context", justify="right")
    for i in range(max(len(contexts), len(concurrencies))):
        left = (f"{contexts[i]:,}", f"{max_conc[contexts[i]]:,}") if i < len(contexts) else ("", "")
        if i < len(concurrencies):
            n = concurrencies[i]
            ctx, why = max_ctx[n]
            right = (str(n), f"{ctx:,} ({why})")
        else:
            right = ("", "")
        t.add_row(*left, *right)
    console.print(t)

    by_key = {(r.context, r.concurrency): r for r in rows}
    t = Table(
        title="Sweep: used / usable memory per GPU",
        caption="[green]fits[/]  [yellow]fits, over 90% full[/]  [red]does not fit[/]",
    )
    t.add_column("context \\ concurrency", justify="right")
    for n in concurrencies:
        t.add_column(str(n), justify="right")
    for c in contexts:
        cells = []
        for n in concurrencies:
            r = by_key[(c, n)]
            share = r.used_bytes_per_gpu / r.usable_bytes_per_gpu
            colour = "red" if not r.fits else ("yellow" if share > 0.9 else "green")
            cells.append(f"[{colour}]{share:.0%}[/]")
        t.add_row(f"{c:,}", *cells)
    console.print(t)
    for note in doc["notes"]:
        err().print(f"[yellow]note:[/] {note}", highlight=False)
