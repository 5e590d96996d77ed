"""The training loop (wrappers/worker.py run_train) in this process, on the NumPy backend: each checkpoint holds
the state of its own step, a checkpoint that cannot be written fails the run, and the row columns it formats
once before the loop (step, epoch, lr, batch checksum) are those of each step.
"""
from __future__ import annotations

import csv
import io

import numpy as np
import pytest

from algorithms import data as D
from algorithms.contract import CHECKPOINT_DIR, Job, checkpoint_file, split_state
from algorithms.optim import HParams, lr_at
from algorithms.params import init_params, load_npz, save_npz
from algorithms.spec import load_model
from wrappers import worker
from wrappers.registry import REGISTRY

MODEL = "cnn2d_2conv_2fc"


def _job(tmp_path, hp: HParams) -> Job:
    model = load_model(MODEL)
    rng = np.random.default_rng(0)
    n = 64
    arrays = {"x_train": rng.random((n, *model.input_shape)).astype(np.float32),
              "y_train": rng.integers(0, model.num_classes, n).astype(np.int32),
              "x_test": rng.random((16, *model.input_shape)).astype(np.float32),
              "y_test": rng.integers(0, model.num_classes, 16).astype(np.int32)}
    save_npz(tmp_path / "data.npz", arrays)
    np.save(tmp_path / "order.npy", np.stack([rng.permutation(n)[:hp.batch_size] for _ in range(hp.steps)]))
    save_npz(tmp_path / "init.npz", init_params(model, 0))
    out = tmp_path / "run"
    out.mkdir()
    return Job(mode="train", backend="numpy", model=model.to_dict(), model_source=MODEL, hparams=hp,
               data=str(tmp_path / "data.npz"), order=str(tmp_path / "order.npy"), params=str(tmp_path / "init.npz"),
               out=str(out))


def _backend(job: Job):
    b = worker.build_backend(job, REGISTRY["numpy"].load())
    b.name = "numpy"
    return b


def test_each_checkpoint_holds_its_own_steps_state_and_the_rows_their_columns(tmp_path):
    hp = HParams(steps=6, batch_size=8, checkpoint_every=2, eval_every=3, lr=0.05, schedule="step", step_size=2,
                 gamma=0.5, optimizer="momentum")
    job = _job(tmp_path, hp)
    worker.run_train(job, _backend(job), tmp_path / "run", io.StringIO())
    # the same steps by hand, without the loop: the state after each step, exported at once
    b = _backend(job)
    arrays = load_npz(job.data)
    order = np.load(job.order)
    b.load_params(load_npz(job.params))
    want = {0: b.export_params()}
    for s in range(hp.steps):
        b.train_step(s, arrays["x_train"][order[s]], arrays["y_train"][order[s]], {})
        want[s + 1] = b.export_params()
    for step in (0, 2, 4, 6):
        params, _ = split_state(load_npz(tmp_path / "run" / checkpoint_file(step)))
        assert set(params) == set(want[step])
        for k, v in params.items():
            assert v.tobytes() == want[step][k].tobytes(), (step, k)
    assert sorted(p.name for p in (tmp_path / "run" / CHECKPOINT_DIR).iterdir()) == sorted(
        checkpoint_file(s).split("/")[-1] for s in (0, 2, 4, 6))
    with open(tmp_path / "run" / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(hp.steps))
    for s, r in enumerate(rows):
        assert int(r["epoch"]) == D.epoch_of(s, 64, hp.batch_size)
        assert float(r["lr"]) == lr_at(hp, s)
        assert r["batch_checksum"] == D.batch_checksum(arrays["x_train"][order[s]], arrays["y_train"][order[s]])


def test_a_checkpoint_that_cannot_be_written_fails_the_run(tmp_path, monkeypatch):
    hp = HParams(steps=4, batch_size=8, checkpoint_every=2)
    job = _job(tmp_path, hp)

    def full_disk(path, arrays):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(worker, "save_npz", full_disk)
    with pytest.raises(OSError, match="No space left"):
        worker.run_train(job, _backend(job), tmp_path / "run", io.StringIO())
    assert not any((tmp_path / "run" / CHECKPOINT_DIR).iterdir())
