"""Errors library code raises and the CLI maps to exit codes.

Library code never prints or exits: it raises one of these with a one-line message
that names the bad value and what is accepted; `cli/` prints it and exits.
"""


class BadInput(ValueError):
    """The user asked for something we cannot do (CLI exit code 2)."""

    exit_code = 2


class QualityGateFailed(RuntimeError):
    """A measured quality figure broke the user's limit (CLI exit code 3)."""

    exit_code = 3
