"""The progress protocol between library code and the CLI.

Library functions take an optional `progress: Progress | None`. They call
`progress(task, done, total, **info)` as work advances; `cli/` turns the calls into a
rich progress bar on stderr. `info` carries extra live figures (tokens/s, running ppl).
"""

from typing import Protocol


class Progress(Protocol):
    def __call__(self, task: str, done: int, total: int, **info: float) -> None: ...


def no_progress(task: str, done: int, total: int, **info: float) -> None:
    """The default callback: report nothing."""
