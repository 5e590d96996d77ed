"""The typed contract between the harness and a backend process (algorithms/contract.py): what a job carries
survives the file, a malformed one is refused naming the field, and a run folder regenerates its own run
from its manifest's stored configuration, from any working directory."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from algorithms.contract import (MANIFEST_FILE, Job, Replay, RunConfig, RunOptions, checkpoint_file, checkpoints_in,
                                 replay_probe_stem)
from algorithms.optim import HParams

from .conftest import need


def _job(**change) -> Job:
    base = Job(mode="train", backend="torch", model={"name": "m"}, model_source="/abs/m.toml",
               hparams=HParams(steps=7, optimizer="adamw", weight_decay=0.01), data="/abs/d.npz",
               order="/abs/order.npy", params="/abs/p.npz", out="/abs/out",
               options=RunOptions(devices=2, fault="missing_bias", extra={"hosts": 2, "channels_last": True}))
    return dataclasses.replace(base, **change)


@pytest.mark.parametrize("change", [
    {},
    {"mode": "probe", "cases": [HParams(optimizer="sgd"), HParams(optimizer="adam", lr=1e-3)], "probe_steps": 2},
    {"mode": "replay", "replay": Replay([30, 10], checkpoints={0: "/abs/c0.npz", 10: "/abs/c10.npz"},
                                        perturb_state_ulps=[None, 1, 2])},
    {"mode": "replay", "replay": Replay([12], states={12: "/abs/s.npz"}, activation_rows=0)},
])
def test_a_job_survives_its_file(tmp_path, change):
    job = _job(**change)
    job.write(tmp_path / "job.json")
    back = Job.read(tmp_path / "job.json")
    assert back == dataclasses.replace(job, replay=job.replay and Replay.from_dict(job.replay.to_dict()))
    assert back.options.hosts == 2 and back.hparams.weight_decay == 0.01
    if back.replay is not None:
        assert back.replay.at == sorted(back.replay.at)      # the worker walks the steps in order


def test_a_job_names_every_path_it_carries():
    job = _job(mode="replay", replay=Replay([5], checkpoints={0: "c0.npz"}, states={5: "/abs/s5.npz"}))
    assert dict(job.paths()) == {"data": "/abs/d.npz", "order": "/abs/order.npy", "params": "/abs/p.npz",
                                 "out": "/abs/out", "replay.checkpoints.0": "c0.npz", "replay.states.5": "/abs/s5.npz"}


@pytest.mark.parametrize("doc, message", [
    ({"mode": "train"}, "job: missing field(s) backend, model, model_source, hparams, data, order, params, out"),
    (dict(_job().to_dict(), steps=5), "job: unknown field(s) steps"),
    (dict(_job().to_dict(), options={"devices": 2, "sharding": "fsdp"}), "run options: unknown field(s) sharding"),
    (dict(_job().to_dict(), mode="evaluate"), "job: unknown mode 'evaluate'"),
    (dict(_job().to_dict(), mode="replay"), "job: mode 'replay' needs a replay"),
    (dict(_job().to_dict(), mode="replay", replay={"at": [3], "checkpoint": "/c.npz"}), "replay: unknown field(s) checkpoint"),
])
def test_a_malformed_job_is_refused_naming_the_field(doc, message):
    with pytest.raises(ValueError) as e:
        Job.from_dict(doc)
    assert str(e.value).startswith(message)


def test_a_configuration_survives_the_manifest():
    cfg = RunConfig(backend="jax", model="cnn2d_hard", hparams=HParams(optimizer="nesterov", schedule="step"),
                    data="synthetic:300", devices=2, dtype="float64", perturb_ulp=3, extra={"sync_bn": True})
    assert RunConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert cfg.options == RunOptions(devices=2, dtype="float64", extra={"sync_bn": True})
    with pytest.raises(ValueError, match="run configuration: unknown field"):
        RunConfig.from_dict(dict(cfg.to_dict(), optimiser="sgd"))


def test_file_names_are_the_contract_s(tmp_path):
    (tmp_path / checkpoint_file(10)).parent.mkdir()
    for s in (20, 0, 10):
        (tmp_path / checkpoint_file(s)).write_bytes(b"")
    assert list(checkpoints_in(tmp_path)) == [0, 10, 20]
    assert checkpoints_in(tmp_path / "nothing") == {}
    assert replay_probe_stem(2) == "probe-2" and replay_probe_stem(2, 7) == "probe-2-ulp7"


def test_a_run_regenerates_from_its_manifest_in_another_folder(tmp_path, monkeypatch):
    """Model and data given as relative paths from the user's folder: the manifest stores them absolute, so the
    run's configuration (as seed runs, envelopes and probe jobs rebuild it) reproduces the run's inputs from any
    folder; a model file edited since is replaced by the manifest's own spec (same spec hash)."""
    need("torch")
    from algorithms.spec import load_model
    from harness import runner
    from harness.runs import check_reproduces, config_of, load_run
    user = tmp_path / "user"
    user.mkdir()
    model_file = user / "my_model.toml"
    model_file.write_text(open(load_model("cnn2d_2conv_2fc").source).read().replace('name = "cnn2d_2conv_2fc"',
                                                                                      'name = "mine"'))
    rng = np.random.default_rng(0)
    np.savez(user / "data.npz", x_train=rng.random((200, 8, 8, 1), np.float32), y_train=rng.integers(0, 10, 200),
             x_test=rng.random((50, 8, 8, 1), np.float32), y_test=rng.integers(0, 10, 50))
    monkeypatch.chdir(user)
    cfg = RunConfig(backend="torch", model="my_model.toml", data="data.npz", hparams=HParams(steps=3, eval_every=3))
    folder = runner.execute(cfg, "results")
    man = json.loads((folder / MANIFEST_FILE).read_text())
    assert man["config"]["model"] == str(model_file) and man["config"]["data"] == str(user / "data.npz")
    assert man["options"] == cfg.options.to_dict()

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    run = load_run(folder)
    again = config_of(run.manifest, folder.parent)
    assert again.model == str(model_file)
    assert dataclasses.replace(again, model="my_model.toml", data="data.npz") == cfg
    check_reproduces(run.manifest, again, runner.prepare(again, folder.parent), "the test")

    model_file.write_text(model_file.read_text().replace('name = "mine"', 'name = "edited"'))
    edited = config_of(run.manifest, folder.parent)
    assert edited.model.endswith(f"spec-{man['spec_hash']}.json")
    check_reproduces(run.manifest, edited, runner.prepare(edited, folder.parent), "the test")

    # a Run standing for this one computed by another backend (the arbiter's): its jobs regenerate that backend
    from harness.arbiter import variant
    other = config_of(variant(run, backend="numpy", dtype="float64").manifest, folder.parent)
    assert (other.backend, other.dtype, other.fault, other.data) == ("numpy", "float64", None, str(user / "data.npz"))
