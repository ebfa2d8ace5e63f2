"""`infer-tool quantize-plan`: a dry run of mixed precision. One sensitivity pass over the
candidates, then the Pareto table of stored bits against predicted KL divergence for each
budget, with which linear groups get which scheme (`jobs/mixed_plan.py`); with `--out`, the
plan of one budget written as a mixed-precision checkpoint (`jobs/mixed_quantize.py`)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from infer_tool.cli.options import AllowPickle, Device, Overwrite, TrustRemoteCode
from infer_tool.cli.output import cli_command, emit_json, err, out, progress_bar, quiet_libraries


def register(app: typer.Typer) -> None:
    app.command("quantize-plan")(quantize_plan)


@cli_command
def quantize_plan(
    model: Annotated[str, typer.Argument(help="Model directory, .gguf file, demo name (smollm2-135m) or hub name.")],
    target_bits: Annotated[
        str | None,
        typer.Option(
            "--target-bits",
            help="Average stored bits per weight of the quantized linears (scales and zero points counted); "
            "several, comma-separated, share one sensitivity pass: 4.25,4.5,5.",
        ),
    ] = None,
    max_kld: Annotated[
        float | None,
        typer.Option("--max-kld", help="The smallest plan whose predicted KL divergence (nats/token) is at most X."),
    ] = None,
    candidates: Annotated[
        str,
        typer.Option(
            help="Schemes to choose among, by preset name, each rounded with RTN: W4A16, W4A16_G32 (_G<n>: group "
            "size), W4A16_G64_FULL (_FULL: the signed full-range grid), W4A16_ASYM, W8A16, FP8 (e4m3 "
            "per-channel weights), FP8_BLOCK, NVFP4A16, MXFP4A16, NONE."
        ),
    ] = "W4A16,W8A16,FP8",
    calib: Annotated[str, typer.Option(help="Calibration corpus for the sensitivity pass.")] = "sotu:calib",
    num_samples: Annotated[int, typer.Option(help="Calibration windows of the sensitivity pass.")] = 8,
    seq_len: Annotated[int, typer.Option(help="Tokens per calibration window.")] = 512,
    seed: Annotated[int, typer.Option(help="Seed of the windows and of the sampled labels.")] = 0,
    estimator: Annotated[
        str,
        typer.Option(
            help="scaled: the Fisher diagonal in the outputs, rescaled to the one-sample full Fisher's total; "
            "diagonal (biased low); sampled (one-sample full Fisher, noisy)."
        ),
    ] = "scaled",
    method: Annotated[
        str,
        typer.Option(help="The candidates' method: rtn or gptq (Hessians from the fp model; FP8 keeps its own)."),
    ] = "rtn",
    dtype: Annotated[
        str,
        typer.Option(
            help="Checkpoint dtype (of INT scales and unquantized tensors): auto (the model's), "
            "float32, bfloat16 or float16."
        ),
    ] = "auto",
    device: Device = "auto",
    allow_pickle: AllowPickle = False,
    trust_remote_code: TrustRemoteCode = False,
    out_dir: Annotated[
        str | None,
        typer.Option(
            "--out",
            help="Write the plan of the one budget given as a mixed-precision checkpoint here (one config group "
            "per scheme); several budgets are refused. `quantize --target-bits` also measures its KL.",
        ),
    ] = None,
    overwrite: Overwrite = False,
    json_: Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")] = False,
    no_progress: Annotated[bool, typer.Option("--no-progress", help="No progress bars on stderr.")] = False,
) -> None:
    """Plan mixed precision under bit budgets: prints the Pareto table (a dry run), or with --out
    writes the plan of one budget as a checkpoint."""
    from infer_tool.jobs.mixed_plan import MixedPlanOptions, check_options, parse_target_bits, plan_mixed

    opts = MixedPlanOptions(
        model=model,
        candidates=candidates,
        target_bits=parse_target_bits(target_bits) if target_bits is not None else (),
        max_kld=max_kld,
        calib=calib,
        num_samples=num_samples,
        seq_len=seq_len,
        seed=seed,
        estimator=estimator,
        method=method,
        dtype=dtype,
        device=device,
        allow_pickle=allow_pickle,
        trust_remote_code=trust_remote_code,
    )
    check_options(opts)
    if out_dir is not None:
        _write(opts, out_dir, overwrite=overwrite, json_=json_, no_progress=no_progress)
        return
    quiet_libraries()
    with progress_bar(not no_progress) as bar:
        report = plan_mixed(opts, progress=bar)
    if json_:
        emit_json(report)
        return
    _print(report.to_dict())


def _write(opts: Any, out_dir: str, *, overwrite: bool, json_: bool, no_progress: bool) -> None:
    """--out: the plan of one budget written (jobs/mixed_quantize.py), its KL not measured."""
    from infer_tool.cli.commands.mixed_quantize import finish
    from infer_tool.common.errors import BadInput
    from infer_tool.jobs.mixed_quantize import MixedWriteOptions, check, write_plan

    if len(opts.target_bits) + (opts.max_kld is not None) != 1:
        raise BadInput(
            "--out writes one checkpoint: give one budget (--target-bits B or --max-kld X); without --out the "
            "table shows several"
        )
    wo = MixedWriteOptions(plan=opts, out=out_dir)
    check(wo, overwrite)
    quiet_libraries()
    with progress_bar(not no_progress) as bar:
        report = write_plan(wo, overwrite=overwrite, progress=bar)
    finish(report, json_)


def _print(report: dict[str, Any]) -> None:
    from rich.table import Table

    names = [c["name"] for c in report["candidates"]]
    table = Table(title=f"mixed precision plan: {report['model']}", title_justify="left")
    for col in ("budget", "bits/weight", "predicted KL", "bound", *(f"# {n}" for n in names)):
        table.add_column(col, justify="left" if col == "budget" else "right")
    for u in report["uniform"]:
        counts = [str(report["linear_groups"]) if n == u["candidate"] else "0" for n in names]
        table.add_row(f"uniform {u['candidate']}", f"{u['bits']:.4f}", f"{u['predicted_kld']:.4g}", "", *counts)
    for p in report["plans"]:
        bound = f"{p['bound']:.4g}" if p["budget"].endswith("bits") else f"{p['bound']:.4f} bits"
        table.add_row(
            p["budget"], f"{p['bits']:.4f}", f"{p['predicted_kld']:.4g}", bound, *(str(p["counts"][n]) for n in names)
        )
    out().print(table)
    for p in report["plans"]:  # the groups off the plan's most common candidate (--json lists every linear)
        by: dict[str, list[str]] = {}
        for g, c in p["groups"].items():
            by.setdefault(c, []).append(g)
        most = max(by, key=lambda c: len(by[c]))
        out().print(f"[bold]{p['budget']}[/]: {most} on {len(by[most])} groups, and", highlight=False)
        for c, gs in by.items():
            if c != most:
                out().print(f"  {c}: {', '.join(_short(g) for g in gs)}", highlight=False)
    for note in report["notes"]:
        err().print(f"note: {note}", highlight=False)
    err().print(
        f"{report['linear_groups']} linear groups, {report['weights']} weights, {report['dtype']} checkpoint; "
        f"sensitivity on {report['calibration_tokens']} tokens in {report['sensitivity_seconds']:.0f} s; "
        "bound: the least predicted KL any plan within the budget can reach (or the least size under the KL limit)",
        highlight=False,
    )


def _short(group: str) -> str:
    """'model.layers.3.mlp.down_proj' -> '3.mlp.down_proj'."""
    head, sep, tail = group.partition(".layers.")
    return tail if sep else group
