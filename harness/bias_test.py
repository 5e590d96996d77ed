"""The sequential bias test over resynced steps: a computation that differs by less than one step's
tolerance (lr x (1 + 1e-5), an eps off by a little, a running variance unbiased with another count) keeps
one sign at every resynced step, while rounding has no preferred sign and no systematic size beyond a few
ULPs. Framework-free; harness/resync.py gives it the signed deviations of every resynced point.

Two families, each at SEQ_ALPHA (Bonferroni inside each):
- per key kind (forward, loss, gradients, updates, buffers, eval): the signed projection of the candidate's
  deviation on the reference's tensor, in float32 ULPs, its median over the kind's keys at each point, tested
  over the points for a mean beyond SEQ_DELTA ULPs (one-sample t-test; the sign test is reported next to it).
  A bias of the whole step moves every key of a kind, and the median is robust to one ill-conditioned key;
- per key: the same test on each key alone, its null widened to MARGIN x the reference's own float32-vs-float64
  projection on that key (a key rounding moves by 500 ULPs, a decay term lr x wd x p rounded through
  1 - lr x wd in float32, is held to 1,500). A bias in a subset of a kind's keys, the running variances and not
  the running means, one layer's eps, is diluted by the kind's median (measured: a synchronized BatchNorm
  whose running variance was unbiased with the replica's count moved every running variance by 13-223 ULPs,
  the buffer kind's median by 6 ULPs; bench/source_bugs.py tf_sync_bn_running_var_local_count).

A plain test of mean 0 is not enough: measured, a clean candidate's Adam updates differ from the reference's
by -0.6 ULP on average, consistently (p 0.0004 over 30 points with a mean-0 test on deviations normalized by
the projected rounding noise).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .probe_analysis import param_layer
from .probes import EPS32, kind_of

# The sequential test: family-wise false-alarm rate over the kinds tested (Bonferroni), and the fewest
# points a kind needs to be tested at all.
SEQ_ALPHA = 0.01
SEQ_MIN_POINTS = 3

# a bias rounding can produce: two float32 implementations of one step differ systematically by a fraction
# of a ULP to a few ULPs (a learning rate rounded to float32, bias corrections computed in another
# precision); measured on two clean candidate backends against the reference (30 points each), the mean over the points
# of a kind's per-point median reached 4.1 ULP (cnn2d_hard adamw gradients; docs/verdict.md). The test asks
# whether the bias is beyond twice that (the envelope's floor is 8 ULPs too).
SEQ_DELTA = 8.0
SEQ_KINDS = ("forward", "loss", "grad", "update", "buffer", "eval")


def projection(a: np.ndarray, b: np.ndarray) -> float:
    """The candidate's deviation projected on the reference's tensor, relative: <a - b, b> / <b, b>
    (a = (1 + e) b gives e, whatever the sign of b). 0 for an all-zero reference; nan on a shape mismatch."""
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    if a.shape != b.shape:
        return float("nan")
    bb = float(b @ b)
    return float((a - b) @ b) / bb if bb > 0 else 0.0


# the suffix of a per-key entry that projects an update's deviation on the parameter, not on the update
ALONG_PARAMETER = "~param"


def along_parameter(a: np.ndarray, b: np.ndarray, p: np.ndarray) -> float:
    """The candidate's update deviation projected on the parameter's direction, relative to the reference's
    update: <a - b, p> / (|p| |b|). A weight-decay error moves the update by lr x e x p, along the parameter;
    before a BatchNorm a weight's gradient is orthogonal to the weight (the loss does not change with its scale),
    so the update is nearly orthogonal to it and `projection` does not see that error (bench/update_projection.py).
    nan on a shape mismatch or an all-zero tensor."""
    a, b, p = (np.asarray(x, np.float64).ravel() for x in (a, b, p))
    nb, n_p = float(np.linalg.norm(b)), float(np.linalg.norm(p))
    if not a.shape == b.shape == p.shape or nb == 0.0 or n_p == 0.0:
        return float("nan")
    return float((a - b) @ p) / n_p / nb


def signed_deviations(a: dict[str, np.ndarray], b: dict[str, np.ndarray],
                      params: dict[str, np.ndarray] | None = None) -> dict[str, float]:
    """Per key of the kinds tested (first optimizer step only): the candidate's deviation projected on the
    reference's tensor (`projection`), in float32 ULPs of relative size (units of EPS32). With `params` (the
    state's parameters by name), each `update0/<name>` also projected on its parameter (`along_parameter`), as
    `update0/<name>~param`: tested per key only, never in its kind's median."""
    out = {}
    for k, y in b.items():
        kind, step = kind_of(k)
        if kind not in SEQ_KINDS or step != 0 or k not in a:
            continue
        p = projection(a[k], y)
        if math.isfinite(p):
            out[k] = p / EPS32
        name = k.split("/", 1)[1] if kind == "update" else None
        if params is not None and name in params:
            q = along_parameter(a[k], y, params[name])
            if math.isfinite(q):
                out[k + ALONG_PARAMETER] = q / EPS32
    return out


def beyond_null(x: np.ndarray, delta: float) -> tuple[float, float]:
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


def _kind_rank(kind: str) -> int:
    """A probe kind's place in the step's order (SEQ_KINDS); after them: any other."""
    return SEQ_KINDS.index(kind) if kind in SEQ_KINDS else len(SEQ_KINDS)


def _series_by_key(per_point: list[dict[str, float]], keep) -> dict[str, list[float]]:
    """Each key's deviations over the points, for the keys `keep(point index, key)` accepts."""
    series: dict[str, list[float]] = {}
    for i, dev in enumerate(per_point):
        for k, v in dev.items():
            if keep(i, k):
                series.setdefault(k, []).append(v)
    return series


def key_tests(per_point: list[dict[str, float]], kind: str, layers: list[str], alpha: float = SEQ_ALPHA,
              delta: float = SEQ_DELTA, min_points: int = SEQ_MIN_POINTS) -> dict[str, Any]:
    """Where in a biased kind the bias starts: the same test per key of `kind` (Bonferroni over its keys), the
    keys in the spec's layer order; `first` is the first significant one (a forward bias that starts at a
    BatchNorm is inherited by every layer after it)."""
    series = _series_by_key(per_point, lambda _, k: kind_of(k)[0] == kind and not k.endswith(ALONG_PARAMETER))
    tested = {k: np.asarray(v) for k, v in series.items() if len(v) >= min_points}
    threshold = alpha / max(len(tested), 1)
    keys = {}
    for k in sorted(tested, key=lambda k: _layer_rank(k, layers)):
        t, p = beyond_null(tested[k], delta)
        keys[k] = {"p": p, "mean_ulp": float(np.mean(tested[k])), "significant": p < threshold}
    first = next((k for k, st in keys.items() if st["significant"]), None)
    return {"threshold": threshold, "keys": keys, "first": first}


def sequential_test(per_point: list[dict[str, float]], alpha: float = SEQ_ALPHA, delta: float = SEQ_DELTA,
                    min_points: int = SEQ_MIN_POINTS, layers: list[str] | None = None,
                    owns: list[dict[str, float]] | None = None) -> dict[str, Any]:
    """The signed deviations of every resynced point (key -> projection in float32 ULPs) tested for a bias:
    per key kind, the median over the kind's keys at each point (one ill-conditioned key does not speak for
    the kind; a bias of the whole step moves them all), then a one-sample t-test over the points of
    H0 |mean| <= delta ULPs. Significant when p < alpha / (kinds tested). Returns the per-kind statistics
    (with the sign test next to it), the threshold and `bias`: the earliest significant kind in the step's
    order (forward, loss, gradients, updates, buffers, then the inference path; None when none is
    significant), where a bias starts: what follows it inherits it, often with a smaller p (a BatchNorm eps
    moves every later activation and the evaluation too); with `layers`, the per-key tests of that kind
    (`key_tests`: the first biased key names the layer). With `owns` (per point, the reference's own float32
    deviation per key), every key is tested on its own as well (`keywise_test`, `per_key`); a significant key
    where no kind is, or of a kind earlier in the step than the earliest biased kind (`by_key`), is the bias,
    its kind and layer its place."""
    by_kind: dict[str, list[float]] = {}
    for dev in per_point:
        groups: dict[str, list[float]] = {}
        for k, v in dev.items():
            if not k.endswith(ALONG_PARAMETER):   # another direction of a key already in its kind
                groups.setdefault(kind_of(k)[0], []).append(v)
        for kd, vs in groups.items():
            by_kind.setdefault(kd, []).append(float(np.median(vs)))
    tested = {kd: np.asarray(v) for kd, v in by_kind.items() if len(v) >= min_points}
    threshold = alpha / max(len(tested), 1)
    kinds = {}
    for kd, x in sorted(tested.items(), key=lambda kv: _kind_rank(kv[0])):
        t, p = beyond_null(x, delta)
        pos, neg, p_sign = _sign_test(x)
        kinds[kd] = {"points": len(x), "mean_ulp": float(np.mean(x)),
                     "sd_ulp": float(np.std(x, ddof=1)) if len(x) > 1 else 0.0,
                     "t": t, "p": p, "positive": pos, "negative": neg, "p_sign": p_sign, "significant": p < threshold}
    sig = [kd for kd, st in kinds.items() if st["significant"]]
    bias = min(sig, key=_kind_rank) if sig else None
    where = key_tests(per_point, bias, layers, alpha, delta, min_points) if bias and layers is not None else None
    per_key = keywise_test(per_point, owns, layers, alpha, delta, min_points) if owns is not None else None
    # a key biased earlier in the step than the earliest biased kind (or where none is) is where the bias starts:
    # a Keras port of resnet_tiny, one BatchNorm eps 2e-5 for 1e-5 (2026-12-06): the grad kind's median biased
    # (p 5.7e-4) from that layer's gradient on, forward/block3_bn2 on its own at p 2.6e-11, the forward kind's
    # median not (one layer of 40)
    first_kind = kind_of(per_key["first"])[0] if per_key is not None and per_key["first"] is not None else None
    by_key = first_kind is not None and (bias is None or _kind_rank(first_kind) < _kind_rank(bias))
    if by_key:
        bias = kind_of(per_key["first"])[0]
        where = {k: per_key[k] for k in ("threshold", "keys", "first")}
    return {"test": f"per key kind: median over its keys of the signed relative deviation (float32 ULPs) at each "
                    f"point; one-sample t-test over the points of H0 |mean| <= {delta:g} ULP",
            "alpha": alpha, "delta_ulp": delta, "kinds_tested": len(tested), "threshold": threshold, "kinds": kinds,
            "bias": bias, "min_p": min((st["p"] for st in kinds.values()), default=None),
            "untested": sorted(kd for kd, v in by_kind.items() if len(v) < min_points), "where": where,
            "per_key": per_key, "by_key": by_key}


STAGE_OF_KIND = {"forward": "forward", "loss": "loss", "grad": "backward", "update": "optimizer",
                 "buffer": "forward", "eval": "eval"}


# a key's own error (the reference's float32 projection on its float64 tensor) this many times over is what
# the per-key test's null allows it beyond SEQ_DELTA: the resync's tolerance margin
KEY_MARGIN = 3.0


def keywise_test(per_point: list[dict[str, float]], owns: list[dict[str, float]], layers: list[str] | None = None,
                 alpha: float = SEQ_ALPHA, delta: float = SEQ_DELTA,
                 min_points: int = SEQ_MIN_POINTS) -> dict[str, Any]:
    """Every key of the kinds tested on its own: H0 |mean| <= max(delta, KEY_MARGIN x the key's largest own
    deviation over the points), one-sample t-test, Bonferroni over every key tested. `owns[i]` is point i's
    |projection of the float32 reference on the float64 one| per key in ULPs; a point without it (no float64
    reference there) tests no key. `first`: the earliest significant key, by kind in the step's order
    (SEQ_KINDS), then by layer: where the bias starts."""
    series = _series_by_key(per_point, lambda i, k: i < len(owns) and math.isfinite(owns[i].get(k, math.nan)))
    own = {k: max(abs(ow[k]) for ow in owns if k in ow and math.isfinite(ow[k])) for k in series}
    tested = {k: np.asarray(v) for k, v in series.items() if len(v) >= min_points}
    threshold = alpha / max(len(tested), 1)
    found, min_p = {}, None
    for k, x in tested.items():
        null = max(delta, KEY_MARGIN * own[k])
        t, p = beyond_null(x, null)
        min_p = p if min_p is None else min(min_p, p)
        if p < threshold:
            pos, neg, _ = _sign_test(x)
            found[k] = {"p": p, "t": t, "points": len(x), "mean_ulp": float(np.mean(x)), "null_ulp": null,
                        "positive": pos, "negative": neg, "significant": True}

    keys = {k: found[k] for k in sorted(found, key=lambda k: (_kind_rank(kind_of(k)[0]), _layer_rank(k, layers or [])))}
    return {"test": "per key: one-sample t-test over the points of H0 |mean| <= max(delta, "
                    f"{KEY_MARGIN:g} x the key's own float32 deviation) ULP, Bonferroni over the keys",
            "tested": len(tested), "threshold": threshold, "min_p": min_p, "keys": keys,
            "first": next(iter(keys), None)}
