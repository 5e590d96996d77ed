"""Localization of a BUG: the analysis of probe comparisons on synthetic probes (fast), and the
replay job mode of the worker on real torch runs."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from harness.probe_analysis import analyse, describe

LAYERS = ["conv1", "relu_1", "pool1", "conv2", "relu_2", "flatten_1", "fc1", "relu_3", "fc2"]
PARAMS = ["conv1.kernel", "conv1.bias", "conv2.kernel", "conv2.bias", "fc1.kernel", "fc1.bias", "fc2.kernel", "fc2.bias"]


def probes(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    p = {f"forward/{l}": rng.standard_normal((4, 8)) for l in LAYERS}
    p["loss"] = np.asarray(2.3)
    p.update({f"grad/{q}": rng.standard_normal(6) for q in PARAMS})
    for i in range(3):
        p.update({f"update{i}/{q}": rng.standard_normal(6) * 1e-2 for q in PARAMS})
        p.update({f"opt{i}/momentum/{q}": rng.standard_normal(6) for q in PARAMS})
    return p


def test_all_agree():
    ref = probes()
    got = {k: v * (1 + 1e-7) for k, v in ref.items()}
    res = analyse(got, ref, LAYERS)
    assert res["stage"] is None and res["disagreeing_keys"] == []
    assert describe(res, "x") == ("", [])


def test_forward_muffin_rule_and_change_rate():
    ref = probes()
    got = dict(ref)
    for l in LAYERS[LAYERS.index("fc1"):]:       # fc1 computes something else; what follows inherits it
        got[f"forward/{l}"] = ref[f"forward/{l}"] + 0.5
    got["loss"] = ref["loss"] + 0.1
    res = analyse(got, ref, LAYERS)
    assert res["stage"] == "forward" and res["layer"] == "fc1" and res["probe"] == "forward/fc1"
    rates = {t["layer"]: t for t in res["layers"]}
    assert rates["flatten_1"]["ok"] and not rates["fc1"]["ok"] and rates["fc1"]["input_ok"]
    assert rates["fc1"]["R"] > 1e5 and abs(rates["relu_3"]["R"]) < 10   # CRADLE: the jump is at fc1
    assert res["max_R_layer"] == "fc1"
    summary, lines = describe(res, "step-0 probes")
    assert summary == "forward: fc1" and any("R (change rate)" in l for l in lines)


def test_an_error_under_the_floor_is_named_where_it_arose_not_where_it_crosses():
    """A pointwise layer's small error (GELU's tanh form for the exact one: ~3e-5, under the 3e-5 forward floor)
    crosses the floor only a layer later: the layer named is the one where the error jumped far above the
    reference's own rounding, with the crossing said; without the float64 probes (own rounding unknown) it is
    Muffin's layer."""
    ref64 = probes()
    ref = {k: v + 1e-9 * np.max(np.abs(v)) for k, v in ref64.items()}          # the reference's own rounding

    def at(k: str, e: float) -> np.ndarray:
        x = ref64[k].copy()
        x.flat[0] += e * np.max(np.abs(x))      # rel (against the probe's scale) ~ e / 5.7 here
        return x
    got = dict(ref)
    got["forward/flatten_1"], got["forward/fc1"] = at("forward/flatten_1", 1.4e-4), at("forward/fc1", 2.6e-4)
    res = analyse(got, ref, LAYERS, ref64=ref64)
    rows = {t["layer"]: t for t in res["layers"]}
    assert rows["flatten_1"]["ok"] and not rows["fc1"]["ok"] and rows["fc1"]["R"] < 1
    assert res["stage"] == "forward" and res["layer"] == "flatten_1" and res["probe"] == "forward/flatten_1"
    assert res["over_tolerance_at"]["layer"] == "fc1"
    summary, lines = describe(res, "step-0 probes")
    assert summary == "forward: flatten_1" and "where the error arose" in lines[0] and "at fc1" in lines[0]
    plain = analyse(got, ref, LAYERS)          # no float64 probes (own rounding unknown): Muffin's layer only
    first_bad = next(t["layer"] for t in plain["layers"] if not t["ok"])
    assert plain["layer"] == first_bad and "over_tolerance_at" not in plain
    got["forward/fc1"] = at("forward/fc1", 1e-3)       # fc1's own jump: fc1 computes something else
    assert analyse(got, ref, LAYERS, ref64=ref64)["layer"] == "fc1"


def test_loss_stage():
    ref = probes()
    got = dict(ref, loss=ref["loss"] * 1.01)
    res = analyse(got, ref, LAYERS)
    assert res["stage"] == "loss"


def test_backward_first_parameter_in_backward_order_and_uniform_scale():
    ref = probes()
    got = dict(ref)
    for q in PARAMS:
        got[f"grad/{q}"] = ref[f"grad/{q}"] * 2.0
    res = analyse(got, ref, LAYERS)
    assert res["stage"] == "backward" and res["parameter"] == "fc2.kernel"   # the last layer comes first
    assert res["gradient_scale"] == pytest.approx(2.0)
    got = dict(ref, **{"grad/conv2.kernel": ref["grad/conv2.kernel"] + 1.0})
    res = analyse(got, ref, LAYERS)
    assert res["parameter"] == "conv2.kernel" and "gradient_scale" not in res


def test_a_backward_only_bug_names_the_layers_whose_backward_can_hold_it():
    """A wrong input gradient in relu_2's backward (the layer between conv2 and fc1): conv2's and conv1's gradients
    disagree, fc1's and fc2's agree. The suspects are conv2 (its own weight gradient) up to fc1, the nearest later
    layer whose parameters' gradients agree (its input gradient can be wrong all the same); when the last layer's
    gradient is the first to disagree, the span runs to the end."""
    ref = probes()
    got = dict(ref, **{f"grad/{q}": ref[f"grad/{q}"] + np.arange(6.0) for q in PARAMS[:4]})
    res = analyse(got, ref, LAYERS)
    assert res["stage"] == "backward" and res["parameter"] == "conv2.kernel"
    assert res["backward_span"] == ["conv2", "relu_2", "flatten_1", "fc1"]
    summary, lines = describe(res, "step-0 probes")
    assert summary == "backward: conv2.kernel"
    assert "in the backward pass of one of conv2, relu_2, flatten_1, fc1 (the gradients of every parameter after conv2 " \
           "agree)" in lines[0]
    got = dict(ref, **{"grad/fc2.bias": ref["grad/fc2.bias"] + 1.0})
    assert analyse(got, ref, LAYERS)["backward_span"] == ["fc2"]


def test_on_a_residual_graph_the_backward_span_follows_the_edges_past_a_shortcut():
    """resnet_tiny, a wrong input gradient in block2_proj's backward (the shortcut conv, after block2_bn2 in the spec's
    order): every gradient from block2_conv1 on agrees, block1_bn2's and earlier do not. The span follows block1_out's
    two readers, the main path's block2_conv1 and the shortcut's block2_proj; in the spec's order alone it stopped at
    block2_conv1 and missed the layer with the bug."""
    from algorithms.spec import load_model
    from harness.probe_analysis import spec_layers
    layers = spec_layers({"spec": load_model("resnet_tiny").to_dict()})
    kinds = {"conv2d": ("kernel",), "batchnorm2d": ("gamma", "beta"), "dense": ("kernel", "bias")}
    decl = load_model("resnet_tiny").to_dict()["layers"]
    params = [f"{l['name']}.{w}" for l in decl for w in kinds.get(l["type"], ())]
    rng = np.random.default_rng(0)
    ref = {f"forward/{n}": rng.standard_normal((2, 4)) for n in layers}
    ref["loss"] = np.asarray(2.3)
    ref.update({f"grad/{q}": rng.standard_normal(5) for q in params})
    upstream = params[:params.index("block2_conv1.kernel")]
    got = dict(ref, **{f"grad/{q}": ref[f"grad/{q}"] + 1.0 for q in upstream})
    res = analyse(got, ref, layers)
    assert res["parameter"].startswith("block1_bn2.")
    assert res["backward_span"] == ["block1_bn2", "block1_add", "block1_out", "block2_conv1", "block2_proj"]


def test_optimizer_stage_when_gradients_agree():
    ref = probes()
    got = dict(ref)
    for q in PARAMS:
        got[f"update0/{q}"] = ref[f"update0/{q}"] * 1.001
    res = analyse(got, ref, LAYERS)
    assert res["stage"] == "optimizer" and res["parameter"] == "conv1.kernel" and res["optimizer_step"] == 0
    got = dict(ref, **{"update1/fc1.bias": ref["update1/fc1.bias"] * 1.5})
    res = analyse(got, ref, LAYERS)
    assert res["stage"] == "optimizer" and res["optimizer_step"] == 1 and res["probe"] == "update1/fc1.bias"


def test_running_statistics_are_the_forward_stage_of_their_layer():
    ref = probes()
    ref["buffer0/bn1.running_mean"] = np.zeros(4)
    got = dict(ref, **{"buffer0/bn1.running_mean": np.ones(4)})
    res = analyse(got, ref, LAYERS + ["bn1"])
    assert res["stage"] == "forward" and res["layer"] == "bn1" and res["note"] == "running statistics"


BN_MODEL = {"name": "bn_after_conv", "input_shape": [6, 6, 1], "num_classes": 10, "layers": [
    {"type": "batchnorm2d", "name": "bn0"},
    {"type": "conv2d", "name": "conv1", "filters": 4, "kernel": 3, "padding": "same", "use_bias": False},
    {"type": "batchnorm2d", "name": "bn1"},
    {"type": "conv2d", "name": "conv2", "filters": 4, "kernel": 3, "padding": "same"},
    {"type": "flatten", "name": "flat"},
    {"type": "dense", "name": "fc", "units": 10}]}


def _replica_runs() -> tuple[list[str], SimpleNamespace, SimpleNamespace]:
    """BN_MODEL's layers, a one-device reference run and a two-replica candidate run (only what _reduction reads)."""
    from algorithms.spec import build_model
    model = build_model(BN_MODEL)
    man = {"model": "bn_after_conv", "spec_hash": model.hash(), "spec": model.to_dict()}
    return ([l.name for l in model.layers], SimpleNamespace(name="ref", options=SimpleNamespace(devices=1), manifest=man),
            SimpleNamespace(name="cand", options=SimpleNamespace(devices=2), manifest=man))


@pytest.mark.parametrize("first, stage, words", [
    ("conv2", "data", "the replicas split the batch differently"),
    ("bn1", "forward", "the replicas' batch statistics at bn1 are not the single-device ones"),
    ("bn0", "data", "the replicas split the batch differently"),    # a batchnorm2d on the input: nothing upstream
])
def test_a_disagreement_only_across_replicas_is_placed_by_its_first_layer(first, stage, words, tmp_path):
    """A candidate on two replicas disagrees from `first` on and agrees once probed on one device. If `first`
    computes batch statistics and has a layer upstream (whose agreement over the global batch vouches that each
    replica had its samples), the statistics across replicas differ: forward, at that layer (a --sync-bn that
    never reached the layers). Otherwise (conv2; bn0, which reads the input) the replicas were fed other samples."""
    from harness.localize import Localizer

    layers, ref_run, cand_run = _replica_runs()
    rng = np.random.default_rng(0)
    ref = {f"forward/{l}": rng.standard_normal((4, 8)) for l in layers}
    ref["loss"] = np.asarray(2.3)
    two = dict(ref)
    for l in layers[layers.index(first):]:
        two[f"forward/{l}"] = ref[f"forward/{l}"] + 0.5

    class OnTheseProbes(Localizer):
        def __init__(self):
            self.root = tmp_path

        def probe0(self, run, **change):
            return two if run is cand_run and change.get("devices") != 1 else ref

        def probe64(self, ref, cand, **change):
            return None

    res = analyse(two, ref, layers)
    assert res["stage"] == "forward" and res["layer"] == first
    got = OnTheseProbes()._reduction(ref_run, cand_run, res, layers, {})
    assert got["stage"] == stage and got["layer"] == first
    assert words in (got.get("across_replicas") if stage == "forward" else got["note"])
    assert words in describe(got, "step-0 probes")[1][0]


@pytest.mark.parametrize("single_differs_at, stage", [
    ("eval/conv2", "data"),        # on one device only a later probe disagrees (its own rounding): still the replicas'
    ("forward/conv2", "forward"),  # on one device the same place disagrees: not the data parallelism's doing
    ("forward/conv1", "forward"),  # ... or an earlier one
])
def test_the_single_device_run_must_agree_up_to_where_the_replicas_disagree(single_differs_at, stage, tmp_path):
    """`_reduction` blames the data parallelism when the candidate on one device agrees with the reference up to
    the replicated run's first disagreement; a disagreement of the single-device run that comes later in the
    analysis order (here the evaluation; on resnet_tiny a BatchNorm beta's update at the third probe step) does
    not clear the replicas, one at or before it does."""
    from harness.localize import Localizer

    layers, ref_run, cand_run = _replica_runs()
    rng = np.random.default_rng(1)
    ref = {f"forward/{l}": rng.standard_normal((4, 8)) for l in layers}
    ref.update({f"eval/{l}": rng.standard_normal((4, 8)) for l in layers})
    ref["loss"] = np.asarray(2.3)
    two = dict(ref, **{f"forward/{l}": ref[f"forward/{l}"] + 0.5 for l in layers[layers.index("conv2"):]})
    one = dict(ref, **{single_differs_at: ref[single_differs_at] + 0.5})

    class OnTheseProbes(Localizer):
        def __init__(self):
            self.root = tmp_path

        def probe0(self, run, **change):
            return (one if change.get("devices") == 1 else two) if run is cand_run else ref

        def probe64(self, ref, cand, **change):
            return None

    res = analyse(two, ref, layers)
    got = OnTheseProbes()._reduction(ref_run, cand_run, res, layers, {})
    assert got["stage"] == stage and got["layer"] == "conv2"
    if stage == "data":
        assert "on one device the first is later, eval/conv2" in got["note"]


def test_eval_path_is_localized_when_training_agrees():
    ref = probes()
    ref.update({f"eval/{l}": v * 0.9 for l, v in ((l, ref[f"forward/{l}"]) for l in LAYERS)})
    got = dict(ref)
    for l in LAYERS[LAYERS.index("relu_3"):]:      # dropout left on after relu_3: what follows inherits it
        got[f"eval/{l}"] = ref[f"eval/{l}"] * 0.5
    res = analyse(got, ref, LAYERS)
    assert res["stage"] == "eval" and res["layer"] == "relu_3" and res["probe"] == "eval/relu_3"
    summary, lines = describe(res, "step-0 probes")
    assert summary == "eval: relu_3" and any("inference mode" in l for l in lines)
    got["forward/fc1"] = ref["forward/fc1"] + 1.0     # a training disagreement comes first
    assert analyse(got, ref, LAYERS)["stage"] == "forward"


class _StubLocalizer:
    """Localizer._set_aside_declared with the reference's probe jobs replaced by arrays."""
    def __init__(self, ref0):
        from harness.localize import Localizer
        self.ref0, self.calls = ref0, []
        self.set_aside = Localizer._set_aside_declared.__get__(self)

    def probe0(self, run, **change):
        self.calls.append(change)
        return self.ref0

    def probe64(self, ref, cand, **change):
        return None


def _run(declared, layers=()):
    from types import SimpleNamespace
    return SimpleNamespace(declared=declared, manifest={"spec": {"layers": [{"type": "x", "name": l} for l in layers]}})


def test_unverified_declared_difference_is_set_aside_and_the_rest_localized():
    """A difference that is not emulated (here a record outside the catalogue naming its keys) is credited
    with at most the probes it names; the disagreement is localized on the others."""
    layers = LAYERS + ["bn1"]
    ref = probes()
    ref["buffer0/bn1.running_var"] = np.ones(4)
    ref.update({f"eval/{l}": ref[f"forward/{l}"] for l in layers if f"forward/{l}" in ref})
    got = dict(ref, **{"buffer0/bn1.running_var": np.full(4, 0.9), "eval/fc2": ref["eval/fc2"] * 2})
    res = analyse(got, ref, layers)
    assert res["stage"] == "forward" and res["note"] == "running statistics"   # the declared buffer comes first
    own = _run([{"id": "my_running_var", "probe_keys": r"^buffer\d+/.*running_var$", "series": ["eval_loss"]}])
    loc = _StubLocalizer(ref)
    out = loc.set_aside(_run([], layers), own, got, res, layers, {}, [])
    assert out["stage"] == "eval" and out["layer"] == "fc2" and out["disagreeing_keys"] == ["eval/fc2"]
    assert out["set_aside"] == {"differences": ["my_running_var"], "keys": ["buffer0/bn1.running_var"], "all": False,
                                "statistical": False}
    assert loc.calls == [{}]               # the plain reference: nothing was emulated
    # every disagreement is one the declared difference may move: marked, the verdict engine decides
    only = dict(ref, **{"buffer0/bn1.running_var": np.full(4, 0.9)})
    res = analyse(only, ref, layers)
    assert loc.set_aside(_run([], layers), own, only, res, layers, {}, [])["set_aside"]["all"]
    # a record that names no keys (or '.*', as old manifests did) moves nothing
    for rec in ({"id": "x"}, {"id": "x", "probe_keys": ".*"}):
        assert loc.set_aside(_run([], layers), _run([rec]), got, res, layers, {}, []) is res
    # an emulated difference is not set aside: it was compared against the emulating reference
    keras = _run([{"id": "running_var_biased"}])
    assert loc.set_aside(_run([], layers), keras, only, res, layers, {"fault": "bn_running_var_biased"},
                         ["running_var_biased"]) is res


# --------------------------------------------------------------------------- the replay job mode, on torch runs
@pytest.mark.slow
def test_replay_probes_later_steps_from_the_reference_state(results_root):
    """Two backend processes beyond the runs of test_compare (about 10 s): in the slow set."""
    from harness.localize import Localizer
    from harness.probe_analysis import spec_layers as _layers
    from harness.runs import load_run

    from .torch_runs import compare_root, run
    root = compare_root(results_root)
    ref, lr = load_run(run(root)), load_run(run(root, fault="lr_scale_1.001"))
    rep = Localizer(root).replay(ref, lr, [24, 25])
    assert rep["checkpoint_step"] == 20
    # the reference, re-trained from its checkpoint, reproduces its own rows bit for bit
    assert rep["reproduced"] == {"from_step": 20, "to_step": 24, "bitwise": True, "max_abs_diff": 0.0}
    assert rep["float64_job"] is None          # one code path: its correct probes are bitwise equal
    for t, got, want, want64, _plain in rep["probes"]:
        res = analyse(got, want, _layers(ref.manifest), ref64=want64)
        assert res["stage"] == "optimizer" and res["probe"].startswith("update0/"), t
        # both backends start from the same saved state: forward and gradients agree bitwise
        same = [k for k in want if k.startswith(("forward/", "grad/"))]
        assert same and all(np.array_equal(got[k], want[k]) for k in same)
        assert all(l["ok"] for l in res["layers"]) and all(g["ok"] for g in res["gradients"])


@pytest.mark.slow
def test_late_schedule_bug_is_localized_by_replay(results_root):
    """lr_schedule_off_by_one under a step schedule: the step-0 probes agree (the lr changes at step 20),
    the curves leave the envelope at step 19, and the replay of steps 18 and 19 finds the update."""
    import json

    from click.testing import CliRunner

    from harness.cli import main

    from .torch_runs import compare_root, run
    root = compare_root(results_root)
    sched = {"schedule": "step", "step_size": 20, "gamma": 0.5}
    runs = [run(root, hp=sched), run(root, hp=sched, fault="lr_schedule_off_by_one")]
    r = CliRunner().invoke(main, ["compare", *map(str, runs), "--json", "--out", str(root / "out-sched")])
    assert r.exit_code == 1, r.output
    p = json.loads(r.stdout)["pairs"][0]
    assert p["verdict"] == "BUG" and p["first_divergence"]["step"] == 19
    loc = p["localization"]
    assert loc["method"] == "replay of step 19 from the reference's state" and loc["stage"] == "optimizer"
    assert loc["step0"]["stage"] is None and loc["replay"]["reproduced"]["bitwise"]


def test_a_small_loss_is_held_to_what_its_logits_allow():
    """Cross-entropy rounds in the logits, not relative to the loss: at a loss of 0.01 with logits of size
    20, a candidate's loss 3e-6 away (rounding of the logits) agrees even when the reference's own float32
    loss happened to equal its float64 one; a loss bug of 10% there is still the loss stage."""
    ref = probes()
    ref["forward/fc2"] = ref["forward/fc2"] * 8.0          # logits up to ~20
    ref["loss"] = np.asarray(0.01)
    ref64 = {k: np.asarray(v, np.float64) for k, v in ref.items()}
    got = dict(ref, loss=np.asarray(0.01 + 3e-6))
    res = analyse(got, ref, LAYERS, rel_tol=3e-5, ref64=ref64)
    assert res["stage"] is None and "loss" not in res["disagreeing_keys"]
    bad = analyse(dict(ref, loss=np.asarray(0.011)), ref, LAYERS, rel_tol=3e-5, ref64=ref64)
    assert bad["stage"] == "loss"
    # the bound is the logits' tolerance: without an output layer probe the loss keeps its own
    no_logits = {k: v for k, v in got.items() if k != "forward/fc2"}
    assert "loss" in analyse(no_logits, {k: v for k, v in ref.items() if k != "forward/fc2"}, LAYERS,
                             rel_tol=3e-5, ref64=ref64)["disagreeing_keys"]


def test_a_job_two_threads_ask_for_runs_once(tmp_path, monkeypatch):
    """Pairs are localized in parallel (compare -j): a job they share (the reference's replay) runs once,
    different jobs run at the same time."""
    import threading
    import time
    from harness.localize import Localizer
    loc = Localizer(tmp_path)
    calls, running, peak = [], [0], [0]
    guard = threading.Lock()

    def fake(self, run, name, mode, replay=None, **change):
        folder = self.jobs / name
        if (folder / "worker.json").is_file():
            return folder
        with guard:
            calls.append(name)
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.2)
        folder.mkdir(parents=True)
        (folder / "manifest.json").write_text("{}")
        (folder / "worker.json").write_text("{}")
        with guard:
            running[0] -= 1
        return folder

    monkeypatch.setattr(Localizer, "_job_once", fake)
    names = ["shared"] * 4 + ["a", "b"]
    run = SimpleNamespace(name="the_run")       # the cache's bookkeeping reads only its name
    threads = [threading.Thread(target=loc._job, args=(run, n, "replay")) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(calls) == ["a", "b", "shared"] and peak[0] >= 2


def test_a_kink_the_reference_itself_flips_is_not_a_disagreement_but_a_larger_one_is():
    """At a ReLU kink one step is discontinuous: the reference moved by one ULP moves its gradients by 1e-3 as
    well, and a candidate within 3x of that agrees there; 10x that still disagrees."""
    ref = probes()
    ref64 = {k: np.asarray(v, np.float64) for k, v in ref.items()}
    g = "grad/fc1.kernel"
    nudged = [dict(ref, **{g: ref[g] * (1 + 1e-3)})]
    near = dict(ref, **{g: ref[g] * (1 + 2e-3)})
    assert g in analyse(near, ref, LAYERS, rel_tol=3e-5, ref64=ref64)["disagreeing_keys"]
    assert g not in analyse(near, ref, LAYERS, rel_tol=3e-5, ref64=ref64, nudged=nudged)["disagreeing_keys"]
    far = dict(ref, **{g: ref[g] * (1 + 1e-2)})
    assert analyse(far, ref, LAYERS, rel_tol=3e-5, ref64=ref64, nudged=nudged)["stage"] == "backward"


def test_the_step0_probes_are_held_as_the_resync_holds_its_step_0(tmp_path):
    """resnet_tiny in jax (2026-12-04): at step 0 the reference's own 1-ULP-nudged step jumped (a ReLU kink its
    rounding flips), and the resync's step 0, which allows for that, agreed; the step-0 probes, held to the fixed
    floor without it, called the same gradients a backward disagreement. The localization now takes the nudged
    steps the resync probed from the same initial state; without a resync of step 0 there is nothing to take."""
    from algorithms.params import save_npz
    from harness.localize import Localizer
    from harness.probe_jobs import LazyProbeMap, ReplayProbes

    rng = np.random.default_rng(3)
    ref = probes()
    ref64 = {k: v * (1 + 1e-9 * rng.standard_normal(np.shape(v))) for k, v in ref.items()}
    key = "grad/conv1.kernel"
    jump = 3e-4 * np.abs(ref[key]).max() * rng.standard_normal(ref[key].shape)
    cand = dict(ref, **{key: ref[key] + jump})                  # the candidate's rounding flipped the kink
    nudged = dict(ref, **{key: ref[key] + 0.5 * jump[::-1]})    # and so did the reference's own nudge, as far
    save_npz(tmp_path / "n0.npz", nudged)
    runs = SimpleNamespace(name="ref"), SimpleNamespace(name="cand")

    class Resynced(Localizer):
        def __init__(self, at):
            self.root, self._replays = tmp_path, {}
            self._replays[("ref", "cand", "")] = {"at": at, "probes": ReplayProbes([(t, ()) for t in at]),
                                                  "sensitivity": LazyProbeMap({0: [tmp_path / "n0.npz"]} if 0 in at else {})}

    assert analyse(cand, ref, LAYERS, ref64=ref64)["stage"] == "backward"
    got = Resynced([0, 25, 50]).nudged_at_step0(*runs, None)
    assert got is not None and len(got) == 1
    assert analyse(cand, ref, LAYERS, ref64=ref64, nudged=got)["stage"] is None
    assert Resynced([25, 50]).nudged_at_step0(*runs, None) is None      # the resync did not probe step 0
    assert Resynced([0, 25]).nudged_at_step0(*runs, {"fault": "x"}) is None   # nor against this reference
    # a flip far beyond the reference's own jump still disagrees
    far = dict(ref, **{key: ref[key] + 30 * jump})
    assert analyse(far, ref, LAYERS, ref64=ref64, nudged=got)["stage"] == "backward"
