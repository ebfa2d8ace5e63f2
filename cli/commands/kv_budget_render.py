"""Output of `kv-budget`: the --json document and the rich tables, from a
`jobs.kv_budget.Report`. Imported only when the command runs."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from infer_tool.cli.output import err, out
from infer_tool.jobs.kv_budget import Report
from infer_tool.sizing.capacity import KIND_LABELS
from infer_tool.sizing.roofline import StepTimes
from infer_tool.sizing.shape import KINDS
from infer_tool.sizing.solve import Candidate, Target


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def _speed(t: StepTimes | None) -> dict[str, Any] | None:
    if t is None:
        return None
    return {
        "ttft_s": t.ttft_s,
        "tpot_s": t.tpot_s,
        "output_tokens_per_s": t.output_tokens_per_s,
        "decode_step_s": t.decode_step_s,
        "decode_bound": t.bound,
        "memory_s": t.memory_s,
        "compute_s": t.compute_s,
        "comm_s": t.comm_s,
        "tokens_per_pass": t.tokens_per_pass,
        **t.terms,
    }


def _candidate(c: Candidate | None) -> dict[str, Any] | None:
    if c is None:
        return None
    return {
        "gpu": c.gpu,
        "num_gpus": c.num_gpus,
        "tp": c.tp,
        "pp": c.pp,
        "dp": c.dp,
        "weights": c.weights,
        "kv_dtype": c.kv_dtype,
        "kv_headroom": c.headroom,
        "max_concurrency": c.max_concurrency,
        "flags": c.flags(),
        "speed": _speed(c.speed),
    }


def _memory(r: Report) -> dict[str, Any]:
    """vLLM's start-up memory per pipeline stage, term by term (bytes per GPU)."""
    dep, fit = r.fit.dep, r.fit
    doc: dict[str, Any] = {
        "source": "vllm profile" if r.profiles is not None else "--reserve",
        "total_bytes": dep.gpu_memory_bytes,
        "total_source": r.gpu.cuda_source or r.gpu.source,
        "mem_util": dep.mem_util,
        "requested_bytes": dep.usable_bytes,
        "weights_bytes": fit.planner.weight_bytes_per_gpu,
        "overhead_bytes": fit.planner.reserve_bytes,
        "available_kv_bytes": fit.planner.kv_budget_per_gpu,
        "stages": [],
    }
    for stage, p in zip(fit.stages, r.profiles or ()):
        g = p.cudagraphs
        doc["stages"].append(
            {
                "layers": [stage.start, stage.stop],
                "weights_bytes": None if r.weights_how.startswith("unknown") else p.weights,
                "activation_peak_bytes": p.activation.bytes if p.activation.known else None,
                "activation_peak_at": p.activation.where,
                "forward_peak_bytes": p.activation.forward_bytes,
                "sampler_peak_bytes": p.activation.sampler_bytes,
                "non_torch_bytes": p.non_torch_bytes,
                "non_torch": dict(p.non_torch),
                "cudagraph_bytes": g.subtracted_bytes,
                "cudagraph_estimate_bytes": g.estimate_bytes,
                "cudagraphs": {
                    "piecewise": g.piecewise,
                    "full": g.full,
                    "largest": g.largest,
                    "first_bytes": g.first_bytes,
                    "per_graph_bytes": g.per_graph_bytes,
                    "in_budget": g.in_budget,
                },
                "overhead_bytes": p.overhead,
                "available_kv_bytes": p.available,
            }
        )
    return doc


def _target(t: Target) -> dict[str, Any]:
    return {"context": t.context, "concurrency": t.concurrency, "max_tpot_s": t.max_tpot_s, "max_ttft_s": t.max_ttft_s}


def document(r: Report) -> dict[str, Any]:
    """The --json document (one per run, printed whether or not anything fits)."""
    shape, fit, dep, req = r.shape, r.fit, r.fit.dep, r.request
    planner = fit.planner
    per_token = planner.bytes_per_token_by_kind()
    vllm: dict[str, Any] | None = None
    if fit.layout is not None:
        vllm = {}
        for c in sorted({row.context for row in r.rows}):
            cap = fit.vllm(c)
            vllm[str(c)] = {
                "num_blocks": cap.num_blocks,
                "blocks_per_request": cap.blocks_per_request,
                "kv_cache_tokens": cap.kv_cache_tokens,
                "max_concurrency_log": cap.max_concurrency_log,
                "max_concurrency": cap.max_concurrency * dep.dp,
                "shared_blocks": cap.shared_blocks,
                "max_num_batched_tokens": fit.max_num_batched_tokens(c),
                "log_line": f"GPU KV cache size: {cap.kv_cache_tokens:,} tokens, Maximum concurrency for {c:,} "
                f"tokens per request: {cap.max_concurrency_log:.2f}x",
            }
    rows = []
    for row in r.rows:
        p, f = row.fit.plain, row.fit
        rows.append(
            {
                "context": row.context,
                "concurrency": row.concurrency,
                "fits": f.fits,
                "binding": f.binding,
                "kv_bytes_per_sequence": p.kv_bytes_per_sequence,
                "kv_bytes_total": p.kv_bytes_total,
                "kv_bytes_per_gpu": f.kv_bytes_per_gpu,
                "weight_bytes_per_gpu": p.weight_bytes_per_gpu,
                "reserve_bytes_per_gpu": p.reserve_bytes_per_gpu,
                "used_bytes_per_gpu": f.used_bytes_per_gpu,
                "usable_bytes_per_gpu": p.usable_bytes_per_gpu,
                "headroom_bytes_per_gpu": f.headroom_bytes,
                "kv_bytes_per_sequence_by_kind": planner.sequence_by_kind(row.context),
                "plain": {
                    "fits": p.fits,
                    "kv_bytes_per_gpu": p.kv_bytes_per_gpu,
                    "max_concurrency": planner.max_concurrency(row.context),
                },
                "speed": _speed(row.speed),
            }
        )
    return {
        "model": shape.name,
        "source": shape.source,
        "layers": {k: shape.count(k) for k in KINDS},
        "params": shape.params.total if shape.params else None,
        "active_params": shape.params.active if shape.params else None,
        "gpu": {
            "name": r.gpu.name,
            "preset": r.gpu.key,
            "memory_bytes": dep.gpu_memory_bytes,
            "driver_memory_bytes": r.gpu.memory_bytes,
            "cuda_memory_bytes": r.gpu.cuda_memory_bytes,
            "hbm_bytes_per_s": r.gpu.hbm_bytes_per_s,
            "bf16_flops": r.gpu.bf16_flops,
            "fp8_flops": r.gpu.fp8_flops,
            "link_bytes_per_s": r.gpu.link_bytes_per_s,
        },
        "deployment": {
            "num_gpus": dep.num_gpus,
            "tp": dep.tp,
            "pp": dep.pp,
            "dp": dep.dp,
            "mem_util": dep.mem_util,
            "usable_bytes_per_gpu": dep.usable_bytes,
            "reserve_bytes_per_gpu": dep.reserve_bytes,
            "kv_cache_memory_bytes": dep.kv_cache_memory_bytes,
            "kv_budget_bytes_per_gpu": planner.kv_budget_per_gpu,
            "kv_dtype": dep.kv.name,
            "kv_scales": dep.kv.scales,
            "block_size": dep.block_size,
            "shared_prefix": dep.shared_prefix,
        },
        "accounting": req.accounting,
        "vllm_version": r.engine.vllm_version,
        "engine": {
            "block_size": fit.layout.block_size if fit.layout else dep.block_size,
            "kv_cache_groups": len(fit.layout.groups) if fit.layout else None,
            "async_scheduling": r.engine.async_on,
            "enable_prefix_caching": req.prefix_caching,
            "max_num_batched_tokens": fit.max_num_batched_tokens(),
            "max_num_seqs": fit.max_num_seqs(),
            "enforce_eager": r.engine.enforce_eager,
            "model_runner": "v2" if fit.model_runner_v2() else "v1",
        },
        "memory": _memory(r),
        "weights": {
            "bytes_total": r.weights_total,
            "bytes_per_gpu": planner.weight_bytes_per_gpu,
            "how": r.weights_how,
            "from_files": r.weights_from_files,
        },
        "kv_bytes_per_token": sum(per_token.values()),
        "kv_bytes_per_token_by_kind": per_token,
        "state_bytes_per_sequence": planner.state_bytes_per_sequence(),
        "vllm": vllm,
        "rows": rows,
        "all_fit": r.all_fit,
        "max_concurrency": {str(c): n for c, n in r.max_concurrency.items()},
        "max_context": {str(n): c for n, (c, _) in r.max_context.items()},
        "max_context_limited_by": {str(n): why for n, (_, why) in r.max_context.items()},
        "fixes": [{"target": _target(t), "deployment": _candidate(c)} for t, c in r.fixes],
        "solve": None
        if r.solve_target is None
        else {"target": _target(r.solve_target), "solutions": [_candidate(c) for c in r.solutions]},
        "speculation": None
        if req.spec is None
        else {
            "alpha": req.spec.alpha,
            "k": req.spec.k,
            "cost_ratio": req.spec.cost_ratio,
            "tokens_per_pass": req.spec.tokens_per_pass,
        },
        "speculative_decoding": None
        if r.drafter is None
        else {
            "method": r.drafter.method,
            "num_speculative_tokens": r.drafter.k,
            "drafter": r.drafter.source,
            "kv_layers_added": r.drafter.layers,
            "kv_bytes_per_token": r.drafter.kv_bytes_per_token,
            "weight_bytes_per_gpu": r.drafter.weight_bytes_per_gpu,
            "weights_how": r.drafter.weights_how,
            "lookahead_tokens_per_request": r.drafter.lookahead_tokens,
        },
        "notes": r.notes,
    }


def _ms(t: float) -> str:
    return f"{t * 1e3:,.1f} ms" if t < 10 else f"{t:,.1f} s"


def human(r: Report) -> None:
    console = out()
    doc = document(r)
    shape, fit, dep, planner = r.shape, r.fit, r.fit.dep, r.fit.planner
    layers = ", ".join(f"{n} {KIND_LABELS[k]}" for k, n in doc["layers"].items() if n)
    p = shape.params
    params = f"{p.total / 1e9:,.2f}B params ({p.active / 1e9:,.2f}B active)" if p else "params unknown"
    drafted = f" + {r.drafter.layers} drafter" if r.drafter and r.drafter.layers else ""
    console.print(
        f"[bold]{shape.name}[/]: {shape.num_layers - (r.drafter.layers if r.drafter else 0)} layers{drafted} "
        f"({layers}), {params}"
    )
    version = r.engine.vllm_version
    fixed = (
        f"KV cache fixed at {_size(dep.kv_cache_memory_bytes)}/GPU"
        if dep.kv_cache_memory_bytes
        else f"requested {_size(dep.usable_bytes)}/GPU = {dep.mem_util:g} x {_size(dep.gpu_memory_bytes)}"
    )
    driver = (
        "" if r.gpu.memory_bytes == dep.gpu_memory_bytes else f" (CUDA's total; driver {_size(r.gpu.memory_bytes)})"
    )
    console.print(f"GPU {r.gpu.name} x {dep.num_gpus} (tp {dep.tp}, pp {dep.pp}, replicas {dep.dp}); {fixed}{driver}")
    console.print(
        f"weights {_size(r.weights_total)} ({r.weights_how}) = {_size(planner.weight_bytes_per_gpu)}/GPU; "
        f"KV {dep.kv.name} (scales: {dep.kv.scales}), block {dep.block_size}, shared prefix {dep.shared_prefix} tokens"
    )
    if fit.layout is not None:
        console.print(
            f"accounting: vLLM {version} blocks ({len(fit.layout.groups)} KV-cache group(s) of "
            f"{fit.layout.block_size}-token blocks; async scheduling {'on' if r.engine.async_on else 'off'}, "
            f"prefix caching {'on' if r.request.prefix_caching else 'off'})"
        )
    _memory_table(console, r, doc["memory"])
    if r.drafter is not None:
        d = r.drafter
        t = Table(title=f"Speculative decoding ({d.method}, k={d.k}): what it adds per GPU")
        for col in ("term", "size", "what"):
            t.add_column(col, justify="right" if col == "size" else "left")
        t.add_row("drafter weights", _size(d.weight_bytes_per_gpu), d.weights_how)
        t.add_row(
            "drafter KV", f"{d.kv_bytes_per_token:,} B/token", f"{d.layers} layers of {d.source}; in the tables below"
        )
        t.add_row(
            "lookahead slots",
            f"{d.lookahead_tokens} tokens/request",
            "capped at --max-model-len: no extra block at context = max model len",
        )
        console.print(t)
    contexts = sorted({row.context for row in r.rows})
    _kv_table(console, doc, r, contexts)
    if doc["vllm"]:
        t = Table(title=f"vLLM {version} KV cache at --max-model-len = context (what its start-up log says)")
        for col in (
            "context",
            "batched tokens",
            "blocks / request",
            "GPU blocks",
            "KV cache tokens",
            "max concurrency (log)",
            "plain max concurrency",
        ):
            t.add_column(col, justify="right")
        for c in contexts:
            v = doc["vllm"][str(c)]
            t.add_row(
                f"{c:,}",
                f"{v['max_num_batched_tokens']:,}",
                f"{v['blocks_per_request']:,}",
                f"{v['num_blocks']:,}",
                f"{v['kv_cache_tokens']:,}",
                f"{v['max_concurrency_log']:,.2f}x",
                f"{planner.max_concurrency(c):,}",
            )
        console.print(t)
    _rows_table(console, r, planner)
    _limits(console, r, contexts)
    _sweep(console, r, contexts)
    for target, cand in r.fixes:
        what = f"{target.context:,} tokens x {target.concurrency}"
        if cand is None:
            console.print(f"[red]{what}: no deployment of up to 16 {r.gpu.key} GPUs serves it[/]")
        else:
            console.print(
                f"[yellow]{what} does not fit; smallest fix on {r.gpu.key}:[/] {cand.flags()} "
                f"(serves {cand.max_concurrency:,} at {target.context:,}, {cand.headroom:.0%} KV headroom)"
            )
    if r.solve_target is not None:
        _solutions(console, r)
    for note in r.notes:
        err().print(f"[yellow]note:[/] {note}", highlight=False)


def _memory_table(console: Any, r: Report, mem: dict[str, Any]) -> None:
    """Where each GPU's memory goes at vLLM's start-up (one column per pipeline stage)."""
    if not mem["stages"]:
        console.print(
            f"memory: {_size(mem['overhead_bytes'])}/GPU kept beside weights and KV cache (--reserve); "
            f"{_size(mem['available_kv_bytes'])}/GPU for the KV cache"
        )
        return
    stages = mem["stages"]
    runner = "V2" if r.fit.model_runner_v2() else "V1"
    t = Table(
        title=f"vLLM {r.engine.vllm_version} start-up memory per GPU (modelled from its profile run, "
        f"model runner {runner})"
    )
    t.add_column("term")
    for s in stages:
        t.add_column("GPU" if len(stages) == 1 else f"layers {s['layers'][0]}-{s['layers'][1] - 1}", justify="right")
    t.add_column("what")

    def row(label: str, key: str, what: str | list[str]) -> None:
        whats = what if isinstance(what, list) else [what] * len(stages)
        t.add_row(label, *("unknown" if s[key] is None else _size(s[key]) for s in stages), whats[0])

    total = mem["total_bytes"]
    t.add_row("total", *(_size(total) for _ in stages), "as CUDA reports it")
    t.add_row(
        f"x {mem['mem_util']:g} requested", *(_size(mem["requested_bytes"]) for _ in stages), "--gpu-memory-utilization"
    )
    row("- weights", "weights_bytes", "per GPU")
    row("- activation peak", "activation_peak_bytes", [s["activation_peak_at"] for s in stages])
    row("- non-torch, workspaces", "non_torch_bytes", ", ".join(stages[-1]["non_torch"]))
    g = stages[-1]["cudagraphs"]
    graphs = (
        (
            f"{g['piecewise']} PIECEWISE + {g['full']} FULL up to {g['largest']} tokens"
            + (
                ""
                if g["in_budget"]
                else f"; {_size(stages[-1]['cudagraph_estimate_bytes'])} outside the budget (see the notes)"
            )
        )
        if g["piecewise"]
        else "none (--enforce-eager)"
    )
    row("- CUDA graphs", "cudagraph_bytes", graphs)
    row("= available KV", "available_kv_bytes", 'what vLLM logs as "Available KV cache memory"')
    console.print(t)


def _kv_table(console: Any, doc: dict[str, Any], r: Report, contexts: list[int]) -> None:
    t = Table(title="KV cache per token and per sequence (plain bytes, all GPUs of a replica)")
    for col in ("layer kind", "layers", "per token", *(f"per seq @ {c:,}" for c in contexts)):
        t.add_column(col, justify="left" if col == "layer kind" else "right")
    per_seq = {c: r.fit.planner.sequence_by_kind(c) for c in contexts}
    for kind, label in KIND_LABELS.items():
        if doc["layers"][kind]:
            tok = doc["kv_bytes_per_token_by_kind"].get(kind)
            t.add_row(
                label,
                str(doc["layers"][kind]),
                f"{tok:,} B" if tok is not None else "constant",
                *(_size(per_seq[c].get(kind, 0)) for c in contexts),
            )
    t.add_row(
        "[bold]total[/]",
        str(r.shape.num_layers),
        f"[bold]{doc['kv_bytes_per_token']:,} B[/]",
        *(f"[bold]{_size(sum(per_seq[c].values()))}[/]" for c in contexts),
    )
    console.print(t)


def _rows_table(console: Any, r: Report, planner: Any) -> None:
    speed = any(row.speed for row in r.rows)
    t = Table(
        title=f"Memory per GPU (busiest GPU, {r.request.accounting} accounting; weights "
        f"{_size(planner.weight_bytes_per_gpu)}/GPU) and speed per replica",
        caption="fits: yes, or what binds: weights (alone), KV (cache at this context x seqs) or seqs (max-num-seqs)",
    )
    cols = ["context", "seqs", "KV / GPU", "used", "fits", "headroom"]
    if speed:
        cols += ["TTFT", "TPOT", "out tok/s"]
    for col in cols:
        t.add_column(col, justify="right")
    for row in r.rows:
        f = row.fit
        short = {"weights": "weights", "max-num-seqs": "seqs"}.get(f.binding or "", "KV")
        verdict = "[green]yes[/]" if f.fits else f"[red]{short}[/]"
        cells = [
            f"{row.context:,}",
            str(row.concurrency),
            _size(f.kv_bytes_per_gpu),
            _size(f.used_bytes_per_gpu),
            verdict,
            f"[{'green' if f.fits else 'red'}]{_size(f.headroom_bytes)}[/]",
        ]
        if speed:
            s = row.speed
            cells += ["-", "-", "-"] if s is None else [_ms(s.ttft_s), _ms(s.tpot_s), f"{s.output_tokens_per_s:,.0f}"]
        t.add_row(*cells)
    console.print(t)
    if speed:
        req = r.request
        prompt = f"{req.prompt_len:,}" if req.prompt_len else "context - output"
        console.print(
            f"speed: roofline on datasheet peaks ({req.efficiency.hbm:g} of HBM, {req.efficiency.mfu:g} of dense "
            f"FLOP/s); prompt {prompt}, output {req.output_len:,} tokens; TPOT includes the prefills arriving "
            "under continuous batching"
            + (f"; speculative {row.speed.tokens_per_pass:.2f} tokens/pass" if req.spec and row.speed else ""),
            highlight=False,
        )


def _limits(console: Any, r: Report, contexts: list[int]) -> None:
    concurrencies = sorted({row.concurrency for row in r.rows})
    t = Table(title="Limits")
    for col in ("context", "max concurrency", "concurrency", "max context"):
        t.add_column(col, justify="right")
    for i in range(max(len(contexts), len(concurrencies))):
        left = (f"{contexts[i]:,}", f"{r.max_concurrency[contexts[i]]:,}") if i < len(contexts) else ("", "")
        right = ("", "")
        if i < len(concurrencies):
            ctx, why = r.max_context[concurrencies[i]]
            right = (str(concurrencies[i]), f"{ctx:,} ({why})")
        t.add_row(*left, *right)
    console.print(t)


def _sweep(console: Any, r: Report, contexts: list[int]) -> None:
    concurrencies = sorted({row.concurrency for row in r.rows})
    by_key = {(row.context, row.concurrency): row.fit for row in r.rows}
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
            f = by_key[(c, n)]
            share = f.used_bytes_per_gpu / f.plain.usable_bytes_per_gpu
            colour = "red" if not f.fits else ("yellow" if share > 0.9 else "green")
            cells.append(f"[{colour}]{share:.0%}[/]")
        t.add_row(f"{c:,}", *cells)
    console.print(t)


def _solutions(console: Any, r: Report) -> None:
    tg = r.solve_target
    assert tg is not None
    lat = "".join(f", {k} <= {_ms(v)}" for k, v in (("TPOT", tg.max_tpot_s), ("TTFT", tg.max_ttft_s)) if v)
    t = Table(title=f"Smallest deployments for {tg.context:,} tokens x {tg.concurrency} sequences{lat}")
    for col in (
        "GPU",
        "GPUs",
        "tp",
        "pp",
        "weights",
        "KV",
        "KV headroom",
        f"max seqs @ {tg.context:,}",
        "TTFT",
        "TPOT",
        "out tok/s",
    ):
        t.add_column(col, justify="left" if col == "GPU" else "right")
    for c in r.solutions:
        s = c.speed
        speed = ["-", "-", "-"] if s is None else [_ms(s.ttft_s), _ms(s.tpot_s), f"{s.output_tokens_per_s * c.dp:,.0f}"]
        t.add_row(
            c.gpu,
            str(c.num_gpus),
            str(c.tp),
            str(c.pp),
            c.weights,
            c.kv_dtype,
            f"{c.headroom:.0%}",
            f"{c.max_concurrency:,}",
            *speed,
        )
    console.print(t)
    if not r.solutions:
        console.print("[red]no deployment of up to 16 GPUs of the presets serves this target[/]")


# --- --from-log -------------------------------------------------------------------------
def replay_document(rep: Any) -> dict[str, Any]:
    """The --json document of `kv-budget --from-log`."""
    log, r = rep.log, rep.report
    return {
        "log": {
            "vllm_version": log.version,
            "model": log.model,
            "device": log.device,
            "lines": log.lines,
            "lines_recognised": log.recognised,
            "non_default_args": {
                k: v for k, v in log.args.items() if isinstance(v, (str, int, float, bool, type(None)))
            },
            "missing": log.missing,
            "kv_cache_tokens": log.kv_tokens,
            "max_concurrency": None if log.concurrency is None else log.concurrency[1],
        },
        "model": r.request.model,
        "settings": {k: {"value": v, "from": where} for k, (v, where) in rep.settings.items()},
        "terms": [
            {
                "term": t.term,
                "logged_bytes": None if t.logged is None else round(t.logged),
                "predicted_bytes": None if t.predicted is None else round(t.predicted),
                "difference_bytes": None if t.difference is None else round(t.difference),
                "why": t.why,
            }
            for t in rep.terms
        ],
        "at_logged_kv": {"kv_cache_tokens": rep.kv_tokens_at_logged, "max_concurrency": rep.concurrency_at_logged},
        "explanation": rep.explanation,
        "notes": rep.notes,
    }


def replay_human(rep: Any) -> None:
    console = out()
    log, r = rep.log, rep.report
    console.print(
        f"[bold]vLLM {log.version or '(version not logged)'}[/] log of {log.model or '(model not logged)'}: "
        f"{log.recognised:,} of {log.lines:,} lines recognised; replayed with {r.request.model} on {r.gpu.name}",
        highlight=False,
    )
    t = Table(title="Settings replayed (from the log unless marked)")
    for col in ("setting", "value", "from"):
        t.add_column(col)
    for key, (value, where) in rep.settings.items():
        shown = (
            "-"
            if value is None
            else (_size(value) if key in ("gpu_total", "weights_per_gpu") and isinstance(value, int) else str(value))
        )
        t.add_row(key, shown, where)
    console.print(t)
    t = Table(title="Start-up memory per GPU: logged against predicted")
    for col in ("term", "logged", "predicted", "difference", "what"):
        t.add_column(col, justify="left" if col in ("term", "what") else "right")
    for term in rep.terms:
        d = term.difference
        t.add_row(
            term.term,
            "-" if term.logged is None else _size(term.logged),
            "-" if term.predicted is None else _size(term.predicted),
            "-" if d is None else ("0" if round(d) == 0 else ("+" if d > 0 else "-") + _size(abs(d))),
            term.why,
        )
    console.print(t)
    mml = r.request.contexts[0] if r.request.contexts else None
    if log.kv_tokens is not None or log.concurrency is not None:
        t = Table(title=f"KV cache at the logged KV memory, max model len {mml:,}")
        for col in ("line", "logged", "block accounting"):
            t.add_column(col, justify="left" if col == "line" else "right")
        t.add_row(
            "GPU KV cache size (tokens)",
            "-" if log.kv_tokens is None else f"{log.kv_tokens:,}",
            "-" if rep.kv_tokens_at_logged is None else f"{rep.kv_tokens_at_logged:,}",
        )
        t.add_row(
            "maximum concurrency",
            "-" if log.concurrency is None else f"{log.concurrency[1]:.2f}x",
            "-" if rep.concurrency_at_logged is None else f"{rep.concurrency_at_logged:.2f}x",
        )
        console.print(t)
    for line in rep.explanation:
        console.print(line, highlight=False)
    for note in rep.notes:
        err().print(f"[yellow]note:[/] {note}", highlight=False)


# --- --target-concurrency / --target-context --------------------------------------------
def suggestion_document(s: Any) -> dict[str, Any]:
    return {
        "context": s.context,
        "concurrency": s.concurrency,
        "feasible": s.feasible,
        "max_model_len": s.max_model_len,
        "max_num_seqs": s.max_num_seqs,
        "kv_cache_memory_bytes": s.kv_cache_memory_bytes,
        "gpu_memory_utilization": s.mem_util,
        "vllm_serve_flags": s.serve_flags() if s.feasible else None,
        "vllm_serve_flags_fixed_kv": s.serve_flags_fixed_kv() if s.feasible else None,
        "costs": s.costs,
        "limit": s.limit or None,
    }


def suggestion_human(s: Any) -> None:
    console = out()
    what = f"{s.concurrency} sequence{'s' if s.concurrency > 1 else ''} of {s.context:,} tokens"
    if not s.feasible:
        console.print(f"[red]target {what}:[/] {s.limit}", highlight=False)
        return
    console.print(f"[bold]target {what}[/] on this server: KV cache {_size(s.kv_cache_memory_bytes)} per GPU")
    console.print(f"  vllm serve MODEL {s.serve_flags()}", highlight=False, soft_wrap=True)
    console.print(f"  or, with the KV size given: {s.serve_flags_fixed_kv()}", highlight=False, soft_wrap=True)
    for c in s.costs:
        console.print(f"  cost: {c}", highlight=False)
