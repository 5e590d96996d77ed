"""Kinks a step's forward pass crossed: where a candidate's own activations put a ReLU (ReLU6, LeakyReLU)
input or a max-pool window's pick on the other side from the float64 reference's, from one resynced step's
full forward probes (every sample of the batch); and saturations: a tanh or sigmoid whose derivative, which
every framework computes from the layer's own float32 output, one ULP of that output moves by far more than
rounding. Framework-free: the spec's layer semantics, NumPy.

Why: a kink is continuous in its input, so when rounding moves an input across it every activation and the
loss still agree, while the derivative there changes, and with it the gradients of every parameter upstream
of that layer (and what follows from them: the updates, the optimizer state). Two float32 programs that sum
in different orders cross different kinks now and then (cnn2d_hard adamw, resynced step 23: a max-pool
window of `pool2` whose two largest inputs are 1.3e-7 apart in float64, picked one way by the reference and
the other by three candidates; conv1, bn1 and conv2's gradients 4-5e-3 off, the reference's own eight
1-ULP-nudged steps all on its side; docs/verdict.md). Seeing the crossing in the candidate's own activations
is evidence that the backward disagreement is that flip, not another computation (harness.resync.judge).

And the candidate's own step in float64 (`same_in_float64`): a gradient that is an ill-conditioned sum (a
BatchNorm gamma's: the sum over the batch and the map of dy * x_hat, which nearly cancels) rounds in float32 by
what the summation order makes of it, and a kernel that sums in another order (a channels-last BatchNorm
backward on mobilenet_tiny, resynced step 1: ir2_expand_bn.gamma's gradient 2.2e-3 of its scale off, 4.3x the
reference's own float32 error, every activation agreeing, no kink crossed) may round several times worse than
the reference's. The candidate's float64 step from the same state computing what the float64 reference computes,
to float64's resolution of that float32 disagreement, is evidence that its kernels compute the same function.

And the candidate's step with its activations recorded (`same_when_recorded`): a graph compiler may fuse a
BatchNorm with the ReLU after it in the plain step, whose activations no probe sees; a program that returns them
is another program (two graph-compiled backends on resnet_tiny at step 0, 2026-12-06: a ReLU input 7.8e-7 below
the kink in float64, -6e-8 in every recorded program, on the active side in the fused one; `block3_bn1.beta`'s
gradient 2.1e-4 off, everything upstream 1e-3..2e-2). The same code compiled with its activations as outputs computing
the reference's gradients within their calibrated tolerance, beside a kink whose input is within the candidate's
own rounding of it, is evidence that the plain step's disagreement upstream of that kink is a kernel's rounding.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from algorithms.layout import pad_hw, pool_windows
from algorithms.model import INPUT, LayerInfo, ModelSpec
from algorithms.params import JOINT

from .probes import BACKWARD_KINDS, EPS32, kind_of, rms_rel

# the candidate's float64 step explains a float32 disagreement of `rel` when its own error against the float64
# reference is within FLOAT64_MARGIN x rel x eps64 / eps32 (what float64 rounding makes of the same conditioning),
# never under FLOAT64_FLOOR: another computation (a bug) stays as far off in float64 as in float32
FLOAT64_MARGIN = 100.0
FLOAT64_FLOOR = 1e-13
# and only a float32 disagreement within FLOAT64_REACH x its calibrated tolerance (the reference's own float32
# error, margin included): one summation order rounds an ill-conditioned sum up to ~sqrt(n / log n) times worse
# than another (25x for a BatchNorm's 8192 terms), not without bound; a key further off is not let through by a
# float64 path that might not be the float32 one (a wrapper that computes in another precision in float32)
FLOAT64_REACH = 10.0
EPS_RATIO = float(np.finfo(np.float64).eps) / EPS32

# the layer kinds whose derivative jumps at some input value (a kink), and what decides the branch
KINK_KINDS = ("relu", "relu6", "leaky_relu", "maxpool2d")


def decisions(layer: LayerInfo, x: np.ndarray) -> np.ndarray:
    """The branch each output of a kink layer takes on its (N, ...) input `x`: the side of 0 (and of 6 for
    ReLU6), or the first maximum's position in each max-pool window (row-major, as every framework picks)."""
    if layer.kind in ("relu", "leaky_relu"):
        return x > 0
    if layer.kind == "relu6":
        return (x > 0).astype(np.int8) + (x >= 6)
    return pool_windows(layer, pad_hw(np.asarray(x, np.float64), layer, -np.inf)).argmax(axis=-1)


def margins(layer: LayerInfo, x: np.ndarray) -> np.ndarray:
    """How far each output's input is from its kink in `x` (the float64 reference's): |x| (ReLU), the
    distance to 0 or 6 (ReLU6), the gap between a window's two largest inputs (max pool)."""
    if layer.kind in ("relu", "leaky_relu"):
        return np.abs(x)
    if layer.kind == "relu6":
        return np.minimum(np.abs(x), np.abs(x - 6))
    top = np.sort(pool_windows(layer, pad_hw(np.asarray(x, np.float64), layer, -np.inf)), axis=-1)[..., -2:]
    return top[..., 1] - top[..., 0]


# layer kinds whose training forward reads the other samples of the batch (its statistics)
BATCH_STATISTICS = ("batchnorm2d",)


def reads_fed_statistics(model: ModelSpec, name: str) -> bool:
    """Is layer `name` one whose training forward reads the batch's statistics (BATCH_STATISTICS) and that has a
    layer upstream, whose agreement over the whole global batch (Muffin's rule: its input agrees) vouches that
    every replica was fed its samples? Then a disagreement there only across replicas is in the statistics."""
    return model.layer(name).kind in BATCH_STATISTICS and bool(upstream(model, name))


def upstream(model: ModelSpec, name: str) -> set[str]:
    """The layers whose outputs reach layer `name` (its ancestors in the graph, itself excluded)."""
    by_name = {l.name: l for l in model.layers}
    seen: set[str] = set()
    todo = [i for i in by_name[name].inputs if i != INPUT]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += [i for i in by_name[n].inputs if i != INPUT]
    return seen


def _kink_inputs(model: ModelSpec, cand: dict[str, np.ndarray], ref64: dict[str, np.ndarray], prefix: str = ""):
    """(kink layer, the candidate's input to it, the float64 reference's) for every kink layer whose input (a layer's
    `forward/` probe, under `prefix` in `cand`) both sides have with the same shape."""
    for layer in model.layers:
        if layer.kind not in KINK_KINDS or len(layer.inputs) != 1 or layer.inputs[0] == INPUT:
            continue
        key = f"forward/{layer.inputs[0]}"
        x = cand.get(prefix + key)
        if x is not None and key in ref64 and x.shape == ref64[key].shape:
            yield layer, np.asarray(x, np.float64), np.asarray(ref64[key], np.float64)


def crossed(model: ModelSpec, cand: dict[str, np.ndarray], ref64: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """Every kink layer whose branch differs somewhere between the candidate's forward probes and the float64
    reference's (both with every sample: `forward/<layer>`, the layer's output, is the next one's input):
    the layer, its kind, how many outputs crossed of how many, the float64 margin of the nearest and the
    farthest crossing, and the layers upstream of it (whose parameters' gradients the crossing moves)."""
    out = []
    for layer, x, x64 in _kink_inputs(model, cand, ref64):
        diff = decisions(layer, x) != decisions(layer, x64)
        if diff.any():
            m = margins(layer, x64)[diff]
            out.append({"layer": layer.name, "kind": layer.kind, "crossed": int(diff.sum()), "of": int(diff.size),
                        "margin_min": float(m.min()), "margin_max": float(m.max()),
                        "upstream": sorted(upstream(model, layer.name))})
    return out


# the layer kinds whose derivative the frameworks compute from the layer's float32 output y (their tanh and
# sigmoid gradient kernels and differentiation rules all take y; docs/verdict.md): the derivative as a function
# of y, and the rounding of evaluating it in float32 (of y * y: half a ULP of it)
SATURATING = {"tanh": (lambda y: 1.0 - y * y, lambda y, d: 0.5 * EPS32 * y * y),
              "sigmoid": (lambda y: y * (1.0 - y), lambda y, d: 0.5 * EPS32 * np.abs(d))}
# the outputs that carry a layer's derivative: the fewest, largest, whose float64 derivatives sum to this share
CARRIED = 0.99


def derivative_error(kind: str, y: np.ndarray, y64: np.ndarray) -> tuple[float, int]:
    """How far a saturating layer's derivative, computed from the float32 outputs `y`, can be from the float64
    reference's (outputs `y64`), relative: the largest relative error over the outputs that carry the
    derivative (CARRIED of its sum), plus what the other outputs' absolute errors add to the carried sum. And
    how many outputs carry it. One step of 2026-12-04 (cnn2d_3conv_3fc adamw lr 0.05, step 1): every output of
    the tanh before the last dense layer within 0.007 of a derivative of 0, 96% of them exactly +-1 in float32,
    so that one ULP of y (6e-8) is 1e-4..1e-2 of the derivative; two clean candidates' gradients of every layer
    upstream 4e-4 and 1.6e-3 (a tanh up to 3.5 ULP from float64's) from the float64 step, 5-18 times the
    reference's own float32 error there; this allowance was 3.5e-3 and 5.9e-3."""
    formula, rounding = SATURATING[kind]
    y, y64 = np.asarray(y, np.float64).ravel(), np.asarray(y64, np.float64).ravel()
    d64, d = np.abs(formula(y64)), formula(y)
    err = np.abs(d - d64) + np.where(d != 0, rounding(y, d), 0.0)
    order = np.argsort(-d64, kind="stable")
    carried = order[:int(np.searchsorted(np.cumsum(d64[order]), CARRIED * d64.sum())) + 1]
    rest = np.ones(d64.size, bool)
    rest[carried] = False
    mass = d64[carried].sum()
    return float((err[carried] / d64[carried]).max() + err[rest].sum() / mass), int(carried.size)


def saturated(model: ModelSpec, cand: dict[str, np.ndarray], ref64: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """Every saturating layer (SATURATING) with how far rounding may move its derivative: the layer, its kind,
    `allowance` (`derivative_error` from the candidate's own outputs: the gradients of the layers upstream,
    which the derivative multiplies, may be that far off relatively, by rounding alone), how many outputs
    carry the derivative, of how many, and the layers upstream. A layer whose float64 derivative is 0
    everywhere passes no gradient and is left out."""
    out = []
    for layer in model.layers:
        key = f"forward/{layer.name}"
        if layer.kind not in SATURATING or key not in cand or key not in ref64 or cand[key].shape != ref64[key].shape:
            continue
        y64 = np.asarray(ref64[key], np.float64)
        if not np.abs(SATURATING[layer.kind][0](y64)).any():
            continue
        allowance, carried = derivative_error(layer.kind, cand[key], y64)
        out.append({"layer": layer.name, "kind": layer.kind, "allowance": allowance, "carried_by": carried,
                    "of": int(y64.size), "upstream": sorted(upstream(model, layer.name))})
    return out


def same_in_float64(cand64: dict[str, np.ndarray] | None, ref64: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """The candidate's own float64 step against the float64 reference's from the same state (both computing the
    candidate's declared formulas), per key of the backward pass: RMS error over the key's float64 scale, as
    `rel` is. [] without the candidate's float64 step (a backend without float64, or its job failed)."""
    if cand64 is None:
        return []
    keys = {k: rms_rel(np.asarray(cand64[k], np.float64), np.asarray(ref64[k], np.float64))
            for k in cand64 if k in ref64 and kind_of(k)[0] in BACKWARD_KINDS}
    return [{"layer": "the candidate's own float64 step", "kind": "float64", "keys": keys}] if keys else []


def same_when_recorded(model: ModelSpec, cand: dict[str, np.ndarray], ref64: dict[str, np.ndarray]
                       ) -> list[dict[str, Any]]:
    """The candidate's step compiled with every activation as an output (Backend.layers_and_gradients: `JOINT`
    keys of its every-sample replay) against the float64 reference, per gradient (RMS error over its float64
    scale, as `rel` is), with the kink layers that have an input within the candidate's own rounding of the kink
    (float64 margin <= the largest |error| of its recorded input) and the layers upstream of them. [] without
    those keys (a backend whose probes are one program already) or without such a kink."""
    grads = {k[len(JOINT):]: v for k, v in cand.items() if k.startswith(JOINT + "grad/")}
    near = []
    for layer, x, x64 in _kink_inputs(model, cand, ref64, JOINT) if grads else ():
        err, m = float(np.max(np.abs(x - x64))), margins(layer, x64)
        if (m <= err).any():
            near.append({"layer": layer.name, "kind": layer.kind, "near": int((m <= err).sum()), "of": int(m.size),
                         "margin_min": float(m.min()), "rounding": err})
    if not near:
        return []
    keys = {k: rms_rel(np.asarray(v, np.float64), np.asarray(ref64[k], np.float64)) for k, v in grads.items() if k in ref64}
    return [{"layer": "the candidate's step with its activations recorded", "kind": "recorded", "keys": keys,
             "near": near, "upstream": sorted(set().union(*(upstream(model, n["layer"]) for n in near)))}]


def explaining(found: list[dict[str, Any]], diffs: list[dict[str, Any]], *, margin: float,
               floor: float) -> list[dict[str, Any]] | None:
    """The crossings, saturations and float64 steps in `found` (one step's `crossed` + `saturated` +
    `same_in_float64`) that explain the disagreeing keys `diffs` (probe diffs: key, kind, rel), when together
    they explain every one; else None. A kink explains any key of a parameter upstream of it (a crossing moves a
    whole derivative); a saturation a gradient upstream of it within `margin` x its allowance (an allowance under
    floor / margin explains nothing the floor does not); the float64 step a key it computes as the float64
    reference does (FLOAT64_MARGIN); an update or optimizer state follows its own parameter's explained gradient."""
    usable = [c for c in found if "allowance" not in c or margin * c["allowance"] > floor]

    def param(d: dict[str, Any]) -> str:        # "update0/conv1.kernel" -> "conv1.kernel"
        return d["key"].rsplit("/", 1)[-1]

    def explains(c: dict[str, Any], d: dict[str, Any]) -> bool:
        if c["kind"] == "float64":
            got = c["keys"].get(d["key"])
            return (got is not None and d["rel"] <= FLOAT64_REACH * d["tol"]
                    and got <= max(FLOAT64_FLOOR, FLOAT64_MARGIN * EPS_RATIO * d["rel"]))
        if c["kind"] == "recorded":   # the same code agrees when recorded; a near kink is what fusing crossed
            got = c["keys"].get(d["key"])
            return got is not None and got <= d["tol"] and param(d).rsplit(".", 1)[0] in c["upstream"]
        if param(d).rsplit(".", 1)[0] not in c["upstream"]:
            return False
        return "allowance" not in c or (d["kind"] == "grad" and d["rel"] <= margin * c["allowance"])

    used = [c for c in usable if any(explains(c, d) for d in diffs)]
    explained = {param(d) for d in diffs if d["kind"] == "grad" and any(explains(c, d) for c in used)}
    ok = all(any(explains(c, d) for c in used) or (d["kind"] in ("update", "opt") and param(d) in explained)
             for d in diffs)
    # a float64 step is reported with the keys it explains (float32 error, then its own float64 error), not all
    said = [c if c["kind"] not in ("float64", "recorded") else
            dict(c, keys={d["key"]: [d["rel"], c["keys"][d["key"]]] for d in diffs if explains(c, d)}) for c in used]
    return said if ok else None


__all__ = ["CARRIED", "KINK_KINDS", "SATURATING", "crossed", "decisions", "derivative_error", "explaining", "margins", "reads_fed_statistics",
           "same_in_float64", "same_when_recorded", "saturated", "upstream"]
