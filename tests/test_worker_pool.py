"""Warm backend processes (harness.worker_pool, `python -m wrappers serve`): a job run in a process that ran
another job first gives what a fresh process gives, bit for bit; a training run always starts a new process;
a process serves one configuration and environment; a job that fails ends its process;
DUIPAI_FRESH_PROCESSES=1 gives every job its own."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from algorithms.contract import Job, Replay, RunConfig, checkpoint_file
from algorithms.optim import HParams
from algorithms.params import load_npz
from harness import runner, worker_pool

from .conftest import ROOT, need

def config(backend: str, seed: int = 0, **kw) -> RunConfig:
    return RunConfig(backend=backend, hparams=HParams(steps=12, eval_every=6, checkpoint_every=6, seed=seed), **kw)


def process_of(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())["process"]


def replay_of(run: Path) -> Replay:
    """Steps 0, 3, 6 and 9 of a 12-step run from its checkpoints at 0, 6 and 12: 3 and 9 re-trained first."""
    return Replay([0, 3, 6, 9], checkpoints={c: str(run / checkpoint_file(c)) for c in (0, 6, 12)},
                  perturb_state_ulps=[None, 1])


def same_replay(a: Path, b: Path) -> None:
    wa, wb = (json.loads((x / "worker.json").read_text()) for x in (a, b))
    assert wa["replayed"] == wb["replayed"] and len(wa["replayed"]) == 6      # steps 0-2 and 6-8 re-trained
    files = sorted(x.name for x in a.glob("*.npz"))
    assert files == sorted(x.name for x in b.glob("*.npz")) and len(files) >= 8
    for f in files:
        pa, pb = load_npz(a / f), load_npz(b / f)
        assert pa.keys() == pb.keys() and all(np.array_equal(pa[k], pb[k]) for k in pa), f


# torch's case is the slowest (22 s of the suite's 15 min); numpy and jax keep the property in `make test`
@pytest.mark.parametrize("backend", ["numpy", pytest.param("torch", marks=pytest.mark.slow), "jax"])
def test_a_replay_in_a_warm_process_is_what_a_fresh_one_computes(backend, tmp_path, monkeypatch):
    """Training runs start in a new process each (nothing of an earlier job can reach them); the replay of a
    run after it then runs in that warm process, and every replayed step, state and probe is bitwise what the
    same replay computes in a fresh process."""
    need(backend)
    other = runner.execute(config(backend, seed=1), tmp_path / "warm", "other")
    run = runner.execute(config(backend), tmp_path / "warm", "run")
    assert process_of(run)["jobs_before"] == 0 and process_of(run)["pid"] != process_of(other)["pid"]
    warm = runner.execute(config(backend), tmp_path / "warm", "replay", mode="replay", replay=replay_of(run))
    assert process_of(warm)["jobs_before"] >= 1 and process_of(warm)["pid"] in (process_of(run)["pid"],
                                                                                 process_of(other)["pid"])
    monkeypatch.setenv(worker_pool.FRESH_ENV, "1")
    fresh = runner.execute(config(backend), tmp_path / "fresh", "replay", mode="replay", replay=replay_of(run))
    assert process_of(fresh)["jobs_before"] == 0 and process_of(fresh)["pid"] != process_of(warm)["pid"]
    same_replay(warm, fresh)
    # with fresh processes none is kept: the next job starts another
    again = runner.execute(config(backend), tmp_path / "fresh", "again", mode="probe")
    assert process_of(again)["jobs_before"] == 0 and process_of(again)["pid"] != process_of(fresh)["pid"]


def test_a_training_run_and_a_self_replay_start_in_a_new_process(tmp_path):
    need("numpy")
    a = runner.execute(config("numpy"), tmp_path, "a")
    probe = runner.execute(config("numpy"), tmp_path, "probe", mode="probe")
    assert process_of(probe)["jobs_before"] >= 1
    b = runner.execute(config("numpy"), tmp_path, "b")
    assert process_of(b)["jobs_before"] == 0 and process_of(b)["pid"] not in (process_of(a)["pid"],
                                                                              process_of(probe)["pid"])
    self_replay = runner.execute(config("numpy"), tmp_path, "self", mode="replay", replay=replay_of(b),
                                 fresh_process=True)
    assert process_of(self_replay)["jobs_before"] == 0 and process_of(self_replay)["pid"] != process_of(b)["pid"]


def test_other_options_or_environment_get_another_process(tmp_path, monkeypatch):
    """What a framework fixes at its first use comes from the options and the environment: a job that differs
    in either never runs in a process made for another."""
    need("numpy")
    a = runner.execute(config("numpy"), tmp_path, "a", mode="probe")
    b = runner.execute(config("numpy", devices=2), tmp_path, "b", mode="probe")
    assert process_of(b)["pid"] != process_of(a)["pid"]
    monkeypatch.setenv("DUIPAI_TEST_SOMETHING", "1")
    c = runner.execute(config("numpy"), tmp_path, "c", mode="probe")
    assert process_of(c)["pid"] not in (process_of(a)["pid"], process_of(b)["pid"])
    monkeypatch.delenv("DUIPAI_TEST_SOMETHING")
    d = runner.execute(config("numpy"), tmp_path, "d", mode="probe")
    assert process_of(d)["pid"] == process_of(a)["pid"]


def serve() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "wrappers", "serve"], cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env=runner._child_env())


def job_file(tmp_path: Path, name: str, **options) -> Path:
    """A numpy probe job from the runner's own files (prepare), with these options."""
    cfg = config("numpy", **options)
    prep = runner.prepare(cfg, tmp_path)
    folder = tmp_path / name
    folder.mkdir()
    np.save(folder / "order.npy", prep.order)
    from algorithms.params import save_npz
    save_npz(folder / "init.npz", prep.params)
    job = Job(mode="probe", backend="numpy", model=prep.model.to_dict(), model_source=prep.model.source,
              hparams=cfg.hparams, data=str(prep.dataset_path), order=str(folder / "order.npy"),
              params=str(folder / "init.npz"), out=str(folder), options=cfg.options)
    job.write(folder / "job.json")
    return folder / "job.json"


def ask(proc: subprocess.Popen, job: Path, log: Path) -> int:
    assert proc.stdin and proc.stdout
    proc.stdin.write(json.dumps({"job": str(job), "log": str(log)}) + "\n")
    proc.stdin.flush()
    return worker_pool.stream_progress(proc, None, None)["exit"]


def test_serve_runs_one_configuration_and_ends_at_a_failure(tmp_path):
    need("numpy")
    proc = serve()
    try:
        assert ask(proc, job_file(tmp_path, "a"), tmp_path / "a.log") == 0
        assert (tmp_path / "a" / "worker.json").is_file() and proc.poll() is None
        # another configuration: refused (exit 2, said in that job's log), and the process ends
        assert ask(proc, job_file(tmp_path, "b", devices=2), tmp_path / "b.log") == 2
        assert "a warm process serves one configuration" in (tmp_path / "b.log").read_text()
        assert proc.wait(timeout=30) == 2
    finally:
        proc.kill()
    proc = serve()
    try:   # a job that fails (its data file gone) ends its process too, its traceback in its own log
        bad = job_file(tmp_path, "c")
        Path(Job.read(bad).data).unlink()
        assert ask(proc, bad, tmp_path / "c.log") == 1
        assert "Traceback" in (tmp_path / "c.log").read_text()
        assert proc.wait(timeout=30) == 1
    finally:
        proc.kill()


def test_a_crashed_warm_process_fails_its_job_only(tmp_path):
    """A process that dies while idle is replaced; one that dies in a job fails that job with its exit code."""
    need("numpy")
    pool = worker_pool.Pool([sys.executable, "-m", "wrappers", "serve"], ROOT)
    env = runner._child_env()
    try:
        rc, _, before = worker_pool.run_job(pool, "k", env, job_file(tmp_path, "a"), tmp_path / "a.log", None, None)
        assert (rc, before) == (0, 0) and len(pool.idle) == 1
        pool.idle[0].proc.kill()
        pool.idle[0].proc.wait()
        rc, _, before = worker_pool.run_job(pool, "k", env, job_file(tmp_path, "b"), tmp_path / "b.log", None, None)
        assert (rc, before) == (0, 0)
        crash = [sys.executable, "-c", "import os, sys; sys.stdin.readline(); os._exit(7)"]
        pool.command = crash
        rc, last, _ = worker_pool.run_job(pool, "other", env, job_file(tmp_path, "c"), tmp_path / "c.log", None, None)
        assert rc == 7 and "exit" not in last
        assert [w.key for w in pool.idle] == [json.dumps(["k", env], sort_keys=True)]   # the crash kept nothing
    finally:
        pool.close()


def test_idle_processes_are_ended_beyond_the_memory_budget(tmp_path, monkeypatch):
    """The least recently used idle process ends first once the idle ones hold more than
    DUIPAI_WARM_MEMORY_GB together; the one that just finished always stays."""
    need("numpy")
    pool = worker_pool.Pool([sys.executable, "-m", "wrappers", "serve"], ROOT)
    env = runner._child_env()
    try:
        worker_pool.run_job(pool, "a", env, job_file(tmp_path, "a"), tmp_path / "a.log", None, None)
        worker_pool.run_job(pool, "b", env, job_file(tmp_path, "b"), tmp_path / "b.log", None, None)
        assert len(pool.idle) == 2        # the default budget (a quarter of the memory) holds two NumPy processes
        first = pool.idle[0].proc
        monkeypatch.setenv("DUIPAI_WARM_MEMORY_GB", "0.001")
        worker_pool.run_job(pool, "c", env, job_file(tmp_path, "c"), tmp_path / "c.log", None, None)
        assert [w.key for w in pool.idle] == [json.dumps(["c", env], sort_keys=True)]
        assert first.poll() is not None
    finally:
        pool.close()


def test_a_source_edited_between_two_jobs_gets_a_new_process(tmp_path):
    """A harness used as a library (a notebook, a test session) may edit a wrapper between two jobs: a warm
    process holds the code it imported, so a job after the edit runs in a new one."""
    need("numpy")
    a = runner.execute(config("numpy"), tmp_path, "a", mode="probe")
    b = runner.execute(config("numpy"), tmp_path, "b", mode="probe")
    assert process_of(b)["pid"] == process_of(a)["pid"]
    source = next(Path(f) for f in runner.backend_info()["numpy"]["sources"] if "/wrappers/numpy/" in f)
    stat = source.stat()
    try:
        os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
        c = runner.execute(config("numpy"), tmp_path, "c", mode="probe")
        assert process_of(c)["pid"] != process_of(a)["pid"]
    finally:
        os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_a_job_that_survived_a_failure_ends_its_process_after_it(tmp_path, monkeypatch, capsys):
    """A replay whose report step failed returns its probes (exit 0) but its framework may be left in any state:
    serve answers that job and runs no further one in that process."""
    import io

    import wrappers.__main__ as entry
    import wrappers.worker as worker
    ran = []

    def fake_main(argv):
        ran.append(argv[1])
        worker.LEFT_IN_DOUBT.append("RuntimeError: a report step failed")
        return 0
    monkeypatch.setattr(entry, "main", fake_main)
    monkeypatch.setattr(worker, "LEFT_IN_DOUBT", [])
    lines = "".join(json.dumps({"job": str(tmp_path / f"{n}.json"), "log": str(tmp_path / f"{n}.log")}) + "\n"
                    for n in ("a", "b"))
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    assert entry.serve() == 0
    assert ran == [str(tmp_path / "a.json")]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {"exit": 0}
