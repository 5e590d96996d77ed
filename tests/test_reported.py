"""harness/reported.py: the statistics a run reports at step 0 against what its own step-0 probe computed."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from harness import reported

from .conftest import need


def test_the_statistics_are_recomputed_from_the_probe_by_hand():
    probe = {"loss": np.asarray(2.5), "grad/a.kernel": np.array([3.0, 4.0], np.float32),
             "grad/b.bias": np.array([12.0], np.float32), "update0/a.kernel": np.array([0.5, 0.0], np.float32),
             "update0/b.bias": np.array([-1.0], np.float32), "buffer0/n.running_mean": np.ones(3, np.float32),
             "forward/logits": np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]], np.float32)}
    params = {"a.kernel": np.array([1.0, 2.0], np.float32), "b.bias": np.array([3.0], np.float32)}
    got = reported.recomputed(probe, params, "logits", np.array([1, 0, 0, 0]))
    assert got["loss"] == 2.5
    assert got["grad_norm"] == pytest.approx(13.0)                   # sqrt(9 + 16 + 144)
    assert got["update_norm"] == pytest.approx(np.sqrt(0.25 + 1.0))
    assert got["param_norm"] == pytest.approx(np.sqrt(1.5 ** 2 + 2.0 ** 2 + 2.0 ** 2))   # after the update
    assert got["accuracy"] == 0.75
    assert "accuracy" not in reported.recomputed(probe, params, "logits", None)


class _Run:
    def __init__(self, **step0):
        self.step = np.array([0, 1])
        self.values = {k: np.array([v, 0.0]) for k, v in step0.items()}
        self.manifest = {"hparams": {"batch_size": 64}}


def test_a_report_off_by_more_than_rounding_or_one_sample_is_a_mismatch():
    computed = {"loss": 2.0, "grad_norm": 10.0, "accuracy": 0.5}
    assert reported.mismatches(_Run(loss=2.0 * (1 + 1e-6), grad_norm=10.0, accuracy=0.5 + 1 / 64), computed) == []
    bad = reported.mismatches(_Run(loss=2.0, grad_norm=10.1, accuracy=0.5 + 2 / 64), computed)
    assert [m["series"] for m in bad] == ["grad_norm", "accuracy"]
    assert bad[0]["reported"] == 10.1 and bad[0]["computed"] == 10.0 and bad[0]["rel"] == pytest.approx(0.01)
    assert [m["series"] for m in reported.mismatches(_Run(loss=np.nan, grad_norm=10.0, accuracy=0.5), computed)] \
        == ["loss"]
    # a float32 norm of many squares rounds ~sqrt(n) times: 2e-3 off is rounding over 25M elements, not over 60k
    assert reported.mismatches(_Run(loss=2.0, grad_norm=10.02, accuracy=0.5), computed, n_params=25_000_000) == []
    assert [m["series"] for m in reported.mismatches(_Run(loss=2.0, grad_norm=10.02, accuracy=0.5), computed,
                                                     n_params=60_000)] == ["grad_norm"]


class _Check:
    def __init__(self, step):
        self.diverged_step = step


class _Pair:
    """The pair as the localizer sees it: reference a, candidate b, and where each series diverges."""

    def __init__(self, a, b, diverging=reported.REPORTED):
        self.a, self.b = a, b
        self.checks = {s: _Check(0 if s in diverging else None) for s in reported.REPORTED}


def test_a_real_runs_report_is_its_step_and_an_edited_one_is_localized_to_whoever_reports_it(tmp_path):
    """torch, 3 steps: its step-0 row is what its own step-0 probe computes (each series within rounding). The same
    run with its reported update norm or accuracy edited (what a wrong statistic in a wrapper writes) is localized
    at stage `report`, naming the series and the side; both sides edited alike is no difference between them, and
    a series off that does not diverge in the pair explains nothing there."""
    need("torch")
    from algorithms.contract import RunConfig
    from algorithms.optim import HParams
    from harness import runner
    from harness.localize import Localizer
    from harness.runs import load_run
    folder = runner.execute(RunConfig(model="cnn2d_hard", backend="torch",
                                      hparams=HParams(steps=3, optimizer="adamw", lr=0.001, weight_decay=0.01)),
                            tmp_path)
    run = load_run(folder)
    loc = Localizer(tmp_path, log=lambda m: None)
    probe = loc.probe0(run)
    params, labels = reported.first_batch(run, tmp_path)
    batch = loc.first_batch            # as the localizer hands it over
    assert reported.mismatches(run, reported.recomputed(probe, params, "fc2", labels)) == []
    assert reported.localize(_Pair(run, run), probe, probe, "fc2", batch) is None

    wrong = copy.deepcopy(run)
    wrong.values["update_norm"] = run.values["update_norm"] * 2.0
    got = reported.localize(_Pair(run, wrong), probe, probe, "fc2", batch)
    assert got["stage"] == "report" and got["series"] == ["update_norm"] and got["reported_by"] == "candidate", got
    assert "reports at step 0 what its own step does not compute" in got["lines"][0]
    assert reported.localize(_Pair(wrong, run), probe, probe, "fc2", batch)["reported_by"] == "reference"
    assert reported.localize(_Pair(wrong, wrong), probe, probe, "fc2", batch) is None
    assert reported.localize(_Pair(run, wrong, diverging=("loss",)), probe, probe, "fc2", batch) is None

    wrong.values = dict(run.values, accuracy=np.minimum(run.values["accuracy"] * 2.0, 1.0) + 0.1)
    assert reported.localize(_Pair(run, wrong), probe, probe, "fc2", batch)["series"] == ["accuracy"]

    # a slip inside REL_TOL (the gradient norm logged 1e-5 high, as with the L2 term in it) that is the whole of the
    # pair's step-0 divergence in that series: the two probes agree, the reference's report is its probe's
    slip = copy.deepcopy(run)
    slip.values["grad_norm"] = run.values["grad_norm"] * (1 + 1e-5)
    got = reported.localize(_Pair(run, slip, diverging=("grad_norm",)), probe, probe, "fc2", batch, gaps=reported.GAP_SERIES)
    assert got["stage"] == "report" and got["series"] == ["grad_norm"] and got["reported_by"] == "candidate", got
    assert "it is the pair's whole divergence there" in got["lines"][0]
    assert reported.localize(_Pair(slip, slip, diverging=("grad_norm",)), probe, probe, "fc2", batch,
                            gaps=reported.GAP_SERIES) is None
    assert reported.localize(_Pair(run, slip, diverging=("grad_norm",)), probe, probe, "fc2", batch, gaps=("loss",)) is None


def test_a_step_0_divergence_is_a_report_slip_only_when_one_sides_own_gap_carries_it():
    """reported.one_sided_gaps by hand: the reports 1e-5 apart, the probes' values equal, the reference reporting its
    own: the candidate's slip. Not when the probes differ as much (another computation), when both reports are off
    their probes, when the gap is a float32 rounding of the value, or when the series does not part at that step."""
    def gaps(cand_rep, ref_rep, cand_rec=10.0, ref_rec=10.0, diverging=("grad_norm",)):
        pair = _Pair(_Run(grad_norm=ref_rep), _Run(grad_norm=cand_rep), diverging=diverging)
        return reported.one_sided_gaps(pair, 0, {"candidate": {"grad_norm": cand_rec}, "reference": {"grad_norm": ref_rec}})
    got = gaps(10.0001, 10.0000001)
    assert got["reference"] == [] and [m["series"] for m in got["candidate"]] == ["grad_norm"]
    assert got["candidate"][0]["rel"] == pytest.approx(1e-5, rel=1e-6)
    assert gaps(10.0, 10.0001)["reference"] and not gaps(10.0, 10.0001)["candidate"]
    for nothing in (gaps(10.0001, 10.0, cand_rec=10.0001), gaps(10.0001, 9.9999), gaps(10.0 * (1 + 1.2e-7), 10.0),
                    gaps(10.0001, 10.0, diverging=("loss",))):
        assert nothing == {"candidate": [], "reference": []}
    # the update norm's own float32 rounding reaches 2.9e-5 on a clean run (Adam's first update): not a slip
    pair = _Pair(_Run(update_norm=1.0), _Run(update_norm=1.0 + 2.9e-5), diverging=("update_norm",))
    assert reported.one_sided_gaps(pair, 0, {w: {"update_norm": 1.0} for w in ("candidate", "reference")})["candidate"] == []


def test_a_report_that_goes_wrong_later_is_found_where_a_replayed_step_reports_it(tmp_path):
    """A slip that starts after step 0 (a statistic scaled once the schedule decays) leaves the step-0 row right
    and every probe agreeing. Each replay job also runs one training step of its backend from every state it
    probed and records what that step reports: a clean backend's rows are what its probes of the same states
    compute, at a checkpoint's step and at a re-trained one; a backend whose report goes wrong from step 5 on
    is localized there, to its side; step 0 says nothing."""
    need("torch")
    from algorithms.contract import RunConfig
    from algorithms.optim import HParams
    from harness import runner
    from harness.localize import Localizer
    from harness.runs import load_run
    hp = HParams(steps=8, optimizer="momentum", lr=0.05, checkpoint_every=4, eval_every=4)
    run = load_run(runner.execute(RunConfig(model="cnn2d_2conv_2fc", backend="torch", hparams=hp), tmp_path))
    loc = Localizer(tmp_path, log=lambda m: None)
    rep = loc.replay(run, run, [4, 5])                # a checkpoint's step, and one re-trained from it
    assert [r[0] for r in rep["reported"]["candidate"]] == [4, 5] == [r[0] for r in rep["reported"]["reference"]]
    assert loc.report_at(_Pair(run, run), rep, "fc2") is None
    # the replayed step from a checkpoint reports what the run reported there (one state, one step)
    row4 = rep["reported"]["reference"][0]
    assert row4[1:] == [run.values[s][4] for s in reported.REPORTED]

    def slipped(rows):             # the same backend, its grad_norm written out halved from step 5 on
        return [[r[0], *r[1:3], r[3] * (0.5 if r[0] >= 5 else 1.0), *r[4:]] for r in rows]
    late = dict(rep, reported={"reference": rep["reported"]["reference"],
                               "candidate": slipped(rep["reported"]["candidate"])})
    probe0 = loc.probe0(run)
    assert reported.localize(_Pair(run, run), probe0, probe0, "fc2", loc.first_batch) is None
    got = loc.report_at(_Pair(run, run), late, "fc2")
    assert got["stage"] == "report" and got["step"] == 5 and got["series"] == ["grad_norm"], got
    assert got["reported_by"] == "candidate" and "reports at step 5" in got["lines"][0]
    swapped = dict(rep, reported={"reference": slipped(rep["reported"]["reference"]),
                                  "candidate": rep["reported"]["candidate"]})
    assert loc.report_at(_Pair(run, run), swapped, "fc2")["reported_by"] == "reference"
    both = dict(rep, reported={w: slipped(r) for w, r in rep["reported"].items()})
    assert loc.report_at(_Pair(run, run), both, "fc2") is None
    assert loc.report_at(_Pair(run, run, diverging=("loss",)), late, "fc2") is None
    # a replay keeps the logits whole: an accuracy reported off by more than one sample is found too
    acc = dict(rep, reported={"reference": rep["reported"]["reference"],
                              "candidate": [[*r[:2], min(r[2] + 0.25, 1.0) if r[0] >= 5 else r[2], *r[3:]]
                                            for r in rep["reported"]["candidate"]]})
    assert loc.report_at(_Pair(run, run), acc, "fc2")["series"] == ["accuracy"]


def test_a_loss_near_zero_is_held_to_its_logits_rounding_not_to_itself():
    """Late in training a loss of 1e-4 is a difference of two float32 numbers of the logits' size: a report a
    few epsilons of the largest logit away is rounding, one further is not."""
    probe = {"forward/fc2": np.array([[30.0, -5.0], [-4.0, 28.0]], np.float32)}
    floor = reported.loss_floor(probe, "fc2")
    assert floor == pytest.approx(reported.LOSS_LOGIT_ULPS * np.finfo(np.float32).eps * 30.0)
    computed = {"loss": 1e-4}
    assert reported.mismatches(_Run(loss=1e-4 + 0.5 * floor), computed, loss_abs=floor) == []
    assert [m["series"] for m in reported.mismatches(_Run(loss=1e-4 + 2 * floor), computed, loss_abs=floor)] == ["loss"]
    assert [m["series"] for m in reported.mismatches(_Run(loss=1e-4 + 0.5 * floor), computed)] == ["loss"]


def test_clean_replayed_reports_of_two_backends_agree_and_each_side_is_held_to_its_own_probe(tmp_path):
    """numpy against torch, momentum with a step decay at the replayed points: each backend's replayed
    training steps report what its own probes of the same states compute, with no report step failing. With a
    declared formula emulated (the reference computing a 1 % larger rate), the reference's rows are still held
    to its plain probe: against the emulated one they would be 1 % off."""
    need("torch")
    from algorithms.contract import RunConfig
    from algorithms.optim import HParams
    from harness import runner
    from harness.localize import Localizer
    from harness.runs import load_run
    hp = HParams(steps=8, optimizer="momentum", lr=0.05, schedule="step", step_size=5, checkpoint_every=4,
                 eval_every=4)
    ref, cand = (load_run(runner.execute(RunConfig(model="cnn2d_2conv_2fc", backend=b, hparams=hp), tmp_path))
                 for b in ("torch", "numpy"))
    loc = Localizer(tmp_path, log=lambda m: None)
    for change in (None, {"fault": "lr_rel_1e-02"}):
        rep = loc.replay(ref, cand, [4, 5], change)     # before the decay and at it
        assert all(len(rep["reported"][w]) == 2 for w in ("reference", "candidate")), rep["reported"]
        assert loc.report_at(_Pair(ref, cand), rep, "fc2") is None, change
    jobs = [p for p in (tmp_path / ".localize").iterdir() if (p / "worker.json").is_file()]
    assert jobs and all(json.loads((p / "worker.json").read_text()).get("report_error") is None for p in jobs)


def _step_probe(loss: float, scale: float = 1.0, update: float = 0.01) -> dict[str, np.ndarray]:
    """One resynced step's probes: two layers' forward, the loss, two gradients, the update they led to."""
    rng = np.random.default_rng(3)
    return {"forward/conv": rng.normal(size=(4, 2, 2, 3)).astype(np.float32),
            "forward/logits": np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]], np.float32),
            "loss": np.asarray(loss, np.float64),
            "grad/conv.kernel": np.array([3.0, 4.0], np.float32) * scale,
            "grad/logits.kernel": np.array([12.0], np.float32) * scale,
            "update0/conv.kernel": np.array([update, -update]), "update0/logits.kernel": np.array([update])}


def _row(loss: float, grad_norm: float = 13.0) -> list[float]:
    return [180, loss, 0.5, grad_norm, 0.02, 5.0]


def test_a_step_whose_own_loss_is_not_its_probes_is_placed_at_the_loss_not_the_optimizer():
    cand, ref = _step_probe(2.0), _step_probe(2.0)
    # the candidate's training step reported 2.3 from the state its probe computes 2.0 at; the reference's is its own
    got = reported.step_upstream({"candidate": _row(2.3), "reference": _row(2.0)}, cand, ref, "logits")
    assert got["stage"] == "loss" and got["probe"] == "step loss" and got["rel"] == pytest.approx(0.15)
    assert "its labels" in got["step_report"]["line"]
    # the gradient norm the step reports, 13 x 1.5, is not its probe's gradient's (13): the step differentiates
    # something else
    got = reported.step_upstream({"candidate": _row(2.0, 19.5), "reference": _row(2.0)}, cand, ref, "logits")
    assert got["stage"] == "backward" and got["step_report"]["mismatches"][0]["series"] == "grad_norm"


def test_a_step_whose_report_is_its_probes_leaves_the_optimizer_where_it_is():
    cand, ref = _step_probe(2.0), _step_probe(2.0)
    assert reported.step_upstream({"candidate": _row(2.0 * (1 + 1e-6)), "reference": _row(2.0)}, cand, ref,
                                   "logits") is None
    # the reference's own report is not its probe's either: nothing to say which side's report to believe
    assert reported.step_upstream({"candidate": _row(2.3), "reference": _row(2.3)}, cand, ref, "logits") is None
    # a side whose training step reported nothing
    assert reported.step_upstream({"candidate": None, "reference": _row(2.0)}, cand, ref, "logits") is None


def test_the_analysis_of_a_resynced_step_reads_the_steps_own_reports():
    from harness.probe_analysis import analyse
    rep = {"reported": {"candidate": [_row(2.0), [181, 2.3, 0.5, 13.0, 0.02, 5.0]],
                        "reference": [_row(2.0), [181, 2.0, 0.5, 13.0, 0.02, 5.0]]}}
    assert reported.rows_at(rep, 181) == {"candidate": [181, 2.3, 0.5, 13.0, 0.02, 5.0],
                                          "reference": [181, 2.0, 0.5, 13.0, 0.02, 5.0]}
    assert reported.rows_at(rep, 7) == {"candidate": None, "reference": None}
    cand, ref = _step_probe(2.0, update=0.02), _step_probe(2.0)     # only the update is off
    assert analyse(cand, ref, ["conv", "logits"])["stage"] == "optimizer"
    assert analyse(cand, ref, ["conv", "logits"], rows=reported.rows_at(rep, 180))["stage"] == "optimizer"
    got = analyse(cand, ref, ["conv", "logits"], rows=reported.rows_at(rep, 181))
    assert got["stage"] == "loss" and got["step_report"]["mismatches"][0]["reported"] == 2.3


def test_the_terminal_says_which_loss_disagrees():
    from harness.probe_analysis import analyse, describe
    rep = {"reported": {"candidate": [[181, 2.3, 0.5, 13.0, 0.02, 5.0]], "reference": [[181, 2.0, 0.5, 13.0, 0.02, 5.0]]}}
    got = analyse(_step_probe(2.0, update=0.02), _step_probe(2.0), ["conv", "logits"], rows=reported.rows_at(rep, 181))
    summary, lines = describe(got, "replay of step 181")
    assert summary == "loss: step loss"
    assert "the training step's own loss rel 0.15" in lines[0] and "reports loss 2.3" in lines[1]


def test_under_a_declared_formula_the_references_report_is_checked_against_the_plain_references_probe():
    """The reported row is the plain reference's training step; the compared probe may be the reference computing
    a declared formula, whose loss differs: the plain one's probe is what its report must match."""
    cand, emulating, plain = _step_probe(2.0), _step_probe(2.0), _step_probe(2.1)
    rows = reported.rows_at({"reported": {"candidate": [_row(2.3)], "reference": [_row(2.1)]}}, 180, plain)
    assert rows["reference_probe"] is plain
    assert reported.step_upstream(rows, cand, emulating, "logits")["stage"] == "loss"
    # against the emulating reference's probe the plain reference's own report would look off: nothing said
    assert reported.step_upstream({k: v for k, v in rows.items() if k != "reference_probe"}, cand, emulating,
                                  "logits") is None


def test_a_relabelled_point_keeps_nothing_of_the_optimizer_and_an_eval_reading_drops_its_report():
    from harness.probe_analysis import analyse, eval_disagreement
    rows = reported.rows_at({"reported": {"candidate": [_row(2.3)], "reference": [_row(2.0)]}}, 180)
    cand, ref = _step_probe(2.0, update=0.02), _step_probe(2.0)
    cand = {k: v for k, v in cand.items() if not k.startswith("update0/")}   # nothing but the optimizer state off
    cand["opt0/momentum/conv.kernel"], ref["opt0/momentum/conv.kernel"] = np.array([1.0, 2.0]), np.array([1.0, 2.5])
    for p in (cand, ref):
        p.update({"update0/conv.kernel": np.array([0.01, -0.01]), "update0/logits.kernel": np.array([0.01])})
    plain = analyse(cand, ref, ["conv", "logits"])
    assert plain["stage"] == "optimizer" and plain["note"] == "optimizer state only" and plain["optimizer_step"] == 0
    got = analyse(cand, ref, ["conv", "logits"], rows=rows)
    assert got["stage"] == "loss" and "note" not in got and "optimizer_step" not in got
    assert "step_report" not in eval_disagreement(got)


class _HostsRun(_Run):
    def __init__(self, hosts, **step0):
        super().__init__(**step0)
        self.name = f"run-hosts-{hosts}"
        self.options = type("Options", (), {"hosts": hosts})()


def _across(run, bad, judged, replayed, step):
    """across_processes as localize calls it: with the run's whole row judged against its probe."""
    computed, n, floor = judged
    whole = reported.mismatches(run, computed, n, step, loss_abs=floor)
    return reported.across_processes("candidate", run, bad, whole, replayed, step)


def test_a_multi_process_runs_wrong_row_that_its_replayed_step_does_not_share_is_the_multi_process_path():
    """The run's own processes computed another step (its replay job's step from the same state reports what the
    probe computes, and the run's row is off in what it trains with): no report slip; `data` when the loss differs,
    `reduction` when only a norm does. A loss or an accuracy alone off may be a report only the processes write."""
    computed, n, floor = {"loss": 2.0, "accuracy": 0.5, "grad_norm": 10.0, "update_norm": 0.3}, 1000, 0.0
    judged = (computed, n, floor)
    right = [0, 2.0, 0.5, 10.0, 0.3, 5.0]
    placed = _HostsRun(2, loss=2.2, accuracy=0.5, grad_norm=11.0, update_norm=0.3)
    bad = [{"series": "loss", "reported": 2.2, "computed": 2.0, "rel": 0.1}]
    got = _across(placed, bad, judged, right, 0)
    assert got["stage"] == "data" and got["summary"] == "data: the candidate's multi-process path (--hosts 2)"
    assert "not a report slip" in got["lines"][0]
    combined = _HostsRun(2, loss=2.0, accuracy=0.5, grad_norm=11.0, update_norm=0.3)
    assert _across(combined, bad, judged, right, 0)["stage"] == "reduction"
    # the replay's step reports the same wrong values: a report slip, left to the report stage
    assert _across(placed, bad, judged, [0, 2.2, 0.5, 11.0, 0.3, 5.0], 0) is None
    # the loss or the accuracy alone off (what only the processes' report gathers), the replay's right: a report
    for row0 in ({"loss": 2.2, "accuracy": 0.5}, {"loss": 2.0, "accuracy": 0.25}):
        alone = _HostsRun(2, grad_norm=10.0, update_norm=0.3, **row0)
        assert _across(alone, bad, judged, right, 0) is None
    # an accuracy the replay shares is judged too (the run gives the batch size)
    acc = _HostsRun(2, loss=2.0, accuracy=0.25, grad_norm=11.0, update_norm=0.3)
    assert _across(acc, bad, judged, [0, 2.0, 0.25, 10.0, 0.3, 5.0], 0) is None
    # one process, or no replay of that step: nothing to tell the two apart
    assert _across(_HostsRun(1, loss=2.2, accuracy=0.5, grad_norm=11.0,
                                                            update_norm=0.3), bad, judged, right, 0) is None
    assert _across(placed, bad, judged, None, 0) is None
