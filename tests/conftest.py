"""Shared fixtures: one results root per session, backend availability, cached torch probes."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

from harness.cli import one_blas_thread  # noqa: E402

one_blas_thread()   # the harness code the tests run in this process, as `duipai` runs it
from wrappers.registry import REGISTRY  # noqa: E402  (no framework imported: entries only)

ALL_BACKENDS = list(REGISTRY)   # every registered backend configuration, as each wrapper declares itself

_SHARED: Path | None = None    # the folder this test run's xdist workers share (pytest_configure), None without xdist


def pytest_configure(config) -> None:
    """JAX's persistent compilation cache, one per test run, shared by the xdist workers and every backend process
    they start (children inherit the environment): the tests start hundreds of jax and keras-jax processes that
    compile the same few steps (`duipai run -b jax -m cnn2d_hard --steps 20`: 11.9 s cold, 4.9 s from the cache,
    the CSV bitwise the same). It lives in the run's own pytest folder (the workers' base temps' parent), which
    pytest rotates; a cache the user set is kept; a run without workers compiles as a user's would."""
    basetemp = getattr(config.option, "basetemp", None)
    if os.environ.get("PYTEST_XDIST_WORKER") and basetemp:
        global _SHARED
        _SHARED = Path(basetemp).parent
        os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(basetemp).parent / "jax-compilation-cache"))
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


@pytest.fixture(scope="session")
def results_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("results")


def _info() -> dict:
    r = subprocess.run([sys.executable, "-m", "wrappers", "info"], capture_output=True, text=True, cwd=ROOT)
    return json.loads(r.stdout)


INFO = _info()


def need(backend: str) -> None:
    """Skip (saying why) when a backend's framework is not installed; CI installs all of them."""
    if INFO[backend]["missing"]:
        pytest.skip(f"{backend}: not installed ({', '.join(INFO[backend]['missing'])})")


def across_workers(tmp_path_factory) -> Path:
    """A folder every pytest-xdist worker of this test run shares (the parent of their base temps), so that
    a result two workers need is made once: `make test` hands a module's tests to both workers now and then,
    and each worker's own session made the Keras collectors twice (measured: 456 s and 300 s for keras-jax)."""
    return _SHARED or tmp_path_factory.getbasetemp()


def duipai_in_process(args: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """The console entry (`duipai ARGS`) in the test process, from the project root: exit code, stdout,
    stderr. For commands that fail on bad input before any backend process would start (a process start
    of the CLI costs 1-3 s; one real-process case per command family stays in the tests)."""
    from harness.cli import entry
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["duipai", *args])
    code = 0
    try:
        entry()
    except SystemExit as exited:
        code = 0 if exited.code is None else exited.code if isinstance(exited.code, int) else 1
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def collected_in_subprocess(module: str, backend: str, folder: Path, cache: dict, timeout: float,
                            parts: tuple[str, ...] = ()) -> dict:
    """What `python -m MODULE BACKEND PATH` pickled into PATH, once per backend and test run: PATH is in
    `folder` (across_workers), under a file lock, so the worker that comes second reads the first one's (a
    framework that must be set up before import, or a Keras backend, needs a process of its own). With `parts`,
    one process per part at once (`python -m MODULE BACKEND PATH PART`), their dicts merged: the second worker,
    waiting on the lock, lends its core. A failed collector is remembered and reported once per test, not re-run."""
    from filelock import FileLock
    need(backend)
    if backend not in cache:
        path = Path(folder) / f"collect-{module.rsplit('.', 1)[-1]}-{backend}.pkl"
        failed = path.with_suffix(".failed")
        with FileLock(str(path) + ".lock"):
            if not path.exists() and not failed.exists():
                _run_collector(module, backend, path, failed, parts, timeout)
        if failed.exists():
            cache[backend] = {"error": failed.read_text()}
        else:
            with open(path, "rb") as f:
                cache[backend] = pickle.load(f)
    if "error" in cache[backend]:
        pytest.fail(cache[backend]["error"])
    return cache[backend]


def _run_collector(module: str, backend: str, path: Path, failed: Path, parts: tuple[str, ...],
                   timeout: float) -> None:
    """The collector's processes, all at once; PATH holds the merged result, or FAILED says why not."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    outs = {part: path.with_name(f"{path.stem}-{part}.pkl") if part else path for part in parts or ("",)}
    logs = {part: out.with_suffix(".stderr") for part, out in outs.items()}   # a file: a full pipe would stall it
    procs: dict[str, subprocess.Popen] = {}
    errors = []
    try:
        for part, out in outs.items():
            with open(logs[part], "w") as log:
                procs[part] = subprocess.Popen([sys.executable, "-m", module, backend, str(out),
                                                *([part] if part else [])],
                                               cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + timeout
        for part, proc in procs.items():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                err = logs[part].read_text()[-4000:]
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                err = f"timed out after {timeout:g} s\n" + logs[part].read_text()[-4000:]
            if proc.returncode != 0:
                errors.append(f"collector for {backend}{f' (part {part})' if part else ''} failed:\n{err}")
    finally:   # interrupted (Ctrl-C, a worker torn down): no collector left running
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if errors:
        path.unlink(missing_ok=True)
        failed.write_text("\n".join(errors))
    elif parts:
        merged: dict = {}
        for out in outs.values():
            with open(out, "rb") as f:
                merged.update(pickle.load(f))
        with open(path, "wb") as f:
            pickle.dump(merged, f)


_PROBES: dict = {}


def data_for(model: str) -> str:
    """The built-in data set of the model's input shape: digits (8x8x1) or digits32 (32x32x3)."""
    from algorithms.spec import load_model
    return "digits32" if load_model(model).input_shape == (32, 32, 3) else "digits"


def probes_for(backend: str, model: str, root: Path, fault: str | None = None, cases: dict | None = None,
               dtype: str = "float32"):
    """Probe results per standard case, computed once per (backend, model, fault, cases, dtype) per test run:
    under xdist in a folder both workers share, under a file lock (the torch reference probes of test_probes,
    and the single-case probes test_fault_detection and the TF lowering test share, went to both workers)."""
    import hashlib

    from filelock import FileLock

    from harness.probes import run_cases, standard_cases
    # the cases' contents, not only their names: two tests may use the same names with other batches or seeds
    key = (backend, model, fault, tuple((n, json.dumps(hp.to_dict(), sort_keys=True)) for n, hp in cases.items())
           if cases else None, dtype)
    if key not in _PROBES:
        need(backend)
        run = lambda where: run_cases(backend, model, cases or standard_cases(), where, fault=fault, dtype=dtype,
                                      data=data_for(model))
        if _SHARED is None:
            _PROBES[key] = run(root)
        else:
            folder = _SHARED / "probes" / hashlib.sha256(repr(key).encode()).hexdigest()[:16]
            folder.mkdir(parents=True, exist_ok=True)
            done = folder / "probes.pkl"
            with FileLock(str(folder) + ".lock"):
                if not done.exists():
                    with open(done.with_suffix(".tmp"), "wb") as f:
                        pickle.dump(run(folder), f)
                    done.with_suffix(".tmp").replace(done)
            with open(done, "rb") as f:
                _PROBES[key] = pickle.load(f)
    return _PROBES[key]
