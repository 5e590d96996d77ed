"""The self-replay check: does a run reproduce its own training from its own checkpoints?

The shared-state step comparison (harness.resync) starts every step it compares from a loaded checkpoint,
so state that a backend's training carries and its checkpoint does not hold (gradients that accumulate
because they are never cleared, a schedule object that counts its own steps, a buffer an evaluation
writes) is invisible to it: every resynced step agrees and the free-running curves diverge (or their
envelope has saturated and says nothing), which is exactly what drift looks like. The step-0 probes'
restart check (Backend.restart_check) sees such state only where it matters at step 1. This check sees it
anywhere: the run's backend, in a fresh process, re-trains every stretch between two of the run's
checkpoints from the first of them, on the run's batches (one replay job, about one run's training), its
state exported and loaded back after every step (Replay.reload_each_step), so that every step starts from
nothing but its state: what a load resets and the run carried on (a host-side cache of a value already
written, a step counter of its own) shows at the first step where it matters. Each stretch's per-step
statistics must equal the run's own rows.

A deterministic backend reproduces them bit for bit (the restart check measured 0.0 for one step in every
backend). State the checkpoint misses makes the rows jump: exact up to some step, then off by far more than
rounding. So a stretch differs when its first row that is not bit-equal to the run's is off by more than TOL
relative. A stretch whose first difference is small is not judged after it: from there a chaotic model
grows it smoothly, and on a model with many ReLU kinks it can flip one and jump, which is rounding's doing,
not the state's. For the same reason, where the backend says its load of a checkpoint is not the state it
had (Backend.state_reload_exact: Keras' momentum velocity is converted through the learning rate), every
stretch is judged on its first row only.

What carries the state, the training or only what the run reports? Training that carries state moves the
update, and so the parameters: the re-trained update and parameter norms part from the run's. A reported
statistic that carries state (a loss or accuracy logged as the running mean of the steps so far, as Keras'
fit metrics are; a norm kept from an earlier step) leaves them bit-equal to the run's through the stretch
(within RELOAD_TOL on the first row of an inexact load, where 0 to 1.2e-7 was measured over 540 clean
stretches) while that series differs: `reported_only`, the series named.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .envelope import deviation

TOL = 1e-4                 # as the restart check (harness.resync_verdict.RESTART_TOL)
SERIES = ("loss", "accuracy", "grad_norm", "update_norm", "param_norm")   # a replayed row's order after its step
TRAINING = ("update_norm", "param_norm")   # what a step that carries state moves; a report's slip does not
RELOAD_TOL = 1e-6          # the training norms of an inexact load's first row (clean: 0 .. 1.2e-7)
EVAL = ("eval_loss", "eval_accuracy")                          # an evaluated row's order after step


def stretches(steps: int, checkpoint_steps: list[int]) -> list[int]:
    """The replay job's `at`: for each checkpoint c but the last, the step before the next checkpoint (at most
    the last step, whose batch the job would probe): the job re-trains c..at-1 from c, so each stretch starts
    from the run's own state; stretches of no step are left out."""
    cs = sorted(c for c in checkpoint_steps if c < steps)
    ends = [min(n, steps) - 1 for n in cs[1:] + [steps]]
    return [t for c, t in zip(cs, ends) if t > c]


def relative(a: float, b: float) -> float:
    """|a - b| relative to the larger, with envelope.deviation's rule for values that are not finite (both: 0,
    one: inf)."""
    d = float(deviation(a, b))
    return d if d == 0.0 or not np.isfinite(d) else d / max(abs(a), abs(b), 1e-30)


def judge(steps: np.ndarray, values: dict[str, np.ndarray], replayed: list[list[float]],
          starts: list[int], reload_exact: bool = True, batch: int = 0) -> dict[str, Any]:
    """The replayed rows [step, loss, accuracy, grad_norm, update_norm, param_norm] against the run's own
    series (on `steps`), stretch by stretch (`starts`: the checkpoint steps each re-training began from; where the
    backend does not reload a checkpoint exactly, `reload_exact` False, each stretch is judged on its first row
    only, whose gradient comes from the parameters as loaded, before anything rounded can reach a ReLU kink):
    {checked, rows, stretches, max_rel, differs, exact_rows (rows bit-equal from their stretch's load on: after
    a stretch's first row that is not, nothing in it is judged), inexact_loads (stretches judged on their first
    row only), and where it jumped: step, from, series, run, replay, reported_only (the training norms
    reproduced through that stretch: only what the run reports carries state) and off (every series off there)}.
    An accuracy at most one sample of the `batch` apart is not judged (a near tie of two logits flips with the last
    bit of a row that is not bit-equal: a load that rounds, a replay in another process layout)."""
    out: dict[str, Any] = {"checked": True, "rows": len(replayed), "stretches": 0, "max_rel": 0.0, "differs": False,
                           "exact_rows": 0, "inexact_loads": 0}
    at = {int(t): i for i, t in enumerate(steps)}
    start, exact = None, True
    for row in replayed:
        step = int(row[0])
        c = max((s for s in starts if s <= step), default=None)
        if c != start:                     # a new stretch, from a loaded checkpoint
            start, exact = c, True
            out["stretches"] += 1
            out["inexact_loads"] += not reload_exact
        got = dict(zip(SERIES, row[1:6]))
        rels = {}
        for s, b in got.items():
            a = float(values[s][at[step]])
            rels[s] = relative(a, b)
        tie = batch > 0 and abs(float(values["accuracy"][at[step]]) - got["accuracy"]) <= 1.5 / batch
        judged = {k: r for k, r in rels.items() if not (k == "accuracy" and tie)}
        worst = max(judged, key=judged.get)
        rel = judged[worst]
        out["max_rel"] = max(out["max_rel"], rel)
        if out["differs"] and out["from"] == c and out["reported_only"] and reload_exact:
            # the rest of the differing stretch: its training must stay the run's for the report alone to be off
            out["reported_only"] = all(rels[k] == 0.0 for k in TRAINING if k not in out["off"])
        if exact and rel > TOL and not out["differs"]:
            off = [s for s in SERIES if judged.get(s, 0.0) > TOL]
            allow = 0.0 if reload_exact else RELOAD_TOL
            out.update({"differs": True, "step": step, "from": c, "series": worst, "rel": rel,
                        "run": float(values[worst][at[step]]), "replay": float(got[worst]), "off": off,
                        "reported_only": any(k not in off for k in TRAINING)
                        and all(rels[k] <= allow for k in TRAINING if k not in off)})
        exact = exact and max(rels.values()) == 0.0 and reload_exact
        out["exact_rows"] += exact
    return out


def judge_evaluations(eval_step: np.ndarray, values: dict[str, np.ndarray], evaluated: list[list[float]]
                      ) -> dict[str, Any]:
    """The backend's evaluation of each of the run's checkpoints, loaded in a fresh process before any step
    ([step, eval_loss, eval_accuracy]), against the run's own evaluation at that step (on `eval_step`): the same
    state through the same evaluation must give the same numbers (a deterministic backend: to the bit). An
    evaluation that reads anything but the state -- weights from before the last update, a copy made once,
    statistics another evaluation left behind -- differs where training does not. {eval_checked (points),
    eval_max_rel, eval_differs, and at the first point beyond TOL: eval_step, eval_series, eval_rel, eval_run,
    eval_replay}."""
    at = {int(t): i for i, t in enumerate(eval_step)}
    out: dict[str, Any] = {"eval_checked": 0, "eval_max_rel": 0.0, "eval_differs": False}
    for step, *got in sorted(evaluated):     # the job evaluates the last first; the earliest is named
        if int(step) not in at:
            continue
        out["eval_checked"] += 1
        for s, b in zip(EVAL, got):
            a = float(values[s][at[int(step)]])
            rel = relative(a, b)
            out["eval_max_rel"] = max(out["eval_max_rel"], rel)
            if rel > TOL and not out["eval_differs"]:
                out.update({"eval_differs": True, "eval_step": int(step), "eval_series": s, "eval_rel": rel,
                            "eval_run": a, "eval_replay": float(b)})
    return out


def describe(run_name: str, sr: dict[str, Any]) -> str:
    """One line for a self-replay that differs (its training, else its evaluation)."""
    if not sr.get("differs"):
        return (f"self-replay: {run_name}'s backend, evaluating the run's own checkpoint at step {sr['eval_step']} as "
                f"loaded in a fresh process, gets {sr['eval_series']} {sr['eval_replay']:.9g} against the run's "
                f"{sr['eval_run']:.9g} at that step (rel {sr['eval_rel']:.2g}): the run's evaluation is not the "
                f"evaluation of the state it had there")
    if sr.get("reported_only"):
        return (f"self-replay: {run_name}'s backend, loading the run's own checkpoint at step {sr['from']} in a fresh "
                f"process and re-training on the run's batches, reproduces its training (every update and parameter "
                f"norm of the stretch as the run's) but reports {' and '.join(sr['off'])} at step {sr['step']} "
                f"otherwise ({sr['series']} {sr['replay']:.9g} against the run's {sr['run']:.9g}, rel "
                f"{sr['rel']:.2g}): what the run reports carries state of its own (a running mean of the steps so "
                f"far, a value kept from an earlier step), not the step's")
    n = sr.get("processes")
    return (f"self-replay: {run_name}'s backend, loading the run's own checkpoint at step {sr['from']} in a fresh "
            f"{'job' if _fewer_processes(sr) else 'process'} and re-training on the run's batches (its state reloaded "
            f"after every step), computes step "
            f"{sr['step']} differently ({sr['series']} {sr['replay']:.9g} against the run's {sr['run']:.9g}, rel "
            f"{sr['rel']:.2g}, every step before it bit-equal): " + (
                f"the run's {n} processes computed another step from the same state and batch" if _across_processes(sr)
                else f"its training carries state the checkpoint does not hold, its load of the checkpoint does not "
                     f"restore it, or the run's {n} processes compute otherwise than the replay's "
                     f"{sr['replay_processes']}" if _fewer_processes(sr) else
                "its training carries state the checkpoint does not hold (a value kept outside the state, which a load "
                "resets), or its load of the checkpoint does not restore it"))


def also_not_reproduced(sr: dict[str, Any]) -> str:
    """For a pair a resynced step already places: the candidate's self-replay differing in its training too, said
    in a clause (else ""). A step from a loaded state that is not the step the run took puts what the backend saves
    in and restores from a checkpoint in question (a resumed run), beside the stage the resync names."""
    if not sr.get("differs") or sr.get("reported_only"):
        return ""
    first = ", the first of its stretch, straight from the load" if sr.get("step") == sr.get("from") else ""
    also = f", or its {sr['processes']} processes," if _fewer_processes(sr) else ""
    return (f"; the candidate does not reproduce its own training from its own checkpoint either (step {sr['step']}"
            f"{first}: {sr['series']} rel {sr['rel']:.2g}): what its checkpoint saves and restores{also} is in "
            f"question too")


def _fewer_processes(sr: dict[str, Any]) -> bool:
    """The re-training ran in fewer processes than the run (a backend that replays a --hosts run in one): what only
    the run's own processes compute is then not in the replay."""
    run, replay = sr.get("processes"), sr.get("replay_processes")
    return isinstance(run, int) and isinstance(replay, int) and replay < run


def _across_processes(sr: dict[str, Any]) -> bool:
    """A self-replay in fewer processes whose first re-trained row of a stretch (straight from its loaded checkpoint,
    so no state carried from an earlier step) has another loss while the checkpoints, loaded, evaluate as the run
    did (its weights were saved and restored): the processes computed another forward of the same state and batch,
    the multi-process path's doing (how each places its part of the batch)."""
    return (_fewer_processes(sr) and sr.get("step") == sr.get("from") and "loss" in (sr.get("off") or [])
            and bool(sr.get("eval_checked")) and not sr.get("eval_differs"))


def placed(sr: dict[str, Any], side: str) -> dict[str, Any]:
    """Where a self-replay that differs puts the pair's bug (`side`: "the candidate" or "the reference"): its
    stage (eval, report, state), the series a report names, a one-line summary and why a loaded state hides it."""
    if not sr.get("differs"):
        return {"stage": "eval", "series": None,
                "summary": f"eval: the run's evaluation at step {sr['eval_step']} is not the evaluation of its state there",
                "why": "does not evaluate its own checkpoint as its run did (self-replay): the evaluation reads something "
                       "besides the state, which a step or an evaluation from a loaded state cannot show"}
    if sr.get("reported_only"):
        return {"stage": "report", "series": list(sr["off"]),
                "summary": f"report: {', '.join(sr['off'])} of {side} carries state of its own (step {sr['step']})",
                "why": "reproduces its own training from its checkpoint but not what its run reported (self-replay): a "
                       "reported statistic that carries state, which a step from a loaded state cannot show"}
    if _across_processes(sr):
        return {"stage": "data", "series": None,
                "summary": f"data: the multi-process path of {side} (--hosts {sr['hosts']}, step {sr['step']})",
                "why": "does not compute, in its own processes, the step its replay computes from the same state "
                       "(self-replay): the multi-process path, which the replay's layout does not take"}
    if _fewer_processes(sr):
        return {"stage": "state", "series": None,
                "summary": f"state: training not reproduced from its checkpoint (step {sr['step']}): carried state, "
                           f"its load, or the multi-process path of {side} (--hosts {sr['hosts']})",
                "why": "does not reproduce its own training from its checkpoint in its replay's layout (self-replay): "
                       "state the checkpoint does not hold or its load does not restore, or the processes standing in "
                       "for hosts, none of which a step from a loaded state in that layout shows"}
    return {"stage": "state", "series": None,
            "summary": f"state: training carries state its checkpoint does not hold (step {sr['step']})",
            "why": "does not reproduce its own training from its checkpoint (self-replay): state the checkpoint does not "
                   "hold, which a step from a loaded state cannot show"}


__all__ = ["TOL", "also_not_reproduced", "describe", "judge", "judge_evaluations", "placed", "relative", "stretches"]
