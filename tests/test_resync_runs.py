"""The shared-state step comparison on real torch runs of the chaotic model (cnn2d_3conv_3fc, momentum
lr 0.05: its loss envelope saturates at step 49): a drift-only candidate (two threads) is DRIFT through
the resync where the free-running curves alone say INCONCLUSIVE, and a fault that starts at a schedule
boundary after a resync point is a BUG. About ten torch processes of 60 steps: in the slow set."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from .conftest import need

STEPS = 60


def _run(root, **cfg):
    from algorithms.optim import HParams
    from harness import runner
    from algorithms.contract import RunConfig
    need("torch")
    hp = HParams(steps=STEPS, optimizer="momentum", lr=0.05, schedule="step", step_size=30, gamma=0.5,
                 eval_every=10, checkpoint_every=10)
    return runner.execute(RunConfig(model="cnn2d_3conv_3fc", backend="torch", hparams=hp, **cfg), root)


def _compare(*args):
    from harness.cli import main
    r = CliRunner().invoke(main, ["compare", *map(str, args), "--json"], catch_exceptions=False)
    assert r.exit_code in (0, 1), r.output
    return r.exit_code, json.loads(r.stdout)


@pytest.fixture(scope="module")
def chaotic(tmp_path_factory):
    root = tmp_path_factory.mktemp("resync-runs")
    ref, two = _run(root), _run(root, threads=2)
    late = _run(root, fault="keras_momentum_schedule")
    return root, ref, two, late


@pytest.mark.slow
def test_two_threads_on_the_chaotic_model_is_drift_by_the_resync(chaotic):
    root, ref, two, _ = chaotic
    code, doc = _compare(ref, two, "--resync-every", "10", "--out", root / "out-two")
    p = doc["pairs"][0]
    assert code == 0 and p["verdict"] == "DRIFT", p["notes"]
    rs = p["resync"]
    assert rs["agree"] and rs["n"] >= 6 and rs["calibrated"] and rs["sequential"]["bias"] is None
    # the free-running curves alone cannot say it
    code, doc = _compare(ref, two, "--resync-every", "0", "--out", root / "out-two-off")
    q = doc["pairs"][0]
    assert q["verdict"] in ("INCONCLUSIVE", "DRIFT") and q["resync"] is None
    assert any("no shared-state step comparison" in n for n in q["notes"])


@pytest.mark.slow
def test_fault_from_a_schedule_boundary_after_a_resync_point_is_a_bug(chaotic):
    """Keras' velocity keeps the old lr: the step at the boundary (30) computes another update."""
    root, ref, _, late = chaotic
    code, doc = _compare(ref, late, "--resync-every", "10", "--out", root / "out-late")
    p = doc["pairs"][0]
    assert code == 1 and p["verdict"] == "BUG", p["notes"]
    assert p["localization"]["stage"] == "optimizer"
    pts = {x["step"]: x["agree"] for x in p["resync"]["per_point"]}
    assert pts[0] and pts[10] and pts[20]           # before the boundary every step agrees
