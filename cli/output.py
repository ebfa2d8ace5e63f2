"""Everything the CLI prints: JSON on stdout, tables, errors and progress bars.

Conventions every subcommand follows:
- `--json` prints exactly one JSON document on stdout (`emit_json`);
- human output is a rich table on stdout;
- diagnostics and progress go to stderr (`err`);
- exit 0 on success, 2 on bad input (`BadInput`), 3 on a failed quality gate.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import typer

from infer_tool.common.errors import BadInput, QualityGateFailed

if TYPE_CHECKING:
    from rich.console import Console


def out() -> Console:
    """Console on stdout (tables). Made per call so tests capturing stdout see it.
    Piped output gets 120 columns (rich's default of 80 squeezes wide tables)."""
    from rich.console import Console

    width = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 120
    return Console(file=sys.stdout, soft_wrap=False, width=width)


def err() -> Console:
    """Console on stderr (diagnostics, warnings, progress)."""
    from rich.console import Console

    return Console(file=sys.stderr, soft_wrap=True)


def _json_default(o: Any) -> Any:
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _finite(o: Any) -> Any:
    """Replace NaN/Inf (not valid JSON) by None, recursively."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def to_json(obj: Any) -> str:
    return json.dumps(_finite(obj), indent=2, default=_json_default)


def emit_json(obj: Any) -> None:
    """Print one JSON document on stdout."""
    sys.stdout.write(to_json(obj) + "\n")
    sys.stdout.flush()


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print a one-line error on stderr and return the Exit to raise."""
    err().print(f"[bold red]error:[/] {message}", highlight=False, markup=True)
    return typer.Exit(code)


def cli_command(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a command: BadInput -> exit 2, QualityGateFailed -> exit 3, one line each,
    no traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (BadInput, QualityGateFailed) as e:
            raise fail(str(e).replace("\n", " "), e.exit_code) from None
        except KeyboardInterrupt:
            raise fail("interrupted", 130) from None

    return wrapper


@contextlib.contextmanager
def progress_bar(enabled: bool = True) -> Iterator[Callable[..., None]]:
    """A `common.progress.Progress` callback drawing rich bars on stderr, one per task.

    Extra keyword figures (`tok_s`, `ppl`, ...) are shown after the bar.
    """
    if not enabled:
        yield lambda *a, **k: None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    bars = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=err(),
        transient=False,
    )
    ids: dict[str, Any] = {}

    def update(task: str, done: int, total: int, **info: float) -> None:
        text = "  ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in info.items()
        )
        if task not in ids:
            ids[task] = bars.add_task(task, total=total, info=text)
        bars.update(ids[task], completed=done, total=total, info=text)

    with bars:
        yield update
