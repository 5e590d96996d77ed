"""What the user reads: the odd one out leading the terminal, the report and summary.md when it is the
reference; the pairs without the reference in one line when they agree (every pair with -v); progress
as plain lines off a terminal and as live bars on one. Synthetic run folders: no framework runs."""
from __future__ import annotations

import io
import json
import re
import threading

import numpy as np
import pytest
from click.testing import CliRunner

from .synthetic import base_eval, base_series, family, jitter, write_run

N = 100


def _shifted(rng, scale: float = 1.01) -> dict[str, np.ndarray]:
    s = jitter(base_series(N), rng, 1e-6)
    s["loss"] = s["loss"] * scale
    return s


@pytest.fixture
def wrong_reference(tmp_path):
    """A reference (with its envelope) whose loss is 1% off, and three backends that agree with each
    other: what a fault injected into the reference looks like."""
    ref, members = family(tmp_path, N)
    rng = np.random.default_rng(7)
    cands = [write_run(tmp_path, f"toy__{b}", _shifted(rng), base_eval(N), backend=b)
             for b in ("jax", "tensorflow", "keras-jax")]
    return tmp_path, ref, members, cands


def _compare(*args: str):
    from harness.cli import main
    return CliRunner().invoke(main, ["compare", *args], catch_exceptions=False)


def _envelope(members) -> list[str]:
    return [a for m in members for a in ("--envelope", str(m))]


def _first_verdict_line_md(md: str) -> str:
    """The first line under the comparison's heading that says something."""
    after = md.split("\n## ", 1)[1].splitlines()[1:]
    return next(x for x in after if x.strip())


def _first_verdict_line_html(page: str) -> str:
    section = page.split("<h2>Verdicts", 1)[1]
    first = re.search(r"<(p|table)\b[^>]*>(.*?)</\1>", section, re.S)
    return re.sub(r"<[^>]+>", "", first.group(2)) if first.group(1) == "p" else "(the table)"


def test_a_wrong_reference_leads_the_terminal_the_report_and_the_summary(wrong_reference):
    root, ref, members, cands = wrong_reference
    out = root / "out"
    r = _compare(str(ref), *map(str, cands), *_envelope(members), "--no-localize", "--out", str(out))
    assert r.exit_code == 1, r.output          # a BUG between the reference and a candidate is still a BUG
    lead = "The reference torch is the odd one out"
    assert r.output.splitlines()[0].startswith(lead), r.output
    assert r.output.count("odd one out") == 1
    doc = json.loads((out / "comparison.json").read_text())
    assert set(doc["verdicts"].values()) == {"BUG"} and doc["odd_one_out"]["run"] == "ref"

    from harness.commands.report import report_cmd
    rr = CliRunner().invoke(report_cmd, [str(out)], catch_exceptions=False)
    assert rr.exit_code == 0, rr.output
    md = (out / "report" / "summary.md").read_text()
    assert _first_verdict_line_md(md).startswith(f"**{lead}"), md
    assert "the bug is most likely in the reference" in _first_verdict_line_md(md)
    assert md.count("| **BUG** |") == 3       # the per-pair verdicts stay as they are
    page = (out / "report" / "index.html").read_text()
    assert _first_verdict_line_html(page).startswith(lead), page[:3000]


def test_a_wrong_candidate_is_named_after_the_table_not_first(tmp_path):
    ref, members = family(tmp_path, N)
    rng = np.random.default_rng(3)
    good = [write_run(tmp_path, f"toy__{b}", jitter(base_series(N), rng, 1e-6), base_eval(N), backend=b)
            for b in ("jax", "keras-jax")]
    bad = write_run(tmp_path, "toy__tensorflow", _shifted(rng), base_eval(N), backend="tensorflow")
    out = tmp_path / "out"
    r = _compare(str(ref), *map(str, good + [bad]), *_envelope(members), "--no-localize", "--out", str(out))
    assert r.exit_code == 1
    lines = r.output.splitlines()
    assert lines[0].startswith("reference:")
    odd = [i for i, x in enumerate(lines) if "odd one out" in x]
    table = lines.index(next(x for x in lines if x.startswith("candidate")))
    assert len(odd) == 1 and odd[0] > table and "tensorflow" in lines[odd[0]]
    from harness.report import markdown
    md = markdown(out)
    assert _first_verdict_line_md(md).startswith("| candidate")
    assert "odd one out: tensorflow" in md


@pytest.fixture
def agreeing(tmp_path):
    """Four candidates inside the reference's envelope: six pairs without the reference, all DRIFT."""
    ref, members = family(tmp_path, N)
    rng = np.random.default_rng(11)
    cands = [write_run(tmp_path, f"toy__{b}", jitter(base_series(N), rng, 1e-6), base_eval(N), backend=b)
             for b in ("jax", "tensorflow", "keras-jax", "keras-torch")]
    return tmp_path, ref, members, cands


def test_pairs_without_the_reference_are_one_line_when_they_agree_and_listed_with_verbose(agreeing):
    root, ref, members, cands = agreeing
    args = [str(ref), *map(str, cands), *_envelope(members), "--no-localize", "--out", str(root / "out")]
    short = _compare(*args)
    assert short.exit_code == 0, short.output
    about = [x for x in short.output.splitlines() if "pairs without the reference" in x or " ~ " in x]
    assert len(about) == 1 and about[0].startswith("pairs without the reference: all 6 DRIFT (max "), about
    # the agreeing pairs' notes are behind -v: after the table, that one line is all
    after = short.output.split("keras-torch toy  DRIFT", 1)[1].splitlines()[1:]
    assert [x for x in after if x.strip() and not x.startswith("written: ")] == about, short.output
    verbose = _compare(*args, "-v")
    assert verbose.exit_code == 0
    assert "note: no shared-state step comparison" in verbose.output
    listed = [x for x in verbose.output.splitlines() if " ~ " in x]
    assert len(listed) == 6 and all(x.endswith(": DRIFT") for x in listed)
    # the machine-readable output does not depend on it
    j1 = _compare(*args, "--json").output
    j2 = _compare(*args, "--json", "-v").output
    assert j1 == j2 and json.loads(j1)["verdicts"] == {c.name: "DRIFT" for c in cands}


def test_disagreeing_pairs_without_the_reference_are_each_listed():
    from harness.compare_output import other_pairs_lines
    rows = [("a", "b", "DRIFT", None, 1.5), ("a", "c", "IDENTICAL", None, 0.0),
            ("b", "c", "DIFFER", {"step": 7, "series": "loss", "factor": 9.0}, 9.0)]
    lines = other_pairs_lines(rows, 6.0)
    assert lines[0] == "pairs without the reference (margin x6): 2 agree: 1 IDENTICAL, 1 DRIFT; 1 do not:"
    assert lines[1:] == ["  b ~ c: DIFFER from step 7 (loss, 9x)"]
    assert other_pairs_lines(rows[:2], 6.0) == [
        "pairs without the reference: all 2 agree: 1 IDENTICAL, 1 DRIFT (max 1.5x of the envelope, margin x6; "
        "-v lists them)"]
    assert len(other_pairs_lines(rows, 6.0, verbose=True)) == 4 and other_pairs_lines([], 6.0) == []


def test_a_pair_that_differs_as_a_verified_declaration_says_is_not_listed_as_a_disagreement():
    """jax and keras-torch both against torch: jax DRIFT, keras-torch DECLARED (Adam's epsilon-hat, verified). The
    pair jax ~ keras-torch differs from step 0, as it must: said on one line as expected, with the declaration,
    not as one that "does not" agree. Two candidates with the same declarations, or one that is a BUG, still are."""
    from harness.compare_output import declared_apart, other_pairs_lines, side_of
    verified, eps_hat = "verified (step-0 probes agree with the reference computing the formula)", {
        "against": {"change": {"fault": "adam_eps_hat"}}}
    sides = {"jax": side_of("DRIFT", [], None, {"agree": True}),
             "keras-torch": side_of("DECLARED", ["adam_epsilon_hat"], verified, eps_hat),
             "keras-jax": side_of("DECLARED", ["adam_epsilon_hat"], verified, eps_hat),
             "tensorflow": side_of("BUG", [], None, None),
             "keras-tensorflow": side_of("DECLARED", ["adam_epsilon_hat"], "not verified (no emulation)", None)}
    assert declared_apart(sides, "jax", "keras-torch") == "keras-torch declares adam_epsilon_hat"
    assert declared_apart(sides, "keras-jax", "keras-torch") is None        # the same declaration: must agree
    assert declared_apart(sides, "tensorflow", "keras-torch") is None       # a BUG explains nothing
    assert declared_apart(sides, "jax", "tensorflow") is None
    assert declared_apart(sides, "jax", "keras-tensorflow") is None         # nor does a declaration without evidence
    # the same name checked against two formulas (where dp 2's running statistics come from): they differ as declared
    sides["tensorflow dp2"] = side_of("DECLARED", ["per_replica_batchnorm"], verified, {
        "against": {"change": {"fault": "bn_replica_mean_running_stats", "devices": 2}}})
    sides["torch dp2"] = side_of("DECLARED", ["per_replica_batchnorm"], verified, {"against": {"change": {"devices": 2}}})
    sides["jax dp2"] = sides["torch dp2"]
    assert declared_apart(sides, "jax dp2", "torch dp2") is None
    assert declared_apart(sides, "tensorflow dp2", "torch dp2") == (
        "tensorflow dp2 declares per_replica_batchnorm (the reference with devices 2 + fault "
        "bn_replica_mean_running_stats); torch dp2 declares per_replica_batchnorm (the reference with devices 2)")
    first = {"step": 0, "series": "update_norm", "factor": 21.0}
    rows = [("jax", "keras-torch", "DIFFER", first, 21.0, declared_apart(sides, "jax", "keras-torch")),
            ("jax", "numpy", "DRIFT", None, 1.2, None)]
    assert other_pairs_lines(rows, 6.0) == [
        "pairs without the reference: the other 1 DRIFT (max 1.2x of the envelope, margin x6; -v lists them)",
        "pairs without the reference: 1 differ as their verified declared differences say they must: "
        "jax ~ keras-torch (keras-torch declares adam_epsilon_hat)"]
    bug = [("jax", "tensorflow", "DIFFER", first, 21.0, None)]
    assert other_pairs_lines(rows + bug, 6.0)[:2] == [
        "pairs without the reference (margin x6): 1 DRIFT; 1 do not:", "  jax ~ tensorflow: DIFFER from step 0 "
        "(update_norm, 21x)"]
    assert other_pairs_lines(rows, 6.0, verbose=True)[1].endswith("(expected: keras-torch declares adam_epsilon_hat)")
    # many such pairs (387 on cnn2d_hard momentum step): counted by what their runs declare, not each listed
    many = [(f"r{i}", "keras-torch", "DIFFER", first, 21.0, "keras-torch declares adam_epsilon_hat") for i in range(3)]
    many.append(("jax dp2", "keras-torch", "DIFFER", first, 21.0,
                 "jax dp2 declares per_replica_batchnorm; keras-torch declares adam_epsilon_hat"))
    many.append(("tensorflow dp2", "torch dp2", "INCONCLUSIVE", first, 21.0,
                 declared_apart(sides, "tensorflow dp2", "torch dp2")))
    assert other_pairs_lines(many, 6.0) == [
        "pairs without the reference: 5 differ as their verified declared differences say they must: "
        "3 by adam_epsilon_hat; 1 by adam_epsilon_hat, per_replica_batchnorm; 1 by per_replica_batchnorm; "
        "-v lists them"]


# --------------------------------------------------------------------------- progress
class FakeExecute:
    """runner.execute without a framework: a few step messages, then a folder (or a failure)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, cfg, out_root, name=None, *, on_progress=None, **kw):
        from harness.errors import BackendFailed
        self.calls += 1
        for s in (0, 5, 10):
            on_progress({"step": s, "of": 10, "loss": 1.0 / (s + 1)})
        if cfg.perturb_ulp == 2:
            raise BackendFailed("toy crash", log=None)
        folder = out_root / name
        folder.mkdir(parents=True, exist_ok=True)
        return folder


def _tiny_matrix(tmp_path):
    p = tmp_path / "tiny.toml"
    p.write_text('name = "tiny"\nmodels = ["cnn2d_2conv_2fc"]\nbackends = ["torch"]\nsteps = 10\nenvelope_k = 2\n'
                 "envelope_fp64 = false\n")
    return p


def test_matrix_progress_is_one_plain_line_per_finished_run_off_a_terminal(tmp_path, monkeypatch):
    from harness import runner
    from harness.cli import main
    fake = FakeExecute()
    monkeypatch.setattr(runner, "execute", fake)
    r = CliRunner().invoke(main, ["matrix", str(_tiny_matrix(tmp_path)), "--out", str(tmp_path / "res"), "-j", "2"],
                           catch_exceptions=False)
    assert r.exit_code == 3 and fake.calls == 3      # one failed run: exit 3, the others complete
    done = sorted(x for x in r.output.splitlines() if re.match(r"\[\d/3\] ", x))
    assert [x[:5] for x in done] == ["[1/3]", "[2/3]", "[3/3]"]
    assert sum(" failed " in x and "ulp2" in x and "toy crash" in x for x in done) == 1
    assert "\x1b[" not in r.output and "step 5/10" not in r.output     # no bars, no escape codes


def test_live_progress_renders_steps_runs_and_time_left_from_several_threads():
    from rich.console import Console
    from harness.progress import RunsProgress
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=140)
    names = [f"toy__torch__momentum__s0__ulp{i}" for i in range(6)]
    logged = []
    go = threading.Barrier(3)
    with RunsProgress(names, logged.append, live=True, console=console) as bars:
        assert bars.live and bars.eta() is None

        def work(mine):
            go.wait()
            for n in mine:
                step = bars.started(n)
                for s in range(0, 101, 5):
                    step({"step": s, "of": 100, "loss": 0.5})
                bars.finished(n, f"ran         {n}")

        threads = [threading.Thread(target=work, args=(names[i::3],)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        bars.bars.refresh()
        assert bars.done == 6 and not bars.share and bars.eta() == 0
    text = buf.getvalue()
    assert sorted(re.findall(r"\[(\d)/6\] ran", text)) == list("123456")
    assert "6/6 done, 0 running" in text and "left" in text and not logged   # live: nothing through the plain log


def test_live_progress_shows_a_running_run_step_and_an_estimate():
    from rich.console import Console
    from harness.progress import RunsProgress
    buf = io.StringIO()
    with RunsProgress(["m__jax__s0", "m__tensorflow__s0"], print, live=True,
                      console=Console(file=buf, force_terminal=True, width=140)) as bars:
        bars.started("m__jax__s0")({"step": 30, "of": 120, "loss": 0.25})
        bars.bars.refresh()
        assert 0 < bars.eta() < 3600
    text = buf.getvalue()
    assert "jax" in text and "step 30/120 loss 0.25" in text and "0/2 done, 1 running" in text


def test_activity_is_plain_off_a_terminal_and_a_spinner_on_one():
    from rich.console import Console
    from harness.progress import Activity
    said = []
    with Activity("comparing", said.append, live=False) as say:
        say("localize: probe jax (x)")
    assert said == ["localize: probe jax (x)"]
    buf = io.StringIO()
    with Activity("comparing", said.append, live=True, console=Console(file=buf, force_terminal=True)) as say:
        say("localize: probe [tensorflow] (y)")
    assert "localize: probe [tensorflow] (y)" in buf.getvalue() and len(said) == 1


def test_two_candidates_that_each_agree_with_the_reference_at_every_resynced_step_drift_from_each_other():
    """numpy and tensorflow --xla, both DRIFT against torch with every resynced step agreeing: their own curves part
    past the envelope's saturation (INCONCLUSIVE, a pair without the reference has no resync of its own), yet both
    compute the reference's step from its state, so each other's: DRIFT, said why. A BUG side, a side decided
    without the shared-state comparison, or a disagreeing resync infer nothing."""
    from types import SimpleNamespace as NS

    from harness.candidate_pairs import through_reference

    def side(verdict="DRIFT", agree=True, n=13):
        return NS(verdict=verdict, resync={"agree": agree, "n": n})

    def pair(verdict="INCONCLUSIVE"):
        return NS(verdict=verdict, notes=[], a=NS(name="numpy"), b=NS(name="tensorflow"), declared=[])
    p = pair()
    through_reference(p, side(), side(verdict="IDENTICAL"))
    assert p.verdict == "DRIFT" and "agree with the reference at every resynced step (13 and 13" in p.notes[0]
    p = pair("DIFFER")
    through_reference(p, side(), side())
    assert p.verdict == "DRIFT" and p.notes[0].startswith("was DIFFER")
    for other in (side("BUG", agree=False), side(agree=False), NS(verdict="DRIFT", resync=None),
                  side("DECLARED"), side(n=0)):
        p = pair()
        through_reference(p, side(), other)
        assert p.verdict == "INCONCLUSIVE" and not p.notes

    # keras-jax and keras-tensorflow, both DECLARED (verified) for Keras' velocity convention: each resynced against
    # the reference computing that formula, so the same step as each other; not so with another formula, an
    # unverified declaration, or against a plain DRIFT side (which computes the plain reference's step)
    def declared(fault="keras_momentum_schedule", evidence="verified (step-0 probes agree ...)"):
        return NS(verdict="DECLARED", evidence=evidence,
                  resync={"agree": True, "n": 32, "against": {"change": {"fault": fault}}})
    p = pair()
    through_reference(p, declared(), declared())
    assert p.verdict == "DRIFT" and "the reference computing fault keras_momentum_schedule" in p.notes[0], p.notes
    p = pair()
    through_reference(p, declared(), declared(evidence="not verified (no emulation)"))
    assert p.verdict == "INCONCLUSIVE" and not p.notes


def test_a_pair_whose_sides_compute_different_verified_formulas_is_declared_through_the_reference():
    """jax dp2 (plain momentum, DRIFT) and keras-jax (Keras' lr-in-velocity momentum) on a step schedule: each
    agrees at every resynced step with the reference computing its own formula, and the plain reference disagrees
    with keras-jax there (the formula is at work): the pair differs as declared, DECLARED, and says so; so do two
    sides with two different verified formulas. A keras side whose every resynced step agrees with the plain
    reference too (no schedule boundary in the run: the formula moved nothing) computes the plain step: DRIFT."""
    from types import SimpleNamespace as NS

    from harness.candidate_pairs import through_reference

    def run(name):
        return NS(name=name)

    def side(verdict="DRIFT", fault=None, evidence=None, resync_evidence=()):
        rs = {"agree": True, "n": 8, "evidence": list(resync_evidence)}
        if fault:
            rs["against"] = {"change": {"fault": fault}}
        return NS(verdict=verdict, evidence=evidence, resync=rs)

    def pair(verdict="INCONCLUSIVE"):
        return NS(verdict=verdict, notes=[], a=run("jax dp2"), b=run("keras-jax"), declared=["keras_momentum_velocity"],
                  evidence=None)
    keras = side("DECLARED", "keras_momentum_schedule", "verified (every resynced step agrees ...)",
                 ["step 100: update0/conv1.kernel"])
    for p, y in ((pair(), keras), (pair("DIFFER"), keras),
                 (pair(), side("DRIFT", "keras_momentum_schedule", None, ["step 100: update0/conv1.kernel"]))):
        through_reference(p, side(), y)
        assert p.verdict == "DECLARED" and p.evidence.startswith("verified through the reference"), p.notes
        assert "differ as their declared difference(s) keras_momentum_velocity say they must" in p.notes[0]
        assert "and keras-jax with the reference computing fault keras_momentum_schedule" in p.notes[0]
    p = pair()
    through_reference(p, side("DECLARED", "adam_eps_hat", "verified (step-0 probes ...)"), keras)
    assert p.verdict == "DECLARED"
    p = pair()
    through_reference(p, side(), side("DRIFT", "keras_momentum_schedule"))     # the formula moved no step
    assert p.verdict == "DRIFT" and "both runs agree with the reference at every" in p.notes[0], p.notes
    for y in (side("BUG"), side("DECLARED", "keras_momentum_schedule", "not verified (no emulation)"),
              NS(verdict="DRIFT", resync={"agree": False, "n": 8})):
        p = pair()
        through_reference(p, side(), y)
        assert p.verdict == "INCONCLUSIVE" and not p.notes
    p = pair("BUG")          # only a parting of the pair's own curves is decided through the reference
    through_reference(p, side(), keras)
    assert p.verdict == "BUG"


def test_when_every_candidate_is_a_bug_the_candidates_are_compared_from_a_pivots_states():
    """A wrong reference on a chaotic model: every candidate BUG against it, and the candidates' own curves part
    past the envelope's saturation (INCONCLUSIVE), with nothing to decide them through the reference. The first
    BUG candidate that declares nothing is the pivot: its pairs are compared one step at a time from its states
    (every step agreeing: DRIFT, so the reference is named the odd one out; one disagreeing: DIFFER; none ran:
    left, said), the other pairs through it. Whatever the candidates that are not BUG are (two BUG runs may share
    the code with the bug), not for candidates with a --fault (a self-test), not without a pivot that declares
    nothing."""
    from types import SimpleNamespace as NS

    from harness.candidate_pairs import decide_by_resync, odd_one_out, resync_candidates, pivot_pairs

    def run(name, declared=(), fault=None, backend=None):
        return NS(name=name, backend=backend or name, declared=list(declared), fault=fault)
    ref, w, x, y, z = run("torch"), run("jax"), run("numpy"), run("tensorflow"), run("keras-torch")
    with_ref = [NS(verdict="BUG", a=ref, b=c) for c in (w, x, y, z)]

    def pair(a, b, verdict="INCONCLUSIVE"):
        return NS(verdict=verdict, a=a, b=b, notes=[], resync=None, first=None, evidence=None, declared=[])
    cands = [pair(w, x), pair(w, y, "DIFFER"), pair(w, z, "DRIFT"), pair(x, y), pair(x, z), pair(y, z, "DRIFT")]
    star, rest, pivot = pivot_pairs(with_ref, cands)
    assert star == cands[:3] and rest == cands[3:5] and pivot == "jax"
    none = ([], [], None)
    # another backend agrees with the reference: the BUG runs are still compared with each other (a bug in code
    # they share makes them one group), numpy the pivot
    star, rest, pivot = pivot_pairs([NS(verdict="DRIFT", a=ref, b=w)] + with_ref[1:], cands)
    assert pivot == "numpy" and star == cands[3:5] and rest == []
    assert pivot_pairs(with_ref[:1], cands[:1]) == none                   # one BUG: nothing to ask
    # the reference's own dp 2 run agrees with it (a bug in that backend's code is in both): still asked
    torch2 = run("torch dp2", backend="torch")
    assert pivot_pairs(with_ref + [NS(verdict="DRIFT", a=ref, b=torch2)], cands)[0] == cands[:3]
    faulty = [NS(verdict="BUG", a=ref, b=run(f"jax {f}", fault=f, backend="jax")) for f in ("a", "b")]
    assert pivot_pairs(faulty, [pair(faulty[0].b, faulty[1].b)]) == none
    keras = run("keras-jax", [{"id": "adam_epsilon_hat"}])
    only_declared = [NS(verdict="BUG", a=ref, b=keras), NS(verdict="BUG", a=ref, b=run("keras-tf", keras.declared))]
    assert pivot_pairs(only_declared, [pair(keras, only_declared[1].b)]) == none    # no plain pivot
    # a declared candidate first in order: the pivot is the first that declares nothing, its pairs turned to it
    with_keras = [NS(verdict="BUG", a=ref, b=keras)] + with_ref[:2]
    kp = [pair(keras, w), pair(keras, x), pair(w, x)]
    star, rest, pivot = pivot_pairs(with_keras, kp)
    assert pivot == "jax" and star == [kp[0], kp[2]] and rest == [kp[1]]

    asked = []

    def resync(p, extra):
        asked.append((p.a.name, p.b.name))
        return {"agree": True, "n": 7, "points": [0, 50]}
    star, rest, pivot = pivot_pairs(with_ref, cands)
    resync_candidates(star, rest, pivot, resync, jobs=2)
    assert sorted(asked) == [("jax", "keras-torch"), ("jax", "numpy"), ("jax", "tensorflow")]
    assert [p.verdict for p in cands] == ["DRIFT"] * 6
    assert "every step agrees from jax's state (7 resynced steps)" in cands[0].notes[0]
    assert not cands[2].notes                        # DRIFT already: the agreeing resync changes nothing
    assert "both runs agree with jax at every resynced step (7 and 7 steps" in cands[3].notes[0]
    index = {(p.a.name, p.b.name): p for p in with_ref + cands}
    assert odd_one_out([ref, w, x, y, z], index)["run"] == "torch"

    # the declared candidate asked from the pivot's states, the pivot first: its formula at work makes the pair
    # DECLARED, verified, and that counts as agreeing for the odd one out
    asked.clear()

    def with_formula(p, extra):
        asked.append((p.a.name, p.b.name))
        if p.b.name == "keras-jax":
            return {"agree": True, "n": 7, "against": {"change": {"fault": "adam_eps_hat"}},
                    "evidence": ["step 0: update0/fc2.bias"]}
        return {"agree": True, "n": 7}
    star, rest, pivot = pivot_pairs(with_keras, kp)
    resync_candidates(star, rest, pivot, with_formula)
    assert sorted(asked) == [("jax", "keras-jax"), ("jax", "numpy")]
    assert kp[0].verdict == "DECLARED" and kp[0].evidence.startswith("verified") and "they differ as declared" in \
        kp[0].notes[0]
    assert kp[1].verdict == "DECLARED" and "keras-jax agrees with jax computing fault adam_eps_hat" in kp[1].notes[0]
    index = {(p.a.name, p.b.name): p for p in with_keras + kp}
    assert odd_one_out([ref, keras, w, x], index)["run"] == "torch"

    # one candidate computes something else from the pivot's states: DIFFER with the pivot, and with the others
    cands = [pair(w, x), pair(w, y), pair(x, y)]
    star, rest, pivot = pivot_pairs(with_ref[:3], cands)
    resync_candidates(star, rest, pivot, lambda p, extra: (
        {"agree": True, "n": 7} if p.b.name == "numpy" else
        {"agree": False, "n": 7, "first_disagreement": {"step": 50},
         "worst": {"worst_factor": 9.0, "worst_key": "update0/fc2.bias", "step": 50}}))
    assert [p.verdict for p in cands] == ["DRIFT", "DIFFER", "DIFFER"]
    assert "computes something else at step 50 (7 resynced steps)" in cands[1].notes[0]
    assert ("numpy agrees with jax at every resynced step and tensorflow does not (update0/fc2.bias at step 50, 9x "
            "its calibrated tolerance)") in cands[2].notes[0]
    p = pair(x, y)
    decide_by_resync(p, {"skipped": "no resync point"}, "numpy")
    assert p.verdict == "INCONCLUSIVE" and "no shared-state comparison from numpy's state (no resync point)" in p.notes[0]
    # decided from the pivot's states: the saturated curves' advice to use --stat is dropped, what they said is kept
    saturated = "the envelope saturates at step 46: pointwise comparison has no power there"
    for rs, verdict in (({"agree": True, "n": 7}, "DRIFT"), ({"agree": False, "n": 7}, "DIFFER"), (None, "INCONCLUSIVE")):
        p = pair(x, y)
        p.notes = [saturated + "; compare seeds statistically (--stat)"]
        decide_by_resync(p, rs, "numpy")
        assert p.verdict == verdict
        assert p.notes[0] == ("free-running curves alone: " + saturated if rs else saturated +
                              "; compare seeds statistically (--stat)")


def test_a_buggy_candidate_on_a_chaotic_model_differs_from_the_runs_that_compute_the_reference_step():
    """jax BUG against torch (its resynced step 0 20x its tolerance), numpy and tensorflow DRIFT with every resynced
    step agreeing; the pairs of jax with them INCONCLUSIVE on their curves: DIFFER, said why, and jax is the odd one
    out. A departure under twice the tolerance, or a side that does not compute the plain reference's step,
    infers nothing."""
    from types import SimpleNamespace as NS

    from harness.candidate_pairs import odd_one_out, through_reference

    def run(name):
        return NS(name=name, backend=name, declared=[], fault=None)     # what odd_one_out reads of a Run
    ref, jax, numpy, tf = run("torch"), run("jax"), run("numpy"), run("tensorflow")
    good = {"agree": True, "n": 10}

    def bug(factor=20.0):
        return NS(verdict="BUG", resync={"agree": False, "n": 10, "worst": {"worst_key": "update0/fc2.bias", "step": 0,
                                                                          "worst_factor": factor}})
    sides = {"jax": bug(), "numpy": NS(verdict="DRIFT", resync=good), "tensorflow": NS(verdict="DRIFT", resync=good)}
    index = {("torch", n): NS(verdict=q.verdict, a=ref, b=r) for (n, q), r in zip(sides.items(), (jax, numpy, tf))}
    for a, b in ((jax, numpy), (jax, tf), (numpy, tf)):
        p = NS(verdict="INCONCLUSIVE", a=a, b=b, notes=[], declared=[], evidence=None)
        through_reference(p, sides[a.name], sides[b.name])
        index[(a.name, b.name)] = p
    assert [index[k].verdict for k in (("jax", "numpy"), ("jax", "tensorflow"), ("numpy", "tensorflow"))] == [
        "DIFFER", "DIFFER", "DRIFT"]
    assert "numpy agrees with the reference at every resynced step and jax does not (update0/fc2.bias at step 0, " \
           "20x its calibrated tolerance)" in index[("jax", "numpy")].notes[0]
    assert odd_one_out([ref, jax, numpy, tf], index)["run"] == "jax"
    for q in (bug(1.5), NS(verdict="BUG", resync={"agree": False, "n": 10, "worst": {"worst_factor": 20.0},
                                                   "against": {"change": {"fault": "x"}}})):
        p = NS(verdict="INCONCLUSIVE", a=jax, b=numpy, notes=[], declared=[], evidence=None)
        through_reference(p, q, sides["numpy"])
        assert p.verdict == "INCONCLUSIVE" and not p.notes


def test_the_reference_and_its_own_backends_other_runs_are_named_the_odd_group():
    """A bug in the reference backend's code is in all its runs: torch and torch dp2 agree with each other and
    disagree with jax, numpy and tensorflow, which agree with each other. The reference's group is named first,
    with the backend they share; a candidate group the same way after the table; no group when the two sides are
    the same size or one side does not agree within itself."""
    from types import SimpleNamespace as NS

    from harness.candidate_pairs import odd_one_out
    from harness.compare_output import odd_one_out_line

    def run(name, backend):
        return NS(name=name, backend=backend, fault=None)     # what odd_one_out reads of a Run
    runs = [run("torch", "torch"), run("torch dp2", "torch"), run("jax", "jax"), run("numpy", "numpy"),
            run("tf", "tensorflow")]
    side = {"torch": 0, "torch dp2": 0, "jax": 1, "numpy": 1, "tf": 1}

    def index(flip=()):
        out = {}
        for i, x in enumerate(runs):
            for y in runs[i + 1:]:
                same = side[x.name] == side[y.name]
                v = ("DRIFT" if same else ("BUG" if i == 0 else "DIFFER"))
                if (x.name, y.name) in flip:
                    v = "INCONCLUSIVE"
                out[(x.name, y.name)] = NS(verdict=v)
        return out
    odd = odd_one_out(runs, index())
    assert odd["runs"] == ["torch", "torch dp2"] and odd["run"] == "torch" and odd["backend"] == "torch"
    lead, said = odd_one_out_line(odd, "torch", lambda n: n)
    assert lead and said == ("The reference torch and torch dp2 are the odd group: they agree with each other and "
                             "disagree with every other run, and those all agree with each other; the bug is most "
                             "likely in the torch backend they share.")
    assert odd_one_out(runs, index(flip=[("jax", "numpy")])) is None              # the others do not all agree
    assert odd_one_out(runs, index(flip=[("torch", "jax")])) is None              # a cross pair undecided
    # sized by backends: torch and torch dp2 (one backend) against jax and numpy (two) is still the torch group;
    # against two runs of one other backend it is a tie, and one run against one other backend's two runs too
    four = {k: v for k, v in index().items() if "tf" not in k}
    assert odd_one_out(runs[:4], four)["runs"] == ["torch", "torch dp2"]
    twins = [runs[0], runs[1], run("jax", "jax"), run("jax dp2", "jax")]
    side["jax dp2"] = 1
    tie = {(x.name, y.name): NS(verdict="DRIFT" if side[x.name] == side[y.name] else "DIFFER")
           for i, x in enumerate(twins) for y in twins[i + 1:]}
    assert odd_one_out(twins, tie) is None
    assert odd_one_out([twins[0]] + twins[2:], tie) is None
    runs[0], runs[2] = runs[2], runs[0]          # jax the reference: the torch group is a candidate group
    odd = odd_one_out(runs, index())
    assert odd["runs"] == ["torch dp2", "torch"] and odd["run"] == "torch dp2"
    lead, said = odd_one_out_line(odd, "jax", lambda n: n)
    assert not lead and said.startswith("odd group: torch dp2 and torch: they agree with each other")


def test_the_pairs_across_the_odd_group_are_one_line():
    """torch and torch dp2 the odd group: torch dp2's pairs with the others DIFFER as the lead line says, one line;
    the others' pairs with each other still their own line ("the other ..."), every pair with -v."""
    from harness.compare_output import other_pairs_lines
    first = {"step": 1, "series": "update_norm", "factor": 690.0}
    rows = [("jax", "numpy", "DRIFT", None, 1.2, None), ("jax", "torch dp2", "DIFFER", first, 690.0, None),
            ("numpy", "torch dp2", "DIFFER", first, 690.0, None)]
    assert other_pairs_lines(rows, 6.0, odd_group={"torch dp2"}) == [
        "pairs without the reference: the other 1 DRIFT (max 1.2x of the envelope, margin x6; -v lists them)",
        "pairs without the reference: the 2 across the odd group DIFFER, as it says; -v lists them"]
    assert other_pairs_lines(rows, 6.0)[0] == "pairs without the reference (margin x6): 1 DRIFT; 2 do not:"
    assert len(other_pairs_lines(rows, 6.0, verbose=True, odd_group={"torch dp2"})) == 4


def test_pairs_the_verdicts_imply_and_pairs_of_two_bug_runs_are_one_line_each():
    """A bug written into a layer every Keras backend shares (keras-* BUG, the rest DRIFT): each BUG run's pairs
    with the agreeing runs DIFFER as the table says (one line, not one per pair), and the BUG runs' pairs with
    each other, which the reference's envelope cannot calibrate, are one line that says so; an INCONCLUSIVE
    candidate's pair is still listed on its own."""
    from harness.compare_output import other_pairs_lines, side_of
    sides = {"jax": side_of("DRIFT", [], None, None), "numpy": side_of("DRIFT", [], None, None),
             "keras-jax": side_of("BUG", [], None, None), "keras-torch": side_of("BUG", [], None, None),
             "tensorflow": side_of("INCONCLUSIVE", [], None, None)}
    at0, at52 = ({"step": t, "series": s, "factor": f} for t, s, f in ((0, "loss", 1870.0), (52, "grad_norm", 77.8)))
    rows = [("jax", "numpy", "DRIFT", None, 1.2, None), ("jax", "keras-jax", "DIFFER", at0, 1870.0, None),
            ("jax", "keras-torch", "DIFFER", at0, 1870.0, None), ("keras-jax", "numpy", "DIFFER", at0, 1870.0, None),
            ("keras-jax", "keras-torch", "DIFFER", at52, 77.8, None),
            ("numpy", "tensorflow", "DIFFER", at52, 77.8, None)]
    lines = other_pairs_lines(rows, 6.0, sides=sides)
    assert lines == [
        "pairs without the reference (margin x6): 1 DRIFT; 1 do not:",
        "  numpy ~ tensorflow: DIFFER from step 52 (grad_norm, 77.8x)",
        "pairs without the reference: the 3 of a BUG run with a run that agrees with the reference DIFFER, as the "
        "verdicts above say; -v lists them",
        "pairs without the reference: 1 of two BUG runs DIFFER from step 52; the envelope measures the reference's "
        "computation, which neither computes, so this does not tell whether they compute the same thing (their "
        "localizations above do); -v lists them"]
    assert len(other_pairs_lines(rows, 6.0, verbose=True, sides=sides)) == 7
    assert other_pairs_lines(rows, 6.0)[0] == "pairs without the reference (margin x6): 1 DRIFT; 5 do not:"
    # a pair of two BUG runs whose curves part past the envelope's saturation (INCONCLUSIVE): the same line
    sides["keras-tf"] = side_of("BUG", [], None, None)
    undecided = rows + [("keras-jax", "keras-tf", "INCONCLUSIVE", None, None, None)]
    assert other_pairs_lines(undecided, 6.0, sides=sides)[-1].startswith(
        "pairs without the reference: 2 of two BUG runs DIFFER or INCONCLUSIVE from step 52; the envelope measures")
    # a pair of two BUG runs compared from a pivot's states is decided: listed with its own verdict, not in that line
    decided = rows[:4] + [("keras-jax", "keras-torch", "DIFFER", at52, 77.8, None, True)]
    assert other_pairs_lines(decided, 6.0, sides=sides) == [
        "pairs without the reference (margin x6): 1 DRIFT; 1 do not:",
        "  keras-jax ~ keras-torch: DIFFER from step 52 (grad_norm, 77.8x)",
        "pairs without the reference: the 3 of a BUG run with a run that agrees with the reference DIFFER, as the "
        "verdicts above say; -v lists them"]


def test_a_candidate_the_pivot_cannot_compute_is_left_aside_and_said():
    """keras-jax declares Adam's epsilon-hat and float32 betas, which only the reference's backend computes: from
    the pivot jax's states it cannot be compared, so it is left out of the split, and the sentence says so; the
    torch group (one backend) against jax and numpy (two) is still named."""
    from types import SimpleNamespace as NS

    from harness.candidate_pairs import odd_one_out, resync_candidates, pivot_pairs
    from harness.compare_output import odd_one_out_line

    def run(name, backend=None, declared=()):
        return NS(name=name, backend=backend or name, declared=list(declared), fault=None)
    ref, ref2 = run("torch"), run("torch dp2", "torch")
    keras, jax, numpy = run("keras-jax", declared=[{"id": "adam_epsilon_hat"}]), run("jax"), run("numpy")
    with_ref = [NS(verdict="DRIFT", a=ref, b=ref2)] + [NS(verdict="BUG", a=ref, b=c) for c in (keras, jax, numpy)]

    def pair(a, b, verdict):
        return NS(verdict=verdict, a=a, b=b, notes=[], resync=None, first=None, evidence=None, declared=[])
    cands = [pair(ref2, keras, "DIFFER"), pair(ref2, jax, "DIFFER"), pair(ref2, numpy, "DIFFER"),
             pair(keras, jax, "DIFFER"), pair(keras, numpy, "DIFFER"), pair(jax, numpy, "INCONCLUSIVE")]
    star, rest, pivot = pivot_pairs(with_ref, cands)
    unplaced = resync_candidates(star, rest, pivot, lambda p, extra: (
        {"skipped": "fault 'adam_eps_hat+adam_float32_betas' is not implemented in this backend's wrapper"}
        if "keras-jax" in (p.a.name, p.b.name) else {"agree": True, "n": 9}))
    assert unplaced == {"keras-jax": "its declared adam_epsilon_hat not computed from the jax run's states (see its "
                                     "pair's notes)"}
    index = {(p.a.name, p.b.name): p for p in with_ref + cands}
    assert odd_one_out([ref, ref2, keras, jax, numpy], index) is None      # keras-jax disagrees with both sides
    odd = odd_one_out([ref, ref2, keras, jax, numpy], index, unplaced)
    assert odd["runs"] == ["torch", "torch dp2"] and odd["unplaced"] == unplaced
    lead, said = odd_one_out_line(odd, "torch", lambda n: n)
    assert lead and said.endswith("the torch backend they share (left aside, not placed in either group: keras-jax: "
                                  "its declared adam_epsilon_hat not computed from the jax run's states (see its pair's "
                                  "notes)).")


def test_the_report_reads_no_comparison_in_the_harness_s_hidden_folders(tmp_path):
    """A run moved to .replaced/ (or a job in .localize/) may hold a comparison.json written beside it: the
    report and the self-test read only the results folder's own comparisons."""
    from harness.report import find_comparisons
    for rel in ("comparison.json", "group/comparison.json", ".replaced/old-run/comparison.json",
                ".localize/job/comparison.json", "runs/r/comparison.json"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("{}")
    assert [p.relative_to(tmp_path).as_posix() for p in find_comparisons(tmp_path)] == [
        "comparison.json", "group/comparison.json"]
