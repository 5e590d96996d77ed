"""Bugs a free-running curve cannot show once its envelope has saturated, on the chaotic models, at the
default evaluation cadence (every 50 steps): a bug confined to the steps at a schedule boundary, and a bug in
the evaluation path seen at the first evaluation. Both were DRIFT before 2026-12-02 (bench/source_bugs.py:
jax_step_schedule_one_step_early, torch_eval_in_train_mode)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from .conftest import need


def test_schedule_points_are_the_steps_around_each_kink_of_the_lr():
    from algorithms.optim import HParams, lr_at
    from harness.resync import schedule_points

    def points(schedule: str, **kw) -> list[int]:
        hp = HParams(steps=300, schedule=schedule, **kw)
        return schedule_points(np.array([lr_at(hp, t) for t in range(300)]))

    assert points("constant") == []
    assert points("step", step_size=100) == [98, 99, 100, 101, 198, 199, 200, 201]
    end = max(points("warmup"))          # the last warm-up step and the first after it, either side
    assert points("warmup") == [end - 2, end - 1, end]
    assert max(points("cosine"), default=0) <= 2       # smooth: only its first steps (the step 0 resync anyway)
    assert len(points("step", step_size=3)) == 24      # capped: at most MAX_SCHEDULE_POINTS


def _compare(ref, cand, out) -> dict:
    from click.testing import CliRunner

    from harness.cli import main
    r = CliRunner().invoke(main, ["compare", str(ref), str(cand), "--json", "--out", str(out), "-j", "2"])
    assert r.exit_code in (0, 1), r.output
    return json.loads(r.stdout)["pairs"][0]


def _run(root, model, steps, fault=None, backend="torch", **hp_extra):
    from algorithms.contract import RunConfig
    from algorithms.optim import HParams
    from harness import runner
    hp = HParams(steps=steps, eval_every=50, checkpoint_every=50, **hp_extra)
    return runner.execute(RunConfig(model=model, backend=backend, hparams=hp, fault=fault), root)


@pytest.mark.slow
def test_a_bug_at_the_schedule_boundary_of_a_chaotic_run_is_found_by_the_resync(tmp_path):
    """cnn2d_3conv_3fc, a step schedule decaying at step 100, jax against torch (its curves have drifted out
    of the envelope's power before step 99: saturated at step ~46), the scheduler stepped before the
    optimizer, the lr logged right: only the update of step 99 differs. The resync probes the steps around
    the boundary: BUG at step 99, optimizer (DRIFT before: no resync point there, and no free-running power
    left)."""
    need("torch")
    need("jax")
    hp = {"schedule": "step", "step_size": 100}
    ref = _run(tmp_path, "cnn2d_3conv_3fc", 130, **hp)
    cand = _run(tmp_path, "cnn2d_3conv_3fc", 130, fault="lr_schedule_off_by_one", backend="jax", **hp)
    p = _compare(ref, cand, tmp_path / "cmp")
    assert p["verdict"] == "BUG", p["notes"]
    assert p["first_divergence"]["step"] == 99 and p["localization"]["stage"] == "optimizer", p["localization"]


@pytest.mark.slow
def test_an_evaluation_bug_is_seen_at_the_first_evaluation_at_the_default_cadence(tmp_path):
    """cnn2d_hard, evaluations every 50 steps, dropout left on in evaluation: the evaluation of the initial
    weights already differs. The envelope's window is +-5 steps, not +-5 evaluations (250 steps, where the
    evaluation spread is saturated): BUG at step 0, stage eval."""
    need("torch")
    ref = _run(tmp_path, "cnn2d_hard", 200)
    cand = _run(tmp_path, "cnn2d_hard", 200, fault="dropout_in_eval")
    p = _compare(ref, cand, tmp_path / "cmp")
    assert p["verdict"] == "BUG", p["notes"]
    assert p["first_divergence"]["step"] == 0 and p["first_divergence"]["series"].startswith("eval_")
    assert p["localization"]["stage"] == "eval", p["localization"]
