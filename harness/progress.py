"""Progress of a set of runs (`duipai all`, `matrix`, `selftest`, `check`): on a terminal, live bars
(rich) with the runs done / total, the running runs' steps and the time left; otherwise one plain
line per finished run, as a log file or CI wants it. Called from the thread pool of
matrix.run_entries: every method takes the lock."""
from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable


def short_names(names: list[str]) -> dict[str, str]:
    """Each run name without the parts (split at '__') that every run shares: the bars stay short."""
    parts = {n: n.split("__") for n in names}
    common = set.intersection(*(set(p) for p in parts.values())) if len(names) > 1 else set()
    out = {n: " ".join(x for x in p if x not in common) or n for n, p in parts.items()}
    return out if len(set(out.values())) == len(out) else {n: n for n in names}


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class _Live:
    """A rich live display (None off a terminal) that runs for the `with` block."""
    display: Any = None

    def __enter__(self):
        if self.display is not None:
            self.display.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.display is not None:
            self.display.stop()


class RunsProgress(_Live):
    """The runs done / total, each running run's step, the time left (wall time so far, scaled by the
    work left: finished runs count 1, a running run its share of steps; so it includes start-up)."""

    def __init__(self, names: list[str], log: Callable[[str], None], *, live: bool | None = None,
                 console: Any = None, label: str = "runs"):
        self.total, self.done, self.log, self.label = len(names), 0, log, label
        self.short = short_names(names)
        self.share: dict[str, float] = {}
        self.lock = threading.RLock()
        self.t0 = time.time()
        self.live = bool(names) and (sys.stderr.isatty() if live is None else live)
        self.bars: Any = None
        self.tasks: dict[str, Any] = {}
        if self.live:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn
            self.console = console or Console(stderr=True)
            self.bars = Progress(TextColumn("{task.description}", markup=False), BarColumn(bar_width=24),
                                 TextColumn("{task.fields[info]}", markup=False), console=self.console,
                                 transient=True, refresh_per_second=4)
            self.overall = self.bars.add_task(label, total=self.total, info=self._info())
            self.display = self.bars

    def eta(self) -> float | None:
        """Seconds left, or None before any work is done."""
        with self.lock:
            work = self.done + sum(self.share.values())
            return None if work <= 0 else (time.time() - self.t0) * (self.total - work) / work

    def _info(self) -> str:
        left = self.eta()
        return (f"{self.done}/{self.total} done, {len(self.share)} running, "
                + ("time left ?" if left is None else f"about {_clock(left)} left")
                + f" ({_clock(time.time() - self.t0)} so far)")

    def _overall(self) -> None:
        self.bars.update(self.overall, completed=self.done + sum(self.share.values()), info=self._info())

    def started(self, name: str) -> Callable[[dict[str, Any]], None]:
        """A run starts: its bar; returns the on_progress callback for runner.execute."""
        with self.lock:
            self.share[name] = 0.0
            if self.bars is not None:
                self.tasks[name] = self.bars.add_task(f"  {self.short.get(name, name)}", total=None, info="starting")
                self._overall()
        return lambda msg: self.step(name, msg)

    def step(self, name: str, msg: dict[str, Any]) -> None:
        """A {"step", "of", "loss"} message of a running run (runner.stream_progress)."""
        with self.lock:
            step, of = int(msg.get("step", 0)), max(int(msg.get("of", 1) or 1), 1)
            self.share[name] = min(step / of, 1.0)
            if self.bars is not None and name in self.tasks:
                loss = msg.get("loss")
                self.bars.update(self.tasks[name], total=of, completed=step,
                                 info=f"step {step}/{of}" + (f" loss {loss:.4g}" if isinstance(loss, float) else ""))
                self._overall()

    def finished(self, name: str, line: str) -> None:
        """A run ends (however it ended): one line, `[done/total] line`, above the bars on a terminal."""
        with self.lock:
            self.done += 1
            self.share.pop(name, None)
            text = f"[{self.done}/{self.total}] {line}"
            if self.bars is None:
                self.log(text)
                return
            task = self.tasks.pop(name, None)
            if task is not None:
                self.bars.remove_task(task)
            self._overall()
            self.console.print(text, markup=False, highlight=False, soft_wrap=True)


class Activity(_Live):
    """One line that says what a long step (envelope runs, localization jobs) is doing: a spinner with
    the latest message on a terminal (each message also kept above it), plain lines otherwise."""

    def __init__(self, what: str, log: Callable[[str], None], *, live: bool | None = None, console: Any = None):
        self.what, self.log = what, log
        self.live = sys.stderr.isatty() if live is None else live
        self.status: Any = None
        self.t0 = time.time()
        if self.live:
            from rich.console import Console
            self.console = console or Console(stderr=True)
            from rich.text import Text
            self.status = self.display = self.console.status(Text(what))

    def __call__(self, msg: str) -> None:
        if self.status is None:
            self.log(msg)
            return
        self.console.print(msg, markup=False, highlight=False, soft_wrap=True)
        from rich.text import Text
        self.status.update(Text(f"{self.what}: {msg} ({_clock(time.time() - self.t0)} so far)"))


__all__ = ["RunsProgress", "Activity", "short_names"]
