"""The shared-state step comparison (resync): one step of the candidate from the reference's own state,
at every resync point, held to a tolerance calibrated at that state; and a sequential test over the
signed per-step differences. Framework-free: the probes come from replay jobs (harness/localize.py).

Why: the free-running curves of two correct implementations part by accumulated rounding (the 1-ULP
envelope saturates within ~50-80 steps on the chaotic models), but one step from the same state agrees
to rounding at step 5,000 as at step 0. So "the curves diverged" and "some step computes something else"
are separate questions; only the second is a bug.

Per point t (a reference checkpoint, the first divergent step): the reference (float32), the reference
in float64 and the candidate each load the reference's state at t and probe one step (forward per layer,
inference forward, loss, gradients, update, buffers, optimizer state). Per key, PyTorch Inductor's rule
on that state: the candidate's RMS error against the float64 step may be MARGIN times the float32
reference's own (never less than FLOOR of the tensor's scale). A key outside it: that step disagrees.

A bias too small for one step's tolerance (lr x (1 + 1e-5), an eps off by a little, a running variance
unbiased with another count) keeps one sign over all resynced steps, while rounding has no preferred sign:
the sequential test over the signed per-step differences, per key kind and per key (harness/bias_test.py).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from algorithms.contract import split_state
from algorithms.params import load_npz

from .implied import optimizer_rest
from .kinks import explaining
from .batch_rows import align as align_rows
from .bias_test import sequential_test, signed_deviations
from .probe_analysis import eval_disagreement
from .probes import BACKWARD_KINDS, kind_of
from .reported import rows_at

# The per-key tolerance at a resynced step: max(MARGIN x the reference's own float32-vs-float64 RMS error
# on that key at that state, FLOOR x the tensor's scale). The numbers behind both: docs/verdict.md,
# bench/calibrate_resync.py.
MARGIN = 3.0
FLOOR = 3e-5
# the fewest resync points a run gets at any asked cadence (resync_points): with 3, the sequential test's
# t-test has 2 degrees of freedom and missed a 118-ULP evaluation bias (sd 14 ULP, p 0.0028 against the
# Bonferroni threshold 0.0017; bench/source_bugs.py jax_bn_inference_without_eps, a 60-step run at K = 25)
MIN_POINTS = 8
# a key's own error at a resynced step this many times its median over the steps: a discontinuity of the
# reference's own step there (a kink flipped by rounding: 1e-5..1e-3 where rounding is 1e-7; judge)
JUMP = 10.0
# an own error this large relative to the key's scale (1%) is not a discontinuity of a value (a flipped kink
# moves a gradient by 1e-4..1e-3 of its scale, measured) but noise of a value that has no scale of its own
NOISE = 1e-2


# the most schedule points (schedule_points) a run adds to its resync points
MAX_SCHEDULE_POINTS = 24


def schedule_points(lr: np.ndarray, limit: int = MAX_SCHEDULE_POINTS) -> list[int]:
    """The steps around each kink of the reference's logged learning rate (a step decay, the end of a warm-up:
    where the step-to-step change of the lr changes by more than half of itself), t-1, t and t+1 for a kink
    at t: a bug in how the schedule is applied (decayed a step early or late, a warm-up that ends a step off,
    a momentum buffer rescaled at the change) lives in those steps only, and a free-running curve that has
    lost its power by then cannot show it. A smooth schedule (cosine) has none past its first steps; at most
    `limit` points, the earliest."""
    lr = np.asarray(lr, np.float64)
    if len(lr) < 3 or not np.isfinite(lr).all():
        return []
    d = np.diff(lr)                                   # d[i]: the change from step i to step i + 1
    big = np.maximum(np.abs(d[1:]), np.abs(d[:-1]))
    kinks = np.nonzero((big > 0) & (np.abs(d[1:] - d[:-1]) > 0.5 * big))[0] + 1
    out = sorted({int(t) + o for t in kinks for o in (-1, 0, 1) if 0 <= int(t) + o < len(lr)})
    return out[:limit]


def resync_points(steps: int, every: int, extra: list[int] = ()) -> list[int]:
    """The steps probed from the reference's state: every `every`-th step from 0 (0 = none); in a run too
    short for MIN_POINTS at that cadence (60 steps at every 25: 3), MIN_POINTS points instead (as many as
    the steps allow); and `extra` (the first divergent step and the one before it), only steps that have a
    batch (< steps). The replay job takes a step that has a checkpoint from it and re-trains to any other
    from the checkpoint before it (one pass: at most one run's steps, however many points)."""
    if every > 0 and len(range(0, steps, every)) < MIN_POINTS:
        every = min(every, max(1, steps // MIN_POINTS))
    pts = list(range(0, steps, every)) if every > 0 else []
    return sorted({int(t) for t in pts + list(extra) if 0 <= int(t) < steps})


def discontinuities(per_point_diffs: dict[int, list[dict[str, Any]]], jump: float = JUMP) -> dict[str, Any]:
    """Where the reference's own one step is discontinuous, from its own errors (`own` of every probe diff:
    float32 vs float64 and the 1-ULP-nudged steps) over all resynced steps: per key of BACKWARD_KINDS, its
    median over the steps; a step where it is at least `jump` x that median is a jump of the reference's
    own step there. Returns the steps with a jump on some key, per kind the largest jump (relative to the
    key's scale, as `rel` is), and per key its jumps."""
    by_key: dict[str, dict[int, float]] = {}
    for t, diffs in per_point_diffs.items():
        for d in diffs:
            if d["kind"] in BACKWARD_KINDS and math.isfinite(d.get("own", 0.0)):
                by_key.setdefault(d["key"], {})[t] = float(d.get("own", 0.0))
    keys, largest = {}, {}
    for k, own in by_key.items():
        med = float(np.median(list(own.values())))
        # a key whose own error reaches NOISE of its scale is noise there (a value zero in exact arithmetic on
        # the emulating reference), not a value with a kink: its "jumps" bound nothing
        jumps = {t: v for t, v in own.items() if 0 < v < NOISE and v >= jump * med}
        if jumps:
            keys[k] = {"median": med, "jumps": sorted(jumps), "max": max(jumps.values())}
            kind = kind_of(k)[0]
            largest[kind] = max(largest.get(kind, 0.0), keys[k]["max"])
    return {"points": sorted({t for v in keys.values() for t in v["jumps"]}), "largest": largest, "keys": keys}


def wants_more_sensitivity(out: dict[str, Any]) -> bool:
    """Whether a judged resync disagrees at a step whose disagreement is the backward pass's only (some gradient
    among BACKWARD_KINDS: what a flipped kink moves). Two 1-ULP nudges of the reference miss a kink the
    candidate's rounding hit often enough (cnn2d_3conv_3fc sgd, step 63: conv1-conv3 gradients 1.4e-4 off,
    every activation and the neighbouring steps agreeing, the reference's own steps jumping nowhere;
    docs/verdict.md) that the answer must come from more of the reference's own nudges, not from the
    absence of two."""
    bad = out.get("first_disagreement")
    if out.get("agree") or not bad or bad.get("missing_keys"):
        return False
    return backward_only({kind_of(k)[0] for k in training_keys(bad.get("disagreeing_keys") or [])})


def training_keys(keys: list[str]) -> list[str]:
    """The keys of the training step itself: all but the inference-mode forward (`eval/`), which the probe computes
    apart, from the same state on the evaluation batch. A kink the training step flips says nothing of it, and an
    evaluation-path bug says nothing of the training step: each part of a point is explained on its own."""
    return [k for k in keys if kind_of(k)[0] != "eval"]


def backward_only(kinds: set[str]) -> bool:
    """Kinds of disagreeing keys a flipped kink can produce: gradients (some), and what follows from them."""
    return "grad" in kinds and kinds <= set(BACKWARD_KINDS)


def parameters_at(rep: dict[str, Any], t: int) -> dict[str, np.ndarray] | None:
    """The parameters of the state a replay resynced step t from (by name), or None without one."""
    path = (rep.get("states") or {}).get(str(t))
    if not path:
        return None
    try:
        return split_state(load_npz(path))[0]
    except (OSError, ValueError):
        return None


def judge(rep: dict[str, Any], layers: list[str], analyse: Callable[..., dict[str, Any]], *, margin: float = MARGIN,
          floor: float = FLOOR, emulated: bool = False,
          implied: Callable[..., dict[str, Any] | None] | None = None) -> dict[str, Any]:
    """The resync section of a pair from the replay of its points (Localizer.replay's result): per point,
    agree or not, the worst key and its factor over the tolerance, and the analysis of the first point that
    disagrees (stage, layer: Muffin's rule); the sequential test over every point; with `emulated`, the
    evidence (keys where the plain reference disagrees with the candidate). `analyse` is
    harness.probe_analysis.analyse (passed in: localize imports this module).

    A discontinuity (a ReLU or ReLU6 input, or a max-pool tie, within rounding of its kink, flipped by the
    candidate's rounding and by none of the reference's own float32, float64 and nudged steps at that point)
    moves the gradients below it by far more than rounding while every activation agrees; on a 32x32 model
    millions of such inputs make it chance at which steps it happens. A point whose every disagreeing key
    is a gradient, an update or optimizer state (BACKWARD_KINDS: the forward, the loss, the buffers and the
    evaluation agree), some gradient among them (the gradient probes are the training step's own gradient,
    so a flip in the step shows there; updates off with every gradient agreeing are the optimizer's doing,
    a late learning-rate, momentum or per-layer bug, not a flip), each by no more than
    `margin` x the largest jump of the reference's own steps on that kind (`discontinuities`), agrees by
    discontinuity; at no more points than the reference's own steps jumped at (a computation that differs
    at every step is not a flip at every step). A point where the candidate's own activations crossed a kink
    (`rep["crossings"]`, harness.kinks: every sample probed again at that step) agrees *by the crossing*
    when every disagreeing key is of BACKWARD_KINDS, some gradient among them, each a parameter upstream of
    a crossed kink: evidence at that point, so neither bounded by the reference's jumps nor counted. The same
    with a saturated tanh or sigmoid in place of the kink (harness.kinks.saturated), each gradient within
    `margin` x how far rounding of the candidate's own outputs moves that layer's derivative.

    With `implied` (harness.implied.ImpliedStep): a point whose every disagreeing key is the resynced step's
    update or optimizer state, every gradient agreeing, agrees *by its formula* when the candidate's update
    is what the reference optimizer's float64 formula gives from the candidate's own gradient (an
    ill-conditioned update: Adam's first step on a gradient within rounding of zero); and beside a flip or a
    crossing, the update and optimizer state of a parameter whose gradient agrees (`optimizer_rest`) are
    explained the same way, by their formula, never by the flip."""
    results, evidence, devs, owns, by_formula, reordered = [], [], [], [], {}, {}
    for t, pa, pb, p64, plain in rep["probes"]:
        pa, moved = align_rows(pa, pb, layers)   # the same samples in another row order (harness.batch_rows)
        if moved:
            reordered[int(t)] = max(moved.values())
        z = p64 if plain is None else rep.get("emulated64", {}).get(t)
        res = analyse(pa, pb, layers, rel_tol=floor, ref64=z, margin=margin,
                      nudged=(rep.get("sensitivity") or {}).get(t), rows=rows_at(rep, t, plain))
        results.append((int(t), res, z is not None))
        rest = optimizer_rest(res) if implied is not None and not res["missing_keys"] else []
        if rest:
            got = implied(int(t), pa, pb, rest)
            if got is not None:
                by_formula[int(t)] = got
        if plain is not None:
            evidence += [f"step {t}: {k}" for k in
                         analyse(pa, plain, layers, rel_tol=floor, ref64=p64, margin=margin,
                                 nudged=(rep.get("plain_sensitivity") or {}).get(t))["disagreeing_keys"]]
        params = parameters_at(rep, int(t))   # updates are projected on their parameter too (bias_test)
        devs.append(signed_deviations(pa, pb, params))
        # the reference's own float32 deviation per key, where its float64 step is there: the per-key null
        owns.append({k: abs(v) for k, v in signed_deviations(pb, z, params).items()} if z is not None else {})
    jumps = discontinuities({t: res["diffs"] for t, res, _ in results})

    def by_its_formula(t: int) -> set[str]:
        """The keys the optimizer's formula explains at step t (optimizer_rest's, when harness.implied agrees)."""
        got = by_formula.get(t) or {}
        return set(got.get("keys") or ()) if got.get("agree") else set()

    def flip(t: int, res: dict[str, Any]) -> list[str] | None:
        """The disagreeing keys (less those its formula explains), when some is a gradient and every one is of
        BACKWARD_KINDS, within margin x the reference's own largest jump on its kind, or the update or optimizer
        state of a parameter whose gradient disagrees within it."""
        if res["missing_keys"] or not res["disagreeing_keys"]:
            return None
        diffs = {d["key"]: d for d in res["diffs"]}
        keys = [k for k in training_keys(res["disagreeing_keys"]) if k not in by_its_formula(t)]
        if not any(diffs[k]["kind"] == "grad" for k in keys):
            return None   # no gradient among them: not a flip (an update-only point is harness.implied's to judge)
        def within(k: str) -> bool:
            kind = diffs[k]["kind"]
            return kind in jumps["largest"] and diffs[k]["rel"] <= margin * jumps["largest"][kind]

        # an update or optimizer state of a parameter whose gradient disagrees follows from that gradient (Adam's
        # moments move with it by a factor the optimizer sets, not the reference's largest jump on that kind)
        off = {k.rsplit("/", 1)[-1] for k in keys if diffs[k]["kind"] == "grad" and within(k)}
        ok = all(within(k) or (diffs[k]["kind"] in ("update", "opt") and k.rsplit("/", 1)[-1] in off) for k in keys)
        return keys if ok else None

    crossings = rep.get("crossings") or {}

    def crossed(t: int, res: dict[str, Any]) -> list[dict[str, Any]] | None:
        """What in the candidate's own activations at step t explains every disagreeing key but those its
        formula explains (harness.kinks.explaining), when all are of BACKWARD_KINDS, some gradient among them."""
        keys = [k for k in training_keys(res["disagreeing_keys"]) if k not in by_its_formula(t)]
        if not crossings.get(t) or res["missing_keys"] or not keys:
            return None
        diffs = {d["key"]: d for d in res["diffs"]}
        if not backward_only({diffs[k]["kind"] for k in keys}):
            return None
        return explaining(crossings[t], [diffs[k] for k in keys], margin=margin, floor=floor)

    seen = {t: crossed(t, res) for t, res, _ in results}
    flips = {t: None if seen[t] else flip(t, res) for t, res, _ in results}
    flipped = [t for t, keys in flips.items() if keys]
    ref_jumps = jumps["points"]
    allow_flips = len(flipped) <= len(ref_jumps)
    points = []
    first_bad = None
    for t, res, calibrated in results:
        agree = res["stage"] is None and not res["disagreeing_keys"]
        # the training step and the inference-mode forward are judged apart (training_keys)
        train = training_keys(res["disagreeing_keys"])
        evals = [k for k in res["disagreeing_keys"] if k not in train]
        train_agrees = agree or (not train and not res["missing_keys"])
        by_flip = not train_agrees and allow_flips and bool(flips[t])
        by_crossing = not train_agrees and bool(seen[t])
        # by its formula: only keys that disagree, never a probe one side lacks (a parameter a model lost)
        by_implied = (not (train_agrees or by_flip or by_crossing) and bool(train) and not res["missing_keys"]
                      and by_its_formula(t) >= set(train))
        # beside a flip or a crossing: the updates of parameters whose gradient agrees, by their formula
        beside = (by_flip or by_crossing) and bool(by_its_formula(t))
        train_explained = train_agrees or by_flip or by_crossing or by_implied
        explained = agree or (train_explained and not evals)
        # an evaluation that disagrees beside an explained training step: that point's disagreement is the eval's
        if not explained and train_explained and train:
            res = eval_disagreement(res)
        # the worst key: of those left unexplained when there are (the evaluation's beside a flip), else of all
        left = [d for d in res["diffs"] if not explained and d["key"] in res["disagreeing_keys"]] or res["diffs"]
        worst = max(left, key=lambda d: d["rel"] / d["tol"] if d["tol"] > 0 else math.inf, default=None)
        points.append({"step": t, "agree": explained, "disagreeing": len(res["disagreeing_keys"]),
                       "worst_key": worst["key"] if worst else None,
                       "worst_factor": (worst["rel"] / worst["tol"]) if worst and worst["tol"] > 0 else None,
                       "calibrated": calibrated, **({"discontinuity": flips[t]} if by_flip else {}),
                       **({"crossed": seen[t]} if by_crossing else {}),
                       **({"implied": by_formula[t]} if by_implied or beside else {})})
        if not explained and first_bad is None:
            first_bad = dict(res, step=t)
    worst_pt = max(points, key=lambda p: p["worst_factor"] or 0.0, default=None)
    out = {"points": [p["step"] for p in points], "per_point": points, "n": len(points),
           "agree": first_bad is None, "margin": margin, "floor": floor,
           "worst": {k: worst_pt[k] for k in ("step", "worst_key", "worst_factor")} if worst_pt else None,
           "calibrated": all(p["calibrated"] for p in points),
           "sequential": sequential_test(devs, layers=layers, owns=owns), "first_disagreement": first_bad,
           "discontinuities": {"flipped": flipped, "reference_jumps": ref_jumps, "allowed": allow_flips,
                               "largest": jumps["largest"],
                               "keys": sorted({k for ks in flips.values() if ks for k in ks}),
                               # the points whose every sample was probed again for a kink the candidate crossed
                               "looked_for_crossings": sorted(crossings),
                               "crossed": {t: seen[t] for t in sorted(crossings) if seen.get(t)}},
           # the points whose update was checked against its own gradient's formula (harness.implied)
           "implied": {t: by_formula[t] for t in sorted(by_formula)},
           "reproduced": rep.get("reproduced"), "jobs": rep.get("jobs"), "rows_matched": reordered}
    if emulated:
        out["evidence"] = evidence
    return out


__all__ = ["resync_points", "judge", "wants_more_sensitivity", "discontinuities", "training_keys", "MARGIN", "FLOOR"]
