"""The numpy backend's hand-written backward against central finite differences in float64, for every
layer kind alone, every built-in model and the loss; then numpy's step-0 probes against torch float64's.

Finite differences are only exact where the loss is smooth: the batch is drawn (seed after seed) until
no relu input lies within MARGIN of zero and no max-pool window has two maxima within MARGIN of each
other, so a step of H cannot cross a kink. Exact ties are allowed: in these models they are the same
function of the parameters (dead relu zeros; 'same' average windows holding one live pixel, a/4 twice),
so either maximum has the same derivative. The
coordinates checked per parameter: its largest gradient entry and SAMPLE random ones (all of them for
small tensors). Relative error: max |fd - analytic| / max |analytic| over the checked coordinates.
"""
from __future__ import annotations

import numpy as np
import pytest

from algorithms import data as D
from algorithms.optim import HParams
from algorithms.params import init_params
from algorithms.spec import ModelSpec, build_model, load_model, model_names
from wrappers.base import RunOptions
from wrappers.numpy.backend import NumpyBackend
from wrappers.numpy.layers import _pad, _windows, softmax_xent

from .conftest import probes_for

H = 1e-6          # central difference step: truncation ~H^2, rounding ~1e-16 / H, both well below TOL
TOL = 1e-6
MARGIN = 5e-5    # distance to the nearest kink: 50 H, more than a step of H moves any activation here
SAMPLE = 12
BATCH = 4


def _backend(model: ModelSpec, seed: int = 0) -> NumpyBackend:
    b = NumpyBackend(model, HParams(), RunOptions(dtype="float64"))
    b.load_params({k: v.astype(np.float64) for k, v in init_params(model, seed).items()})
    # non-zero biases and BatchNorm affine parameters, so their gradients are checked away from the init
    rng = np.random.default_rng(seed + 100)
    for q in model.trainable:
        if q.role in ("bias", "beta", "gamma"):
            b.p[q.name] = b.p[q.name] + rng.normal(0.0, 0.1, q.shape)
    return b


def _masks(model: ModelSpec, n: int) -> dict[str, np.ndarray]:
    return {l.name: D.dropout_keep_mask(0, 0, l.index, (n, *l.out_shape), l.spec["rate"])
            for l in model.layers if l.kind == "dropout"}


def _smooth(b: NumpyBackend, x: np.ndarray, masks: dict[str, np.ndarray]) -> bool:
    """No relu input within MARGIN of zero, no max-pool window with a near tie (exact ties allowed)."""
    rec = b.forward_layers(x, masks)
    prev = x
    for layer in b.model.layers:
        if layer.kind == "relu" and np.any(np.abs(prev) < MARGIN):
            return False
        if layer.kind == "maxpool2d":
            k, s = layer.spec["pool"], layer.spec["stride"]
            oh, ow, _ = layer.out_shape
            win = np.sort(_windows(_pad(prev, layer, -np.inf), k, s, oh, ow).reshape(*rec[layer.name].shape, k * k), -1)
            gap = win[..., -1] - win[..., -2]
            if np.any((gap < MARGIN) & (gap > 0)):
                return False
        prev = rec[layer.name]
    return True


def _batch(b: NumpyBackend) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    masks = _masks(b.model, BATCH)
    for seed in range(200):
        rng = np.random.default_rng(seed)
        x = rng.normal(0.0, 1.0, (BATCH, *b.model.input_shape))
        if _smooth(b, x, masks):
            return x, rng.integers(0, b.model.num_classes, BATCH), masks
    raise AssertionError(f"{b.model.name}: no batch away from the kinks in 200 draws")


def worst_relative_errors(b: NumpyBackend) -> dict[str, float]:
    """Per trainable parameter: the central-difference check's relative error."""
    x, y, masks = _batch(b)
    _, grads = b.gradients(x, y, masks)
    rng = np.random.default_rng(0)
    out = {}
    for name, g in grads.items():
        if g.size <= SAMPLE:
            coords = list(np.ndindex(g.shape))
        else:
            coords = [np.unravel_index(int(np.argmax(np.abs(g))), g.shape)]
            coords += [tuple(int(rng.integers(0, s)) for s in g.shape) for _ in range(SAMPLE)]
        fd = []
        for c in coords:
            old = b.p[name][c]
            b.p[name][c] = old + H
            up, _ = b.gradients(x, y, masks)
            b.p[name][c] = old - H
            down, _ = b.gradients(x, y, masks)
            b.p[name][c] = old
            fd.append((up - down) / (2 * H))
        an = np.array([g[c] for c in coords])
        out[name] = float(np.max(np.abs(np.array(fd) - an)) / max(float(np.max(np.abs(an))), 1e-300))
    return out


# one model per layer kind: a convolution before it (whose kernel gradient carries the layer's input gradient
# back) and a dense head; spatial kinds on an odd 5x5 map so 'same' windows overhang and 'valid' ones floor
SPATIAL = {
    "conv2d_same_s1": {"type": "conv2d", "filters": 3, "kernel": 3, "padding": "same"},
    "conv2d_same_s2_asymmetric": {"type": "conv2d", "filters": 3, "kernel": 3, "stride": 2, "padding": "same"},
    "conv2d_valid_s2_floor": {"type": "conv2d", "filters": 3, "kernel": 2, "stride": 2, "use_bias": False},
    "maxpool2d_valid_floor": {"type": "maxpool2d", "pool": 2},
    "maxpool2d_same_s1": {"type": "maxpool2d", "pool": 3, "stride": 1, "padding": "same"},
    "maxpool2d_same_s2_asymmetric": {"type": "maxpool2d", "pool": 2, "stride": 2, "padding": "same"},
    "avgpool2d_valid_floor": {"type": "avgpool2d", "pool": 2},
    "avgpool2d_same_s1": {"type": "avgpool2d", "pool": 2, "stride": 1, "padding": "same"},
    "avgpool2d_same_s2_asymmetric": {"type": "avgpool2d", "pool": 3, "stride": 2, "padding": "same"},
    "batchnorm2d": {"type": "batchnorm2d", "momentum": 0.1, "eps": 1e-5},
    "relu_spatial": {"type": "relu"},
    "global_avgpool2d": {"type": "global_avgpool2d"},
}
FLAT = {
    "dense": {"type": "dense", "units": 7},
    "relu": {"type": "relu"},
    "tanh": {"type": "tanh"},
    "dropout": {"type": "dropout", "rate": 0.3},
}


def layer_model(case: str) -> ModelSpec:
    # no bias before a BatchNorm: the normalisation removes it, its true gradient is 0 and a relative error meaningless
    pre = {"type": "conv2d", "name": "pre", "filters": 2, "kernel": 3, "padding": "same", "use_bias": case != "batchnorm2d"}
    if case in SPATIAL:
        layers = [pre, {**SPATIAL[case], "name": "under_test"}]
        if case != "global_avgpool2d":
            layers.append({"type": "flatten"})
    else:
        layers = [pre, {"type": "flatten"}, {"type": "dense", "name": "mid", "units": 6},
                  {**FLAT[case], "name": "under_test"}]
    layers.append({"type": "dense", "name": "head", "units": 4})
    return build_model({"name": f"alone_{case}", "input_shape": [5, 5, 2], "num_classes": 4, "layers": layers})


@pytest.mark.parametrize("case", [*SPATIAL, *FLAT])
def test_every_layer_kind_alone(case):
    errs = worst_relative_errors(_backend(layer_model(case)))
    assert "pre.kernel" in errs                      # the layer's input gradient, carried to the first kernel
    bad = {k: v for k, v in errs.items() if v >= TOL}
    assert not bad, f"{case}: relative error >= {TOL}: {bad}"


@pytest.mark.parametrize("model", model_names())
def test_every_builtin_model(model):
    m = load_model(model)
    errs = worst_relative_errors(_backend(m))
    assert set(errs) == {q.name for q in m.trainable}
    bad = {k: v for k, v in errs.items() if v >= TOL}
    assert not bad, f"{model}: relative error >= {TOL}: {bad}"


def test_loss_gradient_and_value():
    """Softmax cross-entropy from logits: the value against the textbook formula, the gradient against
    finite differences, and a large logit that would overflow a naive exp."""
    rng = np.random.default_rng(3)
    z = rng.normal(0.0, 3.0, (5, 4))
    z[0, 1] = 800.0
    y = np.array([1, 0, 3, 2, 2])
    loss, dz, pred = softmax_xent(z, y)
    z0 = z[0] - 800.0
    naive = (np.log(np.sum(np.exp(z0))) - z0[1] + sum(-z[i, y[i]] + np.log(np.sum(np.exp(z[i]))) for i in range(1, 5))) / 5
    assert abs(loss - naive) < 1e-12
    assert list(pred) == list(z.argmax(1))
    fd = np.zeros_like(z)
    for c in np.ndindex(z.shape):
        zp, zm = z.copy(), z.copy()
        zp[c] += H
        zm[c] -= H
        fd[c] = (softmax_xent(zp, y)[0] - softmax_xent(zm, y)[0]) / (2 * H)
    assert np.max(np.abs(fd - dz)) / np.max(np.abs(dz)) < TOL


def test_the_check_fails_for_a_wrong_backward(monkeypatch):
    """The check can fail: a relu backward that lets negative inputs through is caught."""
    import wrappers.numpy.layers as L
    orig = L._one_backward

    def leaky(layer, p, cache, dy):
        if layer.kind == "relu":
            return dy, {}
        return orig(layer, p, cache, dy)
    monkeypatch.setattr(L, "_one_backward", leaky)
    errs = worst_relative_errors(_backend(load_model("cnn2d_2conv_2fc")))
    assert max(errs.values()) > 1e-2


# ----------------------------------------------------------------------------- numpy float64 vs torch float64
PROBE_TOL = 1e-10
EXTRA_CASES = {
    "momentum_l2_warmup": HParams(optimizer="momentum", lr=0.1, weight_decay=5e-3, schedule="warmup", warmup_steps=2,
                                  steps=3, eval_every=1, checkpoint_every=1),
    "nesterov_l2_cosine": HParams(optimizer="nesterov", lr=0.1, weight_decay=5e-3, schedule="cosine", steps=3,
                                  eval_every=1, checkpoint_every=1),
    "adam_l2_step": HParams(optimizer="adam", lr=1e-3, weight_decay=1e-2, schedule="step", step_size=1, gamma=0.5,
                            steps=3, eval_every=1, checkpoint_every=1),
}


def probe_agreement(model: str, root, extra: bool = False) -> dict[str, tuple[float, str]]:
    """Per optimizer case: (worst relative error over every probe key, its key), numpy vs torch in float64.
    The standard cases (their torch float64 probes shared with test_probes.py), or EXTRA_CASES."""
    cases = EXTRA_CASES if extra else None
    ref = probes_for("torch", model, root, cases=cases, dtype="float64")
    got = probes_for("numpy", model, root, cases=cases, dtype="float64")
    out = {}
    for case in got:
        a, b = got[case].arrays, ref[case].arrays
        assert set(a) == set(b), f"{model} {case}: keys differ: {sorted(set(a) ^ set(b))[:6]}"
        worst = (0.0, "")
        for k in b:
            x, y = np.asarray(a[k], np.float64), np.asarray(b[k], np.float64)
            assert x.shape == y.shape, f"{model} {case} {k}: shape {x.shape} vs {y.shape}"
            rel = float(np.max(np.abs(x - y))) / max(float(np.max(np.abs(y))), 1e-300) if y.size else 0.0
            worst = max(worst, (rel, k))
        out[case] = worst
    return out


@pytest.mark.parametrize("model", [pytest.param(m, marks=pytest.mark.slow) if m == "cnn2d_3conv_3fc" else m
                                   for m in model_names()])
def test_step0_probes_numpy_float64_match_torch_float64(model, results_root):
    """Forward (training and inference), loss, gradients, three updates, buffers and optimizer state:
    sgd, sgd + L2, momentum and Nesterov with a step schedule, adam, adamw."""
    for case, (rel, key) in probe_agreement(model, results_root).items():
        assert rel < PROBE_TOL, f"{model} {case}: {key} relative error {rel:.3g} >= {PROBE_TOL}"


@pytest.mark.slow
@pytest.mark.parametrize("model", model_names())
def test_step0_probes_with_weight_decay_and_schedules(model, results_root):
    """L2 with momentum, Nesterov and Adam under warmup, cosine and step schedules."""
    for case, (rel, key) in probe_agreement(model, results_root, extra=True).items():
        assert rel < PROBE_TOL, f"{model} {case}: {key} relative error {rel:.3g} >= {PROBE_TOL}"
