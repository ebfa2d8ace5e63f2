"""`infer-tool convert SRC --to compressed-tensors`: rewrite an AWQ (GEMM), GPTQ (v1), native FP8
or ModelOpt NVFP4 checkpoint as compressed-tensors without rounding anything again, and back
(`--to awq | gptq | fp8`) where the target can hold it (`jobs/convert.py`)."""

from __future__ import annotations

from typing import Annotated

import typer

from infer_tool.cli.options import Json, NoProgress, Overwrite
from infer_tool.cli.output import cli_command


def register(app: typer.Typer) -> None:
    app.command("convert")(convert)


@cli_command
def convert(
    src: Annotated[
        str,
        typer.Argument(
            help="Checkpoint directory (or hub name): AWQ, GPTQ, FP8, ModelOpt NVFP4, compressed-tensors.",
            metavar="SRC",
        ),
    ],
    out: Annotated[str, typer.Option("--out", help="Output checkpoint directory.")],
    to: Annotated[
        str, typer.Option("--to", help="Target: compressed-tensors; from it: awq, gptq, fp8.")
    ] = "compressed-tensors",
    overwrite: Overwrite = False,
    json_: Json = False,
    no_progress: NoProgress = False,
) -> None:
    """Rewrite a quantized checkpoint in another format, losslessly: the same integer codes (or
    e4m3 values) and the same scales; what the target cannot carry is refused, naming why.
    Exit 2: bad input."""
    from infer_tool.cli.output import emit_json, progress_bar, quiet_libraries
    from infer_tool.cli.output import out as stdout
    from infer_tool.jobs.convert import convert as run

    quiet_libraries()
    with progress_bar(not no_progress) as bar:
        report = run(src, out, to=to, overwrite=overwrite, progress=bar)
    if json_:
        emit_json(report)
        return
    stdout().print(
        f"converted {report.linears} {report.source_format} linears of {report.model} to {report.format} "
        f"({report.scheme}) in {report.out}: {report.bytes_in / 1e6:,.1f} MB -> {report.bytes_out / 1e6:,.1f} MB, "
        f"{report.seconds:.1f}s",
        highlight=False,
    )
    for note in report.notes:
        stdout().print(f"note: {note}", highlight=False)
