"""The self-test's plan (which runs, named how, expecting what), its judgement of comparison records and
its matrix, and the command line's checks of what it is asked to run. No backend process: the full
and reduced self-tests themselves are run by `duipai selftest` (CI runs the reduced one)."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from algorithms.faults import FAULTS
from harness import selftest as S
from harness.cli import main


def test_every_fault_has_a_scenario_and_the_reduced_set_is_a_subset():
    assert set(S.FAULT_SCENARIOS) == set(FAULTS)
    from algorithms.faults import perturbation
    from algorithms.spec import load_model
    for f, sc in S.FAULT_SCENARIOS.items():
        touches, layer = S.expected_layer(f, load_model(sc.model))
        assert touches, f"{f}: its scenario's model {sc.model} has no layer it touches"
        if FAULTS[f].where and perturbation(f) is None:
            assert layer is not None, f"{f}: the catalogue names a place, the model no layer to check"
    assert set(S.REDUCED["faults"]) <= set(FAULTS) and set(S.REDUCED["variants"]) <= set(S.DRIFT_VARIANTS)
    assert set(S.REDUCED["backends"]) <= set(S.registered_backends())


def test_plan_runs_each_fault_once_per_backend_with_its_reference_and_envelope():
    p = S.plan(("torch", "jax"), ("flatten_no_permute", "dropout_in_eval"), ("dp2", "xla"), steps=40)
    names = [e.name for e in p.entries]
    assert len(names) == len(set(names))
    faults = {(x["fault"], x["backend"]) for x in p.expect.values() if x["kind"] == "fault"}
    assert faults == {(f, b) for f in ("flatten_no_permute", "dropout_in_eval") for b in ("torch", "jax")}
    # every fault at the default evaluation cadence (no per-fault cadence: the resync probes evaluation)
    assert {e.cfg.hparams.eval_every for e in p.entries} == {S.Scenario().hparams(40).eval_every}
    roles = {(e.cfg.model, e.role) for e in p.entries if e.cfg.backend == "torch" and e.cfg.fault is None}
    assert ("cnn2d_hard", "envelope") in roles and ("cnn2d_2conv_2fc", "envelope") in roles
    # a variant only where it applies (xla: tensorflow), on the default model; the clean candidate of every
    # non-reference backend on the default model and on each model a fault ran on (dropout_in_eval: cnn2d_hard)
    kinds = {(x["kind"], x.get("variant"), x["backend"], x.get("model")) for x in p.expect.values()
             if x["kind"] != "fault"}
    assert kinds == {("variant", "dp2", "torch", None), ("variant", "dp2", "jax", None),
                     ("clean", "clean", "jax", "cnn2d_2conv_2fc"), ("clean", "clean", "jax", "cnn2d_hard")}
    exp = next(x for x in p.expect.values() if x.get("fault") == "flatten_no_permute")
    assert exp["stage"] == "forward" and exp["layer"] == "fc1"


def test_variants_and_faults_follow_what_each_backend_declares(tmp_path):
    """The plan reads the entries' declarations: a variant runs where its capability is declared, a fault the
    wrapper does not implement is n/a without a process started for it."""
    from wrappers.registry import REGISTRY
    backends = S.registered_backends()
    assert backends == tuple(REGISTRY)
    p = S.plan(backends, ("adam_eps_hat", "grad_sum_replicas"), tuple(S.DRIFT_VARIANTS), steps=40)
    for v, (_, cap) in S.DRIFT_VARIANTS.items():
        got = {x["backend"] for x in p.expect.values() if x.get("variant") == v}
        assert got == {b for b in backends if cap in REGISTRY[b].capabilities}, v
    ran = {(e.cfg.fault, e.cfg.backend) for e in p.entries if e.cfg.fault}
    assert ran == {(f, b) for f in ("adam_eps_hat", "grad_sum_replicas") for b in backends if f in REGISTRY[b].faults}
    assert ("adam_eps_hat", "keras-jax") not in ran and ("grad_sum_replicas", "keras-torch") not in ran
    rows = S.judge(p, _entries(p), tmp_path)
    na = [r for r in rows if r["kind"] == "fault" and r["verdict"] == "n/a"]
    assert {(r["what"], r["backend"]) for r in na} == {(f, b) for f in ("adam_eps_hat", "grad_sum_replicas")
                                                      for b in backends if (f, b) not in ran}
    assert all("does not implement" in r["note"] for r in na)


def _entries(p, status="ran"):
    for e in p.entries:
        e.status = status
    return p.entries


def _write_comparison(folder, pairs):
    (folder / "cmp").mkdir(parents=True)
    (folder / "cmp" / "comparison.json").write_text(json.dumps({"pairs": [
        dict(with_reference=True, candidate=n, **rec) for n, rec in pairs.items()]}))


def test_judge_counts_a_fault_right_only_with_bug_and_the_right_stage_and_a_variant_wrong_only_as_bug(tmp_path):
    p = S.plan(("jax",), ("flatten_no_permute", "label_smoothing", "dropout_in_eval"), ("dp2",), steps=40)
    by = {(x.get("fault") or x.get("variant")): n for n, x in p.expect.items()}
    _write_comparison(tmp_path, {
        by["flatten_no_permute"]: {"verdict": "BUG", "localization": {"stage": "forward", "layer": "fc2"},
                                   "first_divergence": {"step": 0, "factor": 40.0}},
        by["label_smoothing"]: {"verdict": "BUG", "localization": {"stage": "forward", "layer": None}},
        by["dropout_in_eval"]: {"verdict": "DECLARED", "localization": {"stage": "eval"}},
        by["dp2"]: {"verdict": "DRIFT"},
        by["clean"]: {"verdict": "BUG", "localization": {"stage": "loss"}},
    })
    rows = {r["what"]: r for r in S.judge(p, _entries(p), tmp_path)}
    assert rows["flatten_no_permute"]["correct"] is True and rows["flatten_no_permute"]["layer_correct"] is False
    assert rows["label_smoothing"]["correct"] is False            # BUG, but in the wrong stage
    assert rows["dropout_in_eval"]["correct"] is False            # right stage, not called a bug
    assert rows["dp2"]["correct"] is True and rows["clean"]["correct"] is False
    text = S.render(list(rows.values()), {"when": "now", "machine": "m", "steps": 40, "command": "c", "seconds": 1})
    assert "**MISSED**" in text and "**FALSE ALARM**" in text
    assert "Faults detected with the right stage: 1/3; right layer: 0/2; drift-only variants called BUG: 1." in text


def test_judge_reports_failed_uncompared_and_unsupported_runs(tmp_path):
    p = S.plan(("jax",), ("grad_sum_replicas", "label_smoothing"), (), steps=40)
    entries = _entries(p)
    by = {x.get("fault") or x.get("variant"): n for n, x in p.expect.items()}
    status = {e.name: e for e in entries}
    status[by["grad_sum_replicas"]].status, status[by["grad_sum_replicas"]].message = "unsupported", "no DP"
    status[by["clean"]].status, status[by["clean"]].message = "failed", "exit -9"
    _write_comparison(tmp_path, {})
    rows = {r["what"]: r for r in S.judge(p, entries, tmp_path)}
    assert rows["grad_sum_replicas"]["verdict"] == "n/a" and rows["grad_sum_replicas"]["correct"] is None
    assert rows["clean"]["verdict"] == "FAILED" and rows["clean"]["correct"] is False
    assert rows["label_smoothing"]["verdict"] == "NOT COMPARED" and rows["label_smoothing"]["correct"] is False


@pytest.mark.parametrize("args,needle", [
    (["--faults", "flatten_no_permute,nope"], "unknown fault 'nope'"),
    (["--variants", "dp3"], "unknown variant 'dp3'"),
    (["--backends", "torch,caffe"], "unknown backend 'caffe'"),
])
def test_cli_refuses_unknown_names_before_running_anything(args, needle, tmp_path):
    res = CliRunner().invoke(main, ["selftest", "--out", str(tmp_path), *args])
    assert res.exit_code == 2 and needle in res.output
    assert not any(tmp_path.iterdir())


def test_the_full_plan_injects_each_fault_into_every_model_whose_layers_it_touches():
    p = S.plan(("torch",), ("flatten_no_permute", "maxpool_ceil", "lr_rel_1e-05", "lr_rel_1e-04_from_100"), (),
               steps=300, models=S.SELFTEST_MODELS)
    got = {(x["fault"], x["model"], x["layer"]) for x in p.expect.values() if x["kind"] == "fault"}
    assert got == {("flatten_no_permute", "cnn2d_2conv_2fc", "fc1"), ("flatten_no_permute", "cnn2d_3conv_3fc", "fc1"),
                   ("flatten_no_permute", S.GRAPH_SCENARIO, "fc"), ("maxpool_ceil", "cnn2d_hard", "pool3")} | {
        (f, m, None) for f in ("lr_rel_1e-05", "lr_rel_1e-04_from_100") for m in S.SELFTEST_MODELS}
    # every model has its reference and envelope; a fault that starts at step 100 needs the steps to get there
    refs = {e.cfg.model for e in p.entries if e.role == "envelope"}
    assert refs == set(S.SELFTEST_MODELS)
    short = S.plan(("torch",), ("lr_rel_1e-04_from_100",), (), steps=40)
    assert not [x for x in short.expect.values() if x["kind"] == "fault"]


def test_every_model_a_fault_ran_on_has_its_clean_control_in_every_backend():
    """A fault's BUG on a model stands beside that model's clean run in the same backend (the clean candidates of
    a graph model, on its own 32x32x3 data); with the reference alone (the reduced self-test) nothing is added."""
    p = S.plan(("torch", "jax", "tensorflow"), ("grad_double",), (), steps=300, models=("mobilenet_tiny",))
    clean = {(e.cfg.model, e.cfg.backend, e.cfg.data) for e in p.entries
             if p.expect.get(e.name, {}).get("kind") == "clean"}
    assert clean == {(m, b, S.builtin_data(m)) for m in ("cnn2d_2conv_2fc", "mobilenet_tiny") for b in ("jax", "tensorflow")}
    assert S.builtin_data("mobilenet_tiny") == "digits32"
    # each clean control has its reference run and envelope on that model
    assert {("mobilenet_tiny", "run"), ("mobilenet_tiny", "envelope")} <= {
        (e.cfg.model, e.role) for e in p.entries if e.cfg.backend == "torch" and e.cfg.fault is None}
    alone = S.plan(("torch",), ("grad_double",), (), steps=300, models=("mobilenet_tiny",))
    assert not [x for x in alone.expect.values() if x["kind"] == "clean"]
    assert sorted(e.role for e in alone.entries if e.cfg.model == "mobilenet_tiny") == ["envelope"] * 4 + ["fault", "run"]


def test_the_full_self_test_injects_a_fault_that_touches_every_model_into_every_built_in_model():
    from algorithms.spec import model_names
    p = S.plan(("torch",), ("lr_rel_1e-05",), (), steps=300, models=S.SELFTEST_MODELS)
    assert {x["model"] for x in p.expect.values() if x["kind"] == "fault"} == {*model_names(), S.GRAPH_SCENARIO}
