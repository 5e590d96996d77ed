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

A bias too small for one step's tolerance (lr x (1 + 1e-5), an eps off by a little) keeps one sign over
all resynced steps, while rounding has no preferred sign and no systematic size beyond a few ULPs: per
key kind (forward, loss, gradients, updates, buffers, eval) the signed projection of the candidate's
deviation on the reference's tensor, in float32 ULPs, its median over the kind's keys at each point, is
tested over the points for a mean beyond SEQ_DELTA ULPs (one-sample t-test; the sign test is reported
next to it). BUG when p < SEQ_ALPHA / (kinds tested) (Bonferroni). A plain test of mean 0 is not enough:
measured, a clean candidate's Adam updates differ from the reference's by -0.6 ULP on average, consistently
(p 0.0004 over 30 points with a mean-0 test on deviations normalized by the projected rounding noise).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from .probe_analysis import param_layer
from .implied import optimizer_rest
from .kinks import explaining
from .probes import EPS32, kind_of

# The per-key tolerance at a resynced step: max(MARGIN x the reference's own float32-vs-float64 RMS error
# on that key at that state, FLOOR x the tensor's scale). The numbers behind both: docs/verdict.md,
# bench/calibrate_resync.py.
MARGIN = 3.0
FLOOR = 3e-5
# The sequential test: family-wise false-alarm rate over the kinds tested (Bonferroni), and the fewest
# points a kind needs to be tested at all.
SEQ_ALPHA = 0.01
SEQ_MIN_POINTS = 3
# the fewest resync points a run gets at any asked cadence (resync_points): with 3, the sequential test's
# t-test has 2 degrees of freedom and missed a 118-ULP evaluation bias (sd 14 ULP, p 0.0028 against the
# Bonferroni threshold 0.0017; bench/source_bugs.py jax_bn_inference_without_eps, a 60-step run at K = 25)
MIN_POINTS = 8
# a bias rounding can produce: two float32 implementations of one step differ systematically by a fraction
# of a ULP to a few ULPs (a learning rate rounded to float32, bias corrections computed in another
# precision); measured on two clean candidate backends against the reference (30 points each), the mean over the points
# of a kind's per-point median reached 4.1 ULP (cnn2d_hard adamw gradients; docs/verdict.md). The test asks
# whether the bias is beyond twice that (the envelope's floor is 8 ULPs too).
SEQ_DELTA = 8.0
SEQ_KINDS = ("forward", "loss", "grad", "update", "buffer", "eval")
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


def projection(a: np.ndarray, b: np.ndarray) -> float:
    """The candidate's deviation projected on the reference's tensor, relative: <a - b, b> / <b, b>
    (a = (1 + e) b gives e, whatever the sign of b). 0 for an all-zero reference; nan on a shape mismatch."""
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    if a.shape != b.shape:
        return float("nan")
    bb = float(b @ b)
    return float((a - b) @ b) / bb if bb > 0 else 0.0


def signed_deviations(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, float]:
    """Per key of the kinds tested (first optimizer step only): the candidate's deviation projected on the
    reference's tensor (`projection`), in float32 ULPs of relative size (units of EPS32)."""
    out = {}
    for k, y in b.items():
        kind, step = kind_of(k)
        if kind not in SEQ_KINDS or step != 0 or k not in a:
            continue
        p = projection(a[k], y)
        if math.isfinite(p):
            out[k] = p / EPS32
    return out


def _bias_test(x: np.ndarray, delta: float) -> tuple[float, float]:
    """Is the mean of x beyond +-delta? One-sample t statistic of |mean| - delta and its one-sided p
    (H0: |mean| <= delta). A sample with no spread: p 0 beyond delta, else 1."""
    n = len(x)
    m = abs(float(np.mean(x)))
    sd = float(np.std(x, ddof=1)) if n > 1 else 0.0
    if sd == 0.0 or not math.isfinite(sd):
        return (math.inf, 0.0) if m > delta else (-math.inf, 1.0)
    from scipy import stats
    t = (m - delta) / (sd / math.sqrt(n))
    return t, float(stats.t.sf(t, n - 1))


def _sign_test(x: np.ndarray) -> tuple[int, int, float]:
    """(positives, negatives, two-sided binomial p), zeros left out."""
    pos, neg = int(np.sum(x > 0)), int(np.sum(x < 0))
    if pos + neg == 0:
        return 0, 0, 1.0
    from scipy import stats
    return pos, neg, float(stats.binomtest(pos, pos + neg, 0.5).pvalue)


def _layer_rank(key: str, layers: list[str]) -> int:
    """A probe key's place in the spec's layer order ('forward/bn1', 'update0/bn1.gamma'); after them: none."""
    rest = key.split("/", 1)[-1].split("/")[-1]
    for name in (rest, param_layer(rest)):
        if name in layers:
            return layers.index(name)
    return len(layers)


def key_tests(per_point: list[dict[str, float]], kind: str, layers: list[str], alpha: float = SEQ_ALPHA,
              delta: float = SEQ_DELTA, min_points: int = SEQ_MIN_POINTS) -> dict[str, Any]:
    """Where in a biased kind the bias starts: the same test per key of `kind` (Bonferroni over its keys), the
    keys in the spec's layer order; `first` is the first significant one (a forward bias that starts at a
    BatchNorm is inherited by every layer after it)."""
    series: dict[str, list[float]] = {}
    for dev in per_point:
        for k, v in dev.items():
            if kind_of(k)[0] == kind:
                series.setdefault(k, []).append(v)
    tested = {k: np.asarray(v) for k, v in series.items() if len(v) >= min_points}
    threshold = alpha / max(len(tested), 1)
    keys = {}
    for k in sorted(tested, key=lambda k: _layer_rank(k, layers)):
        t, p = _bias_test(tested[k], delta)
        keys[k] = {"p": p, "mean_ulp": float(np.mean(tested[k])), "significant": p < threshold}
    first = next((k for k, st in keys.items() if st["significant"]), None)
    return {"threshold": threshold, "keys": keys, "first": first}


def sequential_test(per_point: list[dict[str, float]], alpha: float = SEQ_ALPHA, delta: float = SEQ_DELTA,
                    min_points: int = SEQ_MIN_POINTS, layers: list[str] | None = None) -> dict[str, Any]:
    """The signed deviations of every resynced point (key -> projection in float32 ULPs) tested for a bias:
    per key kind, the median over the kind's keys at each point (one ill-conditioned key does not speak for
    the kind; a bias of the whole step moves them all), then a one-sample t-test over the points of
    H0 |mean| <= delta ULPs. Significant when p < alpha / (kinds tested). Returns the per-kind statistics
    (with the sign test next to it), the threshold and `bias`: the earliest significant kind in the step's
    order (forward, loss, gradients, updates, buffers, then the inference path; None when none is
    significant), where a bias starts: what follows it inherits it, often with a smaller p (a BatchNorm eps
    moves every later activation and the evaluation too); with `layers`, the per-key tests of that kind
    (`key_tests`: the first biased key names the layer)."""
    by_kind: dict[str, list[float]] = {}
    for dev in per_point:
        groups: dict[str, list[float]] = {}
        for k, v in dev.items():
            groups.setdefault(kind_of(k)[0], []).append(v)
        for kd, vs in groups.items():
            by_kind.setdefault(kd, []).append(float(np.median(vs)))
    tested = {kd: np.asarray(v) for kd, v in by_kind.items() if len(v) >= min_points}
    threshold = alpha / max(len(tested), 1)
    kinds = {}
    for kd, x in sorted(tested.items(), key=lambda kv: SEQ_KINDS.index(kv[0]) if kv[0] in SEQ_KINDS else 99):
        t, p = _bias_test(x, delta)
        pos, neg, p_sign = _sign_test(x)
        kinds[kd] = {"points": len(x), "mean_ulp": float(np.mean(x)),
                     "sd_ulp": float(np.std(x, ddof=1)) if len(x) > 1 else 0.0,
                     "t": t, "p": p, "positive": pos, "negative": neg, "p_sign": p_sign, "significant": p < threshold}
    sig = [kd for kd, st in kinds.items() if st["significant"]]
    bias = min(sig, key=lambda kd: SEQ_KINDS.index(kd) if kd in SEQ_KINDS else len(SEQ_KINDS)) if sig else None
    where = key_tests(per_point, bias, layers, alpha, delta, min_points) if bias and layers is not None else None
    return {"test": f"per key kind: median over its keys of the signed relative deviation (float32 ULPs) at each "
                    f"point; one-sample t-test over the points of H0 |mean| <= {delta:g} ULP",
            "alpha": alpha, "delta_ulp": delta, "kinds_tested": len(tested), "threshold": threshold, "kinds": kinds,
            "bias": bias, "min_p": min((st["p"] for st in kinds.values()), default=None),
            "untested": sorted(kd for kd, v in by_kind.items() if len(v) < min_points), "where": where}


STAGE_OF_KIND = {"forward": "forward", "loss": "loss", "grad": "backward", "update": "optimizer",
                 "buffer": "forward", "eval": "eval"}


# the probe kinds a discontinuity of one step moves while the forward pass agrees: a ReLU (or ReLU6, or a
# max-pool tie) is continuous in its input, so a flip of its derivative changes the gradients below it and
# what follows from them (the update, the optimizer state), never an activation, the loss or a buffer
BACKWARD_KINDS = ("grad", "update", "opt")


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
    return backward_only({kind_of(k)[0] for k in bad.get("disagreeing_keys") or []})


def backward_only(kinds: set[str]) -> bool:
    """Kinds of disagreeing keys a flipped kink can produce: gradients (some), and what follows from them."""
    return "grad" in kinds and kinds <= set(BACKWARD_KINDS)


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
    results, evidence, devs, by_formula = [], [], [], {}
    for t, pa, pb, p64, plain in rep["probes"]:
        z = p64 if plain is None else rep.get("emulated64", {}).get(t)
        res = analyse(pa, pb, layers, rel_tol=floor, ref64=z, margin=margin,
                      nudged=(rep.get("sensitivity") or {}).get(t))
        results.append((int(t), res, z is not None))
        rest = optimizer_rest(res) if implied is not None and not res["missing_keys"] else []
        if rest:
            got = implied(int(t), pa, pb, rest)
            if got is not None:
                by_formula[int(t)] = got
        if plain is not None:
            evidence += [f"step {t}: {k}" for k in
                         analyse(pa, plain, layers, rel_tol=floor, ref64=p64, margin=margin)["disagreeing_keys"]]
        devs.append(signed_deviations(pa, pb))
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
        keys = [k for k in res["disagreeing_keys"] if k not in by_its_formula(t)]
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
        keys = [k for k in res["disagreeing_keys"] if k not in by_its_formula(t)]
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
        worst = max(res["diffs"], key=lambda d: d["rel"] / d["tol"] if d["tol"] > 0 else math.inf, default=None)
        agree = res["stage"] is None and not res["disagreeing_keys"]
        by_flip = not agree and allow_flips and bool(flips[t])
        by_crossing = not agree and bool(seen[t])
        by_implied = not (agree or by_flip or by_crossing) and by_its_formula(t) >= set(res["disagreeing_keys"])
        # beside a flip or a crossing: the updates of parameters whose gradient agrees, by their formula
        beside = (by_flip or by_crossing) and bool(by_its_formula(t))
        explained = agree or by_flip or by_crossing or by_implied
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
           "sequential": sequential_test(devs, layers=layers), "first_disagreement": first_bad,
           "discontinuities": {"flipped": flipped, "reference_jumps": ref_jumps, "allowed": allow_flips,
                               "largest": jumps["largest"],
                               "keys": sorted({k for ks in flips.values() if ks for k in ks}),
                               # the points whose every sample was probed again for a kink the candidate crossed
                               "looked_for_crossings": sorted(crossings),
                               "crossed": {t: seen[t] for t in sorted(crossings) if seen.get(t)}},
           # the points whose update was checked against its own gradient's formula (harness.implied)
           "implied": {t: by_formula[t] for t in sorted(by_formula)},
           "reproduced": rep.get("reproduced"), "jobs": rep.get("jobs")}
    if emulated:
        out["evidence"] = evidence
    return out


__all__ = ["resync_points", "sequential_test", "key_tests", "signed_deviations", "judge", "wants_more_sensitivity", "projection", "discontinuities",
           "MARGIN", "FLOOR", "SEQ_ALPHA"]
