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
import os
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import typer

from infer_tool.common.errors import BadInput, PeerFailed, QualityGateFailed
from infer_tool.common.jsonout import to_json

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


def emit_json(obj: Any) -> None:
    """Print one JSON document on stdout."""
    sys.stdout.write(to_json(obj) + "\n")
    sys.stdout.flush()


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print a one-line error on stderr and return the Exit to raise."""
    err().print(f"[bold red]error:[/] {message}", highlight=False, markup=True)
    return typer.Exit(code)


def internal_error(e: BaseException) -> typer.Exit:
    """The last resort: an unexpected exception as one line (exit 1); with
    INFER_TOOL_DEBUG=1 the caller re-raises it with its traceback instead."""
    from infer_tool.common.errors import cause

    return fail(f"internal error: {cause(e)}; set INFER_TOOL_DEBUG=1 for the traceback{_notes(e)}", 1)


def _notes(e: BaseException) -> str:
    """What the library added to an exception for the user (e.g. how to resume), as '; ...'."""
    return "".join(f"; {n}" for n in getattr(e, "__notes__", ()))


def cli_command(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a command: BadInput -> exit 2, QualityGateFailed -> exit 3, anything unexpected
    -> exit 1; one line each on stderr, never a traceback (unless INFER_TOOL_DEBUG=1)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (BadInput, QualityGateFailed, PeerFailed) as e:
            raise fail(str(e).replace("\n", " "), e.exit_code) from None
        except KeyboardInterrupt as e:
            raise fail(f"interrupted{_notes(e)}", 130) from None
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except (Exception, MemoryError, RecursionError) as e:  # noqa: BLE001 - the last-resort handler
            if os.environ.get("INFER_TOOL_DEBUG") == "1":
                raise
            raise internal_error(e) from None

    return wrapper


def quiet_libraries() -> None:
    """transformers' and datasets' warnings and bars would interleave with ours: warnings
    off, datasets' bars off; transformers' bars go through `progress_bar` (drawn as our
    own bars, or nowhere with --no-progress)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DATASETS_VERBOSITY", "error")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    _route_library_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging

        logging.set_verbosity_error()
    if "datasets" in sys.modules:
        import datasets

        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()


_ACTIVE: list[Callable[..., None]] = []  # the progress callback of the innermost enabled progress_bar


def _routed_tqdm(base: type) -> type:
    """A subclass of tqdm `base` that draws nothing and reports to the active progress bar
    (libraries' own bars: transformers' GGUF conversion and weight loading)."""

    class Routed(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            iterable = args[0] if args else kwargs.get("iterable")
            self._task = str(kwargs.get("desc") or "loading").rstrip(". :")
            self._total = kwargs.get("total") or (len(iterable) if hasattr(iterable, "__len__") else None)
            self._done = 0

        def __iter__(self) -> Any:
            for item in self.iterable:
                yield item
                self.update(1)

        def update(self, n: float | None = 1) -> bool | None:
            self._done += int(n or 0)
            if _ACTIVE and self._total:
                _ACTIVE[-1](self._task, min(self._done, int(self._total)), int(self._total))
            return None

    return Routed


def _route_library_bars() -> None:
    """From now on `tqdm.auto.tqdm` (what transformers draws its bars with) reports to the
    innermost enabled progress_bar, and is silent outside one. Idempotent."""
    import tqdm.auto

    if not getattr(tqdm.auto.tqdm, "_infer_tool_routed", False):
        routed = _routed_tqdm(tqdm.auto.tqdm)
        routed._infer_tool_routed = True
        tqdm.auto.tqdm = routed


@contextlib.contextmanager
def _routing_library_bars(update: Callable[..., None] | None) -> Iterator[None]:
    """While active, libraries' bars report to `update` (silent when None)."""
    _route_library_bars()
    if update is not None:
        _ACTIVE.append(update)
    try:
        yield
    finally:
        if update is not None:
            _ACTIVE.pop()


@contextlib.contextmanager
def progress_bar(enabled: bool = True) -> Iterator[Callable[..., None]]:
    """A `common.progress.Progress` callback drawing rich bars on stderr, one per task.

    Extra keyword figures (`tok_s`, `ppl`, ...) are shown after the bar. Libraries' own
    tqdm bars are drawn as rich bars too (or silenced when not `enabled`).
    """
    if not enabled:
        with _routing_library_bars(None):
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

    with bars, _routing_library_bars(update):
        yield update
