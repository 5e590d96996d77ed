"""The exceptions every harness module raises and the exit codes every command returns.

Here, apart from the process launcher (harness/runner.py), so that a module which only needs to say
"bad input" does not import the machinery that starts backends."""
from __future__ import annotations

from pathlib import Path

# exit codes shared by every command
EXIT_OK, EXIT_BUG, EXIT_BAD_INPUT, EXIT_CRASH = 0, 1, 2, 3   # and 128 + a signal when stopped (cli.STOP_SIGNALS)


class BadInput(Exception):
    """User error: one clear line, exit 2, nothing written."""


class Interrupted(KeyboardInterrupt):
    """A job that did not start or was stopped because the command was interrupted: not a backend's failure, so
    nothing is recorded for it (no `.failed/` log, no failed entry); the next run of the same command does it."""


class BackendFailed(Exception):
    """The backend process crashed, hung or refused; its log is kept."""

    def __init__(self, msg: str, log: Path | None = None, unsupported: bool = False):
        super().__init__(msg)
        self.log, self.unsupported = log, unsupported


class CannotLower(BadInput, BackendFailed):
    """A backend that does not lower a layer kind of the model: refused before any process starts. A bad
    input to `run` (exit 2), an unsupported cell to a matrix (as a data-parallel refusal is)."""

    def __init__(self, msg: str):
        BackendFailed.__init__(self, msg, None, unsupported=True)


def error_line(msg: object) -> str:
    """The one line every command prints for a refused input or a failed backend (on stderr)."""
    return f"duipai: error: {msg}"
