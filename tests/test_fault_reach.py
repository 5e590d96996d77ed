"""A fault run that computes the clean model is not a test of anything: algorithms.fault_reach says why a
fault changes nothing in a configuration, the run says so loudly (stderr, run.log, manifest) and
`duipai compare` notes it on the pair."""
from __future__ import annotations

import json

import pytest

from algorithms.fault_reach import inert_reason
from algorithms.faults import FAULTS
from algorithms.optim import HParams
from algorithms.spec import load_model
from harness.selftest import FAULT_SCENARIOS

from .conftest import duipai_in_process


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_every_fault_applies_in_its_self_test_scenario(fault):
    """The self-test's scenario of each fault is a configuration where it bites: none is called inert there
    (a wrong reason here would tell a user their real bug run is the clean one)."""
    sc = FAULT_SCENARIOS[fault]
    hp = sc.hparams(max(300, sc.min_steps))
    assert inert_reason(fault, load_model(sc.model), hp, sc.devices) is None


@pytest.mark.parametrize("fault, model, hp, devices, why", [
    ("gelu_tanh_approx", "cnn2d_2conv_2fc", {}, 1, "a gelu layer with approximate = 'none'"),
    ("bn_eps_keras", "cnn2d_3conv_3fc", {}, 1, "a batchnorm2d layer"),
    ("bn_eps_abs_1e-05", "cnn2d_2conv_2fc", {}, 1, "has no batchnorm2d layer"),
    ("eps_abs_9e-08", "cnn2d_2conv_2fc", {"optimizer": "sgd"}, 1, "it moves eps, which optimizer sgd does not read"),
    ("adam_eps_hat", "cnn2d_2conv_2fc", {"optimizer": "momentum"}, 1, "optimizer adam/adamw"),
    ("momentum_abs_1e-05", "cnn2d_2conv_2fc", {"optimizer": "adam"}, 1, "which optimizer adam does not read"),
    ("l2_not_decoupled", "cnn2d_2conv_2fc", {"optimizer": "adamw"}, 1, "weight_decay > 0"),
    ("lr_schedule_off_by_one", "cnn2d_2conv_2fc", {"schedule": "constant"}, 1, "non-constant schedule"),
    ("grad_sum_replicas", "cnn2d_2conv_2fc", {}, 1, "--devices > 1"),
    ("lr_rel_1e-04_from_100", "cnn2d_2conv_2fc", {"steps": 100}, 1, "starts at step 100 and the run has 100 steps"),
])
def test_a_fault_that_changes_nothing_says_what_it_needs(fault, model, hp, devices, why):
    got = inert_reason(fault, load_model(model), HParams(**hp), devices)
    assert got is not None and why in got, got


def test_faults_that_bite_in_a_configuration_are_not_inert():
    m = load_model("cnn2d_hard")
    assert inert_reason("bn_eps_abs_1e-05", m, HParams(), 1) is None
    assert inert_reason("l2_not_decoupled", m, HParams(optimizer="adamw", weight_decay=0.01), 1) is None
    assert inert_reason("lr_rel_1e-04_from_100", m, HParams(steps=101), 1) is None
    assert inert_reason("grad_sum_replicas", m, HParams(), 2) is None
    assert inert_reason("lr_rel_1e-05", m, HParams(optimizer="adam"), 1) is None


def test_an_inert_fault_run_says_so_in_its_output_log_and_manifest(tmp_path, monkeypatch, capsys):
    """The numpy backend (no framework: the cheapest process)."""
    code, out, err = duipai_in_process(["run", "-b", "numpy", "--steps", "2", "--fault", "gelu_tanh_approx",
                                        "--out", str(tmp_path)], monkeypatch, capsys)
    assert code == 0, out + err
    warn = [l for l in err.splitlines() if "warning" in l]
    assert warn == ["duipai: warning: --fault gelu_tanh_approx does not apply here: it needs a gelu layer with "
                    "approximate = 'none', and model 'cnn2d_2conv_2fc' has none; this run is not that bug"]
    (folder,) = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    man = json.loads((folder / "manifest.json").read_text())
    assert man["fault"] == "gelu_tanh_approx" and "a gelu layer" in man["fault_inert"]
    assert "# warning: --fault gelu_tanh_approx does not apply here" in (folder / "run.log").read_text()


def test_compare_notes_a_candidate_whose_fault_does_not_apply(tmp_path):
    """Synthetic runs (tests/synthetic.py): the candidate's manifest says its fault is inert; the pair's first
    note says so, whatever the verdict."""
    from harness.compare import compare
    from harness.envelope import compute
    from harness.runs import load_run
    from .synthetic import base_eval, base_series, write_run
    s, e = base_series(60), base_eval(60)
    ref = load_run(write_run(tmp_path, "ref", s, e))
    members = [load_run(write_run(tmp_path, f"m{j}", s, e, perturb=j)) for j in (1, 2, 3)]
    cand = load_run(write_run(tmp_path, "cand", s, e, fault="gelu_tanh_approx",
                              fault_inert="it needs a gelu layer with approximate = 'none', and model 'm' has none"))
    p = compare(ref, [cand], compute(ref, members), members).pairs[0]
    assert p.notes[0] == ("--fault gelu_tanh_approx does not apply to this run: it needs a gelu layer with "
                          "approximate = 'none', and model 'm' has none")
