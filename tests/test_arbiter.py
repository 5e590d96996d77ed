"""The arbiter (harness/arbitration.py, harness/arbiter.py): which side of a BUG the exact float64 computation supports.

Pure decision logic on hand-built probe dicts first (side, computation order, tolerance, shapes, NaN, the
options it cannot honour), then real comparisons of two backends through `compare_runs(arbiter=...)` with a
catalogued fault on either side: the faulty side must be named, the reference included."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from harness.arbiter import arbiter_options, lead_lines
from harness.arbitration import MARGIN, REL_FLOOR, REL_TOL, arbitrate, key_order, statement, tolerance

LAYERS = ["conv1", "pool1", "flatten", "fc1", "fc2"]
RNG = np.random.default_rng(0)


def exact_probes() -> dict[str, np.ndarray]:
    """A hand-built probe set in canonical key names (values only matter relative to each other)."""
    return {"forward/conv1": RNG.normal(size=(2, 4, 4, 3)), "forward/pool1": RNG.normal(size=(2, 2, 2, 3)),
            "forward/flatten": RNG.normal(size=(2, 12)), "forward/fc1": RNG.normal(size=(2, 8)),
            "forward/fc2": RNG.normal(size=(2, 5)), "loss": np.float64(2.3),
            "grad/fc2.kernel": RNG.normal(size=(8, 5)), "grad/conv1.kernel": RNG.normal(size=(3, 3, 1, 3)),
            "update0/conv1.kernel": RNG.normal(size=(3, 3, 1, 3)), "update0/fc2.kernel": RNG.normal(size=(8, 5)),
            "opt0/momentum/fc2.kernel": RNG.normal(size=(8, 5)), "update1/conv1.kernel": RNG.normal(size=(3, 3, 1, 3)),
            "eval/conv1": RNG.normal(size=(2, 4, 4, 3))}


def rounded(d: dict[str, np.ndarray], rel: float = 1e-7, seed: int = 1) -> dict[str, np.ndarray]:
    """Each tensor with relative noise `rel` of its scale (a float32 computation's rounding, roughly)."""
    r = np.random.default_rng(seed)
    return {k: np.asarray(v) + rel * np.max(np.abs(v)) * r.normal(size=np.shape(v)) for k, v in d.items()}


def off(d: dict[str, np.ndarray], keys: list[str], rel: float = 1e-2) -> dict[str, np.ndarray]:
    out = dict(d)
    for k in keys:
        out[k] = np.asarray(d[k]) * (1 + rel)
    return out


# --------------------------------------------------------------------------- the pure decision
def test_the_side_off_the_exact_values_is_named_in_either_role():
    ex = exact_probes()
    cal = rounded(ex, 1e-7, 9)
    clean, bad = rounded(ex, 1e-7, 2), off(rounded(ex, 1e-7, 3), ["forward/fc1", "forward/fc2", "loss"])
    a = arbitrate(clean, bad, ex, cal, layers=LAYERS)
    assert (a.side, a.key) == ("reference", "forward/fc1")
    assert a.reference_error > 1e-3 > a.reference_tol > a.candidate_error
    b = arbitrate(bad, clean, ex, cal, layers=LAYERS)
    assert (b.side, b.key) == ("candidate", "forward/fc1")
    assert b.candidate_first == "forward/fc1" and b.reference_first is None and b.candidate_keys == 3
    assert arbitrate(clean, rounded(ex, 1e-7, 4), ex, cal, layers=LAYERS).side == "neither"
    both = arbitrate(off(clean, ["grad/fc2.kernel"]), off(clean, ["grad/fc2.kernel"], 2e-2), ex, cal, layers=LAYERS)
    assert (both.side, both.key) == ("both", "grad/fc2.kernel")


def test_computation_order_not_alphabetical():
    """forward in the spec's layer order (fc1 before flatten would be alphabetical), loss, gradients last layer
    first, per optimizer step update/buffer/opt, inference forward last."""
    keys = ["eval/conv1", "update1/conv1.kernel", "opt0/momentum/fc2.kernel", "update0/fc2.kernel",
            "update0/conv1.kernel", "grad/conv1.kernel", "grad/fc2.kernel", "loss", "forward/fc2", "forward/fc1",
            "forward/flatten", "forward/pool1", "forward/conv1", "buffer0/bn1.running_mean"]
    got = sorted(keys, key=lambda k: key_order(k, LAYERS + ["bn1"]))
    assert got == ["forward/conv1", "forward/pool1", "forward/flatten", "forward/fc1", "forward/fc2", "loss",
                   "grad/fc2.kernel", "grad/conv1.kernel", "update0/conv1.kernel", "update0/fc2.kernel",
                   "buffer0/bn1.running_mean", "opt0/momentum/fc2.kernel", "update1/conv1.kernel", "eval/conv1"]
    # the first key in that order decides, whichever side leaves later keys too
    ex = exact_probes()
    cand = off(ex, ["forward/fc2"])                 # candidate off late in the forward
    ref = off(ex, ["forward/flatten", "eval/conv1"])  # reference off earlier (flatten < fc1 < fc2 in the spec)
    a = arbitrate(cand, ref, ex, rounded(ex), layers=LAYERS)
    assert (a.side, a.key, a.candidate_first) == ("reference", "forward/flatten", "forward/fc2")


def test_tolerance_is_calibrated_per_key_by_the_float32_computation():
    ex = exact_probes()
    big = rounded(ex, 1e-4, 5)          # a key whose float32 computation is ill-conditioned (Adam's update)
    cal = dict(rounded(ex, 1e-8, 6), **{"update0/fc2.kernel": big["update0/fc2.kernel"]})
    side = rounded(ex, 1e-8, 7)
    side["update0/fc2.kernel"] = rounded(ex, 2e-4, 8)["update0/fc2.kernel"]   # 2x the calibration: rounding
    a = arbitrate(side, rounded(ex, 1e-8, 9), ex, cal, layers=LAYERS)
    assert a.side == "neither" and a.worst.key == "update0/fc2.kernel"
    side["update0/fc2.kernel"] = rounded(ex, 1e-3, 8)["update0/fc2.kernel"]   # 10x: off
    assert arbitrate(side, rounded(ex, 1e-8, 9), ex, cal, layers=LAYERS).key == "update0/fc2.kernel"
    # elsewhere the floor decides: 1e-5 is far above the 1e-8 rounding there
    side = off(rounded(ex, 1e-8, 7), ["grad/conv1.kernel"], 1e-5)
    a = arbitrate(side, rounded(ex, 1e-8, 9), ex, cal, layers=LAYERS)
    assert a.key == "grad/conv1.kernel" and a.candidate_tol == REL_FLOOR
    x = ex["grad/conv1.kernel"]
    assert tolerance(x, x) == REL_FLOOR and tolerance(x, None) == REL_TOL
    assert tolerance(x, x * (1 + 1e-3)) == pytest.approx(MARGIN * 1e-3 * np.sqrt(np.mean(x ** 2)) / np.max(np.abs(x)))
    # a side whose own float32 code path rounds more (its float64 probe says so) is held to its own rounding
    noisy = rounded(ex, 1e-8, 7)
    noisy["grad/fc2.kernel"] = rounded(ex, 3e-5, 10)["grad/fc2.kernel"]
    assert arbitrate(noisy, ex, ex, cal, layers=LAYERS).key == "grad/fc2.kernel"
    a = arbitrate(noisy, ex, ex, cal, candidate64=rounded(ex, 1e-8, 11), layers=LAYERS)
    assert a.side == "neither" and a.worst.candidate_tol > 3e-5
    # ... but a fault its float64 probe shares is not rounding
    faulty64 = off(rounded(ex, 1e-8, 11), ["grad/fc2.kernel"])
    a = arbitrate(off(noisy, ["grad/fc2.kernel"]), ex, ex, cal, candidate64=faulty64, layers=LAYERS)
    assert (a.side, a.key) == ("candidate", "grad/fc2.kernel")
    # without a calibration: the fixed float32 tolerance, and the result says so
    a = arbitrate(off(ex, ["loss"], 5e-5), ex, ex, None, layers=LAYERS)
    assert a.side == "neither" and not a.calibrated


def test_a_running_mean_is_arbitrated_on_its_channels_spread():
    """As in the probe comparison (tests/test_probes.py): a running mean whose channels nearly cancel is off by
    another summation order's rounding on its own max|value|, not on the spread of what it averages; a mean off
    by 1e-3 of that spread is still the candidate leaving the exact values."""
    rng = np.random.default_rng(4)
    mean, var = rng.normal(size=8) * 1e-4, 1.0 + rng.random(8)
    ex = {"buffer0/bn.running_mean": mean, "buffer0/bn.running_var": var}
    ref = {"buffer0/bn.running_mean": mean + rng.normal(size=8) * 1e-9, "buffer0/bn.running_var": var}
    cal = {"buffer0/bn.running_mean": mean + rng.normal(size=8) * 1e-9, "buffer0/bn.running_var": var}
    cand = dict(ref, **{"buffer0/bn.running_mean": mean + rng.normal(size=8) * 1e-8})
    assert arbitrate(cand, ref, ex, cal).side == "neither"
    bad = dict(ref, **{"buffer0/bn.running_mean": mean + 1e-3 * np.sqrt(var)})
    assert (arbitrate(bad, ref, ex, cal).side, arbitrate(bad, ref, ex, cal).key) == ("candidate", "buffer0/bn.running_mean")
    # on the tensor's own scale the same rounding was the candidate leaving the exact values
    alone = {"buffer0/bn.running_mean": mean}
    assert arbitrate({k: cand[k] for k in alone}, {k: ref[k] for k in alone}, alone,
                     {k: cal[k] for k in alone}).side == "candidate"


def test_shape_mismatch_and_non_finite_values():
    ex = exact_probes()
    cand = dict(ex, **{"forward/fc1": ex["forward/fc1"].T})         # a transposed layout
    a = arbitrate(cand, ex, ex, ex, layers=LAYERS)
    assert (a.side, a.key, a.candidate_error) == ("candidate", "forward/fc1", float("inf"))
    ref = dict(ex, loss=np.float64("nan"))
    a = arbitrate(ex, ref, ex, ex, layers=LAYERS)
    assert (a.side, a.key) == ("reference", "loss") and a.reference_error == float("inf")
    # exact values that are not finite cannot judge a key: listed, not blamed on a side
    bad_exact = dict(ex, **{"forward/conv1": np.full((2, 4, 4, 3), np.inf)})
    a = arbitrate(off(ex, ["forward/conv1"]), ex, bad_exact, ex, layers=LAYERS)
    assert a.side == "neither" and a.unjudged == ["forward/conv1"]
    # a key one side lacks is listed as missing, not judged
    a = arbitrate({k: v for k, v in ex.items() if k != "loss"}, ex, ex, ex, layers=LAYERS)
    assert a.missing == ["loss"] and a.side == "neither"


def test_statements():
    ex = exact_probes()
    a = arbitrate(ex, off(ex, ["forward/conv1"], 3e-2), ex, rounded(ex), layers=LAYERS)
    s = statement(a, "arb", "torch", "jax")
    assert s.startswith("arbiter (arb float64): the exact computation supports jax; the reference torch disagrees "
                        "with it at forward/conv1 (err ")
    assert "replayed step 7" in statement(a, "arb", "torch", "jax", replayed=7)
    assert "NOT RUN: why" in statement(None, "arb", "torch", "jax", reason="why")
    secs = {"pairs": {"x": {"side": "reference", "ran": True, "statement": "R"},
                      "y": {"side": "candidate", "ran": True, "statement": "C"},
                      "z": {"side": None, "ran": False, "statement": "N"}}}
    assert lead_lines(secs) == ["R", "N"]
    # a wrong reference: every candidate supported against it, one line (each pair's sentence stays in its notes)
    many = {"backend": "numpy", "pairs": {
        n: {"side": "reference", "ran": True, "statement": n, "key": "update1/conv1.bias" if n != "tf" else "loss",
            "reference_error": 3.4e-4, "reference_tol": 1e-6, "candidate_label": n, "reference_label": "torch"}
        for n in ("jax", "numpy", "tf")}}
    assert lead_lines(many) == [
        "arbiter (numpy float64): the exact computation supports all 3 candidates it was asked about (jax, numpy, tf); "
        "the reference torch disagrees with it at update1/conv1.bias (err 0.00034, tolerance 1e-06; that key in 2 of "
        "them): the bug is most likely in the reference (each pair's notes have its numbers)"]


def test_options_the_arbiter_cannot_honour_are_said():
    caps = {"float64", "data_parallel", "sync_bn", "threads"}
    o, adj, why = arbiter_options({"fault": "grad_double", "dtype": "float32", "devices": 2, "threads": 2,
                                   "extra": {"channels_last": True, "port": 1234, "sync_bn": True}}, caps)
    assert why is None and o["fault"] is None and o["dtype"] == "float64" and o["devices"] == 2
    assert o["extra"] == {"sync_bn": True} and o["threads"] == 2
    assert len(adj) == 1 and adj[0].startswith("channels_last=True (not honoured")
    o, adj, why = arbiter_options({"extra": {"sync_bn": True}, "devices": 2}, {"float64", "data_parallel"})
    assert o is None and "sync_bn" in why
    o, adj, why = arbiter_options({"devices": 2}, {"float64"})
    assert o is None and "data_parallel" in why
    o, adj, why = arbiter_options({"dropout": "native"}, caps)
    assert o is None and "framework-RNG" in why
    o, adj, why = arbiter_options({"jit": False, "extra": {"xla": True}}, caps)
    assert o["jit"] is True and o["extra"] == {} and len(adj) == 2


# --------------------------------------------------------------------------- the procedure, with stand-in jobs
class StandInLocalizer:
    """The Localizer's public probe0/replay with hand-built probes instead of backend processes: the reference
    ('ref') computes update0/fc2.kernel wrongly, but only from the state of step 2 (a bug the step-0 probes
    cannot see); the reference backend has no float64 (its tolerance falls back to the arbiter's rounding)."""

    def __init__(self):
        self.ex = {t: exact_probes() for t in (0, 1, 2)}   # the exact values from each step's state
        self.calls = []

    def _probes(self, run, t: int, dtype: str) -> dict:
        ex = self.ex[t]
        if run.backend == "arb" and dtype == "float64":
            return ex
        p = rounded(ex, 1e-7, hash((run.backend, dtype, t)) % 1000)
        if run.backend == "ref" and t == 2:
            p = off(p, ["update0/fc2.kernel"])
        return p

    def probe0(self, run, **change):
        from harness.errors import BackendFailed
        dtype = change.get("dtype", run.options.dtype)
        self.calls.append(("probe0", run.backend, dtype))
        if run.backend == "ref" and dtype == "float64":
            raise BackendFailed("ref: float64 not supported", None, unsupported=True)
        return self._probes(run, 0, dtype)

    def replay(self, ref, run, at, change=None):
        dtype = run.options.dtype
        self.calls.append(("replay", run.backend, dtype))
        return {"probes": [(t, self._probes(run, t, dtype), self._probes(ref, t, "float32"), None, None) for t in at]}


def stand_in_pair(localization: dict):
    from harness.compare import Pair
    from harness.runs import Run
    man = {"spec": {"layers": [{"name": n} for n in LAYERS]}, "options": {"dtype": "float32", "devices": 1}}
    z = np.zeros(0)
    ref = Run(Path("/nonexistent/r"), dict(man, backend="ref"), z, {}, z, z)
    cand = Run(Path("/nonexistent/c"), dict(man, backend="cand"), z, {}, z, z)
    return Pair(ref, cand, True, {}, None, {}, verdict="BUG", localization=localization)


def test_a_bug_seen_only_in_the_replay_is_arbitrated_there():
    from harness.arbiter import arbitrate_pair
    loc = StandInLocalizer()
    pair = stand_in_pair({"stage": "optimizer", "method": "replay of step 2 from the reference's state",
                          "replay": {"at": [1, 2]}})
    sec = arbitrate_pair(pair, "arb", loc, capabilities={"float64"}, log=lambda m: None)
    assert [r["side"] for r in sec["results"]] == ["neither", "neither", "reference"]
    assert (sec["side"], sec["key"], sec["step"]) == ("reference", "update0/fc2.kernel", 2)
    assert "(replayed step 2, from the reference's state)" in sec["statement"]
    assert any("ref float64 probe unavailable" in a for a in sec["adjusted"])
    assert ("replay", "arb", "float64") in loc.calls and ("replay", "arb", "float32") in loc.calls
    # without a replay in the localization, step 0 is all there is: neither side, and it says so
    sec = arbitrate_pair(stand_in_pair({"stage": "forward"}), "arb", StandInLocalizer(), capabilities={"float64"},
                         log=lambda m: None)
    assert sec["side"] == "neither" and "neither side disagrees" in sec["statement"]


def test_the_arbiter_says_when_it_does_not_run():
    from harness.arbiter import arbitrate_pair
    sec = arbitrate_pair(stand_in_pair({"stage": "data"}), "arb", StandInLocalizer(), capabilities={"float64"},
                         log=lambda m: None)
    assert not sec["ran"] and "NOT RUN" in sec["statement"] and "different batches" in sec["reason"]
    pair = stand_in_pair({"stage": "forward"})
    pair.a.manifest["options"] = {"devices": 2}
    sec = arbitrate_pair(pair, "arb", StandInLocalizer(), capabilities={"float64"}, log=lambda m: None)
    assert not sec["ran"] and "data_parallel" in sec["reason"]
    assert lead_lines({"pairs": {"c": sec}}) == [sec["statement"]]


def test_the_arbiter_does_not_judge_a_pair_with_its_own_backend():
    """A bug in the arbiter backend's code is in the arbiter too: as a candidate (or the reference) it would be
    'supported' by itself, and that sentence would lead every output. It is not run for such a pair (said in the
    pair's notes, not at the head), and no job starts."""
    from harness.arbiter import arbitrate_pair
    loc = StandInLocalizer()
    for side in ("b", "a"):
        pair = stand_in_pair({"stage": "optimizer"})
        getattr(pair, side).manifest["backend"] = "arb"
        sec = arbitrate_pair(pair, "arb", loc, capabilities={"float64"}, log=lambda m: None)
        assert not sec["ran"] and sec["own_backend"] and "not an independent judge" in sec["statement"]
        assert lead_lines({"pairs": {"c": sec}}) == []
    assert not loc.calls


# --------------------------------------------------------------------------- real probes, real comparisons
ARBITER = "numpy"
MODEL = "cnn2d_2conv_2fc"


@pytest.mark.slow
@pytest.mark.parametrize("fault, first", [("grad_double", "grad/"), ("flatten_no_permute", "forward/fc1")])
def test_arbitrate_names_the_faulty_side_on_real_probes(fault, first, results_root):
    """torch with a catalogued fault against clean torch, the arbiter's float64 probes as the exact values and its
    float32 probes as the calibration: the faulty side is named whichever role it plays, at the stage the fault
    lives in (clean and exact probes shared with the other probe tests of the session)."""
    from .conftest import probes_for
    clean = probes_for("torch", MODEL, results_root)["sgd"].arrays
    bad = probes_for("torch", MODEL, results_root, fault=fault)["sgd"].arrays
    exact = probes_for(ARBITER, MODEL, results_root, dtype="float64")["sgd"].arrays
    calib = probes_for(ARBITER, MODEL, results_root, dtype="float32")["sgd"].arrays
    as_reference = arbitrate(clean, bad, exact, calib)
    as_candidate = arbitrate(bad, clean, exact, calib)
    assert as_reference.side == "reference" and as_candidate.side == "candidate"
    assert as_reference.key.startswith(first) and as_candidate.key == as_reference.key
    assert as_reference.candidate_error < as_reference.candidate_tol < 1e-4 < 1e-2 < as_reference.reference_error
    assert arbitrate(clean, clean, exact, calib).side == "neither"


STEPS = 3
_RUNS: dict[tuple, object] = {}


def short_run(root, backend: str, fault: str | None = None):
    """A 3-step run of the small model (one backend process), made once per session."""
    from algorithms.optim import HParams
    from harness import runner
    from algorithms.contract import RunConfig

    from .conftest import need
    need(backend)
    key = (str(root), backend, fault)
    if key not in _RUNS:
        hp = HParams(steps=STEPS, optimizer="momentum", lr=0.05, eval_every=STEPS, checkpoint_every=STEPS)
        _RUNS[key] = runner.execute(RunConfig(model=MODEL, backend=backend, hparams=hp, fault=fault), root)
    return _RUNS[key]


def arbitrated(results_root, ref_fault: str | None, cand_fault: str | None, other: str = "jax"):
    """`compare_runs` of torch (the reference) and one other backend, one of them with a fault, with the arbiter.
    The envelope is its floor (the reference as its only member) and no resync: every fault here leaves it at
    step 0 by orders of magnitude, and what is under test is the arbiter, not the envelope nor the shared-state
    comparison (tests/test_resync*.py; the resync's jobs made this case 3.5 minutes of `make test`)."""
    from harness.compare_runs import compare_runs
    from harness.runs import load_run
    from .conftest import need
    need(ARBITER)
    root = results_root / "arbiter"
    ref, cand = short_run(root, "torch", ref_fault), short_run(root, other, cand_fault)
    out = root / f"cmp__{ref_fault}__{cand_fault}"
    out.mkdir(exist_ok=True)
    o = compare_runs(paths=[ref, cand], reference=ref.name, envelope_paths=[ref], out=out, arbiter=ARBITER,
                     resync_every=0, log=lambda m: None)
    doc = json.loads(o.json_text)
    (pair,) = [p for p in doc["pairs"] if p["with_reference"]]
    assert load_run(ref).backend == "torch"
    return o, doc, pair, out


FAULT_CASES = [   # (fault, the probe key prefix where the exact computation first disagrees with the faulty side)
    ("flatten_no_permute", "forward/fc1"),    # a forward layer
    ("label_smoothing", "loss"),              # the loss
    ("grad_double", "grad/fc2."),             # the backward pass (last layer first)
    ("lr_scale_1.001", "update0/"),           # the optimizer
]


@pytest.mark.parametrize("fault, first", [c if c[0] == "flatten_no_permute" else pytest.param(*c, marks=pytest.mark.slow)
                                          for c in FAULT_CASES])
def test_arbiter_names_the_reference_when_the_fault_is_in_the_reference(fault, first, results_root):
    o, doc, pair, out = arbitrated(results_root, fault, None)
    assert pair["verdict"] == "BUG" and o.code == 1
    a = pair["arbiter"]
    assert a["ran"] and a["side"] == "reference" and a["key"].startswith(first), a
    assert a["disagrees"] == pair["reference"] and a["supports"] == pair["candidate"]
    assert a["reference_error"] > 1e2 * a["reference_tol"] and a["candidate_error"] < a["candidate_tol"]
    # it leads every output: the terminal text, comparison.json, summary.md
    assert o.text.startswith(f"arbiter ({ARBITER} float64): the exact computation supports jax; the reference torch "
                             f"fault-{fault} disagrees with it at {a['key']}")
    assert doc["arbiter"]["lead"] == [a["statement"]]
    from harness.report import build, markdown
    md = markdown(out)
    assert md.index(f"**{a['statement']}**") < md.index("| candidate |")
    if fault == "flatten_no_permute":   # the page once (matplotlib is slow to start)
        page = build(out).read_text()
        assert page.index("<p class=lead id=arbiter>arbiter (") < page.index("<table>")


def test_matrix_arbiter_field(tmp_path):
    """`arbiter = NAME` in a matrix: a known float64 backend, used by `duipai all` only when installed."""
    from harness.errors import BadInput
    from harness.matrix import arbiter_of, load_matrix
    base = 'models = ["cnn2d_2conv_2fc"]\nbackends = ["torch"]\n'
    f = tmp_path / "m.toml"
    f.write_text(base + f'arbiter = "{ARBITER}"\n')
    m = load_matrix(f)
    assert m.arbiter == ARBITER and arbiter_of(m) == (ARBITER, None)
    f.write_text(base + 'arbiter = "no-such-backend"\n')
    with pytest.raises(BadInput, match="arbiter: unknown backend"):
        load_matrix(f)
    f.write_text(base)
    assert arbiter_of(load_matrix(f)) == (None, None)
    assert load_matrix("default").arbiter == ARBITER


# every case with make test-slow (about a minute of CPU each); `make test` keeps the reference-side case above
@pytest.mark.parametrize("fault, first", [pytest.param(*c, marks=pytest.mark.slow) for c in FAULT_CASES])
def test_arbiter_names_the_candidate_when_the_fault_is_in_the_candidate(fault, first, results_root):
    o, doc, pair, out = arbitrated(results_root, None, fault)
    a = pair["arbiter"]
    assert pair["verdict"] == "BUG" and a["side"] == "candidate" and a["key"].startswith(first), a
    assert a["disagrees"] == pair["candidate"] and a["supports"] == pair["reference"]
    assert a["candidate_error"] > 1e2 * a["candidate_tol"] and a["reference_error"] < a["reference_tol"]
    assert doc["arbiter"]["lead"] == [] and not o.text.startswith("arbiter")   # the usual order: nothing to lead
    assert f"note: {a['statement']}" in o.text


def test_an_unknown_arbiter_is_refused_before_anything_runs(tmp_path):
    from harness.compare_runs import compare_runs
    from harness.errors import BadInput
    with pytest.raises(BadInput, match="--arbiter no-such-backend: unknown backend"):
        compare_runs(paths=[tmp_path / "a", tmp_path / "b"], reference="x", arbiter="no-such-backend")
    assert not any(tmp_path.iterdir())
