"""Are the statistics a run reports what its step computed? A wrapper writes each step's loss, accuracy and
gradient, update and parameter norms into steps.csv itself, beside the training; a slip there (a copy-pasted
norm, a correct count divided by one replica's batch) moves a series from step 0 while every probe agrees,
since the probes compare the computation, not the report.

At step 0 both runs start from the canonical weights on the first batch, exactly as their step-0 probes do:
from a run's own probe (the loss, the gradient per parameter, the first update per parameter, the logits)
the statistics its step reported are recomputed in float64 and compared with its steps.csv row. Two compiled
programs of one framework round alike to ~1e-6 relative; an accuracy may move by one sample where two logits
nearly tie. A run whose report disagrees with its own step, when the other run's agrees with its own, is
where the pair's difference sits, in the series it reports off that diverge: stage `report`, the series
named. A slip smaller than that allowance (a gradient norm logged with the L2 term in it, 1e-5 of itself) is still
the pair's difference where a series diverges at step 0 and that divergence is one run's own report-vs-probe gap,
the two probes agreeing far closer (`one_sided_gaps`).

A slip that starts later (a statistic scaled by the schedule's rate, a branch taken once a count passes a
batch) leaves step 0's rows right and every shared-state step agreeing, since the probes compute the step,
not its report. So each replay job of a shared-state comparison also runs one training step of its backend
from each state it probed, and records what that step reports (algorithms.contract.Replay.report_steps):
where nothing else localizes the pair, those rows are checked against the probes of the same states, the
same way. Both come from one state, so no trajectory's rounding (a run's own, re-trained) enters."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from algorithms.params import load_npz

from . import runner
from .envelope import as_float32_norm
from .runs import Run, config_of, declared_records

REPORTED = ("loss", "accuracy", "grad_norm", "update_norm", "param_norm")
NORMS = ("grad_norm", "update_norm", "param_norm")
REL_TOL = 1e-3          # relative, for the loss and the norms
# a loss near zero (late in training) rounds in its logits, not relative to itself: a cross-entropy of float32
# logits of size z is off by a few eps x z whatever its value; this many of them are allowed besides REL_TOL
LOSS_LOGIT_ULPS = 16.0
# a float32 norm of n squares accumulates ~sqrt(n) roundings: Adam's first update, every element ~lr, 60k of
# them, reported 2.9e-5 off its float64 norm (cnn2d_3conv_3fc); for 25M parameters the allowance is 4.8e-3
NORM_ULPS = 8.0
F32_EPS = float(np.finfo(np.float32).eps)
ACCURACY_SAMPLES = 1    # samples an accuracy may move by (near-tied logits round apart)


def _norm(arrays: Iterable[np.ndarray]) -> float:
    return float(np.sqrt(sum(float(np.sum(np.square(np.asarray(a, np.float64)))) for a in arrays)))


def recomputed(probe: dict[str, np.ndarray], params: dict[str, np.ndarray], logits_layer: str,
               labels: np.ndarray | None) -> dict[str, float]:
    """A step's statistics as its probe computed them: its loss, the norm of its gradients, of its first update,
    of the parameters after it (the probe's starting `params` plus that update), and the accuracy of its
    training-mode logits on `labels` (None: not recomputed)."""
    updates = {k.split("/", 1)[1]: v for k, v in probe.items() if k.startswith("update0/")}
    out = {"loss": float(probe["loss"]),
           "grad_norm": _norm(v for k, v in probe.items() if k.startswith("grad/")),
           "update_norm": _norm(updates.values()),
           "param_norm": _norm(np.asarray(params[n], np.float64) + u for n, u in updates.items())}
    logits = probe.get(f"forward/{logits_layer}")
    if labels is not None and logits is not None and len(logits) == len(labels):
        out["accuracy"] = float(np.mean(np.argmax(np.asarray(logits).reshape(len(labels), -1), -1) == labels))
    return out


def loss_floor(probe: dict[str, np.ndarray], logits_layer: str) -> float:
    """The absolute rounding a reported loss may carry beside REL_TOL: LOSS_LOGIT_ULPS float32 epsilons of the
    step's largest logit (at least 1)."""
    logits = probe.get(f"forward/{logits_layer}")
    z = float(np.max(np.abs(logits))) if logits is not None and np.size(logits) else 1.0
    return LOSS_LOGIT_ULPS * F32_EPS * max(1.0, z)


def mismatches(run: Run | None, computed: dict[str, float], n_params: int = 0, step: int = 0,
               row: dict[str, float] | None = None, loss_abs: float = 0.0) -> list[dict[str, Any]]:
    """The series whose value at `step` in `run`'s steps.csv (or in `row`: what a replayed step of the run's
    backend reported) is not what that step computed (`recomputed`); the norms are over `n_params` elements. `run`
    may be None with a `row` (an accuracy is then not judged: the run gives the batch size)."""
    at = np.flatnonzero(run.step == step) if row is None else None
    if row is None and not len(at):
        return []
    batch = int(run.manifest.get("hparams", {}).get("batch_size") or 0) if run is not None else 0
    norm_tol = max(REL_TOL, NORM_ULPS * F32_EPS * float(np.sqrt(n_params)))
    out = []
    for s, want in computed.items():
        got = float(run.values[s][at[0]] if row is None else row[s])
        if s == "accuracy":
            bad = batch > 0 and abs(got - want) > (ACCURACY_SAMPLES + 0.5) / batch
        else:
            tol = norm_tol if s in NORMS else REL_TOL
            want = float(as_float32_norm(s, want))   # recomputed in float64 past what a float32 norm holds: inf
            if not (np.isfinite(got) and np.isfinite(want)):   # both non-finite (as envelope.deviation): no slip
                bad = bool(np.isfinite(got)) != bool(np.isfinite(want))
            else:
                bad = abs(got - want) > max(tol * max(abs(want), 1e-12), loss_abs if s == "loss" else 0.0)
        if bad:
            out.append({"series": s, "reported": got, "computed": want,
                        "rel": abs(got - want) / max(abs(want), 1e-12)})
    return out


def _fed(run: Run, root: Path) -> tuple[runner.Prepared, np.ndarray]:
    """The run's inputs as its jobs prepare them, and the labels of every batch it was fed (step -> labels)."""
    prep = runner.prepare(config_of(run.manifest, root), root)
    return prep, np.asarray(load_npz(prep.dataset_path)["y_train"])[prep.order]


def first_batch(run: Run, root: Path) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(the weights the run started from, the labels of its first batch)."""
    prep, labels = _fed(run, root)
    return prep.params, labels[0]


def batch_labels(run: Run, root: Path) -> np.ndarray:
    """The labels of every batch the run was fed (step -> its batch's labels)."""
    return _fed(run, root)[1]


def rows_at(rep: dict[str, Any], step: int, plain: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """What each backend's training step of a replay `rep` reported from its state at `step` (None: not had);
    `plain`: the plain reference's probe there when the compared one is the reference computing a declared formula
    (the reported row is the plain reference's step, so its report is checked against that probe)."""
    out: dict[str, Any] = {who: next((r for r in (rep.get("reported") or {}).get(who) or [] if int(r[0]) == int(step)),
                                     None) for who in ("candidate", "reference")}
    if plain is not None:
        out["reference_probe"] = plain
    return out


def step_upstream(rows: dict[str, list | None], cand: dict[str, np.ndarray], ref: dict[str, np.ndarray],
                  logits_layer: str) -> dict[str, Any] | None:
    """Where a resynced step's update disagrees while the probes' loss and gradients agree (stage `optimizer`):
    is that what the training step itself computed? `rows` ({"candidate": ..., "reference": ...}: [step, loss,
    accuracy, grad, update and parameter norms], what each backend's training step reported from the state its
    probe `cand` / `ref` started from). A candidate whose step reports another loss than its own probe of the
    same state computes (the reference's report agreeing with its probe) was fed or computes its loss from
    something the probes are not given (its batch's samples or labels, its objective): the disagreement sits
    upstream of the optimizer, stage `loss`; the same with the gradient norm: stage `backward`. None where the
    candidate's report is its probe's (the optimizer stands) or the reference's is not its own either."""
    got = {}
    for who, probe in (("candidate", cand), ("reference", rows.get("reference_probe", ref))):
        row = rows.get(who)
        if row is None or "loss" not in probe:
            return None
        grads = [v for k, v in probe.items() if k.startswith("grad/")]
        computed = {"loss": float(probe["loss"]), "grad_norm": _norm(grads)}   # `recomputed`'s, before any update
        got[who] = mismatches(None, computed, sum(int(np.size(g)) for g in grads), row=dict(zip(REPORTED, row[1:])),
                              loss_abs=loss_floor(probe, logits_layer))
    if not got["candidate"] or got["reference"]:
        return None
    m = got["candidate"][0]
    stage = "loss" if m["series"] == "loss" else "backward"
    why = ("computes its loss from something the probes are not given (its batch, its labels or its objective)"
           if stage == "loss" else "differentiates something else than the probes do (its gradient is not the probed one)")
    line = (f"the candidate's training step from this state reports {m['series']} {m['reported']:.7g}; its probe of "
            f"the same state and batch computes {m['computed']:.7g} (rel {m['rel']:.3g}), and the reference's step "
            f"reports what its probe computes: the step {why}, upstream of the optimizer")
    return {"stage": stage, "probe": f"step {m['series']}", "rel": m["rel"], "layer": None, "parameter": None,
            "step_report": {"mismatches": got["candidate"], "line": line}}


def localize(pair, ref0: dict[str, np.ndarray], cand0: dict[str, np.ndarray], logits_layer: str,
             batch_of: Callable[[Run], tuple[dict[str, np.ndarray], np.ndarray] | None],
             step: int = 0, rows: dict[str, dict[str, float]] | None = None,
             replayed: dict[str, Any] | None = None, gaps: tuple[str, ...] = ()) -> dict[str, Any] | None:
    """A localization at stage `report` when exactly one run of the pair (reference `pair.a`, candidate `pair.b`)
    reports statistics of `step` that its own probe of that step does not compute (`ref0`, `cand0`), in series
    that diverge in the pair (what the report explains), or in the multi-process path (`across_processes`); else None. `batch_of(run)`: (the parameters the step
    started from, its batch's labels), as `first_batch` gives them for step 0 (None: not had). `rows` ({"reference":
    ..., "candidate": ...}): what each backend's training step reported from the state both probes started from
    (a replay's), in place of the runs' own rows at `step`. `replayed` (`rows_at` of a replay of `step`): what each
    backend's training step reported from the same state in its replay job, for a run that trained in several
    processes standing in for hosts (`across_processes`). `gaps`: the series one_sided_gaps may judge at step 0
    where nothing is off REL_TOL (with `rows` None)."""
    ref, cand = pair.a, pair.b
    if any(r["statistical"] for r in declared_records(ref, cand).values()):
        return None       # framework-RNG dropout: the probe's masks are not the step's
    diverging = {s for s, c in pair.checks.items() if c.diverged_step is not None}
    found, judged, whole = {}, {}, {}
    for who, run, probe in (("candidate", cand, cand0), ("reference", ref, ref0)):
        got = batch_of(run)
        if got is None:
            return None
        params, labels = got
        n = sum(int(np.size(v)) for k, v in probe.items() if k.startswith("update0/"))
        judged[who] = recomputed(probe, params, logits_layer, labels)
        whole[who] = mismatches(run, judged[who], n, step, rows[who] if rows else None, loss_floor(probe, logits_layer))
        found[who] = [m for m in whole[who] if m["series"] in diverging]
    by_gap = False
    if rows is None and gaps and not found["candidate"] and not found["reference"]:
        found = one_sided_gaps(pair, step, judged, gaps)
        whole, by_gap = found, True
    if bool(found["candidate"]) == bool(found["reference"]):
        return None
    who = "candidate" if found["candidate"] else "reference"
    run, bad = (cand if who == "candidate" else ref), found[who]
    if rows is None and (moved := across_processes(who, run, bad, whole[who], (replayed or {}).get(who), step)):
        return moved
    said = _said(bad)
    what = ", ".join(m["series"] for m in bad)
    whence = ("its step-0 probe" if not rows else f"its probe of the same state (its backend's training step "
              f"from the reference's state at step {step}, replayed, reports this)")
    line = (f"localized by the reported statistics: the {who} {run.name} reports at step {step} what its own step "
            f"does not compute ({said}; recomputed in float64 from {whence}: its loss, gradients, first "
            f"update and logits); the other run's report is its step's: the step agrees, its report does not")
    if by_gap:
        line += (f" (within the {REL_TOL:g} a float32 report is allowed on its own, but it is the pair's whole divergence "
                 f"there: {_gap_said(bad)})")
    return {"stage": "report", "method": "reported statistics", "step": step, "layer": None, "parameter": None,
            "probe": None, "series": [m["series"] for m in bad], "reported_by": who, "mismatches": bad,
            "summary": f"report: {what} of the {who}", "lines": [line], "disagreeing_keys": []}


# A divergence at step 0 (both runs step from the same initial state) that one run's report carries alone: the two
# probes' recomputed values differ by at most GAP_SHARE of the reports' difference, the other run's report is off its
# probe by at most GAP_SHARE of this one's, and this one's is at least GAP_MIN of the value: 4x the largest gap of a
# clean run's report (192 clean runs of the false-alarm matrix, session 27, docs/verdict.md "report": the loss its
# probe's exactly, the gradient norm within 1.0e-6, the parameter norm 8.6e-7, the update norm 2.9e-5, Adam's first
# update, every element ~lr, summed in float32), and 4 float32 epsilons. What REL_TOL lets pass on one run alone (a
# logged gradient norm with the L2 term in it, 1e-5 of itself) is then the pair's difference.
GAP_SHARE = 0.25
GAP_MIN = {"loss": 4.0 * F32_EPS, "grad_norm": 4e-6, "param_norm": 4e-6, "update_norm": 1.2e-4}
GAP_SERIES = tuple(GAP_MIN)


def one_sided_gaps(pair, step: int, computed: dict[str, dict[str, float]], series: tuple[str, ...] = GAP_SERIES
                   ) -> dict[str, list[dict[str, Any]]]:
    """Per side ("candidate", "reference"), the `series` that diverge at `step` (pair.checks) whose divergence is that
    side's gap between its reported value (its run's row `step`) and what its probe computed (`computed`:
    `recomputed`), by the GAP_* rule; the accuracy is not judged (it moves by whole samples)."""
    out: dict[str, list[dict[str, Any]]] = {"candidate": [], "reference": []}
    for s in series:
        c = pair.checks.get(s)
        if c is None or c.diverged_step != step or any(s not in computed[w] for w in out):
            continue
        rep = {}
        for w, run in (("candidate", pair.b), ("reference", pair.a)):
            at = np.flatnonzero(run.step == step)
            rep[w] = float(run.values[s][at[0]]) if len(at) else float("nan")
        rec = {w: float(computed[w][s]) for w in out}
        if not all(np.isfinite(v) for v in (*rep.values(), *rec.values())):
            continue
        gap = {w: rep[w] - rec[w] for w in out}
        who = max(out, key=lambda w: abs(gap[w]))
        other = "reference" if who == "candidate" else "candidate"
        if (abs(rec["candidate"] - rec["reference"]) <= GAP_SHARE * abs(rep["candidate"] - rep["reference"])
                and abs(gap[other]) <= GAP_SHARE * abs(gap[who])
                and abs(gap[who]) >= max(GAP_MIN[s], 4.0 * F32_EPS) * abs(rec[who])):
            out[who].append({"series": s, "reported": rep[who], "computed": rec[who],
                             "rel": abs(gap[who]) / max(abs(rec[who]), 1e-12),
                             "probes_rel": abs(rec["candidate"] - rec["reference"]) / max(abs(rec[who]), 1e-12),
                             "other_rel": abs(gap[other]) / max(abs(rec[other]), 1e-12)})
    return out


def _gap_said(bad: list[dict[str, Any]]) -> str:
    return "; ".join(f"{m['series']}: off its probe by rel {m['rel']:.3g}, the two probes' values {m['probes_rel']:.3g} "
                     f"apart, the other run's report off its probe by {m['other_rel']:.3g}" for m in bad)


def _said(bad: list[dict[str, Any]]) -> str:
    return "; ".join(f"{m['series']} {m['reported']:.7g} reported, {m['computed']:.7g} computed" for m in bad)


def across_processes(who: str, run: Run, bad: list[dict[str, Any]], whole: list[dict[str, Any]],
                     replayed: list | None, step: int) -> dict[str, Any] | None:
    """A run trained by several processes standing in for hosts, whose row at `step` is not what its probe computes
    (`bad`, in the series that diverge; `whole`, in any), while its backend's training step from the same state in its replay job (`replayed`: [step, loss, ...];
    one process for a backend that replays such a run in one) reports what the probe computes: the run's own
    processes computed another step, so the difference is no report slip but sits in the multi-process path: stage
    `data` when the loss differs (how each process places its part of the batch), `reduction` when only the gradient
    or update does (how the processes combine theirs). Asked only when the run's row is off in something its step
    trains with (the gradient or update norm: a loss or an accuracy alone off may be a report only the processes
    write). None otherwise: a report slip is in the replay's row too (that row carries at least half of the run's
    own gap from its probe in some series of `whole`)."""
    hosts = run.options.hosts
    if hosts <= 1 or replayed is None:
        return None
    own = {m["series"] for m in whole}
    row = dict(zip(REPORTED, replayed[1:]))
    off = {m["series"] for m in whole if abs(float(row[m["series"]]) - m["computed"]) >= 0.5 * abs(m["reported"] - m["computed"])}
    if not own & {"grad_norm", "update_norm"} or off:
        return None
    stage = "data" if "loss" in own else "reduction"
    said = _said(bad)
    where = ("how each process places its part of the batch" if stage == "data"
             else "how the processes combine their gradients")
    line = (f"localized by the reported statistics across processes: the {who} {run.name} trained in {hosts} "
            f"processes standing in for hosts and reports at step {step} what its probe of that step does not compute "
            f"({said}), while the same training step in its replay job, from the same state and batch, reports what "
            f"the probe computes: not a report slip; the run's own processes computed another step, so the bug sits in "
            f"its multi-process path ({where})")
    return {"stage": stage, "method": "reported statistics across processes", "step": step, "layer": None,
            "parameter": None, "probe": None, "series": [m["series"] for m in bad], "reported_by": who,
            "mismatches": bad, "summary": f"{stage}: the {who}'s multi-process path (--hosts {hosts})",
            "lines": [line], "disagreeing_keys": []}


__all__ = ["REPORTED", "across_processes", "one_sided_gaps", "batch_labels", "recomputed", "mismatches", "loss_floor", "first_batch",
           "localize", "rows_at", "step_upstream"]
