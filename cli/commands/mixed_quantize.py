"""`infer-tool quantize MODEL --target-bits B --candidates ...` (and `--candidates ... --max-kld X
--eval CORPUS`): the options `quantize` parsed, turned into the mixed-precision job's
(`jobs/mixed_quantize.py`), and its report printed; also `quantize-plan ... --out DIR`'s
printing. Called by `cli/commands/quantize.py` when `--target-bits` or `--candidates` is given.
"""

from __future__ import annotations

from typing import Any

# Options of `quantize` a mixed-precision run takes (the rest pick one scheme, a method other
# than RTN, or a way of running the layer pipeline, none of which apply).
MIXED_OPTIONS = (
    "model",
    "method",
    "out",
    "calib",
    "num_samples",
    "seq_len",
    "seed",
    "eval",
    "eval_tokens",
    "eval_seq_len",
    "kld",
    "max_kld",
    "device",
    "dtype",
    "allow_pickle",
    "trust_remote_code",
    "target_bits",
    "candidates",
)


def mixed_options(opts: Any, flags: dict[str, Any], recipe: dict[str, Any]) -> Any:
    """The job's options from `quantize`'s; BadInput for what does not apply."""
    from infer_tool.calib.mixed_candidates import DEFAULT_CANDIDATES, METHODS
    from infer_tool.calib.recipe import flag, preset_option_names
    from infer_tool.common.errors import BadInput
    from infer_tool.jobs.mixed_plan import MixedPlanOptions
    from infer_tool.jobs.mixed_quantize import MixedWriteOptions

    given = set(recipe) | {k for k, v in flags.items() if v not in (None, ())} | preset_option_names(opts.scheme)
    wrong = sorted(flag(n) for n in given if n not in MIXED_OPTIONS)
    if wrong:
        raise BadInput(
            f"{', '.join(wrong)} do{'es' if len(wrong) == 1 else ''} not apply to mixed precision (--target-bits / "
            "--candidates), whose schemes are the --candidates, each RTN: drop them, or quantize with one scheme"
        )
    if "method" in given and opts.method not in METHODS:
        raise BadInput(
            f"--method {opts.method}: mixed precision solves every candidate with {' or '.join(METHODS)} "
            "(AWQ, AutoRound per candidate are not built)"
        )
    if opts.model is None:
        raise BadInput("mixed precision needs MODEL (--target-bits / --candidates)")
    if opts.out is None:
        raise BadInput("--out DIR is required when MODEL is given")
    if "kld" in given and not opts.kld and opts.max_kld is not None:
        raise BadInput("--max-kld needs the KL divergence: drop --no-kld")
    if opts.target_bits is None and opts.max_kld is None:
        raise BadInput(
            "give the budget: --target-bits B (average stored bits per weight) or --max-kld X with --eval CORPUS"
        )
    if opts.target_bits is not None and not opts.target_bits > 0:
        raise BadInput(f"--target-bits {opts.target_bits:g}: expected a positive number of bits per weight, e.g. 4.5")
    defaults = MixedPlanOptions(model=opts.model)
    plan = MixedPlanOptions(
        model=opts.model,
        candidates=opts.candidates or ",".join(DEFAULT_CANDIDATES),
        target_bits=() if opts.target_bits is None else (float(opts.target_bits),),
        max_kld=opts.max_kld if opts.target_bits is None else None,  # with --target-bits it is the gate only
        calib=opts.calib,
        # the sensitivity pass needs far fewer windows than a calibration: the plan's own default
        num_samples=opts.num_samples if "num_samples" in given else defaults.num_samples,
        seq_len=opts.seq_len,
        seed=opts.seed,
        method=opts.method if "method" in given else "rtn",
        dtype=opts.dtype,
        device=opts.device or "auto",
        allow_pickle=opts.allow_pickle,
        trust_remote_code=opts.trust_remote_code,
    )
    return MixedWriteOptions(
        plan=plan,
        out=opts.out,
        eval=opts.eval if opts.kld else None,
        eval_tokens=opts.eval_tokens,
        eval_seq_len=opts.eval_seq_len,
        max_kld_gate=opts.max_kld,
    )


def run_mixed(
    opts: Any, flags: dict[str, Any], recipe: dict[str, Any], *, overwrite: bool, json_: bool, no_progress: bool
) -> None:
    from infer_tool.cli.output import progress_bar, quiet_libraries
    from infer_tool.jobs.mixed_quantize import check, write_plan

    mo = mixed_options(opts, flags, recipe)
    check(mo, overwrite)  # before any progress bar
    quiet_libraries()
    with progress_bar(not no_progress) as bar:
        report = write_plan(mo, overwrite=overwrite, progress=bar)
    finish(report, json_)


def finish(report: Any, json_: bool) -> None:
    """Print the report (one JSON document with --json), then exit 3 when the gate failed."""
    from infer_tool.cli.output import emit_json
    from infer_tool.common.errors import QualityGateFailed

    if json_:
        emit_json(report)
    else:
        print_report(report)
    gate = report.kld_gate
    if gate is not None and not gate.passed:
        measured = "was not measured" if gate.kld is None else f"is {gate.kld:.4g} nats per token"
        raise QualityGateFailed(
            f"the mean KL divergence of the written checkpoint from the fp model {measured}, above --max-kld "
            f"{gate.max_kld:g}; the checkpoint is in {report.out}"
        )


def print_report(report: Any) -> None:
    from rich.table import Table

    from infer_tool.cli.output import err, out

    table = Table(title=f"mixed precision {report.model} -> {report.out}", title_justify="left", show_header=False)
    table.add_column("", style="bold")
    table.add_column("")
    table.add_row("budget", report.budget)
    table.add_row("schemes", ", ".join(f"{k}: {v} groups" for k, v in report.counts.items() if v))
    table.add_row("bits/weight, planned linears", f"{report.bits_planned:.4f} (as stored)")
    table.add_row("bits/weight, whole model", f"{report.bits_model:.4f} (every tensor as stored)")
    table.add_row("predicted KL", f"{report.predicted_kld:.4g} nats/token ({report.estimator})")
    if report.measured_kld is not None:
        ev = report.kld_eval or {}
        table.add_row(
            "measured KL", f"{report.measured_kld:.4g} nats/token on {ev.get('tokens')} tokens of {ev.get('corpus')}"
        )
        table.add_row("ppl (fp -> mixed)", f"{ev.get('reference_ppl', 0):.4f} -> {ev.get('ppl', 0):.4f}")
    if report.kld_gate is not None:
        table.add_row("--max-kld", f"{report.kld_gate.max_kld:g}: {'passed' if report.kld_gate.passed else 'FAILED'}")
    out().print(table)
    by: dict[str, list[str]] = {}
    for lin in report.linears:
        if not by.get(lin.candidate) or by[lin.candidate][-1] != lin.group:
            by.setdefault(lin.candidate, []).append(lin.group)
    most = max(by, key=lambda c: len(by[c]))
    for c, groups in by.items():
        if c != most:
            out().print(f"  {c}: {', '.join(_short(g) for g in groups)}", highlight=False)
    err().print(
        f"note: {most} on the other {len(by[most])} groups; --json lists every linear's scheme, bits and predicted KL",
        highlight=False,
    )
    for note in report.notes:
        err().print(f"note: {note}", highlight=False)


def _short(group: str) -> str:
    """'model.layers.3.mlp.down_proj' -> '3.mlp.down_proj'."""
    head, sep, tail = group.partition(".layers.")
    return tail if sep else group
