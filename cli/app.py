"""The root typer app. Each subcommand is one module in `commands/` exposing
`register(app)`; command modules import only typer at import time, so
`infer-tool --help` and `infer-tool kv-budget` never load torch."""

from __future__ import annotations

import importlib
import sys
from typing import Annotated, Optional

import typer

from infer_tool.common.errors import BadInput, QualityGateFailed

# Only subcommands that work are registered here.
COMMANDS = (
    "quantize",  # also registers `calibrate`
    "eval",
    "kv_budget",
    "spec_profile",
)

app = typer.Typer(
    name="infer-tool",
    help="Quantize, evaluate, size and profile LLMs for production inference.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version  # ~50 ms: only for --version

    try:
        return version("infer-tool")
    except PackageNotFoundError:
        return "unknown"


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"infer-tool {_version()}")
        raise typer.Exit()


@app.callback()
def root(
    version_: Annotated[
        Optional[bool],
        typer.Option("--version", callback=_show_version, is_eager=True, help="Show the version and exit."),
    ] = None,
) -> None:
    """Quantize, evaluate, size and profile LLMs for production inference."""


for _name in COMMANDS:
    importlib.import_module(f"infer_tool.cli.commands.{_name}").register(app)


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except (BadInput, QualityGateFailed) as e:
        sys.stderr.write(f"error: {e}\n")
        sys.exit(e.exit_code)
