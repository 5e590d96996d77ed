"""The verdict engine (`duipai compare`): unit tests on synthetic run folders for every verdict and
every kind of bad input, then integration tests on real torch runs (fast configs, one session folder)."""
from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from harness.compare import BUG, DECLARED, DRIFT, IDENTICAL, INCONCLUSIVE, check_pair, compare
from harness.envelope import DEFAULT_RULE, compute, deviation, rolling_max, ulp32
from harness.runs import load_run

from .synthetic import base_eval, base_series, family, jitter, write_run

N = 100


@pytest.fixture
def fam(tmp_path):
    ref, members = family(tmp_path, N)
    return tmp_path, load_run(ref), [load_run(m) for m in members]


def verdict_of(root, ref, members, name, series, evals, **man):
    cand = load_run(write_run(root, name, series, evals, **man))
    env = compute(ref, members)
    return compare(ref, [cand], env, members).pairs[0]


def cli(*args: str):
    from harness.cli import main
    return CliRunner().invoke(main, ["compare", *args], catch_exceptions=False)


# --------------------------------------------------------------------------- the envelope pieces
def test_deviation_treats_non_finite_values_as_infinitely_far():
    a = np.array([1.0, np.nan, np.inf, np.nan, 2.0])
    b = np.array([1.5, np.nan, np.inf, 1.0, np.inf])
    assert deviation(a, b).tolist() == [0.5, 0.0, 0.0, math.inf, math.inf]


def test_rolling_max_smooths_chance_zeros():
    d = np.array([0, 0, 5, 0, 0, 0, 0, 1.0])
    assert rolling_max(d, 2).tolist() == [5, 5, 5, 5, 5, 1, 1, 1]
    assert ulp32(np.array([1.0]))[0] == 2.0 ** -23


def test_rolling_max_window_is_in_steps_on_a_sparse_grid():
    """The evaluations' grid (every 50 steps): the window (+-5 steps) holds no neighbour, so the spread of a
    saturated late evaluation is not the envelope of the first one; every 2 steps: +-2 points."""
    d = np.array([1e-7, 1e-6, 0.3, 0.5, 0.4, 0.2, 0.1])
    assert rolling_max(d, 5, np.arange(0, 301, 50)).tolist() == d.tolist()
    assert rolling_max(d, 5, np.array([0, 2, 4, 6, 8, 10, 12])).tolist() == [0.3, 0.5, 0.5, 0.5, 0.5, 0.5, 0.4]
    assert rolling_max(d, 5, np.array([0, 50, 100, 150, 200, 250, 253])).tolist()[-2:] == [0.2, 0.2]
    assert rolling_max(d, 2).tolist() == rolling_max(d, 2, np.arange(7)).tolist()


def test_an_early_evaluation_difference_is_not_hidden_by_the_late_evaluations_spread(tmp_path):
    """Evaluations every 50 steps; the envelope's evaluation spread is 1e-7 until step 100 and O(1) from 150
    (a chaotic run). A candidate whose evaluation loss is 1e-3 off from the first evaluation on (an
    evaluation-path bug) is BUG at step 0: the rolling maximum is over +-5 steps, and the neighbouring
    evaluations 50 steps away are not in it (they were, as +-5 points, before 2026-12-02: DRIFT)."""
    n, every = 300, 50
    rng = np.random.default_rng(3)
    s, e = base_series(n), base_eval(n, every)
    ref = load_run(write_run(tmp_path, "ref", s, e, eval_every=every))
    steps = np.arange(0, n + 1, every)[:len(e["eval_loss"])]
    members = []
    for j in (1, 2, 3):
        rel = np.where(steps < 150, 1e-7, 0.5) * rng.standard_normal(len(steps))
        ej = dict(e, eval_loss=e["eval_loss"] * (1 + rel))
        members.append(load_run(write_run(tmp_path, f"ref__ulp{j}", jitter(s, rng, 1e-7), ej, eval_every=every,
                                          perturb=j)))
    env = compute(ref, members)
    bad = dict(e, eval_loss=e["eval_loss"] * (1 + 1e-3))
    cand = load_run(write_run(tmp_path, "cand", s, bad, eval_every=every))
    p = compare(ref, [cand], env, members).pairs[0]
    assert p.verdict == BUG and p.first["series"] == "eval_loss" and p.first["step"] == 0, p.first


# --------------------------------------------------------------------------- one verdict each
def test_identical(fam):
    root, ref, members = fam
    shutil.copytree(ref.path, root / "copy")
    p = compare(ref, [load_run(root / "copy")], compute(ref, members), members).pairs[0]
    assert p.verdict == IDENTICAL and p.first is None


def test_drift_inside_envelope(fam):
    root, ref, members = fam
    rng = np.random.default_rng(42)
    p = verdict_of(root, ref, members, "cand", jitter(base_series(N), rng, 1e-6), jitter(base_eval(N), rng, 1e-6))
    assert p.verdict == DRIFT, p.first
    assert max(c.max_ratio for c in p.checks.values()) <= DEFAULT_RULE.margin


def test_bug_names_first_step_series_and_factor(fam):
    root, ref, members = fam
    s = base_series(N)
    s["loss"] = s["loss"].copy()
    s["loss"][40:] *= 1 + 1e-3 * np.arange(1, N - 39)      # a growing excess from step 40
    p = verdict_of(root, ref, members, "cand", s, base_eval(N))
    assert p.verdict == BUG
    assert p.first["step"] == 40 and p.first["series"] == "loss"
    assert p.first["factor"] > DEFAULT_RULE.margin and p.first["reason"] == "sustained"


def test_bug_visible_only_in_grad_norm(fam):
    root, ref, members = fam
    s = base_series(N)
    s["grad_norm"] = s["grad_norm"] * 2.0                 # Adam hides a doubled gradient in the loss
    p = verdict_of(root, ref, members, "cand", s, base_eval(N))
    assert p.verdict == BUG and p.first["series"] == "grad_norm" and p.first["step"] == 0
    assert p.first["also"] == []


def test_isolated_exceedances_are_tolerated_up_to_the_rule(fam):
    root, ref, members = fam
    s = base_series(N)
    s["update_norm"] = s["update_norm"].copy()
    spikes = [10, 30, 50, 70, 90][:DEFAULT_RULE.max_isolated]
    s["update_norm"][spikes] *= 1.01
    assert verdict_of(root, ref, members, "few", s, base_eval(N)).verdict == DRIFT
    s["update_norm"][[20, 60, 80][:1]] *= 1.01                # one more isolated point: too many
    s2 = dict(s)
    p = verdict_of(root, ref, members, "many", s2, base_eval(N))
    assert p.verdict == BUG and p.first["reason"] == "isolated" and p.first["step"] == 10


def test_one_sample_accuracy_flip_is_not_an_exceedance(fam):
    root, ref, members = fam
    s = base_series(N)
    s["accuracy"] = s["accuracy"].copy()
    s["accuracy"][[20, 21, 22]] += 1 / 64
    one = verdict_of(root, ref, members, "one", s, base_eval(N))
    assert one.verdict == DRIFT
    # its factor is read against the tolerance applied (one sample = the margin), not a raw spread of ~0
    assert one.checks["accuracy"].max_ratio <= DEFAULT_RULE.margin * (1 + 1e-6)
    s["accuracy"][[20, 21, 22]] += 1 / 64                  # two samples, three steps running
    p = verdict_of(root, ref, members, "two", s, base_eval(N))
    assert p.verdict == BUG and p.first["series"] == "accuracy" and p.first["step"] == 20
    assert p.first["factor"] == pytest.approx(2 * DEFAULT_RULE.margin, rel=0.35)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_value_is_a_divergence_at_that_step(fam, bad):
    root, ref, members = fam
    s = base_series(N)
    s["param_norm"] = s["param_norm"].copy()
    s["param_norm"][73] = bad
    p = verdict_of(root, ref, members, "cand", s, base_eval(N))
    assert p.verdict == BUG
    assert p.first["step"] == 73 and p.first["series"] == "param_norm" and p.first["reason"] == "non-finite"
    assert math.isinf(p.first["factor"])
    assert p.checks["param_norm"].nonfinite_step == 73


def test_non_finite_is_reported_even_after_saturation(tmp_path):
    s, e = base_series(N), base_eval(N)
    ref = load_run(write_run(tmp_path, "ref", s, e))
    members = []
    for j in (1, 2, 3):   # members that wander off by O(1) from step 30: the envelope saturates
        m = {k: v.copy() for k, v in s.items()}
        m["loss"][30:] *= 1 + 0.8 * j
        members.append(load_run(write_run(tmp_path, f"m{j}", m, e, perturb=j)))
    c = {k: v.copy() for k, v in s.items()}
    c["loss"][60] = np.nan
    p = compare(ref, [load_run(write_run(tmp_path, "c", c, e))], compute(ref, members), members).pairs[0]
    assert p.verdict == BUG and p.first["step"] == 60 and p.first["reason"] == "non-finite"


def test_saturated_envelope_is_inconclusive(tmp_path):
    s, e = base_series(N), base_eval(N)
    ref = load_run(write_run(tmp_path, "ref", s, e))
    members = []
    for j in (1, 2, 3):
        m = {k: v.copy() for k, v in s.items()}
        m["loss"][30:] *= 1 + 0.8 * j
        members.append(load_run(write_run(tmp_path, f"m{j}", m, e, perturb=j)))
    c = {k: v.copy() for k, v in s.items()}
    c["loss"][40:] *= 2.5                                  # far off, but only where the envelope is O(1)
    p = compare(ref, [load_run(write_run(tmp_path, "c", c, e))], compute(ref, members), members).pairs[0]
    assert p.verdict == INCONCLUSIVE
    assert p.saturated["loss"] <= 40 and "--stat" in " ".join(p.notes)


def test_declared_difference_is_named_only_when_verified_with_evidence(fam):
    from harness.compare import resolve
    root, ref, members = fam
    s = base_series(N)
    s["update_norm"] = s["update_norm"] * 1.02
    decl = [{"id": "adam_epsilon_hat", "title": "..."}]
    cand = load_run(write_run(root, "keras", s, base_eval(N), backend="keras-jax", declared=decl))
    chk = {"differences": ["adam_epsilon_hat"], "emulated": ["adam_epsilon_hat"], "change": {"fault": "adam_eps_hat"},
           "verified": True, "agree": True, "evidence": ["step 0: update0/fc1.kernel"]}
    for loc, want in (({"stage": None, "disagreeing_keys": [], "declared_check": chk}, DECLARED),
                      # the emulating reference still disagrees: BUG
                      ({"stage": "optimizer", "probe": "update0/fc1.kernel", "disagreeing_keys": ["update0/fc1.kernel"],
                        "declared_check": dict(chk, agree=False)}, BUG),
                      # a pattern alone (no emulation, no probe keys of its own) explains nothing
                      ({"stage": "optimizer", "probe": "update0/fc1.kernel",
                        "disagreeing_keys": ["update0/fc1.kernel"]}, BUG)):
        p = check_pair(compute(ref, members), ref, cand)
        p.localization = loc
        resolve(p, True)
        assert p.verdict == want, (loc, p.notes)
    assert p.declared == ["adam_epsilon_hat"]   # named either way


def test_different_batch_is_a_data_bug_even_inside_the_envelope(fam):
    from harness.localize import Localizer
    root, ref, members = fam
    cs = [f"{i:012x}" for i in range(N)]
    cs[12] = "ffffffffffff"
    cand = load_run(write_run(root, "cand", base_series(N), base_eval(N), checksums=cs))
    p = compare(ref, [cand], compute(ref, members), members, localize=Localizer(root)).pairs[0]
    assert p.verdict == BUG and p.first["series"] == "batch_checksum" and p.first["step"] == 12
    assert p.localization["stage"] == "data" and p.localization["step"] == 12


def test_unreproduced_late_excess_is_inconclusive_but_step0_excess_is_a_bug(fam):
    root, ref, members = fam
    nothing = lambda pair: {"stage": None, "disagreeing_keys": []}     # probes and replay all agree
    late, early = base_series(N), base_series(N)
    late["grad_norm"] = late["grad_norm"].copy()
    late["grad_norm"][60:] *= 1.001
    early["grad_norm"] = early["grad_norm"] * 1.001
    env = compute(ref, members)
    for name, s, want in (("late", late, INCONCLUSIVE), ("early", early, BUG)):
        cand = load_run(write_run(root, name, s, base_eval(N)))
        p = compare(ref, [cand], env, members, localize=nothing).pairs[0]
        assert p.verdict == want and p.first["step"] == (60 if name == "late" else 0), name
    assert "--stat" in compare(ref, [load_run(root / "late")], env, members, localize=nothing).pairs[0].notes[-1]
    # without localization the excess alone is a BUG, said so
    p = compare(ref, [load_run(root / "late")], env, members).pairs[0]
    assert p.verdict == BUG and "--no-localize" in p.notes[-1]


def test_odd_one_out_among_three(fam):
    root, ref, members = fam
    rng = np.random.default_rng(3)
    a = load_run(write_run(root, "a", jitter(base_series(N), rng, 1e-6), base_eval(N), backend="jax"))
    s = base_series(N)
    s["loss"] = s["loss"] * 1.01
    b = load_run(write_run(root, "b", s, base_eval(N), backend="tensorflow"))
    c = compare(ref, [a, b], compute(ref, members), members)
    assert [p.verdict for p in c.pairs if p.with_reference] == [DRIFT, BUG]
    assert [p.verdict for p in c.pairs if not p.with_reference] == ["DIFFER"]
    assert c.odd and c.odd["backend"] == "tensorflow"


def test_runs_sharing_one_injected_fault_do_not_make_the_reference_the_odd_one_out(fam):
    """A self-test's runs with one --fault agree with each other and disagree with their clean reference:
    the shared fault explains that, not a bug in the reference. The same runs without the fault recorded
    do point at the reference."""
    root, ref, members = fam
    s = base_series(N)
    s["loss"] = s["loss"] * 1.01
    for fault, odd_is_reference in (("label_smoothing", False), (None, True)):
        cands = [load_run(write_run(root / str(fault), f"c{i}", s, base_eval(N), backend=b, fault=fault))
                 for i, b in enumerate(("jax", "tensorflow"))]
        c = compare(ref, cands, compute(ref, members), members)
        assert [p.verdict for p in c.pairs if p.with_reference] == [BUG, BUG]
        assert bool(c.odd and c.odd["run"] == ref.name) is odd_is_reference, (fault, c.odd)


# --------------------------------------------------------------------------- the command: outputs and bad input
def test_cli_writes_csv_and_json_and_exit_code(fam):
    root, ref, members = fam
    s = base_series(N)
    s["grad_norm"] = s["grad_norm"] * 1.5
    write_run(root, "cand", s, base_eval(N))
    env = [a for m in members for a in ("--envelope", str(m.path))]
    out = root / "out"
    r = cli(str(ref.path), str(root / "cand"), *env, "--no-localize", "--out", str(out))
    assert r.exit_code == 1, r.output
    assert "BUG" in r.output and "grad_norm" in r.output
    doc = json.loads((out / "comparison.json").read_text())
    assert doc["verdicts"] == {"cand": "BUG"} and doc["pairs"][0]["first_divergence"]["series"] == "grad_norm"
    assert doc["envelope"]["perturb_ulp_seeds"] == [1, 2, 3] and doc["rule"]["margin"] == 3.0
    csv = (out / "comparison.csv").read_text().splitlines()
    assert csv[0].startswith("reference,candidate") and ",BUG,0,grad_norm," in csv[1]
    assert (out / "comparison-steps.csv").exists()
    r = cli(str(ref.path), str(root / "ref__ulp1"), *env[2:], "--no-localize", "--json", "--out", str(out))
    assert r.exit_code == 0 and json.loads(r.output)["verdicts"] == {"ref__ulp1": DRIFT}


def _env_args(members):
    return [a for m in members for a in ("--envelope", str(m.path))]


def test_cli_refuses_a_run_of_another_spec_and_names_the_field(fam):
    root, ref, members = fam
    write_run(root, "other", base_series(N), base_eval(N), spec_hash="spec9999")
    r = cli(str(ref.path), str(root / "other"), *_env_args(members), "--no-localize")
    assert r.exit_code == 2
    assert "spec_hash differs" in r.output and "spec0000" in r.output and "spec9999" in r.output
    r = cli(str(ref.path), str(root / "other"), *_env_args(members), "--no-localize", "--force", "--out", str(root / "o"))
    assert r.exit_code == 0 and r.output.count("FORCED: spec_hash differs") == 2
    doc = json.loads((root / "o" / "comparison.json").read_text())
    assert doc["forced"] and "FORCED" not in doc["forced"][0] and "spec_hash" in doc["forced"][0]
    assert "spec_hash differs" in (root / "o" / "comparison.csv").read_text()


def test_a_run_alone_in_its_configuration_is_told_how_it_differs_from_the_reference(fam):
    """A scanned folder with one run whose flag differs (another batch size, other data): the note names the
    hyper-parameter or the data in words, not as hashes, and leaves out the batch order that follows from them."""
    root, ref, members = fam
    s, e = base_series(N), base_eval(N)
    write_run(root, "cand", s, e, backend="jax")
    write_run(root, "b32", s, e, backend="jax", hparams_hash="hp0032", order_hash="order0032",
              hparams={"steps": N, "batch_size": 32, "seed": 0, "lr": 0.05, "optimizer": "momentum"})
    write_run(root, "mine", s, e, backend="jax", data_hash="data9999", data={"source": "npz:/x/mine.npz"})
    r = cli(str(root), "-r", "torch", *_env_args(members), "--no-localize")
    assert r.exit_code == 0, r.output
    assert "b32: no other run of its configuration, not compared (against ref: batch_size 64 -> 32)" in r.output
    assert "mine: no other run of its configuration, not compared (against ref: data digits -> npz:/x/mine.npz)" \
        in r.output
    assert "order0032" not in r.output and "batch order" not in r.output


def test_what_differs_reads_hand_edited_manifests_without_failing():
    """Manifests whose hparams or data are not tables (edited by hand): the words fall back, nothing raises."""
    from harness.config_diff import differences, what_differs
    a = {"hparams": {"lr": 0.05, "steps": 10}, "data": {"source": "digits"}, "hparams_hash": "h1", "data_hash": "d1"}
    b = {"hparams": "lr=0.05", "data": ["x"], "hparams_hash": "h2", "data_hash": "d2"}
    assert what_differs(a, b, "hparams_hash") == "lr 0.05 -> None, steps 10 -> None"
    assert what_differs(a, b, "data_hash") == "the data"
    assert what_differs(a, dict(a, data_hash="d3"), "data_hash") == "the data's contents (digits)"
    only_order = differences({"order_hash": "o1"}, {"order_hash": "o2"})
    assert [(f, w) for f, _, _, w in only_order] == [("order_hash", "the batch order (seed, batch size, steps or "
                                                      "the data's size)")]


def test_cli_mismatched_step_ranges(fam):
    root, ref, members = fam
    s, e = base_series(60), base_eval(60)
    write_run(root, "short", s, e, hparams_hash="hp0060", hparams={"steps": 60, "batch_size": 64, "seed": 0})
    r = cli(str(ref.path), str(root / "short"), *_env_args(members), "--no-localize")
    assert r.exit_code == 2 and "hparams_hash differs" in r.output and "steps 100 -> 60)" in r.output
    r = cli(str(ref.path), str(root / "short"), *_env_args(members), "--no-localize", "--force", "--json")
    doc = json.loads(r.output)
    pair = doc["pairs"][0]
    assert pair["steps"]["train"]["compared"] == 60 and "step ranges differ" in " ".join(pair["notes"])


@pytest.mark.parametrize("damage,message", [
    ("no_steps", "steps.csv: missing"),
    ("no_manifest", "no manifest.json"),
    ("fewer_rows", "truncated: 80 rows"),
    ("cut_line", "is truncated"),
    ("garbage", "is not a number"),
    ("no_column", "missing column(s) grad_norm"),
    ("unsorted", "not strictly increasing"),
    ("incomplete", "not 'complete'"),
    ("unknown_option", "manifest.json: options: run options: unknown field(s) sharding"),
])
def test_cli_bad_input_is_one_line_and_exit_2(fam, damage, message):
    root, ref, members = fam
    d = write_run(root, "bad", base_series(N), base_eval(N))
    steps = (d / "steps.csv").read_text().splitlines()
    if damage == "no_steps":
        (d / "steps.csv").unlink()
    elif damage == "no_manifest":
        (d / "manifest.json").unlink()
    elif damage == "fewer_rows":
        (d / "steps.csv").write_text("\n".join(steps[:81]) + "\n")
    elif damage == "cut_line":
        (d / "steps.csv").write_text("\n".join(steps[:-1] + [steps[-1][:25]]) + "\n")
    elif damage == "garbage":
        steps[5] = steps[5].replace(steps[5].split(",")[2], "1.2.3", 1)
        (d / "steps.csv").write_text("\n".join(steps) + "\n")
    elif damage == "no_column":
        (d / "steps.csv").write_text("\n".join(",".join(x for i, x in enumerate(l.split(",")) if i != 4)
                                               for l in steps) + "\n")
    elif damage == "unsorted":
        steps[10], steps[11] = steps[11], steps[10]
        (d / "steps.csv").write_text("\n".join(steps) + "\n")
    elif damage == "incomplete":
        m = json.loads((d / "manifest.json").read_text())
        m["status"] = "running"
        (d / "manifest.json").write_text(json.dumps(m))
    elif damage == "unknown_option":     # a run folder from another version of the contract
        m = json.loads((d / "manifest.json").read_text())
        m["options"] = {**m.get("options", {}), "sharding": "fsdp"}
        (d / "manifest.json").write_text(json.dumps(m))
    r = cli(str(ref.path), str(d), *_env_args(members), "--no-localize")
    assert r.exit_code == 2, r.output
    err = [l for l in r.output.splitlines() if l.startswith("duipai: error:")]
    assert len(err) == 1 and message in err[0], r.output


def test_cli_results_folder_groups_runs_and_skips_envelope_members(fam):
    root, ref, members = fam
    rng = np.random.default_rng(5)
    write_run(root, "jaxrun", jitter(base_series(N), rng, 1e-6), base_eval(N), backend="jax")
    write_run(root, "lonely", base_series(N), base_eval(N), spec_hash="specXXXX")
    r = cli(str(root), *_env_args(members), "--no-localize", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["verdicts"] == {"jaxrun": DRIFT}
    assert any("envelope runs, not candidates" in n for n in doc["notes"])
    assert any("lonely" in n for n in doc["notes"])


def test_cli_results_folder_with_two_configurations(tmp_path):
    rng = np.random.default_rng(9)
    for spec in ("specA", "specB"):
        write_run(tmp_path, f"{spec}_torch", base_series(N), base_eval(N), spec_hash=spec)
        s = base_series(N)
        if spec == "specB":
            s["loss"] = s["loss"] * 1.01
        write_run(tmp_path, f"{spec}_jax", s, base_eval(N), spec_hash=spec, backend="jax")
        for j in (1, 2, 3):
            write_run(tmp_path, f"{spec}_torch__ulp{j}", jitter(base_series(N), rng, 1e-6), base_eval(N),
                      spec_hash=spec, perturb=j)
    env = [a for j in (1, 2, 3) for a in ("--envelope", str(tmp_path / f"specA_torch__ulp{j}"))]
    r = cli(str(tmp_path), *env, "--no-localize", "--force", "--json")
    assert r.exit_code == 1, r.output
    doc = json.loads(r.stdout)
    assert doc["mode"] == "lockstep-groups" and len(doc["comparisons"]) == 2
    assert [c["verdicts"] for c in doc["comparisons"]] == [{"specA_jax": IDENTICAL}, {"specB_jax": BUG}]
    # one folder per group, each with one comparison (what the HTML report reads)
    for group, verdict in (("specA_torch", IDENTICAL), ("specB_torch", BUG)):
        one = json.loads((tmp_path / group / "comparison.json").read_text())
        assert one["reference"]["run"] == group and list(one["verdicts"].values()) == [verdict]
        assert len((tmp_path / group / "comparison.csv").read_text().splitlines()) == 2
    assert not (tmp_path / "comparison.json").exists()


def test_cli_no_runs(tmp_path):
    r = cli(str(tmp_path))
    assert r.exit_code == 2 and "no complete run folders" in r.output


# --------------------------------------------------------------------------- statistical mode
def _seed_runs(root, backend, shift, seeds=range(5)):
    rng = np.random.default_rng(0)   # every group the same noise: only `shift` separates them (no chance verdict)
    out = []
    for sd in seeds:
        s, e = base_series(N), base_eval(N)
        e = {k: v.copy() for k, v in e.items()}
        e["eval_accuracy"][-1] = 0.95 + shift + 0.004 * rng.standard_normal()
        e["eval_loss"][-1] = 0.15 - shift + 0.01 * rng.standard_normal()
        out.append(write_run(root, f"{backend}_s{sd}", s, e, backend=backend, seed=sd))
    return out


def test_stat_mode_welch_t_test(tmp_path):
    from scipy import stats
    runs = _seed_runs(tmp_path, "torch", 0.0) + _seed_runs(tmp_path, "jax", 0.0) + _seed_runs(tmp_path, "tensorflow", 0.03)
    r = cli("--stat", *map(str, runs), "--json", "--out", str(tmp_path / "o"))
    assert r.exit_code == 1, r.output
    doc = json.loads(r.output)
    assert doc["verdicts"]["jax"]["verdict"] == DRIFT and doc["verdicts"]["tensorflow"]["verdict"] == BUG
    t = next(x for x in doc["tests"] if x["group"] == "tensorflow" and x["metric"] == "eval_accuracy")
    a = [load_run(p).values["eval_accuracy"][-1] for p in runs[:5]]
    b = [load_run(p).values["eval_accuracy"][-1] for p in runs[10:]]
    assert t["p"] == pytest.approx(stats.ttest_ind(b, a, equal_var=False).pvalue)
    assert t["d"] > 2 and t["step"] == N and t["n"] == 5
    assert (tmp_path / "o" / "comparison.csv").read_text().count("tensorflow") == 3


def test_stat_mode_needs_two_seeds_per_group(tmp_path):
    runs = _seed_runs(tmp_path, "torch", 0.0, [0, 1]) + _seed_runs(tmp_path, "jax", 0.0, [0])
    r = cli("--stat", *map(str, runs))
    assert r.exit_code == 2 and ">= 2 seeds per group" in r.output


# --------------------------------------------------------------------------- integration: real torch runs
def _cli_json(*args: str) -> tuple[int, dict]:
    r = cli(*args, "--json")
    assert r.exit_code in (0, 1), r.output
    return r.exit_code, json.loads(r.stdout)


def _pair(doc: dict, name_part: str) -> dict:
    return next(p for p in doc["pairs"] if p["with_reference"] and p["candidate"].endswith(name_part))


@pytest.fixture(scope="module")
def momentum(results_root):
    """torch reference, lr x 1.001, flatten without permutation, a held-out 1-ULP run and float64, judged in one
    comparison (the envelope: --perturb-ulp 1..3 and a float64 run, trained on demand). No shared-state step
    comparison (--resync-every 0): what is under test is the envelope and the step-0 localization; the resync has
    its own tests (test_resync*.py, and test_torch_vs_jax_is_drift below runs it), and its replays made this fixture
    117 s instead of 67 s (2026-12-03, one pytest process, idle)."""
    from .torch_runs import compare_root, run
    root = compare_root(results_root)
    runs = [run(root), run(root, fault="lr_scale_1.001"), run(root, fault="flatten_no_permute"),
            run(root, perturb_ulp=4), run(root, dtype="float64")]
    return _cli_json(*map(str, runs), "--resync-every", "0", "--out", str(root / "out-momentum"))


def test_torch_lr_scale_is_a_bug_in_the_optimizer_update(momentum):
    code, doc = momentum
    assert code == 1
    p = _pair(doc, "fault-lr_scale_1.001")
    assert p["verdict"] == BUG and p["first_divergence"]["step"] == 0
    assert p["first_divergence"]["factor"] > 100
    loc = p["localization"]
    assert loc["stage"] == "optimizer" and loc["probe"].startswith("update0/") and loc["method"] == "step-0 probes"
    assert all(g["ok"] for g in loc["gradients"]) and all(l["ok"] for l in loc["layers"])


def test_torch_flatten_without_permute_is_a_forward_bug_at_fc1(momentum):
    _, doc = momentum
    p = _pair(doc, "fault-flatten_no_permute")
    assert p["verdict"] == BUG and p["first_divergence"]["step"] == 0
    loc = p["localization"]
    assert loc["stage"] == "forward" and loc["layer"] == "fc1"
    rates = {l["layer"]: l for l in loc["layers"]}
    assert rates["flatten_1"]["ok"] and not rates["fc1"]["ok"] and rates["fc1"]["R"] > 1e3
    assert loc["max_R_layer"] == "fc1"


def test_torch_ulp_and_float64_runs_are_drift(momentum):
    _, doc = momentum
    for part in ("__ulp4", "__float64"):
        p = _pair(doc, part)
        assert p["verdict"] == DRIFT, (part, p["first_divergence"], p["notes"])
    env = doc["envelope"]
    assert env["perturb_ulp_seeds"] == [1, 2, 3, 1] and env["runs"][-1].endswith("__float64__ulp1")
    # the drift-only candidates agree with each other too; the two bugs are not an odd one out
    assert doc["odd_one_out"] is None


@pytest.fixture(scope="module")
def adam_grad_double(results_root):
    from .torch_runs import compare_root, run
    root = compare_root(results_root)
    runs = [run(root, "adam"), run(root, "adam", fault="grad_double")]
    # a 1-run envelope without the float64 run and no localization jobs: three backend processes in all
    # (a x2 gradient is ~1e6 x outside any envelope; the backward localization has its own unit test)
    return _cli_json(*map(str, runs), "-k", "1", "--no-fp64", "--no-localize", "--out", str(root / "out-adam"))


def test_torch_grad_double_under_adam_is_caught_through_grad_norm(adam_grad_double):
    code, doc = adam_grad_double
    p = doc["pairs"][0]
    assert code == 1 and p["verdict"] == BUG
    f = p["first_divergence"]
    assert f["series"] == "grad_norm" and f["step"] == 0
    assert f["b_value"] == pytest.approx(2 * f["a_value"], rel=1e-6)
    # Adam hides the doubled gradient: the loss stays inside for many steps and far closer than grad_norm
    loss, gn = p["series"]["loss"], p["series"]["grad_norm"]
    assert loss["first_exceed_step"] is None or loss["first_exceed_step"] >= 10
    assert gn["max_ratio"] > 1e3 * loss["max_ratio"]
    assert "--no-localize" in p["notes"][-1]


def test_torch_vs_jax_is_drift(results_root, momentum):
    """The same reference and (cached) envelope; one more backend process: the JAX run."""
    from .torch_runs import compare_root, run
    root = compare_root(results_root)
    code, doc = _cli_json(str(run(root)), str(run(root, backend="jax")), "--out", str(root / "out-jax"))
    p = doc["pairs"][0]
    assert code == 0 and p["verdict"] == DRIFT, (p["first_divergence"], p["notes"])
    assert p["candidate_backend"] == "jax" and len(doc["envelope"]["runs"]) == 4
