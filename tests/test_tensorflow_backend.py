"""The native TensorFlow backend on its own: tf.function, eager and XLA steps agree and the step is
traced once under a schedule; state round trips are bit exact and replay from a checkpoint equals
continuing; probes leave state alone; TF's training kernels (ResourceApplyAdam with the adjusted
epsilon, ResourceApplyMomentum, ResourceApplyGradientDescent) compute algorithms.optim's reference
update; the layer semantics the spec fixes; every catalogued fault does what torch's does; and the
two lowering faults make the step-0 probe disagree with torch where they should.

Runs in this process: TensorFlow is imported after the registry's environment is set, and the
backend pins its thread pools before the first op.

The checks every backend passes alike run here as TestTensorflowContract (tests/backend_contract.py).
"""
from __future__ import annotations

import math
import sys

import numpy as np
import pytest

from algorithms.optim import HParams, reference_init, reference_update
from algorithms.params import init_params
from algorithms.spec import build_model, load_model

if "tensorflow" not in sys.modules:   # the backend's own environment, as its worker process would set it
    from algorithms.contract import RunOptions
    from wrappers.__main__ import set_backend_env
    from wrappers.registry import REGISTRY
    set_backend_env(REGISTRY["tensorflow"], RunOptions(threads=1))
tf = pytest.importorskip("tensorflow")

from algorithms.contract import RunOptions  # noqa: E402
from wrappers.tensorflow.backend import TensorflowBackend  # noqa: E402
from wrappers.worker import masks_for  # noqa: E402

from .backend_contract import HP, BackendContract, assert_same, batch, run_steps  # noqa: E402


def make(model, hp, params=None, **opts) -> TensorflowBackend:
    b = TensorflowBackend(model, hp, RunOptions(**opts))
    b.load_params(init_params(model, 0) if params is None else params)
    return b


class TestTensorflowContract(BackendContract):
    """tests/backend_contract.py's checks, on this backend."""
    backend = "tensorflow"
    opt_state_empty_before_first_step = True      # as torch
    joint_program = True                          # tf.function: the recorded program is another one

    def make(self, model, hp, params=None, **opts):
        return make(model, hp, params, **opts)

    def stored(self, b, name):
        return b.v[name].numpy()


# --------------------------------------------------------------------------- the class that runs a job
def test_the_parallel_class_is_chosen_before_construction():
    """--devices or --hosts other than 1 run ParallelTensorflowBackend, named by for_options where the worker
    constructs the backend; the single-device class constructed for such a job refuses it."""
    from wrappers.base import UnsupportedError
    from wrappers.tensorflow.backend import ParallelTensorflowBackend
    from wrappers.worker import backend_class
    assert backend_class(TensorflowBackend, RunOptions()) is TensorflowBackend
    for opts in (RunOptions(devices=2), RunOptions(extra={"hosts": 2})):
        assert backend_class(TensorflowBackend, opts) is ParallelTensorflowBackend
    assert "__new__" not in vars(TensorflowBackend)
    with pytest.raises(UnsupportedError, match="needs the parallel backend"):
        TensorflowBackend(load_model("cnn2d_2conv_2fc"), HParams(steps=1), RunOptions(devices=2))


# --------------------------------------------------------------------------- compilation
@pytest.mark.parametrize("case", ["momentum_step", "adamw"])
def test_tf_function_eager_and_xla_steps_agree(case):
    m = load_model("cnn2d_hard")      # BatchNorm, stride-2 'same', both poolings, harness dropout
    x, y = batch(m)
    runs = {name: make(m, HP[case], **o) for name, o in
            (("function", {}), ("eager", {"jit": False}), ("xla", {"extra": {"xla": True}}))}
    stats = {name: run_steps(b, x, y, 3) for name, b in runs.items()}
    assert runs["xla"].mode == "xla" and runs["eager"].mode == "eager" and runs["function"].mode == "tf.function"
    for other in ("eager", "xla"):
        assert_same(runs[other].export_params(), runs["function"].export_params(), exact=False, rtol=1e-5)
        assert_same(runs[other].export_opt_state(), runs["function"].export_opt_state(), exact=False, rtol=1e-4)
        for a, b in zip(stats[other], stats["function"]):
            assert a.loss == pytest.approx(b.loss, rel=1e-6)
            assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5)
            assert a.update_norm == pytest.approx(b.update_norm, rel=1e-4)
            assert a.param_norm == pytest.approx(b.param_norm, rel=1e-6)
            assert a.accuracy == b.accuracy
        assert runs[other].evaluate(x, y)[0] == pytest.approx(runs["function"].evaluate(x, y)[0], rel=1e-5)


def test_the_step_is_traced_once_under_a_schedule():
    m = load_model("cnn2d_2conv_2fc")
    x, y = batch(m)
    b = make(m, HParams(optimizer="adam", lr=1e-3, schedule="cosine", steps=6))
    run_steps(b, x, y, 6)
    b.evaluate(x, y)
    b.evaluate(x, y)
    assert len({b.lr_for(s) for s in range(6)}) == 6
    assert b.traces == {"train": 1, "eval": 1}
    assert b._step.experimental_get_tracing_count() == 1


# --------------------------------------------------------------------------- state


def test_two_backends_are_bit_identical():
    m = load_model("cnn2d_hard")
    x, y = batch(m)
    a, b = make(m, HP["momentum_step"]), make(m, HP["momentum_step"])
    assert run_steps(a, x, y, 3) == run_steps(b, x, y, 3)
    assert_same(a.export_params(), b.export_params())
    d = a.determinism()
    assert d["enable_op_determinism"] is True and d["intra_op_parallelism_threads"] == 1


# --------------------------------------------------------------------------- TF's training kernels
@pytest.mark.parametrize("dtype,rtol", [(tf.float64, 1e-12), (tf.float32, 2e-5)])
def test_resource_apply_adam_with_adjusted_epsilon_is_the_reference(dtype, rtol):
    """ResourceApplyAdam computes var -= lr sqrt(1-b2^t)/(1-b1^t) m/(sqrt(v) + eps_k): with
    eps_k = eps sqrt(1-b2^t) that is the reference lr m_hat/(sqrt(v_hat) + eps); with eps_k = eps it
    is the declared epsilon-hat form. (float32: the kernel takes beta2 in float32, 1 - float32(0.999)
    is 1.3e-5 off in relative terms, hence the looser bound.)"""
    rng = np.random.default_rng(0)
    shape = (257,)
    for eps_hat in (False, True):
        hp = HParams(optimizer="adam", lr=1e-3, eps=1e-8)
        p = {"w": np.zeros(shape)}      # small parameters: the float32 update is not lost in their rounding
        st = reference_init(hp, p)
        var = tf.Variable(tf.constant(p["w"], dtype))
        m, v = tf.Variable(tf.zeros(shape, dtype)), tf.Variable(tf.zeros(shape, dtype))
        for t in range(1, 6):
            # gradients spanning magnitudes around eps, where the two forms differ most
            g = rng.normal(0, 1, shape) * 10.0 ** rng.uniform(-9, -1, shape)
            g = np.asarray(tf.constant(g, dtype)).astype(np.float64)
            want, st = reference_update(hp, t - 1, p, {"w": g}, st, adam_eps_hat=eps_hat)
            eps_k = hp.eps if eps_hat else hp.eps * math.sqrt(1 - hp.beta2 ** t)
            c = lambda a: tf.constant(a, dtype)  # noqa: E731
            tf.raw_ops.ResourceApplyAdam(var=var.handle, m=m.handle, v=v.handle, beta1_power=c(hp.beta1 ** t),
                                         beta2_power=c(hp.beta2 ** t), lr=c(hp.lr), beta1=c(hp.beta1),
                                         beta2=c(hp.beta2), epsilon=c(eps_k), grad=c(g))
            upd_got = var.numpy().astype(np.float64) - p["w"]
            upd_want = want["w"] - p["w"]
            assert np.max(np.abs(upd_got - upd_want)) <= rtol * np.max(np.abs(upd_want)), (eps_hat, t)
            p = {"w": var.numpy().astype(np.float64)}
    # the two forms really differ (about 31.6 x eps at t = 1): the adjustment is not a no-op
    assert math.sqrt(1 - 0.999) == pytest.approx(1 / 31.62, rel=1e-3)


F64_CASES = {
    "sgd_l2": (dict(optimizer="sgd", lr=0.1, weight_decay=1e-2), None),
    "momentum_step": (dict(optimizer="momentum", lr=0.1, schedule="step", step_size=1), None),
    "nesterov_l2": (dict(optimizer="nesterov", lr=0.1, weight_decay=1e-2, schedule="cosine"), None),
    "adam_l2": (dict(optimizer="adam", lr=1e-3, weight_decay=1e-2), None),
    "adamw": (dict(optimizer="adamw", lr=1e-3, weight_decay=1e-2, schedule="warmup"), None),
    "adam_eps_hat": (dict(optimizer="adam", lr=1e-3), "adam_eps_hat"),
    "l2_not_decoupled": (dict(optimizer="adamw", lr=1e-3, weight_decay=0.1), "l2_not_decoupled"),
    "grad_double": (dict(optimizer="momentum", lr=0.1), "grad_double"),
}


@pytest.mark.parametrize("name", list(F64_CASES))
def test_training_kernels_are_the_reference_update_in_float64(name):
    """In float64 every step equals algorithms.optim.reference_update applied to the backend's own
    gradient, to 1e-9 of the update, and the optimizer state equals the reference state."""
    hpd, fault = F64_CASES[name]
    hp = HParams(steps=3, batch_size=16, **hpd)
    ref_hp = hp.with_(optimizer="adam") if fault == "l2_not_decoupled" else hp   # the fault: Adam + L2
    m = load_model("cnn2d_hard")
    rng = np.random.default_rng(0)
    x, y = rng.normal(0, 1, (16, 8, 8, 1)), rng.integers(0, 10, 16).astype(np.int32)
    masks = {"drop1": np.ones((16, 64), bool)}
    b = make(m, hp, dtype="float64", fault=fault)
    st = reference_init(ref_hp, {n: v for n, v in b.export_params().items() if n in b.trainable})
    for t in range(3):
        p = {n: v for n, v in b.export_params().items() if n in b.trainable}
        _, g = b.gradients(x, y, masks)
        want, st = reference_update(ref_hp, t, p, g, st, adam_eps_hat=fault == "adam_eps_hat")
        b.train_step(t, x, y, masks)
        got = b.export_params()
        for n in want:
            assert got[n].dtype == np.float64
            err = float(np.max(np.abs(got[n] - want[n]))) / max(float(np.max(np.abs(want[n] - p[n]))), 1e-12)
            assert err < 1e-9, f"{name} step {t} {n}: {err:.2e} of the update"
        s = b.export_opt_state()
        for k in ("momentum", "exp_avg", "exp_avg_sq"):
            for n, ref in st.get(k, {}).items():
                np.testing.assert_allclose(s[f"{k}/{n}"], ref, rtol=1e-9, atol=1e-300)
        if "step" in st:
            assert float(s["step"]) == st["step"]


def test_keras_momentum_schedule_is_the_keras_velocity():
    """Under the fault the update is Keras': v = mu v - lr_t g; p += v (reference: b = mu b + g; p -= lr_t b)."""
    m = load_model("cnn2d_2conv_2fc")
    hp = HParams(optimizer="momentum", lr=0.1, schedule="step", step_size=1, gamma=0.5, steps=4)
    rng = np.random.default_rng(0)
    x, y = rng.normal(0, 1, (16, 8, 8, 1)), rng.integers(0, 10, 16).astype(np.int32)
    b = make(m, hp, dtype="float64", fault="keras_momentum_schedule")
    vel = {n: 0.0 for n in b.trainable}
    for t in range(3):
        p = {n: v for n, v in b.export_params().items() if n in b.trainable}
        _, g = b.gradients(x, y, {})
        b.train_step(t, x, y, {})
        got = b.export_params()
        for n in p:
            vel[n] = hp.momentum * vel[n] - b.lr_for(t) * g[n]
            np.testing.assert_allclose(got[n], p[n] + vel[n], rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------- layer semantics


# --------------------------------------------------------------------------- the other faults


def test_native_dropout_is_declared_and_seeded():
    m = load_model("cnn2d_hard")
    x, y = batch(m)
    a, b = make(m, HP["adam"], dropout="native"), make(m, HP["adam"], dropout="native")
    assert a.declared_differences() == ["native_dropout_masks"]
    assert make(m, HP["adam"]).declared_differences() == []
    assert run_steps(a, x, y, 2) == run_steps(b, x, y, 2)     # framework RNG, but seeded: reproducible


# --------------------------------------------------------------------------- against torch


# --------------------------------------------------------------------------- graph kinds (issue 15)
def _against_numpy(case: str, **opts):
    """One graph kind alone (test_gradcheck.layer_model: a convolution before it, a dense head; merges read a
    second branch from the input), float64, biases and affine parameters moved off their init: TF's training
    and inference forward of every layer and its gradients against numpy's (the spec's formulas, its backward
    checked by finite differences). Worst relative error per key."""
    from wrappers.numpy.backend import NumpyBackend

    from .test_gradcheck import layer_model, numpy_float64_backend
    m = layer_model(case)
    ref = numpy_float64_backend(m)                                 # numpy, float64, non-zero biases / gamma / beta
    params = {k: np.asarray(v, np.float64) for k, v in ref.p.items()}
    tfb = make(m, HP["sgd_l2"], params=params, dtype="float64", **opts)
    assert isinstance(ref, NumpyBackend)
    x, y = batch(m, n=6, seed=3)
    x = x.astype(np.float64)
    masks = masks_for(m, 0, 0, len(x), "harness")
    got = {**{f"forward/{k}": v for k, v in tfb.forward_layers(x, masks).items()},
           **{f"eval/{k}": v for k, v in tfb.eval_layers(x).items()}}
    want = {**{f"forward/{k}": v for k, v in ref.forward_layers(x, masks).items()},
            **{f"eval/{k}": v for k, v in ref.eval_layers(x).items()}}
    (loss_t, g_t), (loss_n, g_n) = tfb.gradients(x, y, masks), ref.gradients(x, y, masks)
    got.update({f"grad/{k}": v for k, v in g_t.items()}, loss=np.asarray(loss_t))
    want.update({f"grad/{k}": v for k, v in g_n.items()}, loss=np.asarray(loss_n))
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    out = {}
    for k in want:
        a, b = np.asarray(got[k], np.float64), np.asarray(want[k], np.float64)
        assert a.shape == b.shape, f"{case} {k}: {a.shape} vs {b.shape}"
        out[k] = float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), 1e-4)
    return out


GRAPH_KINDS = ["conv2d_grouped", "conv2d_depthwise_multiplier2_s2", "conv2d_dilated_same",
               "conv2d_dilated_grouped_valid", "layernorm_spatial", "relu6_spatial", "add", "add_three", "concat",
               "leaky_relu", "gelu_none", "gelu_tanh", "silu", "sigmoid", "relu6", "layernorm"]


@pytest.mark.parametrize("case", GRAPH_KINDS)
def test_graph_kinds_alone_match_numpy_float64(case):
    """Every kind the graph spec added, alone, in the tf.function step's lowering (layers.forward): 1e-10."""
    errs = _against_numpy(case)
    bad = {k: v for k, v in errs.items() if v >= 1e-10}
    assert not bad, f"{case}: relative error >= 1e-10: {bad}"


@pytest.mark.parametrize("case", ["conv2d_depthwise_multiplier2_s2", "conv2d_dilated_grouped_valid",
                                  "conv2d_dilated_same", "layernorm_spatial"])
@pytest.mark.parametrize("mode", [{"jit": False}, {"extra": {"xla": True}}])
def test_graph_convolutions_eager_and_xla_match_numpy_float64(case, mode):
    """The grouped / depthwise / dilated formulations eagerly and under XLA (jit_compile) as well."""
    errs = _against_numpy(case, **mode)
    bad = {k: v for k, v in errs.items() if v >= 1e-10}
    assert not bad, f"{case} {mode}: relative error >= 1e-10: {bad}"


def test_depthwise_kernel_order_is_canonical_and_the_mult_major_order_is_not():
    """Depthwise with multiplier 2: output channel o = c*M + m reads input channel o // M (the canonical
    kernel reshaped to (kH, kW, C, M)); the same kernel read mult-major (m*C + c, the classic port bug)
    gives another network, so the check can tell the two apart."""
    from wrappers.tensorflow.layers import conv2d
    m = build_model({"name": "dw", "input_shape": [5, 5, 3], "num_classes": 2, "layers": [
        {"type": "conv2d", "name": "dw", "filters": 6, "kernel": 3, "groups": 3, "padding": "same"},
        {"type": "flatten"}, {"type": "dense", "units": 2}]})
    layer = m.layers[0]
    from algorithms.faults import Seams
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 5, 5, 3))
    k = rng.normal(size=(3, 3, 1, 6))
    got = conv2d(layer, Seams(None), tf.constant(x), tf.constant(k)).numpy()
    xp = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    want = np.zeros((2, 5, 5, 6))
    for o in range(6):
        for i in range(3):
            for j in range(3):
                want[..., o] += xp[:, i:i + 5, j:j + 5, o // 2] * k[i, j, 0, o]
    assert np.max(np.abs(got - want)) < 1e-12
    mult_major = k.reshape(3, 3, 2, 3).transpose(0, 1, 3, 2).reshape(3, 3, 1, 6)   # channel m*C + c
    bad = conv2d(layer, Seams(None), tf.constant(x), tf.constant(mult_major)).numpy()
    assert np.max(np.abs(bad - want)) > 1e-1


def test_graph_kinds_are_declared_and_lowered():
    from wrappers.tensorflow import TensorflowEntry
    for name in ("resnet_tiny", "mobilenet_tiny", "convnext_tiny"):
        m = load_model(name)
        assert m.required_features() <= TensorflowEntry.layer_kinds
        assert TensorflowBackend.layer_kinds == TensorflowEntry.layer_kinds


# --------------------------------------------------------------------------- the graph lowering seams (issue 15)
SCENARIO_TOML = "algorithms/models/scenarios/graph_ops_tiny.toml"


def test_graph_lowering_seams_change_exactly_their_layer():
    """concat_wrong_axis, projection_without_bn and depthwise_multiplier_order in TF, in process (float64):
    each leaves every layer before its own bit-identical to the clean lowering and changes its layer as the
    catalogue says (the end-to-end BUG verdicts: tests/test_graph_faults.py's slow set, every backend)."""
    from algorithms.layout import multiplier_major_perm
    m = load_model(SCENARIO_TOML)
    p = init_params(m, 0)
    x, y = batch(m, n=8, seed=2)
    x = x.astype(np.float64)
    names = [l.name for l in m.layers]

    def run(fault=None, params=p):
        b = make(m, HP["sgd_l2"], params=params, dtype="float64", fault=fault)
        return b, b.forward_layers(x, {})

    clean_b, clean = run()

    def same_before(rec, layer):
        for n in names[:names.index(layer)]:
            assert np.array_equal(rec[n], clean[n]), (layer, n)

    # concat on the width (NHWC axis 2): the maps side by side, the same values
    _, cat = run("concat_wrong_axis")
    same_before(cat, "cat")
    srcs = m.layer("cat").inputs
    assert cat["cat"].shape != clean["cat"].shape
    assert np.array_equal(cat["cat"], np.concatenate([clean[s] for s in srcs], axis=2))
    # the projection's BatchNorm passed through: its output is its input; gamma/beta get no gradient and the
    # running statistics do not move, while every other BatchNorm's do
    bn = "proj_bn"
    nobn_b, nobn = run("projection_without_bn")
    same_before(nobn, bn)
    assert np.array_equal(nobn[bn], nobn[m.layer(bn).inputs[0]]) and not np.array_equal(nobn[bn], clean[bn])
    _, g = nobn_b.gradients(x, y, {})
    assert not np.any(g[f"{bn}.gamma"]) and not np.any(g[f"{bn}.beta"]) and np.any(g["block_bn.gamma"])
    run_steps(nobn_b, x, y, 1)
    after = nobn_b.export_params()
    assert np.array_equal(after[f"{bn}.running_mean"], p[f"{bn}.running_mean"])
    assert not np.array_equal(after["block_bn.running_mean"], p["block_bn.running_mean"])
    # the multiplied depthwise kernel read multiplier-major: the clean network with the kernel's outputs
    # permuted, exported back in the canonical order it was given
    dw_b, dw = run("depthwise_multiplier_order")
    same_before(dw, "dw")
    k = p["dw.kernel"]
    permuted = dict(p, **{"dw.kernel": k[..., multiplier_major_perm(4, k.shape[-1] // 4)]})
    _, want = run(None, permuted)
    assert np.array_equal(dw["dw"], want["dw"]) and not np.allclose(dw["dw"], clean["dw"])
    assert np.array_equal(dw_b.export_params()["dw.kernel"], k)
