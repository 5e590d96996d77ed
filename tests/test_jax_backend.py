"""The JAX backend on its own: compiled vs eager step, exact state round trips, replay from a
checkpoint, no recompilation under a schedule, probes that leave state alone, the layer semantics
the spec fixes (TF 'SAME', padding-excluded average, torch-convention BatchNorm), the optimizer
against the float64 reference, and two lowering faults that the probes must catch against torch.

Runs in this process (JAX is set up with its registry environment before it is first imported);
the float64 check runs in a child process, since x64 must be switched on before JAX starts.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from algorithms.optim import HParams
from algorithms.params import init_params
from algorithms.spec import build_model, load_model

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("optax")
if "jax" not in sys.modules:      # the backend's own environment, as its worker process would set it
    from algorithms.contract import RunOptions
    from wrappers.__main__ import set_backend_env
    from wrappers.registry import REGISTRY
    set_backend_env(REGISTRY["jax"], RunOptions(threads=1))
jax = pytest.importorskip("jax")

from algorithms.contract import RunOptions  # noqa: E402
from wrappers.jax.backend import JaxBackend  # noqa: E402
from wrappers.worker import masks_for  # noqa: E402

HP = {
    "sgd_l2": HParams(optimizer="sgd", lr=0.1, weight_decay=1e-2, steps=4),
    "momentum_step": HParams(optimizer="momentum", lr=0.1, schedule="step", step_size=1, gamma=0.5, steps=4),
    "nesterov_step": HParams(optimizer="nesterov", lr=0.1, schedule="step", step_size=1, gamma=0.5, steps=4),
    "adam": HParams(optimizer="adam", lr=1e-3, weight_decay=1e-3, steps=4),
    "adamw": HParams(optimizer="adamw", lr=1e-3, weight_decay=1e-2, schedule="cosine", steps=4),
}


def batch(model, n=32, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (n, *model.input_shape)).astype(np.float32)
    y = rng.integers(0, model.num_classes, n).astype(np.int32)
    return x, y


def make(model, hp, **opts) -> JaxBackend:
    b = JaxBackend(model, hp, RunOptions(**opts))
    b.load_params(init_params(model, 0))
    return b


def run_steps(b: JaxBackend, x, y, steps, start=0):
    return [b.train_step(s, x, y, masks_for(b.model, b.hp.seed, s, len(x), b.opts.dropout))
            for s in range(start, start + steps)]


def assert_same(a: dict, b: dict, exact=True, rtol=0.0):
    assert set(a) == set(b)
    for k in a:
        if exact:
            assert np.array_equal(a[k], b[k]), k
        else:
            scale = max(float(np.max(np.abs(b[k]))), 1e-6)
            assert float(np.max(np.abs(a[k].astype(np.float64) - b[k]))) <= rtol * scale, k


# --------------------------------------------------------------------------- compilation
@pytest.mark.parametrize("case", ["momentum_step", "adamw"])
def test_eager_and_jit_steps_agree(case):
    m = load_model("cnn2d_hard")
    x, y = batch(m)
    jit, eager = make(m, HP[case]), make(m, HP[case], jit=False)
    sj, se = run_steps(jit, x, y, 3), run_steps(eager, x, y, 3)
    assert_same(jit.export_params(), eager.export_params(), exact=False, rtol=1e-4)
    assert_same(jit.export_opt_state(), eager.export_opt_state(), exact=False, rtol=1e-3)
    for a, b in zip(sj, se):
        assert a.loss == pytest.approx(b.loss, rel=1e-5)
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-4)
        assert a.update_norm == pytest.approx(b.update_norm, rel=1e-3)
        assert a.accuracy == b.accuracy


def test_the_step_compiles_once_under_a_schedule():
    m = load_model("cnn2d_2conv_2fc")
    x, y = batch(m)
    b = make(m, HParams(optimizer="momentum", lr=0.1, schedule="cosine", steps=6))
    run_steps(b, x, y, 6)
    assert len({b.lr_for(s) for s in range(6)}) == 6
    assert b._step._cache_size() == 1


def test_step_stats_are_computed_from_the_step():
    m = load_model("cnn2d_2conv_2fc")
    x, y = batch(m)
    b = make(m, HParams(optimizer="sgd", lr=0.1))
    before = b.export_params()
    loss, grads = b.gradients(x, y, {})
    st = b.train_step(0, x, y, {})
    after = b.export_params()
    assert st.loss == pytest.approx(loss, rel=1e-6)
    gn = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in grads.values()))
    un = np.sqrt(sum(np.sum((after[k].astype(np.float64) - before[k]) ** 2) for k in before))
    pn = np.sqrt(sum(np.sum(after[k].astype(np.float64) ** 2) for k in before))
    assert st.grad_norm == pytest.approx(gn, rel=1e-5)
    assert st.update_norm == pytest.approx(un, rel=1e-4)
    assert st.update_norm == pytest.approx(0.1 * gn, rel=1e-4)        # plain sgd: update = lr * grad
    assert st.param_norm == pytest.approx(pn, rel=1e-6)


# --------------------------------------------------------------------------- state
@pytest.mark.parametrize("fault", [None, "flatten_no_permute"])
def test_params_round_trip_bit_exact(fault):
    m = load_model("cnn2d_2conv_2fc")
    p = init_params(m, 3)
    b = JaxBackend(m, HP["adam"], RunOptions(fault=fault))
    b.load_params(p)
    out = b.export_params()
    assert list(out) == [q.name for q in m.params]
    assert_same(out, p)
    if fault:   # the fault really loads the first dense kernel in the wrong row order
        assert not np.array_equal(np.asarray(b.params["fc1.kernel"]), p["fc1.kernel"])


def test_state_never_aliases_caller_arrays():
    """Loaded arrays are copies and exported arrays are snapshots, so a probe's before/after
    difference is the real update (on CPU, jnp.asarray can alias a NumPy buffer)."""
    m = load_model("cnn2d_hard")
    x, y = batch(m)
    p = init_params(m, 0)
    b = make(m, HP["momentum_step"])
    b.load_params(p)
    ref = {k: v.copy() for k, v in p.items()}
    for v in p.values():
        v += 1.0
    assert_same(b.export_params(), ref)
    before, st0 = b.export_params(), b.export_opt_state()
    snapshot = {k: v.copy() for k, v in before.items()}
    run_steps(b, x, y, 2)
    assert_same(before, snapshot)                               # the export did not move with the state
    assert not np.array_equal(b.export_params()["conv1.kernel"], before["conv1.kernel"])
    assert not np.any(st0["momentum/conv1.kernel"]) and np.any(b.export_opt_state()["momentum/conv1.kernel"])


@pytest.mark.parametrize("case", ["momentum_step", "nesterov_step", "adam", "adamw"])
def test_opt_state_round_trip_and_replay(case):
    """Train 3 steps; separately train 2, export params and optimizer state, load them into a fresh
    backend and take step 2 there: bit-identical to continuing."""
    m = load_model("cnn2d_hard")
    x, y = batch(m)
    full = make(m, HP[case])
    run_steps(full, x, y, 3)
    part = make(m, HP[case])
    run_steps(part, x, y, 2)
    params, state = part.export_params(), part.export_opt_state()
    keys = {"momentum_step": "momentum", "nesterov_step": "momentum"}.get(case)
    if keys:
        assert set(state) == {f"momentum/{n}" for n in part.trainable}
    else:
        assert set(state) == {f"{k}/{n}" for k in ("exp_avg", "exp_avg_sq") for n in part.trainable} | {"step"}
        assert float(state["step"]) == 2.0
    replay = make(m, HP[case])
    replay.load_params(params)
    replay.load_opt_state(state, 2)
    assert_same(replay.export_params(), params)
    assert_same(replay.export_opt_state(), state)
    run_steps(replay, x, y, 1, start=2)
    assert_same(replay.export_params(), full.export_params())
    assert_same(replay.export_opt_state(), full.export_opt_state())


def test_replay_keeps_the_keras_momentum_fault_lr_history():
    m = load_model("cnn2d_2conv_2fc")
    x, y = batch(m)
    hp = HP["momentum_step"]
    full = make(m, hp, fault="keras_momentum_schedule")
    run_steps(full, x, y, 3)
    part = make(m, hp, fault="keras_momentum_schedule")
    run_steps(part, x, y, 2)
    replay = make(m, hp, fault="keras_momentum_schedule")
    replay.load_params(part.export_params())
    replay.load_opt_state(part.export_opt_state(), 2)
    run_steps(replay, x, y, 1, start=2)
    assert_same(replay.export_params(), full.export_params())
    clean = make(m, hp)
    run_steps(clean, x, y, 3)
    assert not np.allclose(clean.export_params()["fc2.kernel"], full.export_params()["fc2.kernel"], rtol=0, atol=1e-6)


def test_probes_and_eval_do_not_move_state():
    m = load_model("cnn2d_hard")
    x, y = batch(m)
    b = make(m, HP["adam"])
    run_steps(b, x, y, 1)
    p0, s0 = b.export_params(), b.export_opt_state()
    masks = masks_for(m, 0, 5, len(x), "harness")
    b.forward_layers(x, masks)
    b.gradients(x, y, masks)
    b.evaluate(x, y)
    assert_same(b.export_params(), p0)
    assert_same(b.export_opt_state(), s0)


def test_dropout_uses_the_harness_masks():
    m = load_model("cnn2d_hard")
    x, y = batch(m)
    b = make(m, HP["adam"])
    masks = masks_for(m, 0, 0, len(x), "harness")
    out = b.forward_layers(x, masks)
    assert list(out) == [l.name for l in m.layers]                 # layer order, not jit's sorted keys
    keep = masks["drop1"]
    np.testing.assert_allclose(out["drop1"], np.where(keep, out["gap"] / 0.75, 0.0), rtol=1e-6)
    other = masks_for(m, 0, 1, len(x), "harness")
    assert not np.array_equal(b.forward_layers(x, other)["drop1"], out["drop1"])


# --------------------------------------------------------------------------- layer semantics
def _spec(layers, shape=(6, 6, 2)):
    return build_model({"name": "t", "input_shape": list(shape), "num_classes": 2,
                        "layers": layers + [{"type": "flatten"}, {"type": "dense", "name": "out", "units": 2}]})


def test_same_avgpool_excludes_padding_and_same_conv_pads_bottom_right():
    m = _spec([{"type": "avgpool2d", "name": "ap", "pool": 3, "stride": 2, "padding": "same"},
               {"type": "conv2d", "name": "cv", "filters": 1, "kernel": 2, "stride": 2, "padding": "same",
                "use_bias": False}])
    b = make(m, HP["adam"])
    p = b.export_params()
    p["cv.kernel"] = np.ones_like(p["cv.kernel"])
    b.load_params(p)
    x = np.ones((2, 6, 6, 2), np.float32)
    out = b.forward_layers(x, {})
    np.testing.assert_array_equal(out["ap"], np.ones((2, 3, 3, 2)))          # padding not counted
    # 3x3 input, kernel 2, stride 2: TF 'SAME' pads one row/column at the bottom/right only, so the
    # top-left window sees 4 pixels x 2 channels, the bottom-right one 1 pixel x 2 channels
    np.testing.assert_array_equal(out["cv"][0, :, :, 0], [[8, 4], [4, 2]])
    sym = JaxBackend(m, HP["adam"], RunOptions(fault="symmetric_same_padding"))
    sym.load_params(p)
    np.testing.assert_array_equal(sym.forward_layers(x, {})["cv"][0, :, :, 0], [[2, 4], [4, 8]])


def test_maxpool_same_and_ceil_fault():
    x = -np.arange(50, dtype=np.float32).reshape(2, 5, 5, 1)    # all negative: -inf padding must never win
    ms = _spec([{"type": "maxpool2d", "name": "mp", "pool": 2, "stride": 2, "padding": "same"}], shape=(5, 5, 1))
    same = make(ms, HP["adam"]).forward_layers(x, {})["mp"]
    np.testing.assert_array_equal(same[0, :, :, 0], [[0, -2, -4], [-10, -12, -14], [-20, -22, -24]])
    # a 'valid' pool on an odd size floors the output; the fault (torch ceil_mode) keeps the partial windows
    mv = build_model({"name": "t", "input_shape": [5, 5, 1], "num_classes": 2, "layers": [
        {"type": "maxpool2d", "name": "mp", "pool": 2}, {"type": "global_avgpool2d", "name": "gap"},
        {"type": "dense", "name": "out", "units": 2}]})
    valid = make(mv, HP["adam"]).forward_layers(x, {})["mp"]
    np.testing.assert_array_equal(valid[0, :, :, 0], [[0, -2], [-10, -12]])
    ceil = make(mv, HP["adam"], fault="maxpool_ceil").forward_layers(x, {})["mp"]
    np.testing.assert_array_equal(ceil[0, :, :, 0], [[0, -2, -4], [-10, -12, -14], [-20, -22, -24]])


def test_batchnorm_torch_convention():
    m = load_model("cnn2d_hard")
    x, y = batch(m, n=8)
    b = make(m, HParams(optimizer="sgd", lr=0.1))
    a = b.forward_layers(x, masks_for(m, 0, 0, 8, "harness"))["conv1"].astype(np.float64)
    b.train_step(0, x, y, masks_for(m, 0, 0, 8, "harness"))
    p = b.export_params()
    n = a.shape[0] * a.shape[1] * a.shape[2]
    np.testing.assert_allclose(p["bn1.running_mean"], 0.1 * a.mean((0, 1, 2)), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(p["bn1.running_var"], 0.9 + 0.1 * a.var((0, 1, 2)) * n / (n - 1), rtol=1e-5)
    f = make(m, HParams(optimizer="sgd", lr=0.1), fault="bn_momentum_flipped")
    f.train_step(0, x, y, masks_for(m, 0, 0, 8, "harness"))
    np.testing.assert_allclose(f.export_params()["bn1.running_mean"], 0.9 * a.mean((0, 1, 2)), rtol=1e-5, atol=1e-7)


def test_flatten_is_hwc_and_the_fault_reads_chw():
    m = load_model("cnn2d_2conv_2fc")
    x, _ = batch(m)
    b = make(m, HP["adam"])
    out = b.forward_layers(x, {})
    np.testing.assert_array_equal(out["flatten_1"], out["relu_2"].reshape(len(x), -1))
    k = init_params(m, 0)["fc1.kernel"]
    np.testing.assert_allclose(out["fc1"], out["flatten_1"] @ k + 0.0, rtol=1e-5, atol=1e-5)
    f = make(m, HP["adam"], fault="flatten_no_permute")
    chw = out["relu_2"].transpose(0, 3, 1, 2).reshape(len(x), -1)          # torch's flatten order
    np.testing.assert_allclose(f.forward_layers(x, {})["fc1"], chw @ k, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- the optimizer in float64
F64_CHECK = textwrap.dedent("""
    import json, sys
    import numpy as np
    from algorithms.contract import RunOptions
    from wrappers.__main__ import set_backend_env
    from wrappers.registry import REGISTRY
    set_backend_env(REGISTRY["jax"], RunOptions(threads=1, dtype="float64"))
    from algorithms.optim import HParams, reference_init, reference_update
    from algorithms.params import init_params
    from algorithms.spec import load_model
    from algorithms.contract import RunOptions
    from wrappers.jax.backend import JaxBackend
    cases = json.loads(sys.argv[1])
    m = load_model("cnn2d_2conv_2fc")
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, (16, 8, 8, 1)); y = rng.integers(0, 10, 16)
    masks = {}
    worst = {}
    for name, (hpd, fault) in cases.items():
        hp = HParams(**hpd)
        b = JaxBackend(m, hp, RunOptions(dtype="float64", fault=fault))
        b.load_params(init_params(m, 0))
        st = reference_init(hp, {n: v for n, v in b.export_params().items() if n in b.trainable})
        err = 0.0
        for t in range(3):
            p = {n: v for n, v in b.export_params().items() if n in b.trainable}
            _, g = b.gradients(x, y, masks)
            ref, st = reference_update(hp, t, p, g, st, adam_eps_hat=fault == "adam_eps_hat")
            b.train_step(t, x, y, masks)
            got = b.export_params()
            err = max(err, max(float(np.max(np.abs(got[n] - ref[n]))) / max(float(np.max(np.abs(ref[n] - p[n]))), 1e-12)
                               for n in ref))
        worst[name] = err
    print(json.dumps(worst))
""")


def test_optax_steps_are_the_reference_update_in_float64():
    from .optim_cases import REFERENCE_CASES as cases
    import json
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    r = subprocess.run([sys.executable, "-c", F64_CHECK, json.dumps(cases)], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    worst = json.loads(r.stdout.strip().splitlines()[-1])
    for name, err in worst.items():       # relative to the size of the update
        assert err < 1e-9, f"{name}: optax step differs from reference_update by {err:.2e} of the update"


def test_adam_bias_correction_is_exact_in_float32():
    """optax computes 1 - b2^t in float32 (b2 = 0.999 rounds up: 1.3e-5 off at t = 1); the injected
    lr / eps / weight decay make the float32 step use the exact corrections of the reference."""
    import jax.numpy as jnp
    import optax

    from wrappers.jax.optim import adam_hyperparams
    b1, b2, lr, eps, wd = 0.9, 0.999, 1e-3, 1e-8, 1e-2
    counts = np.array([0, 1, 9, 99, 999, 2999])
    c1 = 1 - b1 ** (counts + 1.0)
    c2 = 1 - b2 ** (counts + 1.0)
    base = {"learning_rate": jnp.float32(lr), "eps": jnp.float32(eps), "weight_decay": jnp.float32(wd)}
    for n, e1, e2 in zip(counts, c1, c2):
        h = adam_hyperparams(base, jnp.int32(n), b1, b2)
        q1 = 1 / float(optax.tree.bias_correction(jnp.float32(1), b1, jnp.int32(n + 1)))   # optax's own
        q2 = 1 / float(optax.tree.bias_correction(jnp.float32(1), b2, jnp.int32(n + 1)))
        if n == 0:
            assert abs(q2 / e2 - 1) > 1e-5           # the float32 error being corrected
        # optax: lr' (m / q1) / (sqrt(v / q2) + eps') = (lr' sqrt(q2) / q1) m / (sqrt(v) + eps' sqrt(q2));
        # the reference: (lr sqrt(c2) / c1) m / (sqrt(v) + eps sqrt(c2))
        assert float(h["learning_rate"]) * np.sqrt(q2) / q1 == pytest.approx(lr * np.sqrt(e2) / e1, rel=1e-6)
        assert float(h["eps"]) * np.sqrt(q2) == pytest.approx(eps * np.sqrt(e2), rel=1e-6)
        assert float(h["learning_rate"]) * float(h["weight_decay"]) == pytest.approx(lr * wd, rel=1e-6)


def test_l2_not_decoupled_is_adam_with_l2():
    m = load_model("cnn2d_2conv_2fc")
    x, y = batch(m)
    hp = HP["adamw"]
    faulty = make(m, hp, fault="l2_not_decoupled")
    adam = make(m, hp.with_(optimizer="adam"))
    run_steps(faulty, x, y, 2)
    run_steps(adam, x, y, 2)
    assert_same(faulty.export_params(), adam.export_params())
    clean = make(m, hp)
    run_steps(clean, x, y, 2)
    assert not np.array_equal(clean.export_params()["fc1.kernel"], faulty.export_params()["fc1.kernel"])


def test_grad_double_and_label_smoothing():
    m = load_model("cnn2d_2conv_2fc")
    x, y = batch(m)
    clean = make(m, HP["adam"])
    l0, g0 = clean.gradients(x, y, {})
    l1, g1 = make(m, HP["adam"], fault="grad_double").gradients(x, y, {})
    assert l1 == pytest.approx(l0, rel=1e-7)
    for k in g0:
        np.testing.assert_allclose(g1[k], 2 * g0[k], rtol=1e-6, atol=1e-12)
    ls, _ = make(m, HP["adam"], fault="label_smoothing").gradients(x, y, {})
    logits = clean.forward_layers(x, {})["fc2"].astype(np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) - logits.max(1, keepdims=True)
    want = np.mean(-0.9 * logp[np.arange(len(y)), y] - 0.1 * logp.mean(1))
    assert ls == pytest.approx(want, rel=1e-5)


def test_dropout_in_eval_changes_eval_only():
    m = load_model("cnn2d_hard")
    x, y = batch(m, n=64)
    clean, faulty = make(m, HP["adam"]), make(m, HP["adam"], fault="dropout_in_eval")
    assert clean.evaluate(x, y) == clean.evaluate(x, y)
    e1, e2 = faulty.evaluate(x, y), faulty.evaluate(x, y)
    assert e1 != clean.evaluate(x, y) and e1 != e2            # a fresh native mask per evaluation
    masks = masks_for(m, 0, 0, len(x), "harness")
    assert clean.gradients(x, y, masks)[0] == faulty.gradients(x, y, masks)[0]


def test_missing_bias_drops_the_first_bias_only():
    m = load_model("cnn2d_hard")      # conv1 and conv2 have no bias: the first one is conv3's
    x, _ = batch(m)
    p = init_params(m, 0)
    p["conv3.bias"] = np.full_like(p["conv3.bias"], 0.5)
    p["fc1.bias"] = np.full_like(p["fc1.bias"], 0.5)
    clean = JaxBackend(m, HP["adam"], RunOptions())
    clean.load_params(p)
    faulty = JaxBackend(m, HP["adam"], RunOptions(fault="missing_bias"))
    faulty.load_params(p)
    a, b = clean.forward_layers(x, {"drop1": np.ones((len(x), 64), bool)}), \
        faulty.forward_layers(x, {"drop1": np.ones((len(x), 64), bool)})
    np.testing.assert_allclose(a["conv3"] - 0.5, b["conv3"], atol=1e-6)
    assert np.array_equal(a["conv2"], b["conv2"])
    _, g = faulty.gradients(x, np.zeros(len(x), np.int32), {"drop1": np.ones((len(x), 64), bool)})
    assert not np.any(g["conv3.bias"]) and np.any(g["fc1.bias"])


# --------------------------------------------------------------------------- against torch
LOWERING_FAULTS = [("flatten_no_permute", "cnn2d_2conv_2fc", "forward/fc1"),
                   ("symmetric_same_padding", "cnn2d_hard", "forward/conv2")]


@pytest.mark.parametrize("fault,model,first", LOWERING_FAULTS)
def test_lowering_faults_make_the_probe_disagree_with_torch(fault, model, first, results_root):
    """The faulty JAX lowering disagrees with clean torch from the faulty layer on, while clean JAX
    agrees there; and JAX with the fault computes what torch with the same fault computes."""
    from harness.probes import compare, standard_cases

    from .conftest import need, probes_for
    need("torch")
    need("jax")
    cases = {"sgd": standard_cases()["sgd"]}
    ref = probes_for("torch", model, results_root, cases=cases)["sgd"].arrays
    ref_f = probes_for("torch", model, results_root, fault=fault, cases=cases)["sgd"].arrays
    clean = probes_for("jax", model, results_root, cases=cases)["sgd"].arrays
    bad = probes_for("jax", model, results_root, fault=fault, cases=cases)["sgd"].arrays
    # forward (after the flatten), loss and gradients: probes that do not depend on the layout of a flatten
    keys = [k for k in ref if k.startswith(("forward/", "grad/", "loss")) and "flatten" not in k]
    order = [k for k in ref if k in keys]
    by_key = {d.key: d for d in compare(bad, ref, keys=keys)}
    failing = [k for k in order if not by_key[k].ok]
    assert failing and failing[0] == first, failing[:3]
    assert by_key[first].rel > 1e-2
    assert all(d.ok for d in compare(clean, ref, keys=keys)), "clean JAX must agree with clean torch"
    assert all(d.ok for d in compare(bad, ref_f, keys=keys)), "JAX and torch must inject the same fault"
