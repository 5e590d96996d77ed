"""Data parallelism of the Keras backends: keras-jax (keras.distribution.DataParallel over N forced host
devices) and keras-tensorflow (tf.distribute.MirroredStrategy over N logical CPU devices); keras-torch
refuses it.

The agreement rule, as for the jax backend (tests/test_dp_jax.py): a correct dp=N run is a reordering of
the same arithmetic, so max_t |loss_N - loss_1| <= 3 x the one-ULP envelope, the larger of
|dp=1 - dp=1 with --perturb-ulp 1| and |--perturb-ulp 1 - --perturb-ulp 2|. The two catalogued
data-parallel faults break it by orders of magnitude.

Logical CPU devices (TF) and forced host devices (XLA) can be set only before the framework starts, and
a Keras backend needs its own process (KERAS_BACKEND is read at import): the numbers come from ONE fresh
process per backend (`_batch`: the framework imported once, 4 devices, every configuration trained in
it through the backend's own train_step, the harness's data, order, masks and initial weights). The
command-line path (steps.csv replica columns, manifest) is checked by one short run through the runner.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from .conftest import ROOT, need

STEPS = 30
MARGIN = 3.0
DEVICES = 4          # per collector process


# --------------------------------------------------------------------------- in one process per backend
def _batch(backend: str, configs: list[dict], out_root: str) -> dict:
    """Train every config in this process (the framework imported once with DEVICES devices)."""
    from algorithms.contract import RunOptions
    from wrappers.__main__ import set_backend_env
    from wrappers.registry import REGISTRY
    set_backend_env(REGISTRY[backend], RunOptions(threads=1, devices=DEVICES))
    cls = REGISTRY[backend].load()
    if backend == "keras-tensorflow":
        import tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * DEVICES)
    from algorithms.optim import HParams
    from algorithms.contract import RunConfig
    from harness.runner import prepare
    from algorithms.contract import RunOptions
    from wrappers.base import UnsupportedError
    from tests.dp_runs import joint_agreement, train_in_process
    out = {}
    for c in configs:
        hp = HParams(steps=c.get("steps", STEPS))
        cfg = RunConfig(model=c.get("model", "cnn2d_2conv_2fc"), backend=backend, hparams=hp,
                        devices=c.get("devices", 1), fault=c.get("fault"), perturb_ulp=c.get("ulp"),
                        extra=c.get("extra", {}))
        prep = prepare(cfg, Path(out_root))
        try:
            b = cls(prep.model, hp, RunOptions(devices=cfg.devices, fault=cfg.fault, extra=cfg.extra))
        except UnsupportedError as e:
            out[c["key"]] = {"refused": str(e)}
            continue
        b.name = backend
        rows, final = train_in_process(b, prep, hp)   # keras-tensorflow's export checks its replicas agree
        out[c["key"]] = {"rows": rows, "declared": b.declared_differences(), "traces": b.net.traces,
                         "parallel": b.parallel_info(), "devices": b.devices(),
                         "final_finite": bool(all(np.isfinite(v).all() for v in final.values()))}
        if prep.model.has("batchnorm2d"):      # the forward probe per replica: each shard's bn1 output mean
            from wrappers.worker import masks_for
            n = hp.batch_size          # the batch the model was built for (its dropout masks' shape)
            x = np.random.default_rng(0).random((n, *prep.model.input_shape)).astype(np.float32)
            bn1 = b.forward_layers(x, masks_for(prep.model, hp.seed, 0, n, "harness"))["bn1"]
            out[c["key"]]["bn1_shard_means"] = [bn1[:n // 2].mean(axis=(0, 1, 2)).tolist(),
                                                bn1[n // 2:].mean(axis=(0, 1, 2)).tolist()]
            out[c["key"]]["bn1_beta"] = b.export_params()["bn1.beta"].tolist()
            out[c["key"]]["joint"] = joint_agreement(b, prep.model, hp)
    return out


def configs(backend: str) -> list[dict]:
    cs = [{"key": "dp1"}, {"key": "ulp1", "ulp": 1}, {"key": "ulp2", "ulp": 2},
          {"key": "dp2"}, {"key": "dp2_again"},
          {"key": "grad_sum_replicas", "devices": 2, "fault": "grad_sum_replicas"},
          {"key": "overlapping_shards", "devices": 2, "fault": "overlapping_shards"},
          {"key": "hard_dp2", "model": "cnn2d_hard", "devices": 2, "steps": 2},
          {"key": "hard_dp2_sync", "model": "cnn2d_hard", "devices": 2, "steps": 2, "extra": {"sync_bn": True}},
          {"key": "hosts2", "devices": 2, "steps": 1, "extra": {"hosts": 2}}]
    for c in cs:
        if c["key"].startswith("dp2"):
            c["devices"] = 2
    if backend == "keras-jax":          # dp=4 on one of the two (the other's dp=2 alone keeps the test short)
        cs.append({"key": "dp4", "devices": 4})
    return cs


_CACHE: dict[str, dict] = {}


def batch(backend: str, root: Path) -> dict:
    need(backend)
    if backend not in _CACHE:
        code = (f"import json; from tests.test_dp_keras import _batch, configs; "
                f"print('RESULT' + json.dumps(_batch({backend!r}, configs({backend!r}), {str(root)!r})))")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=900,
                           env={**os.environ, "PYTHONHASHSEED": "0"})
        if r.returncode != 0:
            _CACHE[backend] = {"error": r.stderr[-4000:]}
        else:
            line = next(l for l in r.stdout.splitlines() if l.startswith("RESULT"))
            _CACHE[backend] = {k: {**v, "rows": np.asarray(v["rows"], np.float64)} if "rows" in v else v
                               for k, v in json.loads(line[6:]).items()}
    if "error" in _CACHE[backend]:
        pytest.fail(f"collector for {backend} failed:\n{_CACHE[backend]['error']}")
    return _CACHE[backend]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("dp_keras")


DP = ["keras-jax", "keras-tensorflow"]


def loss(run) -> np.ndarray:
    return run["rows"][:, 0]


def max_diff(a, b) -> float:
    return float(np.max(np.abs(loss(a) - loss(b))))


def envelope(res) -> float:
    return MARGIN * max(max_diff(res["dp1"], res["ulp1"]), max_diff(res["ulp1"], res["ulp2"]))


# --------------------------------------------------------------------------- agreement
@pytest.mark.parametrize("backend", DP)
def test_dp_agrees_with_dp1_within_the_ulp_envelope(backend, root):
    res = batch(backend, root)
    env = envelope(res)
    assert env > 0                                  # the one-ULP runs really moved
    for key in [k for k in ("dp2", "dp4") if k in res]:
        d = max_diff(res[key], res["dp1"])
        assert d <= env, f"{backend} {key} vs dp=1: max |loss diff| {d:.3g} > 3 x ulp envelope {env:.3g}"
        assert res[key]["final_finite"]
        n = res[key]["parallel"]["replicas"]
        # one compilation for the whole run, whatever the learning rate or the masks
        # (TF: one trace of Keras' tf.function, in which strategy.run calls train_step once per replica)
        assert res[key]["traces"] == (n if backend == "keras-tensorflow" else 1), res[key]["traces"]
    assert res["dp1"]["parallel"] == {"strategy": "single device", "replicas": 1, "processes": 1}


@pytest.mark.parametrize("backend", DP)
def test_dp_runs_are_bitwise_repeatable(backend, root):
    res = batch(backend, root)
    assert np.array_equal(res["dp2"]["rows"], res["dp2_again"]["rows"])


@pytest.mark.parametrize("backend", DP)
def test_replica_losses_are_the_shards_and_average_to_the_loss(backend, root):
    res = batch(backend, root)
    for key in [k for k in ("dp2", "dp4") if k in res]:
        rows, n = res[key]["rows"], res[key]["parallel"]["replicas"]
        assert rows.shape[1] == 2 + n
        reps = rows[:, 2:]
        np.testing.assert_allclose(reps.mean(axis=1), rows[:, 0], rtol=1e-6, atol=0)
        assert np.all(np.ptp(reps, axis=1) > 0)           # different shards, different losses
        p = res[key]["parallel"]
        assert p["processes"] == 1 and p["hosts"] == 1 and len(p["devices"]) == n and p["sync_bn"] is False
        assert p["strategy"] == ("keras.distribution.DataParallel" if backend == "keras-jax" else "MirroredStrategy")
        assert len(res[key]["devices"]) == n
    # step 0, same weights and batch: the global-batch mean gradient, not N x
    assert res["dp2"]["rows"][0, 1] == pytest.approx(res["dp1"]["rows"][0, 1], rel=1e-5)


# --------------------------------------------------------------------------- faults
@pytest.mark.parametrize("backend", DP)
@pytest.mark.parametrize("fault", ["grad_sum_replicas", "overlapping_shards"])
def test_data_parallel_faults_break_the_agreement(backend, fault, root):
    res = batch(backend, root)
    env = envelope(res)
    d = max_diff(res[fault], res["dp1"])
    assert d > 100 * env, f"{backend} {fault}: max |loss diff| {d:.3g} is not far outside the envelope {env:.3g}"
    if fault == "grad_sum_replicas":     # N x the mean gradient at step 0 (same weights, same batch)
        assert res[fault]["rows"][0, 1] == pytest.approx(2 * res["dp1"]["rows"][0, 1], rel=1e-5)
    else:                                # both replicas saw shard 0
        r = res[fault]["rows"][:, 2:]
        assert np.array_equal(r[:, 0], r[:, 1])


# --------------------------------------------------------------------------- BatchNorm, hosts, keras-torch
@pytest.mark.parametrize("backend", DP)
def test_batchnorm_statistics_are_declared_as_computed(backend, root):
    """keras-tensorflow: per-replica statistics unless --sync-bn (BatchNormalization(synchronized=True));
    keras-jax: DataParallel is one program over the global batch, its statistics are the global batch's
    (nothing to declare, --sync-bn changes nothing)."""
    res = batch(backend, root)
    per, sync = res["hard_dp2"], res["hard_dp2_sync"]
    assert sync["parallel"]["sync_bn"] is True and per["parallel"]["sync_bn"] is False
    assert "per_replica_batchnorm" not in sync["declared"]
    if backend == "keras-tensorflow":
        assert "per_replica_batchnorm" in per["declared"]
        assert "synchronized=True" in sync["parallel"]["batchnorm"]
        assert not np.array_equal(per["rows"][:, 0], sync["rows"][:, 0])
    else:
        assert "per_replica_batchnorm" not in per["declared"]
        assert "global-batch" in per["parallel"]["batchnorm"]
        assert np.array_equal(per["rows"], sync["rows"])


@pytest.mark.parametrize("backend", DP)
def test_the_forward_probe_normalises_as_the_replicas_step_does(backend, root):
    """The forward probe of a dp=2 run is the training step's forward on its replicas: with per-replica
    BatchNorm (keras-tensorflow without --sync-bn) each replica's shard is normalised by its own statistics, so
    each shard's bn1 output averages to beta; with global statistics (--sync-bn, or keras-jax's one GSPMD
    program) only the two shards together do. (A probe that ran the global batch through one replica, or
    whose replicas raced for one record, fails one side.)"""
    res = batch(backend, root)
    for key in ("hard_dp2", "hard_dp2_sync"):
        means, beta = np.asarray(res[key]["bn1_shard_means"]), np.asarray(res[key]["bn1_beta"])
        np.testing.assert_allclose(means.mean(axis=0), beta, atol=1e-5, err_msg=key)
        per_replica = backend == "keras-tensorflow" and key == "hard_dp2"
        gap = float(np.max(np.abs(means - beta)))
        assert (gap < 1e-5) if per_replica else (gap > 1e-3), (key, gap)


@pytest.mark.parametrize("backend", DP)
def test_the_recorded_step_program_spans_the_replicas(backend, root):
    """Backend.layers_and_gradients under data parallelism (harness.kinks.same_when_recorded: the activations the
    replicas' gradients saw): every layer's output over the global batch and the combined gradients from one
    program, equal to the forward probes and the gradient probe up to the rounding of another compiled program,
    with per-replica and with synchronised BatchNorm."""
    res = batch(backend, root)
    for key in ("hard_dp2", "hard_dp2_sync"):
        j = res[key]["joint"]
        assert not j["none"] and j["layer_names"] and j["grad_names"], (key, j)
        assert j["layers"] < 1e-5 and j["grads"] < 1e-4 and j["loss"] < 1e-6, (key, j)


@pytest.mark.parametrize("backend", DP)
def test_hosts_refused_loudly(backend, root):
    r = batch(backend, root)["hosts2"]
    assert "--hosts is not implemented" in r["refused"]


def test_keras_torch_refuses_data_parallelism(results_root):
    from algorithms.optim import HParams
    from algorithms.contract import RunConfig
    from harness.runner import execute
    from harness.errors import BackendFailed
    need("keras-torch")
    with pytest.raises(BackendFailed, match="Keras has no data parallelism on the torch backend") as e:
        execute(RunConfig(backend="keras-torch", hparams=HParams(steps=2), devices=2), results_root)
    assert e.value.unsupported


def test_the_command_line_run_writes_replica_columns_and_the_layout(results_root):
    """One short keras-tensorflow dp=2 run through the runner: steps.csv and manifest.json as the harness writes them."""
    from algorithms.optim import HParams
    from algorithms.contract import RunConfig
    from harness.runner import execute
    need("keras-tensorflow")
    folder = execute(RunConfig(backend="keras-tensorflow", hparams=HParams(steps=3, eval_every=3, checkpoint_every=3),
                               devices=2), results_root)
    s = pd.read_csv(folder / "steps.csv")
    assert list(s.columns[-2:]) == ["replica_loss_0", "replica_loss_1"] and len(s) == 3
    man = json.loads((folder / "manifest.json").read_text())
    assert man["parallel"]["strategy"] == "MirroredStrategy" and man["parallel"]["replicas"] == 2
    assert len(man["devices"]) == 2
