"""Where a reference's training leaves float range, and the comparison with it.

A run whose parameters overflow (a learning rate far too large, or a bug that makes them NaN) goes on
"training" from inf and NaN, and what a framework computes from a non-finite state is its own convention
(whether a ReLU or a max pool passes a NaN on, say), not arithmetic any other framework has to agree with. So
no step from such a state is compared: not on the curves, not from a shared state, not in a self-replay. The
step that makes the parameters non-finite is still compared, from the state before it, which is finite: a
candidate that stays finite there while the reference overflows (or the reverse) differs at that step.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from algorithms.contract import EVAL_SERIES

from .envelope import as_float32_norm
from .runs import Run

STATE_SERIES = "param_norm"   # the norm of the parameters after the step: the state the next step starts from


def left_range_at(run: Run) -> int | None:
    """The first step after which `run`'s parameter norm is not finite (inf or NaN: the parameters, or in a float32
    backend their sum of squares, overflowed) or past what a float32 sum of squares holds (a float64 backend's
    norm there is a float32 one's inf), or None."""
    bad = np.flatnonzero(~np.isfinite(as_float32_norm(STATE_SERIES, run.values[STATE_SERIES])))
    return int(run.step[bad[0]]) if bad.size else None


def cut(run: Run, last: int) -> Run:
    """`run` as far as its step `last` (the evaluations of states before step `last + 1`), to be compared there."""
    keep, keep_eval = run.step <= last, run.eval_step <= last
    values = {s: v[keep_eval] if s in EVAL_SERIES else v[keep] for s, v in run.values.items()}
    return replace(run, step=run.step[keep], values=values, checksum=run.checksum[keep],
                   eval_step=run.eval_step[keep_eval], compared_to=last)


def range_note(run: Run, last: int) -> str:
    """What a comparison cut at `last` (`left_range_at` of the reference `run`) says, before anything else."""
    v = run.values
    i = int(np.flatnonzero(run.step == last)[0])
    what = ", ".join(f"{s} {v[s][i]:g}" for s in ("loss", "grad_norm", "update_norm", "param_norm")
                     if not np.isfinite(as_float32_norm(s, v[s][i])))
    more = run.steps_trained - last - 1
    return (f"the reference {run.name} leaves float range at step {last} ({what}): its parameter norm is not finite "
            f"from there (the parameters, or their float32 sum of squares, overflowed), so only steps 0..{last} are "
            f"compared (curves, shared-state steps and self-replays), the {more} step(s) after it nowhere (a learning "
            "rate too large, or a bug that makes the parameters inf or NaN)")


__all__ = ["left_range_at", "cut", "range_note", "STATE_SERIES"]
