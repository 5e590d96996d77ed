"""Kinks a candidate's own activations crossed (harness/kinks.py) and what the resync makes of them
(harness.resync.judge): a backward-only disagreement upstream of a crossed kink agrees at that point; one
that reaches past the kink, or touches an activation, or has no crossing to show, does not. The same for a
saturated tanh or sigmoid, within its allowance."""
from __future__ import annotations

import json

import numpy as np
import pytest

from algorithms.contract import Replay, RunOptions
from algorithms.params import JOINT
from algorithms.spec import load_model
from harness import kinks
from harness import resync as R
from harness.probe_analysis import analyse
from harness.resync_text import resync_what

from .conftest import need
from .test_resync import LAYERS, kinked_rep

HARD = load_model("cnn2d_hard")   # conv1 bn1 relu_1 conv2 bn2 relu_2 pool1 (avg) pool2 (max 3x3 same) conv3 ...


def _forward(seed: int = 0) -> dict[str, np.ndarray]:
    """float64 forward probes of cnn2d_hard's kink inputs for a batch of 4, with no input within 1e-3 of a kink."""
    rng = np.random.default_rng(seed)
    out = {}
    for name in ("bn1", "bn2", "pool1", "conv3"):
        shape = HARD.layer(name).out_shape
        x = rng.standard_normal((4, *shape))
        out[f"forward/{name}"] = np.where(np.abs(x) < 1e-3, 1e-3, x)
    pool1 = out["forward/pool1"]
    out["forward/pool1"] = pool1 + np.arange(pool1.size).reshape(pool1.shape) * 1e-2   # no near-ties either
    return out


def test_a_max_pool_pick_and_a_relu_side_crossed_by_rounding_are_found_with_what_they_reach():
    """cnn2d_hard adamw warmup, resynced step 23 (2026-12-01): a window of pool2 (max 3x3, stride 1, same)
    whose two largest inputs are 1.3e-7 apart in float64, picked the other way by keras-jax."""
    z = _forward()
    assert kinks.crossed(HARD, {k: v.astype(np.float32) for k, v in z.items()}, z) == []
    z["forward/pool1"][2, :, :, 5] = -1 - np.arange(16).reshape(4, 4) * 1e-2
    z["forward/pool1"][2, 1, 1:3, 5] = [1 + 1e-7, 1.0]      # float64 picks (1, 1) in every window holding both
    c = {k: v.copy() for k, v in z.items()}
    c["forward/pool1"][2, 1, 1:3, 5] = [1.0, 1 + 1e-7]      # the candidate's rounding picks (1, 2)
    found = kinks.crossed(HARD, c, z)
    assert [f["layer"] for f in found] == ["pool2"] and found[0]["kind"] == "maxpool2d"
    assert found[0]["crossed"] == 6 and found[0]["of"] == 4 * 4 * 4 * 32   # the 3x3 windows holding both
    assert found[0]["margin_min"] < 1e-6
    assert set(found[0]["upstream"]) == {"conv1", "bn1", "relu_1", "conv2", "bn2", "relu_2", "pool1"}
    c = {k: v.copy() for k, v in z.items()}
    z["forward/bn1"][0, 3, 3, 7] = 2e-8
    c["forward/bn1"][0, 3, 3, 7] = -1e-8
    assert [(f["layer"], f["crossed"], f["upstream"]) for f in kinks.crossed(HARD, c, z)] == \
        [("relu_1", 1, ["bn1", "conv1"])]


def test_relu6_decides_on_both_kinks():
    z = {"forward/a": np.array([[0.5, 5.9999999, 3.0]])}
    layer = type("L", (), {"kind": "relu6"})()
    assert kinks.decisions(layer, z["forward/a"]).tolist() == [[1, 1, 1]]
    assert kinks.decisions(layer, np.array([[0.5, 6.0, -1e-9]])).tolist() == [[1, 2, 0]]
    assert np.allclose(kinks.margins(layer, z["forward/a"]), [[0.5, 1e-7, 3.0]])


def _with_crossing(upstream: list[str], at: int = 75) -> dict:
    """A candidate that jumps at step `at` in grad/conv1.kernel and update0/conv1.kernel where the reference's
    own steps never jumped, with a crossing seen there whose derivative reaches `upstream`."""
    rep = kinked_rep(list(range(0, 300, 25)), ref_jumps=[], cand_jumps=[at], size=5e-3)
    return dict(rep, crossings={at: [{"layer": "k", "kind": "maxpool2d", "crossed": 1, "of": 4096,
                                      "margin_min": 1.3e-7, "margin_max": 1.3e-7, "upstream": upstream}]})


def test_a_backward_disagreement_upstream_of_a_crossed_kink_agrees_at_that_point_only():
    plain = _with_crossing(["conv1"])
    plain.pop("crossings")
    assert not R.judge(plain, LAYERS, analyse)["agree"]          # no evidence: the disagreement stands
    got = R.judge(_with_crossing(["conv1"]), LAYERS, analyse)
    assert got["agree"], got["first_disagreement"]
    assert got["discontinuities"]["looked_for_crossings"] == [75] and list(got["discontinuities"]["crossed"]) == [75]
    assert next(p for p in got["per_point"] if p["step"] == 75)["crossed"][0]["layer"] == "k"
    assert "agree by what the candidate's own activations or its own float64 step show" in resync_what(got)
    assert "k (maxpool2d, a kink crossed by 1 of 4096 outputs, float64 margin 1.3e-07)" in resync_what(got)
    # a kink whose derivative does not reach conv1 explains nothing of conv1's gradient
    assert not R.judge(_with_crossing(["fc1"]), LAYERS, analyse)["agree"]
    # a crossing at another step explains nothing at this one
    other = _with_crossing(["conv1"])
    other["crossings"] = {50: other["crossings"][75]}
    assert not R.judge(other, LAYERS, analyse)["agree"]


def test_an_activation_that_disagrees_is_not_explained_by_a_crossing():
    rep = _with_crossing(["conv1", "fc1"])
    i = rep["at"].index(75)
    t, cand, ref, p64, plain = rep["probes"][i]
    key = f"forward/{LAYERS[1]}"
    rep["probes"][i] = (t, dict(cand, **{key: cand[key] * (1 + 1e-3)}), ref, p64, plain)
    got = R.judge(rep, LAYERS, analyse)
    assert not got["agree"] and got["first_disagreement"]["step"] == 75


def test_every_sample_probes_the_step_again_in_the_candidate_and_the_float64_reference(tmp_path):
    """The evidence jobs: step t only, from the reference's own state there, every sample's activations kept;
    the reference in float64 computing the candidate's declared formulas (the change); none for a candidate on
    the reference's own code path (its correct probes are bitwise equal: nothing to cross)."""
    from types import SimpleNamespace

    import harness.probe_jobs as PJ
    asked = []

    def fake_job(run, name, mode, replay=None, **change):
        asked.append((run.backend, name, mode, replay, change))
        folder = tmp_path / name
        folder.mkdir()
        np.savez(folder / "probe-0.npz", loss=np.float64(len(asked)))
        return folder
    jobs = PJ.ProbeJobs(tmp_path, log=lambda m: None)
    jobs._job = fake_job
    def run(backend: str, name: str) -> SimpleNamespace:   # what the jobs read of a Run
        return SimpleNamespace(backend=backend, name=name, options=RunOptions(), manifest={"run": name})
    ref, cand = run("torch", "ref"), run("tensorflow", "cand")
    got = jobs.every_sample(ref, cand, {"states": {"23": "/s/state_23.npz", "24": "/s/state_24.npz"}}, 23,
                            {"fault": "adam_eps_hat"})
    assert got is not None and len(got) == 3 and got[2] is not None    # and the candidate's own float64 step
    by = sorted((b, sorted(change.items())) for b, _, mode, extra, change in asked)
    for _, _, _, extra, change in asked:      # every sample for the kinks; the float64 step's gradients only
        rows = None if change == {"dtype": "float64"} else 0
        assert extra == Replay([23], states={23: "/s/state_23.npz"}, probe_steps=1, activation_rows=rows)
    assert by == [("tensorflow", []), ("tensorflow", [("dtype", "float64")]),
                  ("torch", [("dtype", "float64"), ("fault", "adam_eps_hat")])]
    assert jobs.every_sample(ref, run("torch", "ref-dp1-again"), {"states": {"23": "x"}}, 23, None) is None


# --------------------------------------------------------------------------- the candidate's float64 step
def _with_float64_step(off64: float, size: float = 1.5e-4) -> dict:
    """The candidate jumps at step 75 by `size` in grad/conv1.kernel and update0/conv1.kernel (no kink crossed);
    its own float64 step there is `off64` (of the key's scale) from the float64 reference's."""
    rep = kinked_rep(list(range(0, 300, 25)), ref_jumps=[], cand_jumps=[75], size=size)
    keys = {"grad/conv1.kernel": off64, "update0/conv1.kernel": off64, "grad/fc1.kernel": 0.0}
    return dict(rep, crossings={75: [{"layer": "the candidate's own float64 step", "kind": "float64", "keys": keys}]})


def test_the_candidates_float64_step_computing_the_same_explains_its_float32_rounding_only():
    """A backward disagreement no kink explains (an ill-conditioned sum rounded in another order) agrees when the
    candidate's own float64 step from that state is the float64 reference's to float64's resolution; the same
    disagreement in float64 is another computation, and a float32 error far past its tolerance is not let
    through by a float64 path."""
    got = R.judge(_with_float64_step(1e-15), LAYERS, analyse)
    assert got["agree"], got["first_disagreement"]
    said = resync_what(got)
    assert "the candidate's own float64 step from the same state computes what the float64 reference does" in said
    assert "grad/conv1.kernel" in said and "1e-15 in float64" in said and "grad/fc1.kernel" not in said
    assert not R.judge(_with_float64_step(1e-4), LAYERS, analyse)["agree"]        # off in float64 too: a bug
    assert not R.judge(_with_float64_step(1e-6), LAYERS, analyse)["agree"]        # past float64's resolution
    far = _with_float64_step(1e-15, size=5e-3)
    assert not R.judge(far, LAYERS, analyse)["agree"]                             # past FLOAT64_REACH x its tol
    plain = _with_float64_step(1e-15)
    plain.pop("crossings")
    assert not R.judge(plain, LAYERS, analyse)["agree"]                           # no evidence: it stands


def test_same_in_float64_compares_the_backward_keys_on_their_scale():
    ref64 = {"grad/a": np.array([1.0, -2.0]), "update0/a": np.array([0.1, 0.2]), "forward/x": np.ones(3)}
    cand64 = {"grad/a": np.array([1.0, -2.0 + 4e-15]), "update0/a": np.array([0.1, 0.2]), "forward/x": np.zeros(3)}
    (got,) = kinks.same_in_float64(cand64, ref64)
    assert got["kind"] == "float64" and set(got["keys"]) == {"grad/a", "update0/a"}
    assert got["keys"]["grad/a"] == pytest.approx(np.sqrt(8e-30) / 2, rel=1e-6) and got["keys"]["update0/a"] == 0.0
    assert kinks.same_in_float64(None, ref64) == []


# --------------------------------------------------------------------------- the candidate's recorded step
def test_same_when_recorded_reads_the_joint_gradients_beside_a_kink_within_the_candidates_rounding():
    """tensorflow, resnet_tiny, step 0 (2026-12-06): a ReLU input 7.8e-7 below the kink in float64, within the
    candidate's 1e-5 rounding of that layer; the recorded program's gradients are on their float64 scale."""
    z = _forward()
    z["grad/conv1.kernel"] = np.array([1.0, -2.0])
    z["forward/bn1"][0, 3, 3, 7] = -7.8e-7
    cand = {JOINT + k: v + (1e-5 if k == "forward/bn1" else 0.0) for k, v in z.items() if k.startswith("forward/")}
    cand[JOINT + "grad/conv1.kernel"] = np.array([1.0, -2.0 + 2e-6])
    (got,) = kinks.same_when_recorded(HARD, cand, z)
    assert got["kind"] == "recorded" and got["keys"] == {"grad/conv1.kernel": pytest.approx(np.sqrt(2e-12) / 2)}
    assert [(n["layer"], n["near"]) for n in got["near"]] == [("relu_1", 1)]
    assert got["near"][0]["margin_min"] == pytest.approx(7.8e-7) and set(got["upstream"]) == {"bn1", "conv1"}
    assert kinks.same_when_recorded(HARD, {k[len(JOINT):]: v for k, v in cand.items()}, z) == []   # none recorded
    exact = {JOINT + k: v for k, v in z.items() if k.startswith("forward/")}
    exact[JOINT + "grad/conv1.kernel"] = z["grad/conv1.kernel"]
    assert kinks.same_when_recorded(HARD, exact, z) == []            # no kink within its rounding: no evidence


def _with_recorded_step(err: float, upstream: tuple[str, ...] = ("conv1",)) -> dict:
    """The candidate's plain step jumps at step 75 by 5e-3 (33x past FLOAT64_REACH's room: a kink its fused
    kernel crossed unseen); its recorded program's gradient there is `err` of its scale off the float64 one."""
    rep = kinked_rep(list(range(0, 300, 25)), ref_jumps=[], cand_jumps=[75], size=5e-3)
    near = [{"layer": "relu_1", "kind": "relu", "near": 1, "of": 4096, "margin_min": 7.8e-7, "rounding": 1e-5}]
    c = {"layer": "the candidate's step with its activations recorded", "kind": "recorded",
         "keys": {"grad/conv1.kernel": err}, "near": near, "upstream": list(upstream)}
    return dict(rep, crossings={75: [c]})


def test_the_recorded_step_explains_the_plain_step_only_where_it_computes_the_reference_gradient():
    """The same code compiled with its activations as outputs computing the reference's gradient, upstream of a
    kink within the candidate's rounding, explains its plain step's disagreement there; a recorded gradient as
    far off (a bug is in both programs) or a parameter not upstream of the near kink is not explained."""
    got = R.judge(_with_recorded_step(1e-7), LAYERS, analyse)
    assert got["agree"], got["first_disagreement"]
    said = resync_what(got)
    assert "compiled with its activations as outputs computes the reference's gradients" in said
    assert "relu_1: 1 of 4096, float64 margin 7.8e-07" in said
    assert not R.judge(_with_recorded_step(5e-3), LAYERS, analyse)["agree"]           # off when recorded too
    assert not R.judge(_with_recorded_step(1e-7, upstream=("fc1",)), LAYERS, analyse)["agree"]
    plain = _with_recorded_step(1e-7)
    plain.pop("crossings")
    assert not R.judge(plain, LAYERS, analyse)["agree"]                               # no evidence: it stands


# --------------------------------------------------------------------------- saturations
WIDE = load_model("cnn2d_3conv_3fc")   # ... fc1 relu_4 fc2 tanh_1 fc3


def _tanh_outputs(x: np.ndarray, ulps: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """float64 tanh of `x` and a float32 candidate's outputs: correctly rounded, then moved by `ulps` ULPs."""
    y64 = np.tanh(x)
    y32 = y64.astype(np.float32)
    if ulps is not None:
        y32 = y32 + (ulps * np.spacing(np.abs(y32))).astype(np.float32)
        y32 = np.clip(y32, -1, 1)
    return y32, y64


def test_a_saturated_tanh_allows_its_upstream_gradients_rounding_but_a_healthy_one_does_not():
    """cnn2d_3conv_3fc adamw lr 0.05, resynced step 1 (2026-12-04): fc2's outputs 5-20 in size, every tanh
    output within 0.007 of a derivative of 0. One ULP of an output there (6e-8) is up to 1e-2 of its derivative;
    the same ULP of an output near 0.5 is 1e-7 of it."""
    rng = np.random.default_rng(0)
    healthy = _tanh_outputs(rng.uniform(-1.4, 1.4, (64, 64)), rng.integers(-3, 4, (64, 64)))
    allowance, carried = kinks.derivative_error("tanh", *healthy)
    assert allowance < 3e-6 and carried > 0.9 * 64 * 64
    x = rng.choice([-1, 1], (64, 64)) * rng.uniform(3.5, 12, (64, 64))
    saturated = _tanh_outputs(x, rng.integers(-3, 4, (64, 64)))
    allowance, carried = kinks.derivative_error("tanh", *saturated)
    assert 1e-3 < allowance < 1.0 and carried < 0.3 * 64 * 64
    # correct rounding alone already moves the saturated derivative by far more than float32's epsilon
    assert kinks.derivative_error("tanh", *_tanh_outputs(x))[0] > 100 * np.finfo(np.float32).eps
    found = kinks.saturated(WIDE, {"forward/tanh_1": saturated[0]}, {"forward/tanh_1": saturated[1]})
    assert [(f["layer"], f["kind"], f["of"]) for f in found] == [("tanh_1", "tanh", 64 * 64)]
    assert found[0]["allowance"] == allowance and found[0]["upstream"] == [
        "conv1", "conv2", "conv3", "fc1", "fc2", "flatten_1", "pool1", "relu_1", "relu_2", "relu_3", "relu_4"]
    # a layer every output of which is +-1 in float64 passes no gradient: nothing upstream to explain
    ones = np.ones((4, 64))
    assert kinks.saturated(WIDE, {"forward/tanh_1": ones.astype(np.float32)}, {"forward/tanh_1": ones}) == []


def test_a_sigmoid_saturates_towards_1_not_towards_0():
    """sigmoid's derivative y (1 - y): near y = 0 the output keeps its relative precision, near 1 it does not."""
    rng = np.random.default_rng(1)
    for x, big in ((rng.uniform(-14, -9, 512), False), (rng.uniform(9, 14, 512), True)):
        y64 = 1 / (1 + np.exp(-x))
        y32 = y64.astype(np.float32)
        allowance = kinks.derivative_error("sigmoid", y32, y64)[0]
        assert (allowance > 1e-3) == big, (x[:3], allowance)


def _with_saturation(allowance: float, upstream: list[str], size: float = 5e-3) -> dict:
    """The candidate jumps at step 75 by `size` in grad/conv1.kernel and update0/conv1.kernel, with a
    saturated layer there whose derivative reaches `upstream` and rounding may move by `allowance`."""
    rep = kinked_rep(list(range(0, 300, 25)), ref_jumps=[], cand_jumps=[75], size=size)
    return dict(rep, crossings={75: [{"layer": "s", "kind": "tanh", "allowance": allowance, "carried_by": 64,
                                      "of": 4096, "upstream": upstream}]})


def test_a_backward_disagreement_upstream_of_a_saturation_agrees_within_its_allowance_only():
    got = R.judge(_with_saturation(5e-3, ["conv1"]), LAYERS, analyse)
    assert got["agree"], got["first_disagreement"]
    said = resync_what(got)
    assert "s (tanh) saturated: 64 of its 4096 outputs carry 99% of its derivative" in said and "0.005 of" in said
    # the same disagreement beyond margin x the allowance: a computation that differs
    assert not R.judge(_with_saturation(1e-4, ["conv1"]), LAYERS, analyse)["agree"]
    # a saturation whose derivative does not reach conv1 explains nothing of conv1's gradient
    assert not R.judge(_with_saturation(5e-3, ["fc1"]), LAYERS, analyse)["agree"]
    # an update that disagrees while its gradient agrees is not the saturation's doing
    rep = _with_saturation(5e-3, ["conv1"])
    i = rep["at"].index(75)
    t, cand, ref, p64, plain = rep["probes"][i]
    cand = dict(cand, **{"grad/conv1.kernel": ref["grad/conv1.kernel"],
                         "update0/conv1.kernel": cand["update0/conv1.kernel"] * 1.5})
    rep["probes"][i] = (t, cand, ref, p64, plain)
    assert not R.judge(rep, LAYERS, analyse)["agree"]


@pytest.mark.slow
def test_a_clean_run_whose_tanh_saturates_at_a_resynced_step_is_drift(tmp_path):
    """The user's configuration of 2026-12-04 (cnn2d_3conv_3fc, AdamW at the default lr 0.05, weight decay
    0.01, cosine, 120 steps): the first update (norm 10.8) saturates tanh_1; at the resynced step 1 the NumPy
    candidate's gradients upstream of it were 1.8x their calibrated tolerance, BUG. With the saturation seen
    in its own activations the step agrees: DRIFT, and the note names the layer."""
    from click.testing import CliRunner

    from algorithms.contract import RunConfig
    from algorithms.optim import HParams
    from harness import runner
    from harness.cli import main
    need("torch")
    hp = HParams(steps=120, optimizer="adamw", weight_decay=0.01, schedule="cosine")
    ref, cand = (runner.execute(RunConfig(model="cnn2d_3conv_3fc", backend=b, hparams=hp), tmp_path)
                 for b in ("torch", "numpy"))
    r = CliRunner().invoke(main, ["compare", str(ref), str(cand), "--json", "--out", str(tmp_path / "cmp"), "-j", "2"])
    assert r.exit_code == 0, r.output
    pair = json.loads(r.stdout)["pairs"][0]
    assert pair["verdict"] == "DRIFT", pair["notes"]
    step1 = next(p for p in pair["resync"]["per_point"] if p["step"] == 1)
    assert [(c["layer"], c["kind"]) for c in step1["crossed"]] == [("tanh_1", "tanh")], step1
