"""`infer-tool quantize` (calibrate, quantize to INT4 or FP8, write a checkpoint, gate on
ppl) and `infer-tool calibrate` (save calibration statistics for reuse).

The flags come from the option declarations in `calib/recipe.py` (one declaration per
option, shared with recipe files); the work is `jobs/quantize.py` / `jobs/calibrate.py`.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from infer_tool.calib.recipe import (
    DEMO_EVAL,
    DEMO_EVAL_TOKENS,
    DEMO_GROUP_SIZE,
    DEMO_METHOD,
    DEMO_MODEL,
    DEMO_NUM_SAMPLES,
    OPTIONS,
    STATS_NOTE,
)
from infer_tool.cli.options import Json, NoProgress, Overwrite, option_parameter, plain_parameter, with_parameters
from infer_tool.cli.output import cli_command, emit_json, err, out, progress_bar, quiet_libraries
from infer_tool.common.errors import QualityGateFailed

MODEL_HELP = (
    f"Model directory, .gguf file, demo name or hub name. Omitted: the demo model {DEMO_MODEL} with "
    f"{DEMO_METHOD.upper()}, group size {DEMO_GROUP_SIZE}, {DEMO_NUM_SAMPLES} calibration samples, into a fresh "
    f"directory, evaluated on the first {DEMO_EVAL_TOKENS} tokens of {DEMO_EVAL}."
)
# Options of `calibrate` (the rest of QuantizeOptions concerns quantizing and writing).
CALIBRATE_OPTIONS = (
    "model",
    "out",
    "calib",
    "num_samples",
    "seq_len",
    "seed",
    "device",
    "allow_pickle",
    "trust_remote_code",
)


def register(app: typer.Typer) -> None:
    app.command("quantize")(_quantize_command())
    app.command("calibrate")(_calibrate_command())


def _common(json_default: bool = False) -> list[Any]:
    return [
        plain_parameter(
            "recipe",
            Annotated[
                str | None, typer.Option("--recipe", help="YAML/TOML/JSON file with these options; flags override it.")
            ],
            None,
        ),
        plain_parameter("overwrite", Overwrite, False),
        plain_parameter("json_", Json, json_default),
        plain_parameter("no_progress", NoProgress, False),
    ]


ListSchemes = Annotated[
    bool, typer.Option("--list-schemes", help="Print the --scheme presets and the options each sets, then exit.")
]


def _quantize_command() -> Any:
    params = [option_parameter(name, MODEL_HELP if name == "model" else None) for name in OPTIONS] + _common()
    params.append(plain_parameter("list_schemes", ListSchemes, False))

    @cli_command
    def quantize(**kwargs: Any) -> None:
        """Calibrate MODEL layer by layer, quantize its decoder linears to INT4 (AWQ, GPTQ,
        RTN, AWQ+GPTQ, AutoRound), INT8 (W8A8, W8A16), FP4 or FP8, and write a checkpoint
        vLLM/transformers load, with quantize_report.json in it. Exit 2: bad input; exit 3:
        --max-ppl-increase or --max-kld exceeded."""
        from infer_tool.calib.recipe import apply_demo, fresh_dir, load_recipe, merge, preset_option_names

        recipe, overwrite, json_, no_progress, list_schemes = (
            kwargs.pop(k) for k in ("recipe", "overwrite", "json_", "no_progress", "list_schemes")
        )
        if list_schemes:
            _print_presets(json_)
            return
        flags = {name: tuple(v) if name == "ignore" and v is not None else v for name, v in kwargs.items()}
        from_recipe = load_recipe(recipe) if recipe else {}
        opts = merge(from_recipe, flags)
        if opts.model_free:  # jobs/model_free.py: no model class, shard by shard
            from infer_tool.cli.commands.model_free import run_model_free

            run_model_free(opts, flags, from_recipe, overwrite=overwrite, json_=json_, no_progress=no_progress)
            return
        if opts.target_bits is not None or opts.candidates is not None:  # jobs/mixed_quantize.py: mixed precision
            from infer_tool.cli.commands.mixed_quantize import run_mixed

            run_mixed(opts, flags, from_recipe, overwrite=overwrite, json_=json_, no_progress=no_progress)
            return
        if not opts.default_ignore:
            from infer_tool.common.errors import BadInput

            raise BadInput(
                "--no-default-ignore applies to --model-free only (the pipeline quantizes the linears it plans)"
            )
        if opts.model is None:
            given = (
                set(from_recipe)
                | {k for k, v in flags.items() if v not in (None, ())}
                | preset_option_names(opts.scheme)
            )
            opts = apply_demo(opts, given)
            if opts.out is None:
                scheme = opts.fp4 if opts.fp4 is not None else f"w{opts.bits or 4}g{opts.group_size}"
                opts.out = fresh_dir(f"{DEMO_MODEL}-{opts.method}-{scheme}")
        from infer_tool.common.launch import rank0
        from infer_tool.jobs.quantize import check
        from infer_tool.jobs.quantize import quantize as run

        _checked(lambda: check(opts, overwrite))  # before any progress bar or library noise
        quiet_libraries()
        with progress_bar(rank0() and not no_progress) as bar:
            report = run(opts, overwrite=overwrite, recipe=recipe, progress=bar)
        if not rank0():  # under accelerate launch, process 0 reports
            return
        if json_:
            emit_json(report)
            if report.unmatched_ignore:  # the table's notes say it otherwise
                err().print(
                    f"note: --ignore patterns that match no linear: {', '.join(report.unmatched_ignore)}",
                    highlight=False,
                )
        else:
            _print_report(report)
        failed = []
        gate, kld_gate = report.quality_gate, report.kld_gate
        if gate and not gate.passed:
            failed.append(
                f"ppl rose {gate.increase * 100:.2f}% ({report.eval.ppl_before:.4f} -> "
                f"{report.eval.ppl_after:.4f}), above --max-ppl-increase {gate.max_increase * 100:g}%"
            )
        if kld_gate and not kld_gate.passed:
            failed.append(
                f"the mean KL divergence from the fp model is {kld_gate.kld:.4g} nats per token, above "
                f"--max-kld {kld_gate.max_kld:g}"
                if kld_gate.kld is not None
                else f"the KL divergence was not measured (see the notes), so --max-kld {kld_gate.max_kld:g} fails"
            )
        if failed:
            raise QualityGateFailed(f"{'; '.join(failed)}; the checkpoint is in {report.out}")

    return with_parameters(quantize, params)


def _print_presets(json_: bool) -> None:
    """--list-schemes: every preset, the flags it stands for and what it means."""
    from rich.table import Table

    from infer_tool.calib.recipe import preset_flags
    from infer_tool.schemes.presets import PRESETS

    rows = [{"scheme": p.name, "flags": preset_flags(p.name), "summary": p.summary} for p in PRESETS]
    if json_:
        emit_json({"schemes": rows})
        return
    table = Table(
        title="--scheme presets (llm-compressor's names); explicit options override them", title_justify="left"
    )
    for col in ("scheme", "stands for", "weights / activations"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["scheme"], " ".join(r["flags"]), r["summary"])
    out().print(table)
    err().print(
        "note: a preset sets the number format only; --method picks the algorithm (a preset's method applies "
        "when --method is not given)",
        highlight=False,
    )


def _checked(check: Any) -> None:
    """Run the option checks; under accelerate launch every process finds the same bad
    option, and only process 0 says so (the others exit 2 silently)."""
    from infer_tool.common.errors import BadInput
    from infer_tool.common.launch import rank0

    try:
        check()
    except BadInput:
        if not rank0():
            raise typer.Exit(2) from None
        raise


def _print_report(report: Any) -> None:
    from rich.table import Table

    table = Table(title=f"quantize {report.model} -> {report.out}", title_justify="left", show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    cal = report.calibration
    table.add_row("scheme", report.scheme_description)
    table.add_row("format", report.format)
    if cal is None:
        table.add_row("calibration", "none (data-free, --no-layer-error)")
    else:
        source = f"stats {cal.from_stats} ({cal.corpus})" if cal.from_stats else cal.corpus
        table.add_row("calibration", f"{source}: {cal.tokens} tokens")
    table.add_row("quantized linears", f"{report.quantized_layers} ({len(report.ignored)} ignored)")
    if report.layer_error_mean is not None:
        worst = max(report.layer_errors, key=lambda e: e.relative_output_error)
        table.add_row(
            "layer output error",
            f"mean {report.layer_error_mean:.4f}, max {worst.relative_output_error:.4f} ({worst.layer})",
        )
    if report.linear_errors:
        errs = report.linear_errors
        worst_linear = max(errs, key=errs.get)
        table.add_row(
            "linear output error",
            f"mean {sum(errs.values()) / len(errs):.4f}, max {errs[worst_linear]:.4f} ({worst_linear}); from H",
        )
    table.add_row("fallbacks", str(len(report.fallbacks)))
    if report.moe is not None:
        m = report.moe
        counts = sorted(c for t in m.tokens for c in t.counts)
        table.add_row(
            "experts",
            f"{m.experts} in {m.moe_layers} MoE layers, calibration {m.calibration}; routed tokens per expert "
            f"min {counts[0]}, median {counts[len(counts) // 2]}, max {counts[-1]}; "
            f"{len(m.experts_below_min_tokens)} below {m.min_tokens}, {len(m.fallback_experts)} fell back to RTN",
        )
    if report.eval is not None:
        ev = report.eval
        table.add_row(
            "ppl", f"{ev.ppl_before:.4f} -> {ev.ppl_after:.4f} (x{ev.ratio:.4f}, {ev.tokens} tokens of {ev.corpus})"
        )
        table.add_row("ppl after: activations", ev.activations)
    if report.eval is not None and report.eval.kld is not None:
        k = report.eval.kld
        mean, top = k["kld"]["mean"], k["same_top_token"]["mean"]
        interval = f" (95% CI {mean['ci95_low']:.4f}..{mean['ci95_high']:.4f})" if mean["ci95_low"] is not None else ""
        table.add_row(
            "KL divergence",
            f"mean {mean['mean']:.4f} nats/token{interval}, p99 {k['kld']['p99']:.4f}, "
            f"max {k['kld']['max']:.3f}; same top token {top * 100:.1f}%",
        )
    if report.quality_gate is not None:
        g = report.quality_gate
        table.add_row(
            "quality gate",
            f"{'passed' if g.passed else 'FAILED'}: +{g.increase * 100:.2f}% vs max {g.max_increase * 100:g}%",
        )
    if report.kld_gate is not None:
        g = report.kld_gate
        shown = "not measured" if g.kld is None else f"KL {g.kld:.4g}"
        table.add_row("KL gate", f"{'passed' if g.passed else 'FAILED'}: {shown} vs max {g.max_kld:g}")
    table.add_row("time", ", ".join(f"{k} {v:.1f}s" for k, v in report.seconds.items() if "." not in k))
    mem = report.memory
    host = f"RSS {mem['peak_rss_mib']:.0f} MiB (estimate {mem['estimate_host_mib']:.0f})"
    device = (
        f", CUDA {mem['cuda_peak_mib']:.0f} MiB (estimate {mem.get('estimate_device_mib', 0):.0f})"
        if "cuda_peak_mib" in mem
        else ""
    )
    table.add_row("peak memory", host + device)
    out().print(table)
    for note in report.notes:
        err().print(f"note: {note}", highlight=False)


def _calibrate_command() -> Any:
    params = [
        option_parameter(name, "Statistics directory to write." if name == "out" else None)
        for name in CALIBRATE_OPTIONS
    ]
    params += [p for p in _common() if p.name != "recipe"]

    @cli_command
    def calibrate(**kwargs: Any) -> None:
        """Measure every decoder linear's calibration statistics (Hessian 2XXᵀ/T, mean and max
        |x|) on the fp model and save them for `quantize --stats`."""
        from infer_tool.calib.recipe import merge
        from infer_tool.common.errors import BadInput
        from infer_tool.common.launch import rank0
        from infer_tool.jobs.calibrate import CalibrateOptions
        from infer_tool.jobs.calibrate import calibrate as run

        overwrite, json_, no_progress = (kwargs.pop(k) for k in ("overwrite", "json_", "no_progress"))
        for name in ("model", "out"):
            if kwargs[name] is None:
                raise BadInput(f"calibrate needs {'MODEL' if name == 'model' else '--out DIR'}")
        opts = merge({}, kwargs)
        copts = CalibrateOptions(**{k: getattr(opts, k) for k in CALIBRATE_OPTIONS})
        quiet_libraries()
        with progress_bar(rank0() and not no_progress) as bar:
            report = run(copts, overwrite=overwrite, progress=bar)
        if not rank0():  # under accelerate launch, process 0 reports
            return
        if json_:
            emit_json(report)
            return
        out().print(
            f"saved statistics of {report.linears} linears ({report.tokens} tokens of {report.calib}) to {report.out} "
            f"in {report.seconds:.1f}s"
        )
        err().print(f"note: {STATS_NOTE}", highlight=False)

    return with_parameters(calibrate, params)
