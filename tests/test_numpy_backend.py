"""The numpy backend in-process: its data parallelism (explicit all-reduce, per-replica or synchronized
BatchNorm, the two replica faults), state round trips, read-only probes, its dtype and its refusals."""
from __future__ import annotations

import numpy as np
import pytest

from algorithms import data as D
from algorithms.optim import HParams
from algorithms.params import init_params
from algorithms.spec import load_model
from algorithms.contract import RunOptions
from wrappers.base import UnsupportedError
from wrappers.numpy.backend import NumpyBackend

BATCH = 8


def make(model: str = "cnn2d_hard", hp: HParams | None = None, **opts) -> NumpyBackend:
    m = load_model(model)
    b = NumpyBackend(m, hp or HParams(optimizer="adam", lr=1e-3), RunOptions(**{"dtype": "float64", **opts}))
    b.load_params(init_params(m, 0))
    return b


def batch(b: NumpyBackend, step: int = 0):
    rng = np.random.default_rng(step)
    x = rng.normal(0.0, 1.0, (BATCH, *b.model.input_shape))
    y = rng.integers(0, b.model.num_classes, BATCH)
    masks = {l.name: D.dropout_keep_mask(0, step, l.index, (BATCH, *l.out_shape), l.spec["rate"])
             for l in b.model.layers if l.kind == "dropout"}
    return x, y, masks


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-300))


def test_replicas_without_batchnorm_reduce_to_the_global_gradient():
    """Mean of the replicas' mean-loss gradients over equal shards = the global-batch gradient."""
    one, two = make("cnn2d_2conv_2fc"), make("cnn2d_2conv_2fc", devices=2)
    x, y, m = batch(one)
    l1, g1 = one.gradients(x, y, m)
    l2, g2 = two.gradients(x, y, m)
    assert abs(l1 - l2) < 1e-14
    assert max(rel(g2[k], g1[k]) for k in g1) < 1e-12
    assert two.declared_differences() == []


@pytest.mark.parametrize("fault, at", [("lr_rel_1e-02", 0), ("lr_rel_1e-02_from_1", 1)])
def test_an_lr_perturbation_is_applied_to_the_update_and_not_logged(fault, at):
    """The perturbation family's lr target moves what the optimizer applies (Backend.lr_for) from its step;
    the NumPy update once ignored it and computed the schedule's rate itself (self-test: lr faults DRIFT)."""
    hp = HParams(optimizer="sgd", lr=0.05)
    clean, bad = make("cnn2d_2conv_2fc", hp), make("cnn2d_2conv_2fc", hp, fault=fault)
    for step in range(2):
        x, y, m = batch(clean, step)
        before = {k: v.copy() for k, v in clean.export_params().items()}
        clean.train_step(step, x, y, m)
        bad.train_step(step, x, y, m)
        a, b = clean.export_params(), bad.export_params()
        for k in a:
            du_clean, du_bad = a[k] - before[k], b[k] - before[k]
            want = 1.01 if step >= at else 1.0
            assert np.allclose(du_bad, want * du_clean, rtol=1e-9, atol=0), (fault, step, k)
        bad.load_params(a)                            # the same state for the next step
        assert bad.logged_lr(step) == clean.logged_lr(step)


def test_per_replica_batchnorm_differs_and_sync_bn_is_the_global_batch():
    one, per, sync = make(), make(devices=2), make(devices=2, extra={"sync_bn": True})
    x, y, m = batch(one)
    _, g1 = one.gradients(x, y, m)
    _, gp = per.gradients(x, y, m)
    _, gs = sync.gradients(x, y, m)
    assert max(rel(gs[k], g1[k]) for k in g1) < 1e-12            # all-reduced statistics: the dp=1 maths
    assert rel(gp["conv1.kernel"], g1["conv1.kernel"]) > 1e-3      # each replica's own statistics
    assert per.declared_differences() == ["per_replica_batchnorm"] and sync.declared_differences() == []
    # running statistics: replica 0's under per-replica BatchNorm (DDP's broadcast), the global batch's under sync
    for b in (one, per, sync):
        b.train_step(0, x, y, m)
    half = make()
    half.train_step(0, x[:BATCH // 2], y[:BATCH // 2], {k: v[:BATCH // 2] for k, v in m.items()})
    for k in ("bn1.running_mean", "bn2.running_var"):
        assert rel(sync.p[k], one.p[k]) < 1e-12
        assert rel(per.p[k], half.p[k]) < 1e-12


def test_replica_faults():
    x, y, m = batch(make("cnn2d_2conv_2fc"))
    _, g = make("cnn2d_2conv_2fc", devices=2).gradients(x, y, m)
    _, gsum = make("cnn2d_2conv_2fc", devices=2, fault="grad_sum_replicas").gradients(x, y, m)
    assert max(rel(gsum[k], 2 * g[k]) for k in g) < 1e-12
    _, gover = make("cnn2d_2conv_2fc", devices=2, fault="overlapping_shards").gradients(x, y, m)
    _, g0 = make("cnn2d_2conv_2fc").gradients(x[:BATCH // 2], y[:BATCH // 2], {})
    assert max(rel(gover[k], g0[k]) for k in g) < 1e-12
    with pytest.raises(UnsupportedError, match="not implemented"):
        make(fault="flatten_no_permute")


def test_probe_primitives_leave_the_state_alone():
    b = make()
    x, y, m = batch(b)
    before = b.export_params()
    b.forward_layers(x, m)
    b.eval_layers(x)
    b.gradients(x, y, m)
    b.evaluate(x, y)
    after = b.export_params()
    assert all(np.array_equal(before[k], after[k]) for k in before)
    assert b.export_opt_state() == {}                                # torch's optimizer state is empty before a step


def test_state_round_trip_continues_the_run_bit_exactly():
    """Train 2 steps, export, load into a fresh backend: the third step is the same bits in both."""
    hp = HParams(optimizer="adamw", lr=1e-3, weight_decay=1e-2, schedule="cosine", steps=3)
    a = make(hp=hp)
    for s in range(2):
        a.train_step(s, *batch(a, s))
    params, state = a.export_params(), a.export_opt_state()
    assert {"step", "exp_avg/conv1.kernel", "exp_avg_sq/fc2.bias"} <= set(state) and float(state["step"]) == 2
    b = make(hp=hp)
    b.load_params(params)
    b.load_opt_state(state, 2)
    sa, sb = a.train_step(2, *batch(a, 2)), b.train_step(2, *batch(b, 2))
    assert sa == sb
    pa, pb = a.export_params(), b.export_params()
    assert all(np.array_equal(pa[k], pb[k]) for k in pa)


def test_float32_on_request():
    b = make(dtype="float32")
    x, y, m = batch(b)
    st = b.train_step(0, x, y, m)
    assert all(v.dtype == np.float32 for v in b.export_params().values())
    assert all(v.dtype == np.float32 for k, v in b.export_opt_state().items() if k != "step")
    b64 = make()
    st64 = b64.train_step(0, x, y, m)
    assert abs(st.loss - st64.loss) / st64.loss < 1e-5


def test_refusals_say_why():
    with pytest.raises(UnsupportedError, match="harness masks"):
        make(dropout="native")
    with pytest.raises(UnsupportedError, match="one process"):
        make(devices=2, extra={"hosts": 2})
    with pytest.raises(UnsupportedError, match="float32 or float64"):
        make(dtype="float16")
