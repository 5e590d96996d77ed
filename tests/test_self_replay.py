"""The self-replay check (harness.self_replay): a run re-trained from its own checkpoint in a fresh process must
reproduce its own rows; where it does not, its training carries state the checkpoint does not hold, which the
resync (every step from a loaded checkpoint) cannot see. Why: a step counter kept in a jax wrapper that
scaled the learning rate after 100 steps was DRIFT ("every step agrees from a shared state")."""
from __future__ import annotations

import numpy as np
import pytest

from harness import resync as R
from harness.compare import BUG, DRIFT, compare
from harness.probe_analysis import analyse
from harness.self_replay import TOL, describe, judge, judge_evaluations, placed, stretches

from .conftest import need
from .test_resync import LAYERS, chaotic_candidate, replay_of, saturating_family


def test_each_stretch_between_two_checkpoints_is_re_trained_from_the_first():
    assert stretches(300, [0, 50, 100, 150, 200, 250, 300]) == [49, 99, 149, 199, 249, 299]
    assert stretches(300, [0, 100, 299, 300]) == [99, 298]     # the last step's batch is the job's probe step
    assert stretches(300, [0, 1, 2]) == [299]                  # stretches of no step are left out
    assert stretches(300, [300]) == []


def _rows(steps, values, scale=lambda t: 1.0, training=lambda t: 1.0, params=None):
    """Replayed rows [step, loss, accuracy, grad_norm, update_norm, param_norm]: the loss and gradient norm scaled
    by `scale`, the update norm by `training`, the parameter norm by `params` (default: `training`)."""
    params = params or training
    return [[t, values["loss"][t] * scale(t), values["accuracy"][t], values["grad_norm"][t] * scale(t),
             values["update_norm"][t] * training(t), values["param_norm"][t] * params(t)] for t in steps]


def _values(n=60):
    rng = np.random.default_rng(0)
    out = {s: rng.uniform(0.5, 2.0, n) for s in ("loss", "grad_norm", "update_norm", "param_norm")}
    return dict(out, accuracy=rng.integers(0, 65, n) / 64)


def test_bit_equal_rows_and_rows_that_part_from_a_rounding_reproduce():
    v, steps = _values(), np.arange(60)
    same = judge(steps, v, _rows(range(40, 50), v), [40])
    assert same["checked"] and not same["differs"] and same["max_rel"] == 0.0 and same["rows"] == same["exact_rows"] == 10
    # a load that rounds (1e-7) under a chaotic model: the difference grows 1.5x a step, past TOL
    grown = judge(steps, v, _rows(range(20, 50), v, lambda t: 1 + 1e-7 * 1.5 ** (t - 20)), [20])
    assert not grown["differs"] and grown["max_rel"] > TOL and grown["exact_rows"] == 0
    # and then a kink flipped by that rounding jumps: still rounding's doing
    flip = judge(steps, v, _rows(range(20, 50), v, lambda t: 1 + (1e-7 if t < 30 else 3e-3)), [20])
    assert not flip["differs"]


def test_a_row_that_jumps_past_the_tolerance_differs_where_it_jumps():
    v, steps = _values(), np.arange(60)
    got = judge(steps, v, _rows(range(40, 50), v, lambda t: 1.02 if t >= 45 else 1.0), [40])
    assert got["differs"] and got["step"] == 45 and got["from"] == 40 and got["series"] in ("loss", "grad_norm")
    assert got["rel"] > TOL
    first = judge(steps, v, _rows(range(40, 50), v, lambda t: 1.3), [40])   # differs straight after the load
    assert first["differs"] and first["step"] == 40
    # a stretch that rounds from its load is not judged, the next stretch (its own load, exact) is
    rows = _rows(range(0, 20), v, lambda t: 1 + 1e-7) + _rows(range(20, 40), v, lambda t: 1.02 if t >= 30 else 1.0)
    two = judge(steps, v, rows, [0, 20])
    assert two["stretches"] == 2 and two["differs"] and two["step"] == 30 and two["from"] == 20
    # a checkpoint the backend does not reload bit for bit: its stretch is judged on its first row only
    late = judge(steps, v, _rows(range(20, 40), v, lambda t: 1.02 if t >= 30 else 1.0), [20], reload_exact=False)
    assert not late["differs"] and late["exact_rows"] == 0 and late["inexact_loads"] == 1
    first_row = judge(steps, v, _rows(range(20, 40), v, lambda t: 1.3), [20], reload_exact=False)
    assert first_row["differs"] and first_row["step"] == 20


def test_a_report_that_carries_state_is_told_from_training_that_does():
    """Keras' fit logs the running mean of the losses so far: re-trained from a checkpoint in a fresh process the
    mean starts again, so the loss differs at the stretch's first step while every update and parameter norm is
    the run's. A step counter that scales the lr moves the update and the parameters: state in the training."""
    v, steps = _values(), np.arange(60)
    running = {**v, "loss": np.array([np.mean(v["loss"][:t + 1]) for t in range(60)])}
    report = judge(steps, running, _rows(range(40, 50), v), [40])
    assert report["differs"] and (report["step"], report["series"], report["off"]) == (40, "loss", ["loss"])
    assert report["reported_only"]
    # the same on a backend whose load rounds (first row only), its update norm 1e-7 off as measured
    inexact = judge(steps, running, _rows(range(40, 50), v, training=lambda t: 1 + 1e-7), [40], reload_exact=False)
    assert inexact["differs"] and inexact["reported_only"]
    # a running accuracy: the accuracy is judged too
    acc = {**v, "accuracy": np.clip(v["accuracy"] + 2 / 64, 0, 1)}
    got = judge(steps, acc, _rows(range(40, 50), v), [40])
    assert got["differs"] and "accuracy" in got["off"] and got["reported_only"]
    # training that carries state: the update 2% off from step 45, the parameters after it off by less than TOL
    lr = judge(steps, v, _rows(range(40, 50), v, training=lambda t: 1.02 if t >= 45 else 1.0,
                               params=lambda t: 1 + 1e-6 if t >= 45 else 1.0), [40])
    assert lr["differs"] and lr["off"] == ["update_norm"] and not lr["reported_only"]
    inexact_lr = judge(steps, v, _rows(range(40, 50), v, training=lambda t: 1 + 3e-6), [40], reload_exact=False)
    assert not inexact_lr["differs"]     # inside TOL: not judged a difference at all
    # a gradient off at the first step and the parameters after it: training, even where the loss alone is off
    both = judge(steps, running, _rows(range(40, 50), v, training=lambda t: 1 + 1e-5), [40])
    assert both["differs"] and not both["reported_only"]
    # the parameters part later in the stretch: the training carried state after all
    later = judge(steps, running, _rows(range(40, 50), v, training=lambda t: 1 + 1e-5 if t >= 47 else 1.0), [40])
    assert later["differs"] and not later["reported_only"]
    assert placed(report, "the candidate")["stage"] == "report" and placed(lr, "the candidate")["stage"] == "state"
    assert placed(report, "the candidate")["summary"] == "report: loss of the candidate carries state of its own (step 40)"


def test_a_pair_every_resynced_step_agrees_on_is_a_bug_when_the_candidate_does_not_reproduce_itself(tmp_path):
    from harness.envelope import compute
    ref, members, s, e = saturating_family(tmp_path)
    cand = chaotic_candidate(tmp_path, s, e)
    env = compute(ref, members)
    base = R.judge(replay_of([0, 25, 50, 75]), LAYERS, analyse)
    nothing = lambda pair: {"stage": None, "disagreeing_keys": []}
    differs = {"checked": True, "rows": 60, "stretches": 3, "exact_rows": 40, "max_rel": 0.02, "differs": True, "step": 40, "series": "loss",
               "rel": 0.02, "run": 1.02, "replay": 1.0, "from": 40}
    p = compare(ref, [cand], env, members, localize=nothing,
                resync=lambda pair, extra: dict(base, self_replay=differs)).pairs[0]
    assert p.verdict == BUG and p.localization["stage"] == "state", p.notes
    assert "checkpoint at step 40" in p.localization["lines"][0]
    assert "does not reproduce its own training" in p.notes[-1]
    same = dict(differs, differs=False, max_rel=0.0, exact_rows=60)
    q = compare(ref, [cand], env, members, localize=nothing,
                resync=lambda pair, extra: dict(base, self_replay=same, self_replay_reference=same)).pairs[0]
    assert q.verdict == DRIFT and "(3 stretches, its state reloaded after every step) reproduces its 60 steps to the " \
        "bit, and so does the reference" in q.notes[-1], \
        q.notes
    # the reference's own training carries such state: the pair is a BUG that names it
    r = compare(ref, [cand], env, members, localize=nothing,
                resync=lambda pair, extra: dict(base, self_replay=same, self_replay_reference=differs)).pairs[0]
    assert r.verdict == BUG and r.localization["stage"] == "state", r.notes
    assert "the reference ref does not reproduce its own training" in r.notes[-1]
    # only what the reference reports carries state: the report, the reference and the series named
    s = compare(ref, [cand], env, members, localize=nothing, resync=lambda pair, extra: dict(
        base, self_replay=same, self_replay_reference=dict(differs, off=["loss"], reported_only=True))).pairs[0]
    assert s.verdict == BUG and (s.localization["stage"], s.localization["series"]) == ("report", ["loss"]), s.notes
    assert s.localization["summary"] == "report: loss of the reference carries state of its own (step 40)"
    assert "reproduces its own training from its checkpoint but not what its run reported" in s.notes[-1]


def test_an_evaluation_of_a_checkpoint_that_is_not_the_runs_evaluation_there_differs():
    """A jax wrapper that evaluated the weights from before the last update was DRIFT: training (and so every
    resynced step and the re-trained rows) untouched, the evaluation curve inside a saturated envelope."""
    grid = np.array([0, 20, 40, 60])
    v = {"eval_loss": np.array([2.3, 0.5, 0.3, 0.2]), "eval_accuracy": np.array([0.1, 0.8, 0.9, 0.95])}
    rows = [[int(t), v["eval_loss"][i], v["eval_accuracy"][i]] for i, t in enumerate(grid)]
    same = judge_evaluations(grid, v, rows + [[10, 9.0, 0.0]])            # a checkpoint off the grid: not judged
    assert same == {"eval_checked": 4, "eval_max_rel": 0.0, "eval_differs": False}
    stale = judge_evaluations(grid, v, [[60, 0.2002, 0.95], [40, 0.3003, 0.9]] + rows[:2])   # the job's order
    assert stale["eval_differs"] and (stale["eval_step"], stale["eval_series"]) == (40, "eval_loss")
    assert stale["eval_rel"] > TOL and stale["eval_replay"] == 0.3003
    assert not judge_evaluations(grid, v, [[40, 0.3 * (1 + TOL / 2), 0.9]])["eval_differs"]


def test_a_pair_whose_candidate_evaluates_its_own_checkpoint_otherwise_is_a_bug_in_the_evaluation(tmp_path):
    from harness.envelope import compute
    ref, members, s, e = saturating_family(tmp_path)
    cand = chaotic_candidate(tmp_path, s, e)
    env = compute(ref, members)
    base = R.judge(replay_of([0, 25, 50, 75]), LAYERS, analyse)
    trains = {"checked": True, "rows": 60, "stretches": 3, "exact_rows": 60, "max_rel": 0.0, "differs": False}
    evals = dict(trains, eval_checked=4, eval_max_rel=2e-3, eval_differs=True, eval_step=40, eval_series="eval_loss",
                 eval_rel=2e-3, eval_run=0.3003, eval_replay=0.3)
    p = compare(ref, [cand], env, members, localize=lambda pair: {"stage": None, "disagreeing_keys": []},
                resync=lambda pair, extra: dict(base, self_replay=evals)).pairs[0]
    assert p.verdict == BUG and p.localization["stage"] == "eval", p.notes
    assert "evaluating the run's own checkpoint at step 40" in p.localization["lines"][0]
    assert "does not evaluate its own checkpoint as its run did" in p.notes[-1]


def test_a_real_run_reproduces_itself_and_edited_rows_do_not(tmp_path):
    """torch, 60 steps, checkpoints every 20: each stretch re-trained from its checkpoint in a fresh process
    reproduces the run to the bit; the same run with its rows from step 43 scaled (what state outside the
    checkpoint does to a run) differs at step 43, in the stretch from 40."""
    need("torch")
    from algorithms.contract import RunConfig
    from algorithms.optim import HParams
    from harness import runner
    from harness.localize import Localizer
    from harness.runs import load_run
    folder = runner.execute(RunConfig(model="cnn2d_2conv_2fc", backend="torch",
                                      hparams=HParams(steps=60, eval_every=20, checkpoint_every=20)), tmp_path)
    run = load_run(folder)
    loc = Localizer(tmp_path, log=lambda m: None)
    got = loc.self_replay(run)
    assert got["checked"] and not got["differs"] and got["max_rel"] == 0.0, got
    assert (got["stretches"], got["rows"], got["exact_rows"]) == (3, 57, 57)     # steps 0..18, 20..38, 40..58
    assert (got["eval_checked"], got["eval_max_rel"], got["eval_differs"]) == (4, 0.0, False)   # steps 0, 20, 40, 60
    loss = run.values["loss"].copy()
    loss[43:] *= 1.01
    run.values["loss"] = loss
    edited = loc.self_replay(run)
    assert edited["differs"] and (edited["step"], edited["from"], edited["series"]) == (43, 40, "loss"), edited
    run.values["eval_loss"] = run.values["eval_loss"] * np.where(run.eval_step == 40, 1.001, 1.0)
    stale = loc.self_replay(run)
    assert stale["eval_differs"] and (stale["eval_step"], stale["eval_series"]) == (40, "eval_loss"), stale
    # a run trained on another machine is not re-trained here: its kernels need not be this machine's
    run.manifest["host"] = dict(run.manifest["host"], hostname="elsewhere")
    moved = loc.self_replay(run)
    assert not moved["checked"] and "trained on another machine (elsewhere" in moved["why"], moved


def test_a_multi_process_run_not_reproduced_by_its_replay_names_the_multi_process_path():
    """A run of two processes standing in for hosts, re-trained in one (its backend's replay layout): another loss on
    a stretch's first row (the loaded state, the same batch), its checkpoints evaluating as the run did, is the
    processes' doing, `data`; a later row may be carried state or a load as well, and the place says all three. A
    replay in as many processes as the run, or a checkpoint that does not evaluate as the run did, keeps the
    carried-state reading."""
    v, steps = _values(), np.arange(60)
    layouts = {"hosts": 2, "processes": 2, "replay_processes": 1, "eval_checked": 2, "eval_differs": False}
    first = dict(judge(steps, v, _rows(range(40, 50), v, lambda t: 1.3, lambda t: 1.3), [40]), **layouts)
    assert "loss" in first["off"] and first["step"] == first["from"] == 40
    assert placed(first, "the candidate")["stage"] == "data"
    assert "multi-process path of the candidate (--hosts 2" in placed(first, "the candidate")["summary"]
    assert "the run's 2 processes computed another step" in describe("c", first)
    later = dict(judge(steps, v, _rows(range(40, 50), v, lambda t: 1.02 if t >= 45 else 1.0,
                                       lambda t: 1.02 if t >= 45 else 1.0), [40]), **layouts)
    assert placed(later, "the candidate")["stage"] == "state"
    assert "carried state, its load, or the multi-process path" in placed(later, "the candidate")["summary"]
    for plain in (dict(first, replay_processes=2), dict(first, eval_differs=True), dict(first, processes=1,
                                                                                       replay_processes=1)):
        assert placed(plain, "the candidate")["stage"] == "state"
    assert "carries state" in describe("c", dict(first, replay_processes=2))


def test_an_accuracy_one_sample_apart_is_not_judged_but_ends_the_bit_equal_rows():
    """A near tie of two logits flips with the last bit of a row that is not bit-equal (a load that rounds, another
    process layout): one sample of the batch is not a difference; two are."""
    v, steps = _values(), np.arange(60)
    rows = _rows(range(40, 50), v)
    rows[0][2] += 1 / 64
    one = judge(steps, v, rows, [40], batch=64)
    assert not one["differs"] and one["exact_rows"] == 0
    rows[0][2] += 1 / 64
    assert judge(steps, v, rows, [40], batch=64)["differs"]


def test_a_pair_placed_by_its_resync_also_says_when_the_candidate_does_not_reproduce_itself():
    """A checkpoint whose load or export is wrong shows in both: a step from the reference's state and the
    candidate's step from its own checkpoint; the second is said beside the resync's place."""
    from harness.self_replay import also_not_reproduced
    v, steps = _values(), np.arange(60)
    first = judge(steps, v, _rows(range(40, 50), v, lambda t: 1.0, lambda t: 1.3), [40])
    said = also_not_reproduced(first)
    assert "does not reproduce its own training from its own checkpoint either (step 40, the first of its" in said
    assert "saves and restores" in said
    assert also_not_reproduced(judge(steps, v, _rows(range(40, 50), v), [40])) == ""   # reproduces: nothing said
    assert also_not_reproduced({}) == ""


@pytest.mark.slow
def test_a_run_of_two_processes_standing_in_for_hosts_is_re_trained_in_its_replay_layout(tmp_path):
    """jax --devices 2 --hosts 2 (two processes joined by jax.distributed): its self-replay is made (until session
    36 it was skipped), in the replay job's one process over the same mesh, and reproduces the run to the bit;
    the same run with its rows from step 20 moved (what a process's loader gone astray does) is placed in the
    multi-process path."""
    need("jax")
    from algorithms.contract import RunConfig
    from algorithms.optim import HParams
    from harness import runner
    from harness.localize import Localizer
    from harness.runs import load_run
    folder = runner.execute(RunConfig(model="cnn2d_2conv_2fc", backend="jax", devices=2, extra={"hosts": 2},
                                      hparams=HParams(steps=40, eval_every=20, checkpoint_every=20)), tmp_path)
    run = load_run(folder)
    loc = Localizer(tmp_path, log=lambda m: None)
    got = loc.self_replay(run)
    assert got["checked"] and not got["differs"] and got["max_rel"] == 0.0, got
    assert (got["hosts"], got["processes"], got["replay_processes"]) == (2, 2, 1), got
    for s in ("loss", "update_norm", "param_norm"):
        run.values[s] = run.values[s] * np.where(run.step >= 20, 1.01, 1.0)
    moved = loc.self_replay(run)
    assert moved["differs"] and (moved["step"], moved["from"]) == (20, 20), moved
    assert placed(moved, "the candidate")["stage"] == "data"


class _CachedRate:
    """A backend that keeps, outside its state, the learning rate it wrote first (a host-side write cache keyed by
    shape: the same shape, no new transfer); loading a state empties the cache, as a framework's sync does."""

    def __init__(self):
        from types import SimpleNamespace
        from algorithms.spec import load_model
        self.model, self.opts = load_model("cnn2d_2conv_2fc"), SimpleNamespace(fault=None, dropout="harness")
        self.hp, self.w, self.rate = SimpleNamespace(seed=0), 0.0, None

    def train_step(self, step, x, y, masks):
        from wrappers.base import StepStats
        self.rate = 0.1 / (1 + step) if self.rate is None else self.rate
        self.w += self.rate
        return StepStats(loss=self.w, accuracy=0.0, grad_norm=1.0, update_norm=self.rate, param_norm=self.w)

    def export_params(self):
        return {"w": np.float64(self.w)}

    def export_opt_state(self):
        return {}

    def load_params(self, params):
        self.w, self.rate = float(params["w"]), None

    def load_opt_state(self, opt, step):
        pass

    def state_reload_exact(self):
        return True


def test_the_re_training_reloads_its_state_after_every_step_so_a_value_kept_outside_it_shows(tmp_path):
    """Re-trained in one pass, a stretch repeats the cache's stale rate (the run's own rows, which a bug of this
    kind in keras-jax's Stepper left DRIFT); reloaded after every step, each step takes its own rate."""
    from types import SimpleNamespace
    from algorithms.contract import Replay
    from algorithms.params import save_npz
    from wrappers.worker import run_replay
    save_npz(tmp_path / "data.npz", {"x_train": np.zeros((8, 8, 8, 1), np.float32), "y_train": np.zeros(8, np.int64)})
    np.save(tmp_path / "order.npy", np.arange(8).reshape(4, 2))
    save_npz(tmp_path / "ck0.npz", {"param/w": np.float64(0.0)})
    rows = {}
    for fresh in (False, True):
        job = SimpleNamespace(data=str(tmp_path / "data.npz"), order=str(tmp_path / "order.npy"),
                              replay=Replay([3], checkpoints={0: str(tmp_path / "ck0.npz")}, perturb_state_ulps=[],
                                            reload_each_step=fresh))
        out = tmp_path / f"out{fresh}"
        out.mkdir()
        rows[fresh] = [r[4] for r in run_replay(job, _CachedRate(), out)["replayed"]]   # the update norms
    assert rows[False] == [0.1, 0.1, 0.1]                       # the stale rate, as the run had it
    assert rows[True] == [0.1, 0.1 / 2, 0.1 / 3]                # each step's own
