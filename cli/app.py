"""The root typer app. Each subcommand is one module in `commands/` exposing
`register(app)`; command modules import only typer at import time, so
`infer-tool --help` and `infer-tool kv-budget` never load torch."""

from __future__ import annotations

import importlib
import sys
from typing import Annotated, Any

import typer

from infer_tool.cli import help_panels
from infer_tool.common.errors import BadInput, QualityGateFailed

# Only subcommands that work are registered here.
COMMANDS = (
    "quantize",  # also registers `calibrate`
    "eval",
    "kv_budget",
    "spec_profile",
    "convert",
    "quantize_plan",
)

app = typer.Typer(
    name="infer-tool",
    help="Quantize, evaluate, size and profile LLMs for production inference.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version  # imported only for --version

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
        bool | None,
        typer.Option("--version", callback=_show_version, is_eager=True, help="Show the version and exit."),
    ] = None,
) -> None:
    """Quantize, evaluate, size and profile LLMs for production inference."""


for _name in COMMANDS:
    importlib.import_module(f"infer_tool.cli.commands.{_name}").register(app)
help_panels.install(app)


def _click_exceptions() -> Any:
    """click's exception module: typer >= 0.26 vendors click as typer._click."""
    try:
        from typer._click import exceptions
    except ImportError:
        from click import exceptions
    return exceptions


def _ascii_numbers(command: Any) -> None:
    """Make every int and float option of `command` and its subcommands refuse a value that
    is not written in ASCII digits (a usage error naming the value), before click converts it."""
    try:
        from typer._click import types
    except ImportError:
        from click import types

    class Ascii(types.ParamType):
        def __init__(self, inner: Any) -> None:
            self.inner, self.name = inner, inner.name

        def convert(self, value: Any, param: Any, ctx: Any) -> Any:
            # Python's int() and float() also take other scripts' digits ("١٢") and "1_000"
            if isinstance(value, str) and (not value.isascii() or "_" in value):
                self.fail(f"{value!r} is not a number written in ASCII digits", param, ctx)
            return self.inner.convert(value, param, ctx)

        def get_metavar(self, *args: Any, **kwargs: Any) -> Any:
            return self.inner.get_metavar(*args, **kwargs)

    for param in command.params:
        if isinstance(param.type, (types.IntParamType, types.FloatParamType)):
            param.type = Ascii(param.type)
    for sub in getattr(command, "commands", {}).values():
        _ascii_numbers(sub)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point. Usage errors (an unknown flag, a value of the wrong
    type) are one line on stderr, exit 2, like every other bad input."""
    click = _click_exceptions()
    command = typer.main.get_command(app)
    _ascii_numbers(command)
    try:
        code = command.main(args=argv, prog_name="infer-tool", standalone_mode=False)
    except click.NoArgsIsHelpError as e:
        sys.stdout.write(e.ctx.get_help() + "\n")
        code = 0
    except click.UsageError as e:
        hint = (
            f" (see: infer-tool {e.ctx.command_path.partition(' ')[2]} --help)".replace("  --help", " --help")
            if e.ctx
            else ""
        )
        sys.stderr.write(f"error: {e.format_message()}{hint}\n")
        code = 2
    except typer.Abort:
        sys.stderr.write("error: interrupted\n")
        code = 130
    except (BadInput, QualityGateFailed) as e:
        sys.stderr.write(f"error: {e}\n")
        code = e.exit_code
    sys.exit(code if isinstance(code, int) else 0)
