"""The numpy backend's hand-written backward against central finite differences in float64, for every
layer kind alone, every built-in model and the loss; then numpy's step-0 probes against torch float64's.

Finite differences are only exact where the loss is smooth: the batch is drawn (seed after seed) until
no relu/leaky_relu input lies within MARGIN of zero, no relu6 input within MARGIN of 0 or 6, and no max-pool window has two maxima within MARGIN of each
other, so a step of H cannot cross a kink. Exact ties are allowed: in these models they are the same
function of the parameters (dead relu zeros; 'same' average windows holding one live pixel, a/4 twice),
so either maximum has the same derivative. The
coordinates checked per parameter: its largest gradient entry and SAMPLE random ones (all of them for
small tensors). Relative error: max |fd - analytic| / max |analytic| over the checked coordinates.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from algorithms import data as D
from algorithms.optim import HParams
from algorithms.params import init_params
from algorithms.spec import INPUT, ModelSpec, build_model, load_model, model_names
from algorithms.contract import RunOptions
from wrappers.numpy.backend import NumpyBackend
from algorithms.layout import pad_hw, windows
from wrappers.numpy.layers import softmax_xent

from .conftest import probes_for

H = 1e-6          # central difference step: truncation ~H^2, rounding ~1e-16 / H, both well below TOL
TOL = 1e-6
MARGIN = 5e-5    # distance to the nearest kink: 50 H, more than a step of H moves any activation here
SAMPLE = 12
# the relative error's smallest denominator: a gradient below it on every checked coordinate is held to an
# absolute error of TOL * ZERO_SCALE = 1e-9 (central-difference rounding is ~1e-10). Needed for structurally
# zero gradients (~1e-17 of rounding: a BatchNorm beta before a linear map and another BatchNorm, MobileNet's
# projections), whose relative error would be meaningless
ZERO_SCALE = 1e-3
BATCH = 4


def numpy_float64_backend(model: ModelSpec, seed: int = 0) -> NumpyBackend:
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
    for layer in b.model.layers:
        prev = x if layer.inputs[0] == INPUT else rec[layer.inputs[0]]
        if layer.kind in ("relu", "leaky_relu", "relu6") and np.any(np.abs(prev) < MARGIN):
            return False
        if layer.kind == "relu6" and np.any(np.abs(prev - 6.0) < MARGIN):
            return False
        if layer.kind == "maxpool2d":
            k, s = layer.spec["pool"], layer.spec["stride"]
            oh, ow, _ = layer.out_shape
            win = np.sort(windows(pad_hw(prev, layer, -np.inf), k, s, oh, ow).reshape(*rec[layer.name].shape, k * k), -1)
            gap = win[..., -1] - win[..., -2]
            if np.any((gap < MARGIN) & (gap > 0)):
                return False
    return True


def _batch(b: NumpyBackend, draws: int = 200) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]] | None:
    masks = _masks(b.model, BATCH)
    for seed in range(draws):
        rng = np.random.default_rng(seed)
        x = rng.normal(0.0, 1.0, (BATCH, *b.model.input_shape))
        if _smooth(b, x, masks):
            return x, rng.integers(0, b.model.num_classes, BATCH), masks
    return None


def _kink_pattern(b: NumpyBackend, x: np.ndarray, masks: dict[str, np.ndarray]) -> bytes:
    """Which side of every kink each activation is on (relu-like signs, relu6's upper bound, max-pool argmax)."""
    rec = b.forward_layers(x, masks)
    parts = []
    for layer in b.model.layers:
        prev = x if layer.inputs[0] == INPUT else rec[layer.inputs[0]]
        if layer.kind in ("relu", "leaky_relu", "relu6"):
            parts.append(np.packbits(prev > 0).tobytes())
        if layer.kind == "relu6":
            parts.append(np.packbits(prev < 6).tobytes())
        if layer.kind == "maxpool2d":
            k, s = layer.spec["pool"], layer.spec["stride"]
            oh, ow, _ = layer.out_shape
            win = windows(pad_hw(prev, layer, -np.inf), k, s, oh, ow).reshape(*rec[layer.name].shape, k * k)
            parts.append(win.argmax(-1).tobytes())
    return b"".join(parts)


def worst_relative_errors(b: NumpyBackend) -> dict[str, float]:
    """Per trainable parameter: the central-difference check's relative error.

    On a batch away from every kink when one is found in 200 draws; otherwise (the 32x32 models: with ~1e5
    relu inputs per sample some always lie within MARGIN of zero) on the first batch, skipping the coordinates
    whose +-H step moves some activation across a kink (the pattern of signs and argmaxes changes), which is
    the exact condition for the central difference to be smooth; at most a quarter may be skipped."""
    found = _batch(b)
    exact_pattern = found is None
    if found is None:
        rng0 = np.random.default_rng(0)
        x = rng0.normal(0.0, 1.0, (BATCH, *b.model.input_shape))
        found = x, rng0.integers(0, b.model.num_classes, BATCH), _masks(b.model, BATCH)
    x, y, masks = found
    base = _kink_pattern(b, x, masks) if exact_pattern else b""
    _, grads = b.gradients(x, y, masks)
    rng = np.random.default_rng(0)
    out, skipped, total = {}, 0, 0
    for name, g in grads.items():
        if g.size <= SAMPLE:
            coords = list(np.ndindex(g.shape))
        else:
            coords = [np.unravel_index(int(np.argmax(np.abs(g))), g.shape)]
            coords += [tuple(int(rng.integers(0, s)) for s in g.shape) for _ in range(SAMPLE)]
        fd, kept = [], []
        for c in coords:
            old = b.p[name][c]
            b.p[name][c] = old + H
            up, _ = b.gradients(x, y, masks)
            crossed = exact_pattern and _kink_pattern(b, x, masks) != base
            b.p[name][c] = old - H
            down, _ = b.gradients(x, y, masks)
            crossed = crossed or (exact_pattern and _kink_pattern(b, x, masks) != base)
            b.p[name][c] = old
            total += 1
            if crossed:
                skipped += 1
                continue
            fd.append((up - down) / (2 * H))
            kept.append(c)
        if not kept:
            continue
        an = np.array([g[c] for c in kept])
        out[name] = float(np.max(np.abs(np.array(fd) - an)) / max(float(np.max(np.abs(an))), ZERO_SCALE))
    assert skipped <= total // 4, f"{b.model.name}: {skipped} of {total} coordinates cross a kink"
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
    # the graph spec's kinds (pre has 4 filters for the grouped ones)
    "conv2d_grouped": {"type": "conv2d", "filters": 6, "kernel": 3, "groups": 2, "padding": "same"},
    "conv2d_depthwise_multiplier2_s2": {"type": "conv2d", "filters": 8, "kernel": 3, "groups": 4, "stride": 2,
                                        "padding": "same"},
    "conv2d_dilated_same": {"type": "conv2d", "filters": 3, "kernel": 3, "dilation": 2, "padding": "same"},
    "conv2d_dilated_grouped_valid": {"type": "conv2d", "filters": 4, "kernel": 2, "dilation": 2, "groups": 2,
                                     "use_bias": False},
    "layernorm_spatial": {"type": "layernorm", "eps": 1e-6},
    "relu6_spatial": {"type": "relu6"},
    "add": {"type": "add", "inputs": ["pre", "pre2"]},
    "add_three": {"type": "add", "inputs": ["pre", "pre2", INPUT]},
    "concat": {"type": "concat", "inputs": ["pre2", "pre"]},
}
FLAT = {
    "dense": {"type": "dense", "units": 7},
    "relu": {"type": "relu"},
    "tanh": {"type": "tanh"},
    "dropout": {"type": "dropout", "rate": 0.3},
    "leaky_relu": {"type": "leaky_relu", "alpha": 0.2},
    "gelu_none": {"type": "gelu", "approximate": "none"},
    "gelu_tanh": {"type": "gelu", "approximate": "tanh"},
    "silu": {"type": "silu"},
    "sigmoid": {"type": "sigmoid"},
    "relu6": {"type": "relu6"},
    "layernorm": {"type": "layernorm", "eps": 1e-5},
}
GROUPED = {"conv2d_grouped", "conv2d_depthwise_multiplier2_s2", "conv2d_dilated_grouped_valid"}


def layer_model(case: str) -> ModelSpec:
    # no bias before a BatchNorm: the normalisation removes it, its true gradient is 0 and a relative error meaningless
    pre = {"type": "conv2d", "name": "pre", "filters": 4 if case in GROUPED else 2, "kernel": 3, "padding": "same",
           "use_bias": case != "batchnorm2d"}
    if case in SPATIAL:
        layers = [pre, {**SPATIAL[case], "name": "under_test"}]
        if "inputs" in SPATIAL[case]:   # a merge: a second branch from the input (a dilated 'same' conv)
            layers.insert(1, {"type": "conv2d", "name": "pre2", "filters": 2, "kernel": 2, "dilation": 2,
                              "padding": "same", "inputs": [INPUT]})
        if case != "global_avgpool2d":
            layers.append({"type": "flatten"})
    else:
        layers = [pre, {"type": "flatten"}, {"type": "dense", "name": "mid", "units": 6},
                  {**FLAT[case], "name": "under_test"}]
    layers.append({"type": "dense", "name": "head", "units": 4})
    return build_model({"name": f"alone_{case}", "input_shape": [5, 5, 2], "num_classes": 4, "layers": layers})


@pytest.mark.parametrize("case", [*SPATIAL, *FLAT])
def test_every_layer_kind_alone(case):
    errs = worst_relative_errors(numpy_float64_backend(layer_model(case)))
    assert "pre.kernel" in errs                      # the layer's input gradient, carried to the first kernel
    if "inputs" in SPATIAL.get(case, {}):
        assert "pre2.kernel" in errs                 # and to the other branch of the merge
    bad = {k: v for k, v in errs.items() if v >= TOL}
    assert not bad, f"{case}: relative error >= {TOL}: {bad}"


GRAPH_MODELS = ("resnet_tiny", "mobilenet_tiny", "convnext_tiny")


@pytest.mark.parametrize("model", [pytest.param(m, marks=pytest.mark.slow) if m in GRAPH_MODELS else m
                                   for m in model_names()])
def test_every_builtin_model(model):
    m = load_model(model)
    errs = worst_relative_errors(numpy_float64_backend(m))
    assert len(errs) >= len(m.trainable) - 1 and set(errs) <= {q.name for q in m.trainable}
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
    errs = worst_relative_errors(numpy_float64_backend(load_model("cnn2d_2conv_2fc")))
    assert max(errs.values()) > 1e-2


# ----------------------------------------------------------------------------- numpy float64 vs torch float64
PROBE_TOL = 1e-10
FLOAT64_FLOOR = 1e-4   # a tensor below it everywhere is held to PROBE_TOL * FLOAT64_FLOOR = 1e-14 absolute
# Adam on the graph models: gradients of ~1e-6 (MobileNet's expand BatchNorm gammas) carry float64 rounding of
# ~1e-10 relative, which Adam's g / sqrt(v) passes on whole, and the rounding noise of structurally zero gradients
# moves the next BatchNorm's running mean by ~1e-12 (true value 0). Measured worst: 3.3e-8 (mobilenet_tiny,
# adamw, buffer2/head_bn.running_mean, 3.3e-12 absolute over the 1e-4 floor)
GRAPH_ADAM_TOL = 1e-7
EXTRA_CASES = {
    "momentum_l2_warmup": HParams(optimizer="momentum", lr=0.1, weight_decay=5e-3, schedule="warmup", warmup_steps=2,
                                  steps=3, eval_every=1, checkpoint_every=1),
    "nesterov_l2_cosine": HParams(optimizer="nesterov", lr=0.1, weight_decay=5e-3, schedule="cosine", steps=3,
                                  eval_every=1, checkpoint_every=1),
    "adam_l2_step": HParams(optimizer="adam", lr=1e-3, weight_decay=1e-2, schedule="step", step_size=1, gamma=0.5,
                            steps=3, eval_every=1, checkpoint_every=1),
}


def graph_cases() -> dict[str, HParams]:
    """Three of the standard cases at batch 16, for the fast checks of the 32x32x3 graph models."""
    from harness.probes import standard_cases
    return {n: hp.with_(batch_size=16) for n, hp in standard_cases().items() if n in ("sgd_l2", "nesterov_step", "adamw")}


def probe_agreement(model: str, root, extra: bool = False, cases: dict | None = None) -> dict[str, tuple[float, str]]:
    """Per optimizer case: (worst relative error over every probe key, its key), numpy vs torch in float64.
    The standard cases (their torch float64 probes shared with test_probes.py), EXTRA_CASES, or `cases`."""
    cases = EXTRA_CASES if extra else cases
    ref = probes_for("torch", model, root, cases=cases, dtype="float64")
    got = probes_for("numpy", model, root, cases=cases, dtype="float64")
    out = {}
    for case in got:
        a, b = got[case].arrays, ref[case].arrays
        assert set(a) == set(b), f"{model} {case}: keys differ: {sorted(set(a) ^ set(b))[:6]}"
        # Adam divides by sqrt(v) + eps: a structurally zero gradient (|g| ~1e-17, rounding) gets an update of
        # lr * g / (|g| + eps), rounding amplified ~lr/eps = 1e5-fold. Its gradient is checked (held to 1e-14
        # absolute); its Adam update and moments are not comparable and skipped
        adam = "opt0/step" in b
        rounding_only = {k.split("/", 1)[1] for k in b if k.startswith("grad/") and float(np.max(np.abs(b[k]))) < 1e-12}
        worst = (0.0, "")
        for k in b:
            if adam and re.match(r"(update|opt)\d+/", k) and k.split("/")[-1] in rounding_only:
                continue
            x, y = np.asarray(a[k], np.float64), np.asarray(b[k], np.float64)
            assert x.shape == y.shape, f"{model} {case} {k}: shape {x.shape} vs {y.shape}"
            # a floor on the scale, as harness/probes.py's ABS_FLOOR: structurally zero tensors are ~1e-17 of rounding
            # and their "relative" error meaningless (MobileNet: a BatchNorm's beta before a linear map and another
            # BatchNorm; the running mean of a bias-free 1x1 conv of a sum of BatchNorm outputs)
            rel = float(np.max(np.abs(x - y))) / max(float(np.max(np.abs(y))), FLOAT64_FLOOR) if y.size else 0.0
            worst = max(worst, (rel, k))
        out[case] = worst
    return out


@pytest.mark.parametrize("model", [pytest.param(m, marks=pytest.mark.slow) if m == "cnn2d_3conv_3fc" or m in GRAPH_MODELS
                                   else m for m in model_names()])
def test_step0_probes_numpy_float64_match_torch_float64(model, results_root):
    """Forward (training and inference), loss, gradients, three updates, buffers and optimizer state:
    sgd, sgd + L2, momentum and Nesterov with a step schedule, adam, adamw."""
    for case, (rel, key) in probe_agreement(model, results_root).items():
        tol = GRAPH_ADAM_TOL if model in GRAPH_MODELS and case.startswith("adam") else PROBE_TOL
        assert rel < tol, f"{model} {case}: {key} relative error {rel:.3g} >= {tol}"


# resnet_tiny in `make test` (add, concat-free residual, BatchNorm, projection); the other two with make test-slow
@pytest.mark.parametrize("model", [m if m == "resnet_tiny" else pytest.param(m, marks=pytest.mark.slow)
                                   for m in GRAPH_MODELS])
def test_step0_probes_graph_models_numpy_float64_match_torch_float64(model, results_root):
    """The 32x32x3 graph models (residual adds, grouped/depthwise convolutions, LayerNorm, GELU, ReLU6) on
    digits32 at batch 16: L2 SGD, Nesterov with a step schedule, AdamW (all six cases: the slow test above)."""
    for case, (rel, key) in probe_agreement(model, results_root, cases=graph_cases()).items():
        tol = GRAPH_ADAM_TOL if case.startswith("adam") else PROBE_TOL
        assert rel < tol, f"{model} {case}: {key} relative error {rel:.3g} >= {tol}"


@pytest.mark.slow
@pytest.mark.parametrize("model", model_names())
def test_step0_probes_with_weight_decay_and_schedules(model, results_root):
    """L2 with momentum, Nesterov and Adam under warmup, cosine and step schedules."""
    for case, (rel, key) in probe_agreement(model, results_root, extra=True).items():
        assert rel < PROBE_TOL, f"{model} {case}: {key} relative error {rel:.3g} >= {PROBE_TOL}"
