"""Errors library code raises and the CLI maps to exit codes.

Library code never prints or exits: it raises one of these with a one-line message
that names the bad value and what is accepted; `cli/` prints it and exits.
"""

import contextlib
from collections.abc import Iterator


class BadInput(ValueError):
    """The user asked for something we cannot do (CLI exit code 2)."""

    exit_code = 2


class QualityGateFailed(RuntimeError):
    """A measured quality figure broke the user's limit (CLI exit code 3)."""

    exit_code = 3


class PeerFailed(RuntimeError):
    """Another process of a multi-process run failed (it printed why); this one stops (exit 1)."""

    exit_code = 1


def cause(e: BaseException) -> str:
    """One line describing an exception: its first message line, or its type."""
    text = str(e).strip()
    first = text.splitlines()[0].strip() if text else ""
    if isinstance(e, MemoryError):
        return "it claims more memory than this machine has (corrupt or crafted file?)"
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


@contextlib.contextmanager
def untrusted(what: str) -> Iterator[None]:
    """Parse a user's file or name: any failure inside (a parser's own exception, a
    truncated file, a crafted header) becomes one BadInput naming `what` and the cause.

    Wrap only the call that reads the untrusted input, never our own computation: a bug
    of ours would otherwise be reported as bad input."""
    try:
        yield
    except BadInput:
        raise
    except (Exception, MemoryError, RecursionError) as e:  # noqa: BLE001 - third-party parsers raise anything
        raise BadInput(f"{what}: {cause(e)}") from None
