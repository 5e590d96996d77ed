"""Warm backend processes: a process that ran one job runs the next job of the same configuration.

Every job of a backend runs in a process of its own (`python -m wrappers serve`), never in the
harness's. Starting one costs its framework's import, 2-7 s on a 2-core machine, and that was most of
`make all`'s time (its 17 runs and 15 replays each trained for 1-4 s; docs/measurements.md). So a
process that finished a job cleanly waits for the next job with the same backend and the same
options (what a framework fixes when it is first used: environment, device count, precision,
fault), and runs it exactly as a fresh one would; a job that fails, times out or crashes ends its
process. DUIPAI_FRESH_PROCESSES=1 gives every job a process of its own, as before.

Each process leads a process group of its own, so that the harness, not the terminal, decides when it ends:
a timeout or an interrupt kills the whole group (a multi-process job's launcher with it; torchrun's ranks,
in sessions of their own, end with their agents' pipes), and `interrupt()` stops every running job at once
when the command is interrupted (Ctrl-C, SIGTERM, SIGHUP).
"""
from __future__ import annotations

import atexit
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .errors import Interrupted

# idle processes kept at most (the least recently used one ends first), and the memory they may hold
# together: a TensorFlow or Keras process holds 0.3-0.55 GB, a NumPy one 0.04 GB
MAX_IDLE = max(0, int(os.environ.get("DUIPAI_WARM_PROCESSES", "12")))
# jobs one process runs at most before it is replaced: what a framework keeps between jobs stays bounded
MAX_JOBS = 64
FRESH_ENV = "DUIPAI_FRESH_PROCESSES"
# set once the command is interrupted: no job starts after it, and every running one is killed
_STOPPING = threading.Event()
_RUNNING: set[subprocess.Popen] = set()
_RUNNING_LOCK = threading.RLock()   # re-entrant: `interrupt` (a signal handler) may run while its thread holds it


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL a job's process and every process it started (its group); never one already reaped (its number may
    then be another process's)."""
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()


def kill(proc: subprocess.Popen) -> None:
    """Kill a job's process group and reap the process."""
    _kill_group(proc)
    proc.wait()


def _register(proc: subprocess.Popen) -> None:
    """A job's process is running: `interrupt` kills it from now on; Interrupted if the command already was
    (after `interrupt` looked, so it did not see this one)."""
    with _RUNNING_LOCK:
        _RUNNING.add(proc)
    if _STOPPING.is_set():
        raise Interrupted()


def _unregister(proc: subprocess.Popen) -> None:
    """The job's process is done with (before it is reaped: `interrupt` never signals a reaped one)."""
    with _RUNNING_LOCK:
        _RUNNING.discard(proc)


def interrupt() -> None:
    """The command was interrupted: no further job starts (`run_job` raises Interrupted), every running job's
    process group is killed now, and the idle processes end. Safe to call from a signal handler."""
    _STOPPING.set()
    with _RUNNING_LOCK:      # held while signalling: a job's thread takes its process out before reaping it
        for proc in _RUNNING:
            _kill_group(proc)
    if _POOL is not None:
        _POOL.close(grace_s=0.0)


def memory_budget() -> int:
    """Bytes the idle processes may hold together: DUIPAI_WARM_MEMORY_GB, else a quarter of this machine's
    memory (0 where it cannot be read: then only MAX_IDLE bounds them)."""
    if os.environ.get("DUIPAI_WARM_MEMORY_GB"):
        return int(float(os.environ["DUIPAI_WARM_MEMORY_GB"]) * 2**30)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError, AttributeError):
        return 0


def resident_bytes(pid: int) -> int:
    """A process's resident memory (Linux /proc; 0 where it cannot be read)."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def stream_progress(proc: subprocess.Popen, on_progress: Callable[[dict], None] | None, deadline: float | None) -> dict:
    """A job's progress lines until its {"exit": code} line or the end of the process's output, merged into one
    dict. The process is killed at `deadline` even when it prints nothing (a running job reports every 0.2 s or
    so; a hung one never again), so the lines are read by a thread and waited for with the time left."""
    last: dict[str, Any] = {}
    assert proc.stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()
    stdout = proc.stdout

    def pump() -> None:    # stops at the job's exit line: the process's next job is read by the next pump
        for line in stdout:
            lines.put(line)
            if line.startswith('{"exit"'):
                break
        lines.put(None)
    threading.Thread(target=pump, daemon=True).start()
    while True:
        try:
            line = lines.get(timeout=None if deadline is None else max(0.0, deadline - time.time()))
        except queue.Empty:
            line = ""
        if line is None:
            break
        if deadline and time.time() > deadline:
            kill(proc)
            last["timeout"] = True
            break
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            continue
        last.update(msg)
        if on_progress and "step" in msg:
            on_progress(msg)
    return last


@dataclass
class Worker:
    key: str
    proc: subprocess.Popen
    jobs: int = 0      # jobs it ran before the current one


class Pool:
    """The idle warm processes by configuration; thread-safe (a matrix runs its jobs from a thread pool)."""

    def __init__(self, command: list[str], cwd: Path):
        self.command, self.cwd = command, cwd
        self.idle: list[Worker] = []       # least recently used first
        self.lock = threading.RLock()      # re-entrant: `interrupt` may run while this thread holds it

    def take(self, key: str, env: dict[str, str]) -> Worker:
        with self.lock:
            for i in range(len(self.idle) - 1, -1, -1):
                w = self.idle[i]
                if w.key == key:
                    del self.idle[i]
                    if w.proc.poll() is None:
                        return w
        return self.start(key, env)

    def start(self, key: str, env: dict[str, str]) -> Worker:
        proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, cwd=self.cwd, env=env, start_new_session=True)
        return Worker(key, proc)

    def give_back(self, w: Worker, reusable: bool) -> None:
        w.jobs += 1
        if not reusable or os.environ.get(FRESH_ENV) == "1" or w.jobs >= MAX_JOBS:
            end(w)
            return
        with self.lock:
            self.idle.append(w)
            n = max(0, len(self.idle) - MAX_IDLE)     # the least recently used beyond the count, then the memory
            budget, held = memory_budget(), [resident_bytes(x.proc.pid) for x in self.idle]
            while budget and n < len(self.idle) - 1 and sum(held[n:]) > budget:
                n += 1
            surplus = self.idle[:n]
            del self.idle[:n]
        end(*surplus)

    def close(self, grace_s: float = 5.0) -> None:
        with self.lock:
            workers, self.idle = self.idle, []
        end(*workers, grace_s=grace_s)


def end(*workers: Worker, grace_s: float = 5.0) -> None:
    """End processes: an idle one exits at the end of its input (all are told at once); one that has not within
    `grace_s` is killed."""
    for w in workers:
        try:
            if w.proc.stdin:
                w.proc.stdin.close()
        except OSError:
            pass
    deadline = time.time() + grace_s
    for w in workers:
        try:
            w.proc.wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            kill(w.proc)


def send(w: Worker, request: str) -> bool:
    """Hand a process its next job; False when it has ended (its input closed)."""
    assert w.proc.stdin is not None
    try:
        w.proc.stdin.write(request)
        w.proc.stdin.flush()
        return True
    except OSError:
        return False


def run_job(pool: Pool, configuration: str, env: dict[str, str], job_file: Path, log_file: Path,
            on_progress: Callable[[dict], None] | None, deadline: float | None,
            fresh: bool = False) -> tuple[int, dict[str, Any], int]:
    """Run one job in a warm process of this configuration and environment, or in a new one (always, when
    `fresh`; afterwards it may serve other jobs): (exit code, its merged progress messages, how many jobs that
    process ran before). -9: killed at the deadline. Interrupted once the command is (`interrupt`)."""
    if _STOPPING.is_set():
        raise Interrupted()
    key = json.dumps([configuration, env], sort_keys=True)
    w = pool.start(key, env) if fresh else pool.take(key, env)
    request = json.dumps({"job": str(job_file), "log": str(log_file)}) + "\n"
    try:
        _register(w.proc)
        if not send(w, request):    # it ended while idle (after `take` looked): a new one
            _unregister(w.proc)
            end(w)
            w = pool.start(key, env)
            _register(w.proc)
            send(w, request)
        last = stream_progress(w.proc, on_progress, deadline)
        if _STOPPING.is_set():      # killed by `interrupt`: no exit code of the job's own
            raise Interrupted()
    except BaseException:
        _unregister(w.proc)
        kill(w.proc)
        raise
    _unregister(w.proc)
    before = w.jobs
    if last.get("timeout"):       # killed by stream_progress; give_back reaps it
        pool.give_back(w, reusable=False)
        return -9, last, before
    if "exit" in last:
        rc = int(last["exit"])
    else:                                   # it died: its own exit code (a crash's signal), never 0
        rc = w.proc.wait() or 1
    pool.give_back(w, reusable=rc == 0)
    return rc, last, before


_POOL: Pool | None = None
_POOL_LOCK = threading.Lock()


def shared_pool(cwd: Path) -> Pool:
    """This harness process's pool (made at its first job; its idle processes end when the harness exits)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = Pool([sys.executable, "-m", "wrappers", "serve"], cwd)
            atexit.register(_POOL.close)
        return _POOL
