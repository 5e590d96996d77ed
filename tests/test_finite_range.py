"""A reference whose parameters overflow: nothing computed from its non-finite state is compared
(harness.finite_range), said first; a candidate that overflows where the reference does not is still a BUG."""
from __future__ import annotations

import json

import numpy as np
from click.testing import CliRunner

from harness import reported
from harness.finite_range import cut, left_range_at
from harness.runs import load_run

from .synthetic import base_eval, base_series, jitter, write_run

N, OVER = 100, 40   # the reference's parameters are inf after step OVER


def _overflowing(series: dict[str, np.ndarray], after: dict[str, float]) -> dict[str, np.ndarray]:
    """`series` whose parameters overflow at step OVER; from there each series holds `after`'s value (what a
    framework makes of inf and NaN is its own convention)."""
    s = {k: v.copy() for k, v in series.items()}
    s["grad_norm"][OVER], s["update_norm"][OVER], s["param_norm"][OVER] = np.inf, np.inf, np.inf
    for k, v in after.items():
        s[k][OVER + 1:] = v
    return s


def _family(root, after_ref: dict[str, float]):
    """The reference and its envelope: two 1-ULP members that overflow with it, and one that stays finite (as the
    float64 member does)."""
    rng = np.random.default_rng(0)
    s, e = base_series(N), base_eval(N)
    ref = write_run(root, "ref", _overflowing(s, after_ref), e)
    members = [write_run(root, f"ref__ulp{j}", _overflowing(jitter(s, rng, 1e-6), after_ref), jitter(e, rng, 1e-6),
                         perturb=j) for j in (1, 2)]
    members.append(write_run(root, "ref__ulp3", jitter(s, rng, 1e-6), jitter(e, rng, 1e-6), perturb=3))
    return s, e, ref, members


NAN = {"loss": np.nan, "grad_norm": np.nan, "update_norm": np.nan, "param_norm": np.nan}


def _compare(root, ref, cand, members):
    from harness.cli import main
    env = [a for m in members for a in ("--envelope", str(m))]
    out = root / "out"
    r = CliRunner().invoke(main, ["compare", str(ref), str(cand), *env, "--no-localize", "--out", str(out)],
                           catch_exceptions=False)
    return r, json.loads((out / "comparison.json").read_text())


def test_left_range_at_and_cut_keep_the_steps_up_to_the_overflow(tmp_path):
    s, e, ref, _ = _family(tmp_path, NAN)
    run = load_run(ref)
    assert left_range_at(run) == OVER
    assert left_range_at(load_run(write_run(tmp_path, "fine", s, e))) is None
    big = {k: v.copy() for k, v in s.items()}
    big["param_norm"][70:] = 2e19         # a float64 backend's norm where a float32 one overflows
    assert left_range_at(load_run(write_run(tmp_path, "big", big, e))) == 70
    c = cut(run, OVER)
    assert c.step.tolist() == list(range(OVER + 1)) and c.steps_compared == OVER + 1 and run.steps_compared == N
    assert c.eval_step.tolist() == [0, 10, 20, 30, 40]          # the states before step OVER + 1 only
    assert len(c.values["loss"]) == OVER + 1 and len(c.values["eval_loss"]) == 5 and len(c.checksum) == OVER + 1


def test_after_the_reference_overflows_another_convention_for_nan_is_not_a_bug(tmp_path):
    """Reference NaN from OVER + 1 on; the candidate, from the same inf state, reports finite values (as a
    framework whose ReLU drops NaN does): before the cut a BUG at OVER + 1, now nothing after OVER is compared."""
    s, e, ref, members = _family(tmp_path, NAN)
    cand = write_run(tmp_path, "cand", _overflowing(s, {"loss": 2.0e6, "grad_norm": np.nan, "update_norm": np.nan,
                                                         "param_norm": np.nan}), e)
    r, doc = _compare(tmp_path, ref, cand, members)
    assert r.exit_code == 0, r.output
    assert doc["verdicts"]["cand"] != "BUG" and doc["compared_to_step"] == OVER
    first = r.output.splitlines()[0]
    assert first.startswith("WARNING: the reference ref leaves float range at step 40") and "0..40" in first
    assert "leaves float range" in doc["range_warning"] and not any("float range" in n for n in doc["notes"])
    assert r.output.count("leaves float range") == 1
    from harness.report import markdown
    md = markdown(tmp_path / "out").splitlines()
    assert md[4].startswith("**WARNING: the reference ref leaves float range at step 40")


def test_a_candidate_that_overflows_as_the_reference_does_agrees_there(tmp_path):
    """The same overflow (one norm inf where the reference's is NaN: which one is the order of the arithmetic)
    is agreement, not a BUG, and the envelope does not saturate on it (no resync needed to call it DRIFT)."""
    s, e, ref, members = _family(tmp_path, NAN)
    c = _overflowing(s, NAN)
    c["update_norm"][OVER] = np.nan
    r, doc = _compare(tmp_path, ref, write_run(tmp_path, "cand", c, e), members)
    assert r.exit_code == 0 and doc["verdicts"]["cand"] in ("IDENTICAL", "DRIFT"), r.output


def test_a_difference_just_before_the_overflow_is_still_seen(tmp_path):
    """The finite member's distance from the reference's inf at the overflow is no spread: not smoothed onto the
    steps before it, where a candidate 1 % off is a BUG, not INCONCLUSIVE."""
    s, e, ref, members = _family(tmp_path, NAN)
    c = _overflowing(s, NAN)
    c["grad_norm"][OVER - 5:OVER] *= 1.01
    r, doc = _compare(tmp_path, ref, write_run(tmp_path, "cand", c, e), members)
    assert doc["verdicts"]["cand"] == "BUG" and doc["pairs"][0]["first_divergence"]["step"] == OVER - 5, r.output


def test_a_float64_norm_past_float32_range_is_the_overflow_of_a_float32_one(tmp_path):
    """A backend that sums squares in float64 reports 2e19 where a float32 one reports inf: both overflowed."""
    s, e, ref, members = _family(tmp_path, NAN)
    c = _overflowing(s, NAN)
    c["grad_norm"][OVER] = c["update_norm"][OVER] = c["param_norm"][OVER] = 2e19
    r, doc = _compare(tmp_path, ref, write_run(tmp_path, "cand", c, e), members)
    assert doc["verdicts"]["cand"] != "BUG", r.output
    c["param_norm"][OVER] = 1e19    # below it: a float32 norm would be finite too, so this one differs
    r, doc = _compare(tmp_path, ref, write_run(tmp_path, "cand2", c, e), members)
    assert doc["verdicts"]["cand2"] == "BUG" and doc["pairs"][0]["first_divergence"]["step"] == OVER


def test_a_candidate_that_overflows_where_the_reference_does_not_is_still_a_bug(tmp_path):
    s, e, ref, members = _family(tmp_path, NAN)
    c = _overflowing(s, NAN)
    c["param_norm"][30] = np.inf      # ten steps before the reference
    r, doc = _compare(tmp_path, ref, write_run(tmp_path, "cand", c, e), members)
    assert r.exit_code == 1 and doc["verdicts"]["cand"] == "BUG"
    assert doc["pairs"][0]["first_divergence"]["step"] == 30


def test_a_candidate_that_stays_finite_where_the_reference_overflows_differs_at_that_step(tmp_path):
    """The step that overflows starts from a finite state: it is compared (a reference bug that makes NaN)."""
    s, e, ref, members = _family(tmp_path, NAN)
    r, doc = _compare(tmp_path, ref, write_run(tmp_path, "cand", s, e), members)
    assert r.exit_code == 1 and doc["pairs"][0]["first_divergence"]["step"] == OVER


def test_nan_reported_where_nan_was_computed_is_no_report_slip():
    class _Row:
        step = np.array([0])
        manifest = {"hparams": {"batch_size": 64}}

        def __init__(self, **v):
            self.values = {k: np.array([x]) for k, x in v.items()}

    nan = float("nan")
    assert reported.mismatches(_Row(loss=nan, grad_norm=np.inf), {"loss": nan, "grad_norm": np.inf}) == []
    bad = reported.mismatches(_Row(loss=nan, grad_norm=np.inf), {"loss": 2.0, "grad_norm": 1e19})
    assert [m["series"] for m in bad] == ["loss", "grad_norm"]
    # recomputed in float64 past what a float32 norm holds: the run's inf is that norm
    assert reported.mismatches(_Row(grad_norm=np.inf), {"grad_norm": 2e19}) == []
    assert [m["series"] for m in reported.mismatches(_Row(loss=2.0), {"loss": nan})] == ["loss"]
