"""What every command shares: the one-line error and exit, the stderr log, a bar for one run."""
from __future__ import annotations

import math
import sys
from typing import Any, Callable, NoReturn

import click

from ..errors import EXIT_BAD_INPUT, error_line


class Seconds(click.FloatRange):
    """A job limit in seconds: a number > 0 (0 or less killed the job at its start, reported as "timed out")."""
    name = "seconds"

    def __init__(self) -> None:
        super().__init__(min=0, min_open=True)

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        if not math.isfinite(seconds):    # nan passes FloatRange; inf overflows the waits it is handed to
            self.fail(f"{value!r} is not a finite number of seconds", param, ctx)
        return super().convert(seconds, param, ctx)


SECONDS = Seconds()


def fail(msg: str, code: int = EXIT_BAD_INPUT) -> NoReturn:
    """Print `duipai: error: MSG` on stderr and exit (2 by default: bad input)."""
    click.echo(error_line(msg), err=True)
    sys.exit(code)


def options(opts: list[Callable]) -> Callable:
    """One decorator applying a list of click options in their listed order (shared option sets)."""
    def apply(f: Callable) -> Callable:
        for o in reversed(opts):
            f = o(f)
        return f
    return apply


def say(msg: str) -> None:
    """One line on stderr (progress, notes)."""
    click.echo(msg, err=True)


class Progress:
    """A one-line progress bar on stderr, only when stderr is a terminal."""

    def __init__(self, label: str):
        self.label, self.tty = label, sys.stderr.isatty()

    def __call__(self, msg: dict[str, Any]) -> None:
        if not self.tty:
            return
        step, of = msg["step"], msg["of"]
        w = 30
        fill = int(w * step / max(of, 1))
        sys.stderr.write(f"\r{self.label:<40} [{'#' * fill}{'.' * (w - fill)}] {step}/{of} loss {msg.get('loss', 0):.4g}")
        if step >= of:
            sys.stderr.write("\n")
        sys.stderr.flush()
