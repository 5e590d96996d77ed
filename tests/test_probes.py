"""Step-0 agreement with the torch reference: forward per layer, gradient per parameter, three
optimizer updates, buffers and optimizer state, for every model, optimizer and backend.

Tolerance: float32 relative error 1e-4, or three times the float32 torch run's own error against
the float64 torch run where that is larger (ill-conditioned probes such as Adam's first update).
Keys that a declared semantic difference may move are left to the backend's own test, which checks
that the difference is exactly the declared formula."""
from __future__ import annotations

import numpy as np
import pytest

from algorithms.spec import load_model, model_names
from harness.probes import compare, first_failure

from .conftest import ALL_BACKENDS, INFO, probes_for

OTHERS = [b for b in ALL_BACKENDS if b != "torch"]
# cnn2d_3conv_3fc adds no layer kind, padding or pooling case to cnn2d_2conv_2fc and cnn2d_hard: its
# probes run with `make test-slow`, keeping `make test` inside CI's 15 minutes on 2 cores
# The 32x32x3 graph models: all six cases at batch 64 are slow; the fast test runs three at batch 16
GRAPH_MODELS = ("resnet_tiny", "mobilenet_tiny", "convnext_tiny")
MODELS = [pytest.param(m, marks=pytest.mark.slow) if m == "cnn2d_3conv_3fc" or m in GRAPH_MODELS else m
          for m in model_names()]
# cnn2d_hard's layers (BatchNorm, 'same' padding, dropout, global pooling) under two cases in `make test`: L2 coupled
# into the gradient and Adam's decoupled decay, both on the BatchNorm parameters too; every optimizer case of
# every layer is the slow set's; cnn2d_2conv_2fc takes the other four (plain SGD, momentum and Nesterov under a
# halving step schedule, Adam), so that make test checks each backend's lowering of all six optimizer cases once
FAST_CASES = {"cnn2d_hard": ("sgd_l2", "adamw"), "cnn2d_2conv_2fc": ("sgd", "momentum_step", "nesterov_step", "adam")}


def lowers(backend: str, model: str) -> bool:
    """Whether the backend declares every layer kind the model needs; the harness refuses it otherwise
    (checked here), and the comparison is then not made: a declared gap, listed by `pytest -rs`."""
    need = load_model(model).required_features()
    missing = sorted(need - set(INFO[backend].get("layer_kinds", ())))
    if not missing:
        return True
    from harness import runner
    from harness.errors import CannotLower
    with pytest.raises(CannotLower, match=f"{backend}: cannot lower layer kind"):
        runner.check_lowers(backend, load_model(model))
    pytest.skip(f"{backend} does not lower {', '.join(missing)} (declared in its Entry; the harness refuses {model})")


KINK_MARGIN = 2e-6    # ~5x float32's absolute forward error on these models (3e-7 to 1e-6 of the scale)


def kink_free_seed(model: str, batch: int = 16, margin: float = KINK_MARGIN, tries: int = 60) -> int:
    """The first run seed whose step-0 batch (digits32) puts every relu/relu6 input at least `margin` from a kink
    in the float64 forward (numpy). Otherwise one input within float32 rounding of zero may fall on the other side
    in one framework: measured on resnet_tiny, seed 0: one block1_out input flipped in jax float32 and block1's
    gradients moved 0.5% (jax float64 agrees with torch float64 to 1e-14 on the same batch). A property of float32
    at a kink, not of the lowering; the harness's localization meets the same (reported, not solved here)."""
    import numpy as np
    from algorithms import data as D
    from algorithms.optim import HParams
    from algorithms.params import init_params
    from algorithms.spec import INPUT
    from algorithms.contract import RunOptions
    from wrappers.numpy.backend import NumpyBackend
    m = load_model(model)
    ds = D.digits32()
    b = NumpyBackend(m, HParams(), RunOptions(dtype="float64"))
    b.load_params(init_params(m, HParams().init_seed))
    for seed in range(tries):
        x = ds.x_train[D.batch_order(len(ds.x_train), batch, 1, seed)[0]].astype(np.float64)
        rec = b.forward_layers(x, {})
        gaps = [np.abs(x if l.inputs[0] == INPUT else rec[l.inputs[0]]) for l in m.layers if l.kind in ("relu", "relu6")]
        gaps += [np.abs(rec[l.inputs[0]] - 6.0) for l in m.layers if l.kind == "relu6"]
        if not gaps or min(float(g.min()) for g in gaps) >= margin:
            return seed
    raise AssertionError(f"{model}: no batch of {batch} with every relu input {margin} from a kink in {tries} seeds")


def graph_cases(model: str) -> dict:
    """Three of the standard cases at batch 16, on a batch away from the relu kinks (kink_free_seed)."""
    from harness.probes import standard_cases
    seed = kink_free_seed(model)
    return {n: hp.with_(batch_size=16, seed=seed) for n, hp in standard_cases().items()
            if n in ("sgd_l2", "nesterov_step", "adamw")}


# Known float32 failures on the graph models, all Adam's first update (g / sqrt(v) of tiny gradients) over
# harness.probes' tolerance rule; the lowering is exact in float64 (tests/test_graph_backends.py, 1e-14)
GRAPH_FLOAT32_KNOWN = {
    ("jax", "mobilenet_tiny"): "adamw update0/ir1_expand_bn.gamma: rel 0.0419 vs tol 0.0398 (3x torch float32's own "
                               "error; gradients ~1e-6)",
    ("numpy", "resnet_tiny"): "adamw update0/block3_conv2.kernel: rel 1.08e-4 vs tol 1e-4",
    ("numpy", "mobilenet_tiny"): "adamw update0/ir1_expand_bn.gamma: rel 0.126 vs tol 0.0398 (gradients ~1e-6)",
}


@pytest.mark.slow
@pytest.mark.parametrize("model", GRAPH_MODELS)
@pytest.mark.parametrize("backend", OTHERS)
def test_step0_probes_graph_models_match_torch(backend, model, results_root, request):
    """Residual adds, grouped/depthwise convolutions, LayerNorm, GELU, ReLU6 on digits32, batch 16: step 0 (the
    forward, the gradients, the first update); the later updates start from parameters the first one moved, whose
    relu inputs are not checked for kinks. Slow: jax compiles three cases of each model (90-190 s per model on the
    loaded 2-core machine)."""
    if (backend, model) in GRAPH_FLOAT32_KNOWN:
        request.applymarker(pytest.mark.xfail(strict=True, reason=GRAPH_FLOAT32_KNOWN[(backend, model)]))
    lowers(backend, model)
    _check(backend, model, results_root, graph_cases(model), steps=(0,))


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("backend", OTHERS)
def test_step0_probes_match_torch(backend, model, results_root):
    lowers(backend, model)
    _check(backend, model, results_root, _cases(FAST_CASES.get(model)))


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(FAST_CASES))
@pytest.mark.parametrize("backend", OTHERS)
def test_step0_probes_match_torch_every_case(backend, model, results_root):
    lowers(backend, model)
    _check(backend, model, results_root, None)


def _cases(names: tuple[str, ...] | None) -> dict | None:
    from harness.probes import standard_cases
    return None if names is None else {n: hp for n, hp in standard_cases().items() if n in names}


def _check(backend: str, model: str, results_root, cases: dict | None, steps: tuple[int, ...] | None = None) -> None:
    from harness.probes import kind_of
    ref = probes_for("torch", model, results_root, cases=cases)
    ref64 = probes_for("torch", model, results_root, cases=cases, dtype="float64")
    got = probes_for(backend, model, results_root, cases=cases)
    for case, res in got.items():
        keys = [k for k in res.undeclared_keys() if k in ref[case].arrays]
        if steps is not None:
            keys = [k for k in keys if kind_of(k)[1] in steps]
            # (the graph models) a tensor that is zero in exact arithmetic (float64 below 1e-12 everywhere: MobileNet's
            # projection BatchNorm beta gradients, the running mean of a bias-free 1x1 conv of a sum of BatchNorm
            # outputs) is float32 rounding in both runs (1e-8..1e-7, over harness.probes' floor 1e-6): not
            # comparable, and neither are the Adam updates and moments of such a gradient
            ref_arrays = ref64[case].arrays
            noise = {k for k, v in ref_arrays.items() if np.size(v) and float(np.max(np.abs(v))) < 1e-12}
            zero_grads = {k.split("/", 1)[1] for k in noise if k.startswith("grad/")}
            keys = [k for k in keys if k not in noise
                    and not (k.startswith(("update", "opt")) and k.split("/")[-1] in zero_grads)]
        assert any(k.startswith("forward/") for k in keys) or res.declared, f"{case}: nothing compared"
        assert any(k.startswith("eval/") for k in keys), f"{case}: no inference-mode probe compared"
        diffs = compare(res.arrays, ref[case].arrays, keys=keys, ref64=ref64[case].arrays)
        bad = first_failure(diffs)
        assert bad is None, f"{backend} {model} {case}: {bad} (declared: {res.declared})"
        # and every key of the reference is probed
        missing = set(ref[case].arrays) - set(res.arrays)
        assert not missing, f"{backend} {model} {case}: probes missing {sorted(missing)[:5]}"


def test_a_tensor_zero_in_exact_arithmetic_is_held_at_its_kinds_scale():
    """The gradient of a conv bias right before a BatchNorm is zero in exact arithmetic: both float32 values
    are cancellation noise (here the candidate's 5x the reference's), compared at the scale of the largest
    gradient, not at their own 1e-6 floor; the same tensor off by 1e-3 of that scale is still a disagreement."""
    from harness.probes import compare
    rng = np.random.default_rng(0)
    w64 = rng.normal(size=100) * 1e-2
    ref64 = {"grad/conv.kernel": w64, "grad/conv.bias": rng.normal(size=8) * 1e-17}
    ref32 = {"grad/conv.kernel": w64.astype(np.float32).astype(np.float64),
             "grad/conv.bias": rng.normal(size=8) * 1e-7}
    cand = dict(ref32, **{"grad/conv.bias": rng.normal(size=8) * 5e-7})
    got = {d.key: d for d in compare(cand, ref32, ref64=ref64)}
    assert got["grad/conv.bias"].ok and got["grad/conv.bias"].rel < 1e-4
    bad = dict(cand, **{"grad/conv.bias": cand["grad/conv.bias"] + 1e-3 * np.abs(w64).max()})
    assert not {d.key: d for d in compare(bad, ref32, ref64=ref64)}["grad/conv.bias"].ok
    # a small but real value (the float64 value far above the float32 error) keeps its own scale
    real64 = dict(ref64, **{"grad/conv.bias": np.full(8, 1e-5)})
    real32 = dict(ref32, **{"grad/conv.bias": np.full(8, 1e-5) * (1 + 1e-7)})
    off = dict(real32, **{"grad/conv.bias": np.full(8, 1e-5) * (1 + 1e-2)})
    assert not {d.key: d for d in compare(off, real32, ref64=real64)}["grad/conv.bias"].ok


def test_a_running_mean_of_float32_noise_is_held_at_its_kinds_scale():
    """mobilenet_tiny (2026-12-01): an expand BatchNorm's batch means are zero in exact arithmetic, so its
    running mean holds only the float32 noise of the reference's history (~1e-7, the float64 step keeps it)
    where the other running statistics are ~1: tensorflow's new noise (4e-8) read as 3.5x a tolerance of 3x
    torch's (4e-9) on the tensor's own 1e-6 floor, BUG. Below ZERO_ULPS ULPs of its kind it is held at the
    kind's scale; the same tensor off by 1e-3 of that scale still disagrees."""
    from harness.probes import ZERO_ULPS, EPS32, compare
    rng = np.random.default_rng(1)
    history = rng.normal(size=16) * 1e-7                     # the reference's accumulated float32 noise
    ref64 = {"buffer0/bn1.running_var": 1.0 + rng.random(16), "buffer0/ir_bn.running_mean": history}
    ref32 = {"buffer0/bn1.running_var": ref64["buffer0/bn1.running_var"].astype(np.float32).astype(np.float64),
             "buffer0/ir_bn.running_mean": history + rng.normal(size=16) * 4e-9}
    cand = dict(ref32, **{"buffer0/ir_bn.running_mean": history + rng.normal(size=16) * 4e-8})
    assert np.abs(history).max() <= ZERO_ULPS * EPS32 * 2.0
    assert np.abs(history).max() > np.sqrt(np.mean((ref32["buffer0/ir_bn.running_mean"] - history) ** 2))
    got = {d.key: d for d in compare(cand, ref32, rel_tol=3e-5, ref64=ref64)}
    assert got["buffer0/ir_bn.running_mean"].ok
    bad = dict(cand, **{"buffer0/ir_bn.running_mean": history + 1e-3})
    assert not {d.key: d for d in compare(bad, ref32, rel_tol=3e-5, ref64=ref64)}["buffer0/ir_bn.running_mean"].ok


def test_a_running_mean_is_held_on_the_spread_of_what_its_batch_means_sum():
    """mobilenet_tiny Adam (2026-12-02): an expand BatchNorm's inputs nearly cancel per channel (a 1x1 convolution
    of a BatchNorm's zero-mean output), so its batch mean is ~1e-3 of the values' spread; the previous BatchNorm's
    mean, summed in TensorFlow's order instead of torch's pairwise one, shifts every value of a channel by
    ~1e-6 of that spread, and the running mean with it: measured on the tensor's own max|running_mean| that read
    as 1.3x a tolerance calibrated on torch's own error, a false BUG. On the channel's spread
    sqrt(running_var + running_mean^2) it is rounding; a running mean off by 1e-3 of the spread still disagrees,
    and without the running variance beside it the key keeps the tensor's own scale."""
    from harness.probes import compare, running_mean_scale
    rng = np.random.default_rng(3)
    c, momentum = 16, 0.1
    batch_mean = rng.normal(size=c) * 1e-3                       # in units of the channel's spread (~1)
    var64 = 1.0 + 0.1 * rng.random(c)
    ref64 = {"buffer0/bn.running_mean": momentum * batch_mean, "buffer0/bn.running_var": var64}
    ref32 = {"buffer0/bn.running_mean": momentum * (batch_mean + rng.normal(size=c) * 1e-8),
             "buffer0/bn.running_var": var64.astype(np.float32).astype(np.float64)}
    cand = dict(ref32, **{"buffer0/bn.running_mean": momentum * (batch_mean + rng.normal(size=c) * 1e-6)})
    scale = running_mean_scale("buffer0/bn.running_mean", ref64)
    assert scale is not None and scale.shape == (c,) and np.all(scale >= 1.0)
    assert running_mean_scale("buffer0/bn.running_var", ref64) is None
    assert running_mean_scale("forward/bn.running_mean", ref64) is None
    got = {d.key: d for d in compare(cand, ref32, ref64=ref64)}
    assert got["buffer0/bn.running_mean"].ok and got["buffer0/bn.running_mean"].rel < 1e-6
    # the same deviation on the tensor's own scale (no running variance beside it) is far over its tolerance
    alone = {"buffer0/bn.running_mean": ref64["buffer0/bn.running_mean"]}
    strict = {d.key: d for d in compare({k: cand[k] for k in alone}, {k: ref32[k] for k in alone}, ref64=alone)}
    assert not strict["buffer0/bn.running_mean"].ok
    bad = dict(cand, **{"buffer0/bn.running_mean": cand["buffer0/bn.running_mean"] + 1e-3 * np.sqrt(var64)})
    off = {d.key: d for d in compare(bad, ref32, ref64=ref64)}["buffer0/bn.running_mean"]
    assert not off.ok and off.rel > 10 * off.tol


def test_continuous_kinds_have_the_lower_floor_and_derivatives_keep_theirs():
    """A GELU tanh approximation moves its layer's output by 5.1e-5 RMS-relative (convnext_tiny, measured): under
    REL_TOL, so with one floor for every kind the layer agreed and the first key over it was a gradient one
    layer early. An activation is continuous in the parameters (rounding cannot flip it the way it flips a
    ReLU's derivative), so forward, loss, buffer and eval keys are held to CONTINUOUS_TOL; gradients, updates
    and optimizer state keep REL_TOL's room."""
    from harness.probes import CONTINUOUS_TOL, REL_TOL, compare
    rng = np.random.default_rng(2)
    z = rng.normal(size=4096)
    ref32 = z.astype(np.float32).astype(np.float64)
    off = z + 5.1e-5 * np.abs(z).max() * rng.choice([-1.0, 1.0], size=z.size)   # RMS-relative 5.1e-5
    keys = ("forward/stage1_gelu", "eval/stage1_gelu", "buffer0/bn.running_var", "grad/ln.gamma", "update0/ln.gamma",
            "opt0/exp_avg/ln.gamma")
    ref64 = {k: z for k in keys}
    got = {d.key: d for d in compare({k: off for k in keys}, {k: ref32 for k in keys}, ref64=ref64)}
    assert CONTINUOUS_TOL < 5.1e-5 < REL_TOL
    assert [k for k in keys if not got[k].ok] == ["forward/stage1_gelu", "eval/stage1_gelu", "buffer0/bn.running_var"]
    assert got["forward/stage1_gelu"].tol == CONTINUOUS_TOL and got["grad/ln.gamma"].tol == REL_TOL
    # without a float64 reference (a candidate on the reference's own code path: max-abs rule) nothing changes
    plain = {d.key: d for d in compare({k: off for k in keys}, {k: z for k in keys})}
    assert all(d.tol == REL_TOL for d in plain.values())
