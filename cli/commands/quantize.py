"""`infer-tool quantize` (calibrate, quantize to INT4, write a checkpoint, gate on ppl) and
`infer-tool calibrate` (save calibration statistics for reuse)."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from infer_tool.calib.recipe import (
    DEFAULTS,
    DEMO_EVAL,
    DEMO_EVAL_TOKENS,
    DEMO_GROUP_SIZE,
    DEMO_METHOD,
    DEMO_MODEL,
    DEMO_NUM_SAMPLES,
)
from infer_tool.cli.fp8_options import ACTIVATIONS_HELP, CLIP_HELP, GRANULARITY_HELP, KV_CACHE_HELP
from infer_tool.cli.output import cli_command, emit_json, err, out, progress_bar, to_json
from infer_tool.common.errors import BadInput, QualityGateFailed

REPORT_NAME = "quantize_report.json"

STATS_NOTE = (
    "Reused statistics (--stats) were measured on the fp model: layer i's Hessian and "
    "activation magnitudes come from inputs that did not pass through quantized layers "
    "0..i-1 nor through the quantized earlier groups of layer i (q/k/v before o, gate/up "
    "before down). A live GPTQ run measures them after quantizing those (true-sequential), "
    "so it compensates upstream error; reuse gives that up. AWQ needs live block outputs "
    "and cannot reuse statistics."
)


def register(app: typer.Typer) -> None:
    app.command("quantize")(quantize)
    app.command("calibrate")(calibrate)


def _flag_help(text: str, name: str) -> str:
    return f"{text} (default: {getattr(DEFAULTS, name)})"


def _scheme_default(method: str, name: str) -> object:
    """A field default of a method's scheme (packers/scheme.py), for help texts."""
    import dataclasses

    from infer_tool.packers.scheme import SCHEMES

    return next(f.default for f in dataclasses.fields(SCHEMES[method]) if f.name == name)


@cli_command
def quantize(
    model: Annotated[Optional[str], typer.Argument(help=f"Model directory, .gguf file, demo name or hub name. Omitted: the demo model {DEMO_MODEL} with {DEMO_METHOD.upper()}, group size {DEMO_GROUP_SIZE}, {DEMO_NUM_SAMPLES} calibration samples, into a fresh directory, evaluated on the first {DEMO_EVAL_TOKENS} tokens of {DEMO_EVAL}.")] = None,
    method: Annotated[Optional[str], typer.Option(help=_flag_help("awq, gptq, rtn, or fp8 (e4m3 weights and activations).", "method"))] = None,
    bits: Annotated[Optional[int], typer.Option(help=f"Weight bits (default: {_scheme_default('rtn', 'bits')}).")] = None,
    group_size: Annotated[Optional[int], typer.Option(help=f"Columns per scale group, -1 per channel (default: {_scheme_default('rtn', 'group_size')}; demo {DEMO_GROUP_SIZE}).")] = None,
    sym: Annotated[Optional[bool], typer.Option("--sym/--asym", help="Symmetric (no zero point) or asymmetric (default: "
        + ", ".join(f"{m} {'sym' if _scheme_default(m, 'symmetric') else 'asym'}" for m in ("awq", "gptq", "rtn")) + ").", show_default=False)] = None,
    act_order: Annotated[Optional[bool], typer.Option("--act-order/--no-act-order", help="GPTQ: columns by decreasing Hessian diagonal, static groups.", show_default=False)] = None,
    damp: Annotated[Optional[float], typer.Option(help=f"GPTQ dampening, fraction of mean diag(H) (default: {_scheme_default('gptq', 'damp')}).")] = None,
    fp8_granularity: Annotated[Optional[str], typer.Option(help=GRANULARITY_HELP)] = None,
    fp8_activations: Annotated[Optional[str], typer.Option(help=ACTIVATIONS_HELP)] = None,
    kv_cache: Annotated[Optional[str], typer.Option(help=KV_CACHE_HELP)] = None,
    fp8_clip_search: Annotated[Optional[bool], typer.Option("--fp8-clip-search/--no-fp8-clip-search", help=CLIP_HELP, show_default=False)] = None,
    calib: Annotated[Optional[str], typer.Option(help=_flag_help("Calibration corpus: sotu:calib, a .txt/.jsonl/.json/.parquet file or a HF dataset.", "calib"))] = None,
    num_samples: Annotated[Optional[int], typer.Option(help=_flag_help("Calibration sequences.", "num_samples"))] = None,
    seq_len: Annotated[Optional[int], typer.Option(help=_flag_help("Tokens per calibration sequence.", "seq_len"))] = None,
    format: Annotated[Optional[str], typer.Option("--format", help=_flag_help("compressed-tensors, awq or gptq (symmetric only).", "format"))] = None,
    out_dir: Annotated[Optional[str], typer.Option("--out", help="Output checkpoint directory (must not exist unless --overwrite).")] = None,
    ignore: Annotated[Optional[list[str]], typer.Option("--ignore", help="Leave matching linears unquantized: a glob on the module name (*.down_proj, model.layers.0.*) or re:REGEX. Repeatable.")] = None,
    seed: Annotated[Optional[int], typer.Option(help=_flag_help("Seed of the calibration windows.", "seed"))] = None,
    eval_: Annotated[Optional[str], typer.Option("--eval", help="Evaluate ppl before and after on this corpus (e.g. sotu:eval).")] = None,
    eval_tokens: Annotated[Optional[int], typer.Option(help=_flag_help("Evaluate on the first N tokens of the --eval corpus.", "eval_tokens"))] = None,
    eval_seq_len: Annotated[Optional[int], typer.Option(help=_flag_help("Evaluation window length.", "eval_seq_len"))] = None,
    max_ppl_increase: Annotated[Optional[str], typer.Option(help="Quality gate: exit 3 when ppl rises by more than this (5%). Needs --eval.")] = None,
    stats: Annotated[Optional[str], typer.Option("--stats", help="Reuse statistics saved by `infer-tool calibrate` (gptq/rtn). " + STATS_NOTE)] = None,
    recipe: Annotated[Optional[str], typer.Option("--recipe", help="YAML/TOML file with these options; flags override it.")] = None,
    device: Annotated[Optional[str], typer.Option(help="auto, cpu, cuda or cuda:N (default: auto: CUDA when available).")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="Checkpoint dtype of unquantized tensors and INT scales: auto (the source model's), float32, bfloat16 or float16. Calibration sees the weights as stored.")] = None,
    allow_pickle: Annotated[Optional[bool], typer.Option("--allow-pickle", help="Allow pickle-based weight files (.bin/.pt); they can run code.", show_default=False)] = None,
    trust_remote_code: Annotated[Optional[bool], typer.Option("--trust-remote-code", help="Run the model repository's own Python code.", show_default=False)] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing --out directory.")] = False,
    json_: Annotated[bool, typer.Option("--json", help="Print the report as one JSON document on stdout.")] = False,
    no_progress: Annotated[bool, typer.Option("--no-progress", help="No progress bars.")] = False,
) -> None:
    """Calibrate MODEL layer by layer, quantize its decoder linears to INT4 (AWQ, GPTQ,
    RTN) or FP8, and write a checkpoint vLLM/transformers load, with quantize_report.json
    in it. Exit 2: bad input; exit 3: --max-ppl-increase exceeded."""
    from infer_tool.calib.recipe import apply_demo, fresh_dir, load_recipe, merge

    t_start = time.perf_counter()
    flags = {
        "model": model, "method": method, "bits": bits, "group_size": group_size, "symmetric": sym,
        "act_order": act_order, "damp": damp, "calib": calib, "num_samples": num_samples, "seq_len": seq_len,
        "format": format, "out": out_dir, "ignore": tuple(ignore or ()), "seed": seed, "eval": eval_,
        "eval_tokens": eval_tokens, "eval_seq_len": eval_seq_len, "max_ppl_increase": max_ppl_increase,
        "stats": stats, "device": device, "dtype": dtype, "allow_pickle": allow_pickle, "trust_remote_code": trust_remote_code,
        "fp8_granularity": fp8_granularity, "fp8_activations": fp8_activations, "kv_cache": kv_cache,
        "fp8_clip_search": fp8_clip_search,
    }
    from_recipe = load_recipe(recipe) if recipe else {}
    opts = merge(from_recipe, flags)
    given = set(from_recipe) | {k for k, v in flags.items() if v not in (None, ())}
    if opts.model is None:
        opts = apply_demo(opts, given)
        if opts.out is None:
            opts.out = fresh_dir(f"{DEMO_MODEL}-{opts.method}-w4g{opts.group_size}")
    report = run_quantize(opts, overwrite=overwrite, show_progress=not no_progress, recipe=recipe)
    report["seconds"]["total"] = time.perf_counter() - t_start
    _rewrite_report(Path(report["out"]), report)
    if json_:
        emit_json(report)
    else:
        _print_report(report)
    gate = report.get("quality_gate")
    if gate and not gate["passed"]:
        raise QualityGateFailed(
            f"ppl rose {gate['increase'] * 100:.2f}% ({report['eval']['ppl_before']:.4f} -> "
            f"{report['eval']['ppl_after']:.4f}), above --max-ppl-increase {gate['max_increase'] * 100:g}%; "
            f"the checkpoint is in {report['out']}"
        )


def _validate(opts: Any, overwrite: bool) -> tuple[Any, Any]:
    """Every option checked before any work: (scheme, format)."""
    from infer_tool.packers.checkpoint import get_format
    from infer_tool.packers.scheme import SCALE_DTYPES, make_scheme

    from infer_tool.cli.fp8_options import check_no_fp8_options, fp8_scheme

    if opts.method == "fp8":
        scheme, kind = fp8_scheme(opts), "fp8"
    else:
        check_no_fp8_options(opts)
        scheme = make_scheme(
            opts.method, bits=opts.bits, group_size=opts.group_size, symmetric=opts.symmetric,
            act_order=opts.act_order, damp=opts.damp,
        )
        kind = "int"
    fmt = get_format(opts.format, kind)
    fmt.check(scheme, {})
    if opts.out is None:
        raise BadInput("--out DIR is required when MODEL is given")
    if Path(opts.out).exists() and not overwrite:
        raise BadInput(f"output directory {opts.out!r} already exists; pass --overwrite to replace it")
    if opts.dtype != "auto" and opts.dtype not in SCALE_DTYPES:
        raise BadInput(f"unknown --dtype {opts.dtype!r}: expected auto, {', '.join(SCALE_DTYPES)}")
    if opts.max_ppl_increase is not None and opts.eval is None:
        raise BadInput("--max-ppl-increase needs --eval CORPUS (the ppl to compare)")
    if opts.stats is not None:
        if opts.method == "awq":
            raise BadInput("--stats works with --method gptq or rtn: AWQ's scale search needs block outputs on live activations")
        if not (Path(opts.stats) / "stats_index.json").is_file():
            raise BadInput(f"--stats {opts.stats!r} is not a statistics directory; make one with `infer-tool calibrate --out DIR`")
    return scheme, fmt


def run_quantize(opts: Any, *, overwrite: bool, show_progress: bool, recipe: str | None = None) -> dict[str, Any]:
    """Load, (evaluate), calibrate + quantize, (evaluate), write; returns the report."""
    scheme, fmt = _validate(opts, overwrite)
    from infer_tool.cli.commands.eval import pick_device, quiet_transformers

    dev = pick_device(opts.device or "auto")
    quiet_transformers()
    import torch

    from infer_tool.calib.corpora import calibration_batch, load_text, tokenize
    from infer_tool.calib.models import load_model
    from infer_tool.calib.pipeline import peak_memory, plan, quantize_from_stats, quantize_model
    from infer_tool.calib.recipe import to_dict
    from infer_tool.calib.stats import load_stats
    from infer_tool.evals.ppl import evaluate_ppl
    from infer_tool.cli.fp8_options import EVALUATED_FP8, eval_context, fp8_notes, kv_scales, kv_tensors
    from infer_tool.packers.checkpoint import write_checkpoint

    seconds: dict[str, float] = {}
    t = time.perf_counter()
    loaded = load_model(opts.model, device="cpu", allow_pickle=opts.allow_pickle, trust_remote_code=opts.trust_remote_code)
    seconds["load"] = time.perf_counter() - t
    lm = loaded.model
    dtype_name = _checkpoint_dtype(opts.dtype, loaded.path)
    store_dtype = getattr(torch, dtype_name)
    if dtype_name != "float32":
        _round_to(lm, store_dtype)
    if hasattr(scheme, "scale_dtype"):  # INT: scales rounded to what the checkpoint stores
        scheme = dataclasses.replace(scheme, scale_dtype=fmt.scale_dtype or dtype_name)
    arch, names = plan(lm, scheme, opts.ignore)  # unknown architecture / bad group size: before any work
    if arch.conv1d:
        raise BadInput(
            f"{lm.config.model_type} stores its linears as Conv1D, which the INT4 checkpoint formats "
            "(compressed-tensors, awq, gptq) do not carry: they quantize nn.Linear modules only"
        )
    eval_ids = None
    if opts.eval is not None:
        eval_ids = tokenize(load_text(opts.eval), loaded.tokenizer)[: opts.eval_tokens]
    calib_ids = None
    if opts.stats is None:
        calib_ids = calibration_batch(loaded.tokenizer, opts.calib, opts.num_samples, opts.seq_len, opts.seed)

    report: dict[str, Any] = {
        "model": opts.model,
        "model_path": str(loaded.path),
        "model_type": lm.config.model_type,
        "method": scheme.method,
        "scheme": scheme.to_dict(),
        "format": fmt.name,
        "dtype": dtype_name,
        "out": opts.out,
        "device": dev,
        "recipe": recipe,
        "options": to_dict(opts),
        "notes": list(loaded.notes),
    }
    with progress_bar(show_progress) as bar:
        if eval_ids is not None:
            t = time.perf_counter()
            before = _ppl(evaluate_ppl, lm, eval_ids, opts.eval_seq_len, dev, bar, "ppl before")
            seconds["eval_before"] = time.perf_counter() - t
        t = time.perf_counter()
        if opts.stats is not None:
            saved, meta = load_stats(Path(opts.stats))
            if meta.get("model_path") not in (None, str(loaded.path)):
                report["notes"].append(f"statistics were calibrated on {meta.get('model')} ({meta.get('model_path')})")
            result = quantize_from_stats(lm, saved, scheme, ignore=opts.ignore, device=dev, progress=bar)
            report["calibration"] = {"from_stats": opts.stats, **{k: meta.get(k) for k in ("calib", "num_samples", "seq_len", "seed")},
                                     "tokens": result.tokens, "note": STATS_NOTE}
        else:
            result = quantize_model(lm, calib_ids, scheme, ignore=opts.ignore, device=dev, progress=bar)
            report["calibration"] = {"corpus": opts.calib, "num_samples": opts.num_samples, "seq_len": opts.seq_len,
                                     "seed": opts.seed, "tokens": result.tokens}
        lm.to("cpu")
        seconds["quantize"] = time.perf_counter() - t
        seconds.update({f"quantize.{k}": v for k, v in result.seconds.items()})
        if eval_ids is not None:
            t = time.perf_counter()
            with eval_context(lm, result, scheme):
                after = _ppl(evaluate_ppl, lm, eval_ids, opts.eval_seq_len, dev, bar, "ppl after")
            lm.to("cpu")
            seconds["eval_after"] = time.perf_counter() - t
            increase = after.ppl / before.ppl - 1.0
            report["eval"] = {
                "corpus": opts.eval, "tokens": after.tokens, "seq_len": after.seq_len, "windows": after.windows,
                "ppl_before": before.ppl, "ppl_after": after.ppl, "ratio": after.ppl / before.ppl,
                "evaluated": EVALUATED_FP8 if scheme.method == "fp8" else "the quantized model in memory, whose linear weights are exactly the checkpoint's dequantized values",
            }
            if opts.max_ppl_increase is not None:
                report["quality_gate"] = {"max_increase": opts.max_ppl_increase, "increase": increase,
                                          "passed": increase <= opts.max_ppl_increase}

    errors = [e["relative_output_error"] for e in result.layer_errors]
    report.update({
        "quantized_layers": len(result.quantized),
        "ignored": result.ignored,
        "layer_errors": result.layer_errors,
        "linear_errors": result.linear_errors,
        "layer_error_mean": sum(errors) / len(errors) if errors else None,
        "layer_error_max": max(errors) if errors else None,
        "fallbacks": result.fallbacks,
        "fallback_count": len(result.fallbacks),
        "awq": result.awq,
        **({"kv_cache_scales": {n: {"k_scale": k, "v_scale": v} for n, (k, v) in kv_scales(result).items()}} if result.kv_amax else {}),
        "notes": report["notes"] + fp8_notes(result, scheme),
        "memory": peak_memory(torch.device(dev)),
        "seconds": seconds,
    })
    t = time.perf_counter()
    write_checkpoint(
        lm, result.quantized, fmt.name, scheme, opts.out, src_dir=loaded.path, overwrite=overwrite, dtype=store_dtype,
        extra_files={REPORT_NAME: to_json(report) + "\n"}, extra_tensors=kv_tensors(result, fmt.name),
    )
    seconds["write"] = time.perf_counter() - t
    _rewrite_report(Path(opts.out), report)
    return report


def _checkpoint_dtype(requested: str, model_dir: Path) -> str:
    """`--dtype`, with auto resolved to the source config's dtype (float32 when it names none)."""
    if requested != "auto":
        return requested
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    from infer_tool.packers.scheme import SCALE_DTYPES

    name = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
    return name if name in SCALE_DTYPES else "float32"


def _round_to(model: Any, dtype: Any) -> None:
    """Round every floating parameter to `dtype`'s values (kept in the compute dtype), so
    calibration, evaluation and the written checkpoint all see the weights as stored."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.copy_(p.to(dtype).to(p.dtype))


def _rewrite_report(out_path: Path, report: dict[str, Any]) -> None:
    """Put the final timings (write included) into the saved report."""
    (out_path / REPORT_NAME).write_text(to_json(report) + "\n")


def _ppl(evaluate_ppl: Any, lm: Any, ids: Any, seq_len: int, dev: str, bar: Any, label: str) -> Any:
    context = getattr(lm.config, "max_position_embeddings", None)
    lm.to(dev)
    return evaluate_ppl(lm, ids.to(dev), min(seq_len, context or seq_len),
                        progress=lambda task, done, total, **info: bar(label, done, total, **info))


def _print_report(report: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title=f"quantize {report['model']} -> {report['out']}", title_justify="left", show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    sc = report["scheme"]
    cal = report["calibration"]
    if sc["method"] == "fp8":
        from infer_tool.cli.fp8_options import describe

        table.add_row("scheme", describe(sc))
    else:
        table.add_row("scheme", f"{sc['method']} w{sc['bits']} g{sc['group_size']} {'sym' if sc['symmetric'] else 'asym'}"
                      + (" act-order" if sc.get("act_order") else ""))
    table.add_row("format", report["format"])
    table.add_row("calibration", f"{cal.get('corpus') or 'stats ' + str(cal.get('from_stats'))}: {cal['tokens']} tokens")
    table.add_row("quantized linears", f"{report['quantized_layers']} ({len(report['ignored'])} ignored)")
    if report["layer_error_mean"] is not None:
        worst = max(report["layer_errors"], key=lambda e: e["relative_output_error"])
        table.add_row("layer output error", f"mean {report['layer_error_mean']:.4f}, max {worst['relative_output_error']:.4f} ({worst['layer']})")
    if report["linear_errors"]:
        errs = report["linear_errors"]
        worst = max(errs, key=errs.get)
        table.add_row("linear output error", f"mean {sum(errs.values()) / len(errs):.4f}, max {errs[worst]:.4f} ({worst}); from H")
    table.add_row("fallbacks", str(report["fallback_count"]))
    if "eval" in report:
        ev = report["eval"]
        table.add_row("ppl", f"{ev['ppl_before']:.4f} -> {ev['ppl_after']:.4f} (x{ev['ratio']:.4f}, {ev['tokens']} tokens of {ev['corpus']})")
    if "quality_gate" in report:
        g = report["quality_gate"]
        table.add_row("quality gate", f"{'passed' if g['passed'] else 'FAILED'}: +{g['increase'] * 100:.2f}% vs max {g['max_increase'] * 100:g}%")
    s = report["seconds"]
    table.add_row("time", ", ".join(f"{k} {v:.1f}s" for k, v in s.items() if "." not in k))
    mem = report["memory"]
    table.add_row("peak memory", f"RSS {mem['peak_rss_mib']:.0f} MiB" + (f", CUDA {mem['cuda_peak_mib']:.0f} MiB" if "cuda_peak_mib" in mem else ""))
    out().print(table)
    for note in report["notes"]:
        err().print(f"note: {note}", highlight=False)


@cli_command
def calibrate(
    model: Annotated[str, typer.Argument(help="Model directory, .gguf file, demo name (smollm2-135m) or hub name.")],
    out_dir: Annotated[str, typer.Option("--out", help="Statistics directory to write.")],
    calib: Annotated[Optional[str], typer.Option(help=_flag_help("Calibration corpus.", "calib"))] = None,
    num_samples: Annotated[Optional[int], typer.Option(help=_flag_help("Calibration sequences.", "num_samples"))] = None,
    seq_len: Annotated[Optional[int], typer.Option(help=_flag_help("Tokens per calibration sequence.", "seq_len"))] = None,
    seed: Annotated[Optional[int], typer.Option(help=_flag_help("Seed of the calibration windows.", "seed"))] = None,
    device: Annotated[Optional[str], typer.Option(help="auto, cpu, cuda or cuda:N (default: auto).")] = None,
    allow_pickle: Annotated[Optional[bool], typer.Option("--allow-pickle", help="Allow pickle-based weight files (.bin/.pt); they can run code.", show_default=False)] = None,
    trust_remote_code: Annotated[Optional[bool], typer.Option("--trust-remote-code", help="Run the model repository's own Python code.", show_default=False)] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing --out directory.")] = False,
    json_: Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")] = False,
    no_progress: Annotated[bool, typer.Option("--no-progress", help="No progress bars.")] = False,
) -> None:
    """Measure every decoder linear's calibration statistics (Hessian 2XXᵀ/T, mean and max
    |x|) on the fp model and save them for `quantize --stats`. """
    from infer_tool.calib.recipe import merge

    opts = merge({}, {"model": model, "calib": calib, "num_samples": num_samples, "seq_len": seq_len, "seed": seed, "device": device,
                      "allow_pickle": allow_pickle, "trust_remote_code": trust_remote_code})
    if Path(out_dir).exists() and not overwrite:
        raise BadInput(f"output directory {out_dir!r} already exists; pass --overwrite to replace it")
    from infer_tool.cli.commands.eval import pick_device, quiet_transformers

    dev = pick_device(opts.device or "auto")
    quiet_transformers()
    import torch

    from infer_tool.calib.corpora import calibration_batch
    from infer_tool.calib.models import load_model
    from infer_tool.calib.pipeline import peak_memory, plan, quantize_model
    from infer_tool.calib.stats import save_stats

    t0 = time.perf_counter()
    loaded = load_model(opts.model, device="cpu", allow_pickle=opts.allow_pickle, trust_remote_code=opts.trust_remote_code)
    plan(loaded.model, None)
    ids = calibration_batch(loaded.tokenizer, opts.calib, opts.num_samples, opts.seq_len, opts.seed)
    with progress_bar(not no_progress) as bar:
        result = quantize_model(loaded.model, ids, None, device=dev, progress=bar)
    meta = {"model": opts.model, "model_path": str(loaded.path), "model_type": loaded.model.config.model_type,
            "calib": opts.calib, "num_samples": opts.num_samples, "seq_len": opts.seq_len, "seed": opts.seed,
            "tokens": result.tokens, "measured_on": "fp model (no layer quantized)"}
    save_stats(result.stats, Path(out_dir), meta=meta, overwrite=overwrite)
    report = {"out": out_dir, **meta, "linears": len(result.stats), "note": STATS_NOTE,
              "seconds": time.perf_counter() - t0, "memory": peak_memory(torch.device(dev))}
    if json_:
        emit_json(report)
        return
    out().print(f"saved statistics of {report['linears']} linears ({result.tokens} tokens of {opts.calib}) to {out_dir} "
                f"in {report['seconds']:.1f}s")
    err().print(f"note: {STATS_NOTE}", highlight=False)

