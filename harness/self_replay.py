"""The self-replay check: does a run reproduce its own training from its own checkpoint?

The shared-state step comparison (harness.resync) starts every step it compares from a loaded checkpoint,
so state that a backend's training carries and its checkpoint does not hold (gradients that accumulate
because they are never cleared, a schedule object that counts its own steps, a buffer an evaluation
writes) is invisible to it: every resynced step agrees and the free-running curves diverge, which is
exactly what drift looks like. The step-0 probes' restart check (Backend.restart_check) sees such state
only where it matters at step 1. This check sees it where the curves diverge: the candidate's backend, in
a fresh process, loads the candidate's own checkpoint at or before the first divergent step d and
re-trains from there to d on the run's batches; its per-step statistics must equal the run's own rows.

A deterministic backend reproduces them bit for bit (the restart check measured 0.0 for one step in every
backend). State the checkpoint misses makes the rows jump: exact up to some step, then off by far more than
rounding. So the replay differs when the first row that is not bit-equal to the run's is off by more than TOL
relative. A replay whose first difference is small (a load that rounds, ~1e-7) is never called different
later: from there a chaotic model grows it smoothly, and on a model with many ReLU kinks it can flip one
and jump, which is rounding's doing, not the state's.
"""
from __future__ import annotations

from typing import Any

import numpy as np

TOL = 1e-4                 # as the restart check (harness.resync_verdict.RESTART_TOL)
SERIES = ("loss", "grad_norm", "update_norm", "param_norm")   # the replayed row's order after step, accuracy


def replay_span(steps: int, checkpoint_steps: list[int], d: int) -> tuple[int, int] | None:
    """(c, t): re-train from the checkpoint c (the latest at or before d) through step t - 1, t = d + 1 (at
    least c + 1, at most the last step, whose batch the replay job probes); None when there is no such span."""
    c = max((s for s in checkpoint_steps if s <= d), default=None)
    if c is None:
        return None
    t = min(max(d + 1, c + 1), steps - 1)
    return (c, t) if t > c else None


def judge(steps: np.ndarray, values: dict[str, np.ndarray], replayed: list[list[float]]) -> dict[str, Any]:
    """The replayed rows [step, loss, accuracy, grad_norm, update_norm, param_norm] against the run's own
    series (on `steps`): {checked, rows, max_rel, differs, exact_rows (how many rows from the load on are
    bit-equal: after the first that is not, nothing is judged), and where it jumped: step, series, run, replay}."""
    out: dict[str, Any] = {"checked": True, "rows": len(replayed), "max_rel": 0.0, "differs": False, "exact_rows": 0}
    at = {int(t): i for i, t in enumerate(steps)}
    exact = True     # every row so far bit-equal to the run's
    for row in replayed:
        step = int(row[0])
        got = dict(zip(SERIES, (row[1], row[3], row[4], row[5])))
        rels = {}
        for s, b in got.items():
            a = float(values[s][at[step]])
            rels[s] = abs(a - b) / max(abs(a), abs(b), 1e-30) if a != b else 0.0
        worst = max(rels, key=rels.get)
        rel = rels[worst]
        out["max_rel"] = max(out["max_rel"], rel)
        if exact and rel > TOL:
            out.update(differs=True, step=step, series=worst, rel=rel, run=float(values[worst][at[step]]),
                       replay=float(got[worst]))
        exact = exact and rel == 0.0
        out["exact_rows"] += exact
    return out


def describe(run_name: str, sr: dict[str, Any]) -> str:
    """One line for a self-replay that differs."""
    return (f"self-replay: {run_name}'s backend, loading the run's own checkpoint at step {sr['from']} in a fresh "
            f"process and re-training on the run's batches, computes step {sr['step']} differently ({sr['series']} "
            f"{sr['replay']:.9g} against the run's {sr['run']:.9g}, rel {sr['rel']:.2g}, every step before it "
            f"bit-equal): its training carries state the checkpoint does not hold")


__all__ = ["TOL", "describe", "judge", "replay_span"]
