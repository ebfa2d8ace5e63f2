"""`infer-tool quantize MODEL --model-free`: the options `quantize` parsed, turned into the
model-free job's (`jobs/model_free.py`), and its report printed. Called by
`cli/commands/quantize.py` when `--model-free` is given."""

from __future__ import annotations

import dataclasses
from typing import Any

# Options of `quantize` that calibrate, evaluate or load a model: refused with --model-free.
NOT_MODEL_FREE = (
    "eval",
    "max_ppl_increase",
    "max_kld",
    "stats",
    "calib",
    "num_samples",
    "seq_len",
    "moe_calibration",
    "moe_min_tokens",
    "max_memory",
    "device",
    "allow_pickle",
    "trust_remote_code",
)


def model_free_options(opts: Any, flags: dict[str, Any], recipe: dict[str, Any]) -> Any:
    """The job's options from `quantize`'s; BadInput for what does not apply."""
    from infer_tool.calib.recipe import flag, preset_option_names, scheme_from_options
    from infer_tool.common.errors import BadInput
    from infer_tool.jobs.model_free import ModelFreeOptions

    given = set(recipe) | {k for k, v in flags.items() if v not in (None, ())}
    wrong = [flag(n) for n in NOT_MODEL_FREE if n in given]
    if wrong:
        raise BadInput(
            f"{', '.join(wrong)} do{'es' if len(wrong) == 1 else ''} not apply to --model-free, which reads no "
            "text and builds no model; drop them, or quantize without --model-free"
        )
    if opts.format != "compressed-tensors":
        raise BadInput(f"--model-free writes --format compressed-tensors only, not {opts.format!r}")
    if opts.model is None:
        raise BadInput("--model-free needs MODEL (a model directory with safetensors shards, or a hub name)")
    if opts.out is None:
        raise BadInput("--out DIR is required when MODEL is given")
    if "method" not in given and "method" not in preset_option_names(opts.scheme):
        opts = dataclasses.replace(opts, method="rtn")  # the data-free method, whatever quantize's default
    return ModelFreeOptions(
        model=opts.model,
        out=opts.out,
        scheme=scheme_from_options(opts),
        ignore=tuple(opts.ignore),
        default_ignore=opts.default_ignore,
        dtype=opts.dtype,
        resume=opts.resume,
    )


def run_model_free(
    opts: Any, flags: dict[str, Any], recipe: dict[str, Any], *, overwrite: bool, json_: bool, no_progress: bool
) -> None:
    from infer_tool.cli.output import emit_json, err, progress_bar, quiet_libraries
    from infer_tool.jobs.model_free import check, launch_rank, quantize_model_free

    mf = model_free_options(opts, flags, recipe)
    rank, world = launch_rank()
    check(mf, overwrite, first=rank == 0)  # before any progress bar
    quiet_libraries()
    with progress_bar(rank == 0 and not no_progress) as bar:
        report = quantize_model_free(mf, overwrite=overwrite, progress=bar, rank=rank, world=world)
    if rank != 0:  # under torchrun, process 0 reports
        return
    if json_:
        emit_json(report)
    else:
        _print_report(report)
    for pattern in report.unmatched_ignore:
        err().print(f"note: --ignore pattern {pattern} matches no tensor", highlight=False)
    for note in report.notes if not json_ else ():
        err().print(f"note: {note}", highlight=False)


def _print_report(report: Any) -> None:
    from rich.table import Table

    from infer_tool.cli.output import out

    table = Table(
        title=f"quantize --model-free {report.model} -> {report.out}", title_justify="left", show_header=False
    )
    table.add_column("", style="bold")
    table.add_column("")
    table.add_row("scheme", report.scheme)
    table.add_row("format", report.format)
    if report.source_quantization:
        table.add_row("source", f"{report.source_quantization}, dequantized tensor by tensor")
    table.add_row("quantized", f"{report.quantized} tensors; {report.kept} kept ({len(report.ignore)} in ignore)")
    if report.skipped:
        first = next(iter(report.skipped.items()))
        table.add_row("kept for shape", f"{len(report.skipped)}, e.g. {first[0]}: {first[1]}")
    resumed = f", {report.resumed_shards} resumed" if report.resumed_shards else ""
    table.add_row("shards", f"{report.shards}{resumed}")
    table.add_row(
        "bytes", f"{report.bytes_in / 1e6:,.1f} MB in, {report.bytes_out / 1e6:,.1f} MB out; {report.mb_per_s:.1f} MB/s"
    )
    table.add_row("time", f"{report.seconds:.1f}s")
    table.add_row("peak memory", f"RSS {report.peak_rss_mib:.0f} MiB")
    out().print(table)
