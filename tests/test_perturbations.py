"""Perturbation faults (algorithms/faults.py): a hyper-parameter off by a little, applied the same way by every
wrapper through the seams in wrappers/base.py — checked here against the hand-applied value, and end to end
on torch: a learning rate off by 1e-5, which no per-step tolerance sees, is BUG (optimizer) by the sequential
test over the resynced steps."""
from __future__ import annotations

import numpy as np
import pytest

from algorithms.faults import FAULTS, fault_info, perturbation, perturbation_name
from algorithms.optim import HParams
from algorithms.spec import build_model, load_model
from wrappers.base import WORKER_FAULTS, effective_hparams, effective_model_decl, eval_inputs


def test_names_parse_and_round_trip():
    assert perturbation("lr_rel_1e-05").apply(0.05) == pytest.approx(0.05 * (1 + 1e-5), rel=1e-15)
    assert perturbation("momentum_abs_1e-05").apply(0.9) == pytest.approx(0.90001, rel=1e-15)
    p = perturbation("lr_rel_1e-04_from_100")
    assert (p.target, p.start) == ("lr", 100)
    assert perturbation("momentum_abs_1e-05_from_100") is None   # only the lr is applied per step
    assert perturbation("flatten_no_permute") is None and perturbation(None) is None
    assert perturbation("lr_rel_1e-3x") is None
    assert perturbation_name("bn_eps", "rel", 1e-3) == "bn_eps_rel_1e-03"
    with pytest.raises(ValueError, match="not a perturbation"):
        perturbation_name("dropout", "rel", 1e-3)
    assert fault_info("weight_decay_abs_1e-03").stage == "optimizer"
    assert fault_info("eval_input_rel_1e-02").stage == "eval"
    # the catalogued subtle faults are perturbations every wrapper implements
    subtle = {n for n in FAULTS if perturbation(n) is not None}
    assert len(subtle) >= 8 and subtle <= WORKER_FAULTS


def test_the_seams_apply_exactly_the_perturbation():
    hp = HParams(optimizer="adam", lr=1e-3, eps=1e-8, weight_decay=0.0)
    assert effective_hparams(hp, "eps_abs_9e-08").eps == pytest.approx(1e-7, rel=1e-12)
    assert effective_hparams(hp, "weight_decay_abs_1e-05").weight_decay == 1e-5
    assert effective_hparams(hp, "lr_rel_1e-05") == hp          # the lr: Backend.lr_for, per step
    hard = load_model("cnn2d_hard")
    import tomllib
    from algorithms.spec import MODELS_DIR
    decl = tomllib.loads((MODELS_DIR / "cnn2d_hard.toml").read_text())
    moved = build_model(effective_model_decl(decl, "bn_eps_abs_1e-05"))
    eps = {l.name: l.spec.options["eps"] for l in moved.layers if l.kind == "batchnorm2d"}
    assert eps == {l.name: l.spec.options["eps"] + 1e-5 for l in hard.layers if l.kind == "batchnorm2d"}
    assert effective_model_decl(decl, "lr_rel_1e-05") is decl
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    assert eval_inputs(x, None) is x
    got = eval_inputs(x, "eval_input_rel_1e-04")
    assert got.dtype == np.float32 and np.allclose(got, x * (1 + 1e-4), rtol=1e-7)


def test_the_logged_lr_is_the_nominal_one_and_the_applied_one_moves_from_its_step():
    from algorithms.optim import lr_at
    from algorithms.contract import RunOptions
    from wrappers.base import Backend
    hp = HParams(lr=0.05, schedule="step", step_size=100)
    b = Backend.__new__(Backend)
    b.hp, b.opts = hp, RunOptions(fault="lr_rel_1e-04_from_100")
    assert b.logged_lr(150) == lr_at(hp, 150) and b.lr_for(99) == lr_at(hp, 99)
    assert b.lr_for(150) == pytest.approx(lr_at(hp, 150) * (1 + 1e-4), rel=1e-12)
    # the scheduler stepped before the optimizer: the update at 99 takes step 100's lr, the log stays the schedule's
    b.opts = RunOptions(fault="lr_schedule_off_by_one")
    assert b.lr_for(99) == lr_at(hp, 100) != lr_at(hp, 99) and b.lr_for(100) == lr_at(hp, 101)
    assert [b.logged_lr(t) for t in (98, 99, 100)] == [lr_at(hp, t) for t in (98, 99, 100)]


@pytest.mark.slow
def test_a_learning_rate_off_by_1e_5_is_a_bug_in_the_optimizer(results_root):
    from harness.compare_runs import compare_runs
    from harness import runner
    root = results_root / "perturb"
    hp = HParams(steps=60, eval_every=30, checkpoint_every=30)
    ref = runner.execute(runner.RunConfig(model="cnn2d_2conv_2fc", backend="torch", hparams=hp), root)
    bad = runner.execute(runner.RunConfig(model="cnn2d_2conv_2fc", backend="torch", hparams=hp, fault="lr_rel_1e-05"),
                         root)
    import json
    out = compare_runs(paths=[ref, bad], reference="torch", resync_every=10, out=root / "cmp", log=lambda s: None)
    pair = next(p for p in json.loads(out.json_text)["pairs"] if p["with_reference"])
    assert pair["verdict"] == "BUG" and pair["localization"]["stage"] == "optimizer", pair["notes"]
