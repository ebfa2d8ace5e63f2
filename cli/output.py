"""Everything the CLI prints: JSON on stdout, tables, errors and progress bars.

Conventions every subcommand follows:
- `--json` prints exactly one JSON document on stdout (`emit_json`);
- human output is a rich table on stdout;
- diagnostics and progress go to stderr (`err`);
- exit 0 on success, 2 on bad input (`BadInput`), 3 on a failed quality gate.
"""

from __future__ import annotations

import contextlib
import errno
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


def disk_full(e: OSError) -> typer.Exit:
    """A full disk or quota (exit 1): the machine's, not our bug and not bad input."""
    where = f" writing {e.filename}" if e.filename else ""
    return fail(f"no space left on the device{where} ({e.strerror}); free some space and run again{_notes(e)}", 1)


def _notes(e: BaseException) -> str:
    """What the library added to an exception for the user (e.g. how to resume), as '; ...'."""
    return "".join(f"; {n}" for n in getattr(e, "__notes__", ()))


def cli_command(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a command: BadInput -> exit 2, QualityGateFailed -> exit 3, a full disk or
    anything unexpected -> exit 1; one line each on stderr, never a traceback (unless INFER_TOOL_DEBUG=1)."""

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
            if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise disk_full(e) from None
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


# Libraries' bar descriptions, as short task names (the bar's count and time need the width).
_LIBRARY_TASKS = {
    "Converting and de-quantizing GGUF tensors": "read GGUF",  # transformers' GGUF conversion
    "Loading weights": "load weights",  # transformers 5's weight loading
}
TASK_WIDTH = 24  # the most a bar's description takes
_WIDE = 100  # from this many columns on, the bar also shows the estimated time left


def task_name(task: str) -> str:
    """A bar's description in at most TASK_WIDTH characters: a library's by its short name,
    a path after the first word by its last part ("perplexity /a/b/ckpt" -> "perplexity ckpt"),
    then cut in the middle."""
    task = _LIBRARY_TASKS.get(task, task)
    head, _, rest = task.partition(" ")
    if "/" in rest:
        task = f"{head} {rest.rstrip('/').rsplit('/', 1)[-1]}"
    if len(task) > TASK_WIDTH:
        keep = TASK_WIDTH - 1
        task = task[: keep // 2] + "\u2026" + task[len(task) - (keep - keep // 2) :]
    return task


def bar_columns(width: int) -> tuple[Any, ...]:
    """The columns of a progress bar `width` characters wide. The count and the elapsed time
    always fit whole, and the description up to TASK_WIDTH; the bar takes what is left (4 to
    40 characters); the live figures (`info`) are shown where at least 12 characters remain
    for them beside a 10-character bar, cut at the end; the estimated time left only from
    _WIDE columns on."""
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    from rich.table import Column

    def fixed(max_width: int | None = None) -> Column:
        return Column(no_wrap=True, overflow="ellipsis", max_width=max_width)

    count, elapsed = 10, 8  # "9999/9999" and "0:00:00", each with its gap
    task = max(4, min(TASK_WIDTH, width - count - elapsed - 1))
    info = width - (task + 1) - count - elapsed - (10 + 1)
    columns: list[Any] = [TextColumn("[bold]{task.description}", table_column=fixed(task))]
    if width - task - count - elapsed >= 5:
        columns.append(BarColumn(bar_width=None, table_column=Column(max_width=40)))
    columns.append(MofNCompleteColumn(table_column=fixed()))
    if info >= 12:
        columns.append(TextColumn("{task.fields[info]}", table_column=fixed(info)))
    columns.append(TimeElapsedColumn(table_column=fixed()))
    if width >= _WIDE:
        columns.append(TimeRemainingColumn(table_column=fixed()))
    return tuple(columns)


def _fitting_progress(console: Console) -> Any:
    """A rich Progress whose columns follow the console's width at every refresh."""
    from rich.progress import Progress

    class FittingProgress(Progress):
        def make_tasks_table(self, tasks: Any) -> Any:
            self.columns = bar_columns(console.width)
            return super().make_tasks_table(tasks)

    return FittingProgress(*bar_columns(console.width), console=console, transient=False)


@contextlib.contextmanager
def progress_bar(enabled: bool = True) -> Iterator[Callable[..., None]]:
    """A `common.progress.Progress` callback drawing rich bars on stderr, one per task.

    Extra keyword figures (`tok_s`, `ppl`, ...) are shown after the bar. Libraries' own
    tqdm bars are drawn as rich bars too (or silenced when not `enabled`). At any width the
    description, the count and the elapsed time stay whole (`bar_columns`).
    """
    if not enabled:
        with _routing_library_bars(None):
            yield lambda *a, **k: None
        return
    bars = _fitting_progress(err())
    ids: dict[str, Any] = {}

    def update(task: str, done: int, total: int, **info: float) -> None:
        text = "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in info.items())
        if task not in ids:
            ids[task] = bars.add_task(task_name(task), total=total, info=text)
        bars.update(ids[task], completed=done, total=total, info=text)

    with bars, _routing_library_bars(update):
        yield update
