"""The graph models across backends: jax and tensorflow float64 against torch float64 step-0 probes (the lowering, with no
float32 kink noise), a short torch/numpy run compared by the harness, and the 32x32x3 data sources."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from algorithms import data as D
from algorithms.spec import load_model

from .conftest import ROOT, need, probes_for
from .test_gradcheck import FLOAT64_FLOOR, GRAPH_ADAM_TOL, GRAPH_MODELS, PROBE_TOL, graph_cases


def float64_agreement(backend: str, model: str, root, *, emulate_declared: bool = False,
                      not_held: dict[str, str] | None = None) -> dict[str, tuple[float, str, float, str]]:
    """Per case: (worst relative error over the held keys, its key, worst over every key, its key) of `backend`
    against torch, both float64, over every probe key. `emulate_declared`: torch computes the differences
    `backend` declares (their emulations); `not_held`: case -> a pattern of keys reported, not held."""
    import re
    from algorithms.differences import DIFFERENCES
    from algorithms.faults import combine
    got = probes_for(backend, model, root, cases=graph_cases(), dtype="float64")
    fault = None
    if emulate_declared:
        emulations = {DIFFERENCES[d].emulated_by for res in got.values() for d in res.declared}
        assert None not in emulations, f"{backend} {model}: a declared difference without an emulation"
        fault = combine(sorted(emulations))
    ref = probes_for("torch", model, root, fault=fault, cases=graph_cases(), dtype="float64")
    out = {}
    for case in ref:
        a, b = got[case].arrays, ref[case].arrays
        assert set(a) == set(b), f"{backend} {model} {case}: keys differ: {sorted(set(a) ^ set(b))[:6]}"
        adam = "opt0/step" in b
        rounding_only = {k.split("/", 1)[1] for k in b if k.startswith("grad/") and float(np.max(np.abs(b[k]))) < 1e-12}
        unheld = re.compile((not_held or {}).get(case, r"^$^"))
        held, every = (0.0, ""), (0.0, "")
        for k in b:
            if adam and k.startswith(("update", "opt")) and k.split("/")[-1] in rounding_only:
                continue        # Adam on a structurally zero gradient: rounding amplified (see test_gradcheck)
            x, y = np.asarray(a[k], np.float64), np.asarray(b[k], np.float64)
            assert x.shape == y.shape, f"{backend} {model} {case} {k}: shape {x.shape} vs {y.shape}"
            rel = float(np.max(np.abs(x - y))) / max(float(np.max(np.abs(y))), FLOAT64_FLOOR) if y.size else 0.0
            every = max(every, (rel, k))
            if not unheld.search(k):
                held = max(held, (rel, k))
        out[case] = (*held, *every)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["jax", "tensorflow"])
@pytest.mark.parametrize("model", GRAPH_MODELS)
def test_float64_probes_match_torch_float64_on_graph_models(backend, model, results_root):
    """Every forward, eval, gradient, three updates, buffers and optimizer state: the lowering itself.
    Slow: jax compiles, and TensorFlow traces, three optimizer cases of each model."""
    need(backend)
    for case, (rel, key, _, _) in float64_agreement(backend, model, results_root).items():
        tol = GRAPH_ADAM_TOL if case.startswith("adam") else PROBE_TOL
        assert rel < tol, f"{backend} {model} {case}: {key} relative error {rel:.3g} >= {tol}"


@pytest.mark.slow
def test_resnet_tiny_torch_numpy_run_and_compare(tmp_path):
    """`run` resnet_tiny on torch and numpy (20 steps, digits32), then `compare`: DRIFT or IDENTICAL."""
    out = tmp_path / "results"
    for backend in ("torch", "numpy"):
        r = subprocess.run([sys.executable, "-m", "harness", "run", "-m", "resnet_tiny", "-b", backend, "--steps", "20",
                            "--data", "digits32", "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
        assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "harness", "compare", str(out), "--json"], capture_output=True, text=True,
                       cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    verdicts = {p["candidate"]: p["verdict"] for p in json.loads(r.stdout)["pairs"]}
    assert verdicts and all(v in ("DRIFT", "IDENTICAL") for v in verdicts.values()), verdicts


def test_digits32_is_deterministic_32x32x3_with_real_labels(tmp_path):
    a = D.load_data("digits32", cache_dir=tmp_path)          # built, then cached
    b = D.load_data("digits32", cache_dir=tmp_path)
    c = D.digits32()
    assert a.hash() == b.hash() == c.hash()
    assert a.image_shape == (32, 32, 3) and a.x_train.dtype == np.float32
    assert len(a.x_train) + len(a.x_test) == 1797 and set(np.unique(a.y_train)) == set(range(10))
    assert abs(float(a.x_train.mean())) < 1e-5                  # standardised by the train set's statistics
    D.check_fits(a, load_model("resnet_tiny").input_shape, 10, "resnet_tiny")


def test_data_sources_take_the_model_shape(tmp_path):
    shape = load_model("mobilenet_tiny").input_shape
    syn = D.load_data("synthetic:60", image_shape=shape)
    assert syn.image_shape == (32, 32, 3)
    rng = np.random.default_rng(0)
    rows = np.concatenate([rng.integers(0, 10, (30, 1)), rng.integers(0, 256, (30, 32 * 32 * 3))], axis=1)
    csv = tmp_path / "colour.csv"
    np.savetxt(csv, rows, fmt="%d", delimiter=",")
    got = D.load_data(str(csv), image_shape=shape, cache_dir=tmp_path)
    assert got.image_shape == (32, 32, 3)
    # pixel columns in (H, W, C) order: column 1 + c is pixel (0, 0) channel c
    raw = got.x_train * got.meta["normalisation"]["std"] + got.meta["normalisation"]["mean"]
    first = D._split(rows[:, 1:].reshape(30, 32, 32, 3), rows[:, 0])[0]
    assert np.allclose(raw * 255.0, first, atol=1e-3)
    npz = tmp_path / "flat.npz"
    np.savez(npz, x=rows[:, 1:].astype(np.float32), y=rows[:, 0])
    assert D.load_data(str(npz), image_shape=shape).image_shape == (32, 32, 3)
    with pytest.raises(D.DataError, match="do not fit the image shape"):
        D.load_data(str(npz), image_shape=(8, 8, 1))
    with pytest.raises(D.DataError, match="--data digits32"):
        D.check_fits(D.load_data("digits"), shape, 10, "mobilenet_tiny")


def test_graph_gradients_with_two_replicas_numpy_match_torch_float64():
    """Data parallel on a graph: two replicas, BatchNorm per replica, gradients averaged (numpy's explicit
    all-reduce against torch's emulated replicas), on resnet_tiny at batch 8. Measured: 1.3e-14."""
    need("torch")
    from algorithms.optim import HParams
    from algorithms.params import init_params
    from algorithms.contract import RunOptions
    from wrappers.numpy.backend import NumpyBackend
    from wrappers.torch.backend import TorchBackend
    m = load_model("resnet_tiny")
    ds = D.digits32()
    idx = D.batch_order(len(ds.x_train), 8, 1, 0)[0]
    x, y = ds.x_train[idx].astype(np.float64), ds.y_train[idx]
    out = []
    for backend in (TorchBackend, NumpyBackend):
        b = backend(m, HParams(), RunOptions(dtype="float64", devices=2))
        b.load_params(init_params(m, 0))
        out.append(b.gradients(x, y, {}))
    (loss_t, g_t), (loss_n, g_n) = out
    assert abs(loss_t - loss_n) < 1e-12
    worst = max(float(np.max(np.abs(g_t[k] - g_n[k]))) / max(float(np.max(np.abs(g_t[k]))), FLOAT64_FLOOR) for k in g_t)
    assert worst < PROBE_TOL, worst


# ----------------------------------------------------------------------------- Keras 3 (functional API)
# keras-jax and keras-tensorflow run float64 (keras-torch refuses it: its float32 probes are held to the harness's
# rule in tests/test_probes.py test_step0_probes_graph_models_match_torch). Keras declares differences (Adam's
# epsilon hat, the momentum velocity under a schedule, the biased running variance): the torch float64 reference
# computes them through its emulations (algorithms.differences `emulated_by`), so every probe key is compared.
KERAS_FLOAT64 = ("keras-jax", "keras-tensorflow")


# Keras' own optimizers in float64 on keras-tensorflow round their constants through float32 (runtimes/tensorflow.py
# FLOAT64_NOTE: momentum 0.9 as 0.89999998; Adam's betas and epsilon), and keras-jax exports its velocity as a momentum
# buffer through the float32 learning rate: not the lowering, and the same on the straight-line models (measured with
# the code before graphs: keras-tensorflow cnn2d_hard adamw update1 6.3e-5, nesterov update2 8.8e-8; keras-jax opt
# momentum 1.49e-8). These keys are reported, not held; every other key is.
KERAS_FLOAT64_OPTIMIZER_ROUNDING = {
    ("keras-tensorflow", "nesterov_step"): r"^(update|opt)\d+/|^buffer[1-9]\d*/",
    ("keras-tensorflow", "adamw"): r"^(update|opt)\d+/|^buffer[1-9]\d*/",
    ("keras-jax", "nesterov_step"): r"^opt\d+/momentum/",
}


@pytest.mark.slow
@pytest.mark.parametrize("model", GRAPH_MODELS)
@pytest.mark.parametrize("backend", KERAS_FLOAT64)
def test_keras_float64_probes_match_torch_float64_on_graph_models(backend, model, results_root):
    """The functional-API lowering of every graph kind (residual adds, depthwise convolutions as DepthwiseConv2D,
    LayerNorm, exact GELU, ReLU6) on keras-jax and keras-tensorflow: forward and eval per layer, loss, gradients,
    three updates, buffers and optimizer state against torch float64 (emulating the declared differences).
    Slow: Keras compiles three optimizer cases of each model."""
    need(backend)
    not_held = {case: pat for (b, case), pat in KERAS_FLOAT64_OPTIMIZER_ROUNDING.items() if b == backend}
    agreement = float64_agreement(backend, model, results_root, emulate_declared=True, not_held=not_held)
    for case, (rel, key, rel_all, key_all) in agreement.items():
        print(f"{backend} {model} {case}: held {rel:.3g} ({key}); every key {rel_all:.3g} ({key_all})")
        tol = GRAPH_ADAM_TOL if case.startswith("adam") else PROBE_TOL
        assert rel < tol, f"{backend} {model} {case}: {key} relative error {rel:.3g} >= {tol}"


# ----------------------------------------------------------------------------- Keras 3: the graph faults' seams
# (kept apart from the blocks above: another branch edits this file for the tensorflow wrapper)
_KERAS_FAULT_FORWARD = r'''
import pickle, sys
import numpy as np
from algorithms.optim import HParams
from algorithms.params import init_params
from algorithms.spec import build_model, load_model
from algorithms.contract import RunOptions
from wrappers.base import effective_model_decl
from wrappers.keras.backend import KerasBackend
model, faults, x, out = sys.argv[1], sys.argv[2].split(","), np.load(sys.argv[3]), sys.argv[4]
clean = load_model(model)
res = {}
for f in faults:
    m = build_model(effective_model_decl(clean.to_dict(), f or None))
    b = KerasBackend(m, HParams(optimizer="sgd", batch_size=len(x)), RunOptions(fault=f or None))
    b.load_params(init_params(clean, 0))
    res[f] = b.forward_layers(x, {})
pickle.dump(res, open(out, "wb"))
'''


def test_keras_tensorflow_graph_faults_are_the_reference_s_bugs_at_their_layer(tmp_path):
    """Every graph fault keras-tensorflow claims (the three lowering seams in wrappers/keras/layers.py and
    backend.py, the five declaration rewrites) computes, on the scenario model at the canonical initial weights,
    the forward torch computes with the same fault at the layer the self-test expects (float32, 1e-5 relative;
    concat_wrong_axis: the joined map, torch's following flatten reads it in its own order), and differs there
    from the clean run; every layer before it agrees with the clean run. ~20 s: one Keras process."""
    import os
    import pickle
    need("keras-tensorflow")
    need("torch")
    from algorithms.optim import HParams
    from algorithms.params import init_params
    from algorithms.spec import build_model
    from algorithms.contract import RunOptions
    from wrappers.base import effective_model_decl
    from wrappers.torch.backend import TorchBackend

    from .test_graph_faults import EXPECTED, GRAPH_FAULTS, SCENARIO
    from .conftest import INFO
    claimed = [f for f in GRAPH_FAULTS if f in INFO["keras-tensorflow"]["faults"]]
    assert claimed == list(GRAPH_FAULTS)
    clean = load_model(SCENARIO)
    x = np.random.default_rng(3).normal(size=(8, *clean.input_shape)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    env = {**os.environ, "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "3",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    r = subprocess.run([sys.executable, "-c", _KERAS_FAULT_FORWARD, SCENARIO, ",".join(["", *claimed]),
                        str(tmp_path / "x.npy"), str(tmp_path / "out.pkl")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = pickle.loads((tmp_path / "out.pkl").read_bytes())

    def rel(a, b) -> float:
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float("inf") if a.shape != b.shape else float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), 1e-6)

    names = [l.name for l in clean.layers]
    for f in claimed:
        m = build_model(effective_model_decl(clean.to_dict(), f))
        t = TorchBackend(m, HParams(optimizer="sgd", batch_size=len(x)), RunOptions(fault=f))
        t.load_params(init_params(clean, 0))
        ref = t.forward_layers(x, {})
        at = EXPECTED[f][SCENARIO]
        assert rel(got[f][at], ref[at]) < 1e-5, (f, at, rel(got[f][at], ref[at]))
        assert rel(got[f][at], got[""][at]) > 1e-4, (f, at, "the fault changes nothing at its layer")
        for n in names[:names.index(at)]:
            assert rel(got[f][n], got[""][n]) < 1e-6, (f, n, "a layer before the fault's moved")


def test_keras_layout_holds_a_depthwise_kernel_as_depthwiseconv2d_does():
    """algorithms/layout.py KERAS: a depthwise kernel (kH, kW, 1, C*M) as (kH, kW, C, M) with [.., c, m] the
    canonical output c*M + m, round trip exact, the depthwise_multiplier_order fault's order on top of it."""
    from algorithms.layout import KERAS, from_native, multiplier_major_perm, to_native
    from algorithms.params import init_params

    from .test_graph_faults import SCENARIO
    m = load_model(SCENARIO)
    k = init_params(m, 0)["dw.kernel"]                         # (3, 3, 1, 8): 4 channels x multiplier 2
    native = to_native(m, "dw.kernel", k, KERAS)
    assert native.shape == (3, 3, 4, 2)
    assert all(np.array_equal(native[:, :, c, j], k[:, :, 0, c * 2 + j]) for c in range(4) for j in range(2))
    assert np.array_equal(from_native(m, "dw.kernel", native, KERAS), k)
    bad = to_native(m, "dw.kernel", k, KERAS, channel_major=False)
    assert np.array_equal(bad.reshape(3, 3, 1, 8), k[..., multiplier_major_perm(4, 2)])
    assert np.array_equal(from_native(m, "dw.kernel", bad, KERAS, channel_major=False), k)
