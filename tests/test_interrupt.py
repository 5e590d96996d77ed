"""Ctrl-C and SIGTERM end a command within seconds, with its backend processes, and leave nothing half-done.

Before, an interrupted `duipai all` went on with every queued run (its thread pool waited for them) and recorded
the runs the terminal's Ctrl-C had killed as backend failures; a signal sent to the command alone (a CI job
cancelled) left its backend processes running. The NumPy backend: no framework to import, so the job is running
within a second of its start."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.runner import PROJECT_ROOT

LONG = ["--steps", "20000"]     # minutes of NumPy training: only an interrupt ends it within the test


def children_of(pid: int) -> set[int]:
    """Every live descendant of a process (Linux /proc)."""
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        parents, frontier = frontier, set()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid in parents and int(entry.name) not in found:
                found.add(int(entry.name))
                frontier.add(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def start(cwd: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    return subprocess.Popen([sys.executable, "-m", "harness.cli", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_for_job(proc: subprocess.Popen, out: Path, timeout: float = 120) -> set[int]:
    """Wait until a job was handed to a backend process and that process is training; its process ids."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()
        if list(out.glob("**/.tmp/*/job.json")) and children_of(proc.pid):
            time.sleep(1.5)
            return children_of(proc.pid)
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"no job started within {timeout} s")


def stop(proc: subprocess.Popen, sig: int) -> tuple[int, str, float]:
    t0 = time.time()
    proc.send_signal(sig)           # to the command alone, as `kill` or a CI runner does: not its process group
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the command was still running 60 s after the signal")
    return proc.returncode, err, time.time() - t0


@pytest.mark.parametrize("sig, said", [(signal.SIGINT, "interrupted"), (signal.SIGHUP, "hung up")])
def test_a_signal_ends_a_run_and_its_backend_process_and_keeps_nothing_of_it(tmp_path, sig, said):
    proc = start(tmp_path, "run", "-b", "numpy", *LONG, "--out", "res")
    workers = wait_for_job(proc, tmp_path / "res")
    rc, err, took = stop(proc, sig)
    assert rc == 128 + sig, err
    assert err.strip().splitlines()[-1].startswith(f"duipai: {said}"), err
    assert "Traceback" not in err
    assert took < 30
    time.sleep(0.5)
    assert not [p for p in workers if alive(p)], "a backend process outlived the interrupted command"
    res = tmp_path / "res"
    assert not [p for p in res.iterdir() if not p.name.startswith(".")], "an interrupted run was published"
    assert not list(res.glob(".tmp/*")), "the interrupted run's working folder was left behind"
    assert not (res / ".failed").exists(), "an interrupt is not a backend failure"


def test_sigterm_ends_a_matrix_without_running_its_queued_runs(tmp_path):
    """Three runs at -j 1: the signal comes during the first; the other two never start."""
    (tmp_path / "m.toml").write_text(
        'name = "m"\nmodels = ["cnn2d_2conv_2fc"]\nbackends = ["numpy"]\ndevices = [1, 2]\nseeds = [0, 1]\n'
        'optimizers = ["sgd"]\ndata = "digits"\nsteps = 20000\nbatch_size = 64\n')
    proc = start(tmp_path, "matrix", "m.toml", "-j", "1", "--out", "res")
    workers = wait_for_job(proc, tmp_path / "res")
    rc, err, took = stop(proc, signal.SIGTERM)
    assert rc == 143, err
    assert err.strip().splitlines()[-1].startswith("duipai: terminated"), err
    assert took < 30
    assert " ran " not in err and "failed" not in err, err     # nothing ran to its end, nothing recorded as failed
    time.sleep(0.5)
    assert not [p for p in workers if alive(p)], "a backend process outlived the terminated command"
    runs = tmp_path / "res" / "m" / "runs"
    assert not [p for p in runs.iterdir() if not p.name.startswith(".")] if runs.exists() else True
    assert not list((tmp_path / "res").glob("**/.failed/*"))
