"""Canonical parameters (seeded, hashed, 1-ULP perturbation) and the reference optimizer maths,
each piece checked against a hand-applied formula (optax style)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from algorithms.optim import HParamError, HParams, float32_bias_corrections, lr_at, reference_init, reference_update
from algorithms.params import init_params, load_npz, params_hash, perturb_ulp, save_npz
from algorithms.spec import load_model


def test_init_is_seeded_and_shaped(tmp_path):
    m = load_model("cnn2d_hard")
    a, b = init_params(m, 0), init_params(m, 0)
    assert params_hash(a) == params_hash(b) != params_hash(init_params(m, 1))
    for p in m.params:
        assert a[p.name].shape == p.shape and a[p.name].dtype == np.float32
    k = a["conv2.kernel"]
    assert abs(k.std() - math.sqrt(2 / (3 * 3 * 16))) < 0.01      # he_normal: std sqrt(2 / fan_in)
    assert np.all(a["bn1.running_var"] == 1) and np.all(a["bn1.beta"] == 0)
    save_npz(tmp_path / "p.npz", a)
    assert params_hash(load_npz(tmp_path / "p.npz")) == params_hash(a)


def test_perturb_moves_each_nonzero_weight_one_ulp():
    m = load_model("cnn2d_2conv_2fc")
    a = init_params(m, 0)
    b = perturb_ulp(a, 1)
    k0, k1 = a["fc1.kernel"], b["fc1.kernel"]
    ulps = np.abs(k1.view(np.int32).astype(np.int64) - k0.view(np.int32).astype(np.int64))
    assert np.all(ulps[k0 != 0] == 1)
    assert np.array_equal(a["fc1.bias"], b["fc1.bias"])             # zeros stay zero
    up = (k1 > k0).mean()
    assert 0.4 < up < 0.6                                            # seeded random sign
    assert params_hash(perturb_ulp(a, 1)) == params_hash(b) != params_hash(perturb_ulp(a, 2))


def test_schedules():
    h = HParams(lr=1.0, schedule="step", step_size=10, gamma=0.5, steps=100)
    assert [lr_at(h, t) for t in (0, 9, 10, 25)] == [1.0, 1.0, 0.5, 0.25]
    c = HParams(lr=1.0, schedule="cosine", steps=100)
    assert lr_at(c, 0) == 1.0 and abs(lr_at(c, 50) - 0.5) < 1e-12 and lr_at(c, 100) < 1e-12
    w = HParams(lr=1.0, schedule="warmup", warmup_steps=4)
    assert [lr_at(w, t) for t in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]


def test_bad_hparams_name_field():
    with pytest.raises(HParamError, match="'optimizer'"):
        HParams(optimizer="rmsprop")
    with pytest.raises(HParamError, match="'lr'"):
        HParams(lr=-1.0)
    with pytest.raises(HParamError, match="unknown hyper-parameter"):
        HParams.from_dict({"lr": 0.1, "nonsense": 1})


def _one(opt, **kw):
    h = HParams(optimizer=opt, lr=0.1, **kw)
    p = {"w": np.array([1.0, -2.0])}
    g = {"w": np.array([0.5, 0.25])}
    s = reference_init(h, p)
    p1, s1 = reference_update(h, 0, p, g, s)
    p2, s2 = reference_update(h, 1, p1, g, s1)
    return h, p, g, p1, p2


def test_reference_sgd_momentum_nesterov_by_hand():
    h, p, g, p1, p2 = _one("sgd", weight_decay=0.1)
    np.testing.assert_allclose(p1["w"], p["w"] - 0.1 * (g["w"] + 0.1 * p["w"]))
    h, p, g, p1, p2 = _one("momentum")
    b1 = g["w"]
    b2 = 0.9 * b1 + g["w"]
    np.testing.assert_allclose(p2["w"], p["w"] - 0.1 * b1 - 0.1 * b2)
    h, p, g, p1, p2 = _one("nesterov")
    np.testing.assert_allclose(p1["w"], p["w"] - 0.1 * (g["w"] + 0.9 * g["w"]))


def test_reference_adam_and_eps_hat_by_hand():
    h = HParams(optimizer="adam", lr=0.1, eps=1e-3)
    p, g = {"w": np.array([1.0])}, {"w": np.array([0.5])}
    p1, s1 = reference_update(h, 0, p, g, reference_init(h, p))
    m, v = 0.1 * 0.5, 0.001 * 0.25
    mh, vh = m / 0.1, v / 0.001
    np.testing.assert_allclose(p1["w"], 1.0 - 0.1 * mh / (math.sqrt(vh) + 1e-3))
    q1, _ = reference_update(h, 0, p, g, reference_init(h, p), adam_eps_hat=True)
    np.testing.assert_allclose(q1["w"], 1.0 - 0.1 * math.sqrt(0.001) / 0.1 * m / (math.sqrt(v) + 1e-3))
    assert abs(q1["w"][0] - p1["w"][0]) > 1e-4                     # the forms really differ


def test_keras_bias_corrections_use_float32_betas():
    """Keras casts the betas to float32 before the power: 1 - b2 is 1.3e-5 relative low at t = 1, the same
    sign at every step (the systematic difference keras_float32_betas declares)."""
    h = HParams(optimizer="adam")
    k1, k2 = float32_bias_corrections(h, 1)
    assert k2 == float(np.float32(1) - np.float32(0.999)) and k1 == float(np.float32(1) - np.float32(0.9))
    assert -1.4e-5 < k2 / (1 - 0.999) - 1 < -1.2e-5
    for t in (2, 10, 100, 1000):
        assert float32_bias_corrections(h, t)[1] < 1 - 0.999 ** t          # always low: a bias, not rounding


def test_reference_adamw_is_decoupled():
    h = HParams(optimizer="adamw", lr=0.1, weight_decay=0.5)
    p, g = {"w": np.array([2.0])}, {"w": np.array([0.0])}
    p1, _ = reference_update(h, 0, p, g, reference_init(h, p))
    np.testing.assert_allclose(p1["w"], 2.0 * (1 - 0.1 * 0.5))       # zero gradient: only the decay moves it


def test_replay_probes_keep_a_strided_sample_of_every_feature_map():
    """A replay's feature maps keep REPLAY_ACTIVATION_ROWS rows spread over the batch (both shards of a
    dp=2 batch); dense activations, logits and everything else stay whole."""
    from algorithms.params import REPLAY_ACTIVATION_ROWS, thin_activations
    x = np.arange(64 * 4 * 4 * 2, dtype=np.float32).reshape(64, 4, 4, 2)
    p = {"forward/conv1": x, "eval/conv1": x, "forward/fc": np.ones((64, 10)), "grad/conv1.kernel": np.ones((3, 3, 1, 2)),
         "forward/small": x[:4], "loss": np.asarray(1.0)}
    t = thin_activations(p)
    assert t["forward/conv1"].shape == (REPLAY_ACTIVATION_ROWS, 4, 4, 2)
    np.testing.assert_array_equal(t["forward/conv1"], x[::64 // REPLAY_ACTIVATION_ROWS])
    assert t["forward/conv1"][REPLAY_ACTIVATION_ROWS // 2 :, 0, 0, 0].min() >= x[32, 0, 0, 0]   # the second shard
    np.testing.assert_array_equal(t["eval/conv1"], t["forward/conv1"])
    for k in ("forward/fc", "grad/conv1.kernel", "forward/small", "loss"):
        assert np.shape(t[k]) == np.shape(p[k])
