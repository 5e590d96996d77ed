"""The runner through the real command line: results, manifests, determinism, atomicity, bad input."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from .conftest import ROOT, duipai_in_process, need

NAME = "cnn2d_2conv_2fc__torch__momentum-constant__s0"


def duipai(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, **(env or {})}, timeout=timeout)


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory):
    need("torch")
    out = tmp_path_factory.mktemp("runs")
    r = duipai("run", "-b", "torch", "--steps", "60", "--out", str(out))
    assert r.returncode == 0, r.stderr
    return out


def test_run_writes_csv_log_manifest(torch_run):
    d = torch_run / NAME
    steps = pd.read_csv(d / "steps.csv")
    assert list(steps.columns) == ["step", "epoch", "loss", "accuracy", "grad_norm", "update_norm", "param_norm",
                                   "lr", "batch_checksum", "step_time_s"]
    assert len(steps) == 60 and steps["step"].tolist() == list(range(60))
    assert steps["loss"].iloc[-1] < steps["loss"].iloc[0]
    ev = pd.read_csv(d / "eval.csv")
    assert ev["step"].tolist() == [0, 50, 60]
    m = json.loads((d / "manifest.json").read_text())
    for key in ("spec_hash", "data_hash", "weights_hash", "hparams", "versions", "devices", "determinism", "host"):
        assert m[key], key
    assert m["status"] == "complete" and m["versions"]["torch"].startswith("2.")
    assert m["determinism"]["use_deterministic_algorithms"] is True and m["determinism"]["num_threads"] == 1
    assert m["determinism"]["fill_uninitialized_memory"] is False   # deterministic without the NaN fill, and said so
    assert (d / "run.log").exists() and (d / "checkpoints" / "step_0000050.npz").exists()


def test_floats_round_trip_exactly(torch_run):
    text = (torch_run / NAME / "steps.csv").read_text().splitlines()[1].split(",")
    loss = float(text[2])
    assert repr(loss) == text[2]                      # the shortest repr: parsing gives back the same double


def test_rerun_is_bit_identical(torch_run, tmp_path):
    r = duipai("run", "-b", "torch", "--steps", "60", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    a = (torch_run / NAME / "steps.csv").read_text().splitlines()
    b = (tmp_path / NAME / "steps.csv").read_text().splitlines()
    cols = lambda rows, i: [row.split(",")[i] for row in rows]  # noqa: E731
    assert cols(a, 2) == cols(b, 2) and cols(a, 4) == cols(b, 4)   # loss and grad_norm, as text


@pytest.mark.slow    # 12.5 s; torch's rerun above and the bitwise baseline checks stay in `make test`
def test_jax_rerun_is_bit_identical(tmp_path):
    need("jax")
    cols = []
    for out in ("a", "b"):
        r = duipai("run", "-b", "jax", "--steps", "30", "--out", str(tmp_path / out))
        assert r.returncode == 0, r.stderr
        s = pd.read_csv(next((tmp_path / out).glob("*jax*")) / "steps.csv", dtype=str)
        cols.append((s["loss"].tolist(), s["grad_norm"].tolist()))
    assert cols[0] == cols[1]


BAD_SPEC = """name = "bad"
input_shape = [8, 8, 1]
num_classes = 10
[[layers]]
type = "conv2d"
filters = 4
kernel = 11
[[layers]]
type = "flatten"
[[layers]]
type = "dense"
units = 10
"""


@pytest.mark.parametrize("args,needle", [
    (["-m", "no_such_model"], "unknown model 'no_such_model'"),
    (["-m", "{tmp}/missing.toml"], "no such file"),
    (["-m", "{tmp}/malformed.toml"], "not valid TOML"),
    (["-m", "{tmp}/unknown_layer.toml"], "layer 0 (conv9d): field 'type': unknown layer type"),
    (["-m", "{tmp}/impossible.toml"], "layer 0 (conv2d): field 'kernel': window 11 is larger than the input 8x8"),
    (["--optimizer", "rmsprop"], "'rmsprop' is not one of"),
    (["-b", "mxnet"], "unknown backend 'mxnet'"),
    (["--data", "{tmp}/nothing.csv"], "no such data file"),
    (["--batch-size", "5000"], "digits: batch size 5000 is larger than the train set (1438 samples)"),
    (["--lr", "-1"], "hyper-parameter 'lr'"),
    (["--data", "synthetic:abc"], "data 'synthetic:abc': synthetic takes a sample count"),
    (["--name", "../escaped"], "--name must be a plain folder name (no '/', not '.' or '..'), got '../escaped'"),
    (["--seed", "-1"], "hyper-parameter 'seed': must be a non-negative integer, got -1"),
    (["--weight-decay", "nan"], "hyper-parameter 'weight_decay': must be a finite number >= 0, got nan"),
    (["--perturb-ulp", "-1"], "--perturb-ulp must be a non-negative seed, got -1"),
    (["--timeout", "0"], "Invalid value for '--timeout': 0.0 is not in the range x>0."),   # was: "timed out"
])
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, args, needle, capsys, monkeypatch):
    """The console entry in this process (every case fails before a backend process would start); the test
    below runs one case as a real process."""
    (tmp_path / "malformed.toml").write_text("name = 'x'\n[[layers]\n")
    (tmp_path / "unknown_layer.toml").write_text(BAD_SPEC.replace('"conv2d"', '"conv9d"'))
    (tmp_path / "impossible.toml").write_text(BAD_SPEC)
    out = tmp_path / "out"
    code, _, stderr = duipai_in_process(["run", *[a.replace("{tmp}", str(tmp_path)) for a in args],
                                         "--steps", "5", "--out", str(out)], monkeypatch, capsys)
    assert code == 2, stderr
    assert needle in stderr
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) <= 2
    assert not [p for p in out.glob("*") if not p.name.startswith(".")] if out.exists() else True


def test_bad_input_from_the_command_line_is_one_line_exit_2(tmp_path):
    r = duipai("run", "--lr", "-1", "--steps", "5", "--out", str(tmp_path / "out"))
    assert r.returncode == 2 and r.stderr.startswith("duipai: error: hyper-parameter 'lr'"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("backend,package", [("torch", "torch"), ("keras-jax", "jax"), ("keras-tensorflow", "tensorflow")])
def test_backend_not_installed_is_bad_input(tmp_path, backend, package):
    # a child interpreter in which the package cannot be found: importlib.util.find_spec says None, as for a
    # missing package (for keras-*: Keras present, the framework under it missing)
    (tmp_path / "sitecustomize.py").write_text(
        "import importlib.util as u\n_f = u.find_spec\n"
        f"u.find_spec = lambda name, *a: None if name.split('.')[0] == {package!r} else _f(name, *a)\n")
    env = {"PYTHONPATH": str(tmp_path)}
    r = duipai("run", "-b", backend, "--steps", "5", "--out", str(tmp_path / "out"), env=env)
    assert r.returncode == 2, r.stderr
    assert f"backend '{backend}' is not installed: missing Python package(s) {package}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_timeout_keeps_log_and_publishes_nothing(tmp_path):
    need("torch")
    r = duipai("run", "-b", "torch", "--steps", "100000", "--timeout", "4", "--out", str(tmp_path))
    assert r.returncode == 3, r.stderr
    assert "timed out" in r.stderr and "run.log" in r.stderr
    assert not (tmp_path / "cnn2d_2conv_2fc__torch__momentum-constant__s0").exists()
    failed = list((tmp_path / ".failed").glob("*/run.log"))
    assert len(failed) == 1


def test_more_steps_than_memory_is_bad_input(tmp_path):
    """The batch order is made before the run: one that cannot be held is one line naming the fields, exit 2."""
    r = duipai("run", "-b", "numpy", "--steps", str(10**11), "--out", str(tmp_path))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "--steps 100000000000 x batch size 64: the batch order (47683.7 GiB) does not fit in memory" in r.stderr
    assert not list(tmp_path.glob("*/manifest.json"))


def test_a_silent_worker_is_killed_at_the_deadline():
    """The timeout holds for a worker that prints nothing (a long run reports every 0.2 s, a hung one
    never): it was once checked only when a progress line came. Lines before the deadline are still read."""
    from harness.worker_pool import stream_progress
    code = "import json, time; print(json.dumps({'step': 1, 'of': 9}), flush=True); time.sleep(120)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    seen: list[dict] = []
    t0 = time.time()
    last = stream_progress(proc, seen.append, t0 + 2.0)
    assert proc.wait(timeout=30) != 0 and last["timeout"] and seen == [{"step": 1, "of": 9}]
    assert time.time() - t0 < 60        # not the 120 s the worker would have slept


def test_killed_run_leaves_no_complete_looking_result(tmp_path):
    need("torch")
    p = subprocess.Popen([sys.executable, "-m", "harness.cli", "run", "--steps", "100000", "--out", str(tmp_path)],
                         cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 60
    while time.time() < deadline and not list((tmp_path / ".tmp").glob("*/steps.csv")):
        time.sleep(0.2)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    assert list((tmp_path / ".tmp").glob("*/steps.csv")), "the run never started"
    assert not (tmp_path / NAME).exists()
    assert not list(tmp_path.glob("*/manifest.json"))


def test_rerun_replaces_result_atomically_and_keeps_a_run_of_another_configuration(torch_run, tmp_path):
    """The same configuration again replaces its folder; a run of another configuration under the same name
    (more steps here) is moved to .replaced/, not lost, and the warning says what differs."""
    r = duipai("run", "-b", "torch", "--steps", "20", "--out", str(tmp_path), "--name", "x")
    r = duipai("run", "-b", "torch", "--steps", "30", "--out", str(tmp_path), "--name", "x")
    assert r.returncode == 0
    assert len(pd.read_csv(tmp_path / "x" / "steps.csv")) == 30
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".old-")]
    kept = list((tmp_path / ".replaced").iterdir())
    assert len(kept) == 1 and len(pd.read_csv(kept[0] / "steps.csv")) == 20
    assert f"{tmp_path / 'x'} held a run of another configuration (" in r.stderr and "steps 20 -> 30" in r.stderr
    assert str(kept[0]) in r.stderr
    r = duipai("run", "-b", "torch", "--steps", "30", "--out", str(tmp_path), "--name", "x")
    assert r.returncode == 0 and "another configuration" not in r.stderr
    assert len(list((tmp_path / ".replaced").iterdir())) == 1
    # the rendezvous port is where to meet, not what is computed; a perturbed run is another configuration
    man_file = tmp_path / "x" / "manifest.json"
    man = json.loads(man_file.read_text())
    man["config"]["extra"]["port"] = 29999
    man_file.write_text(json.dumps(man))
    r = duipai("run", "-b", "torch", "--steps", "30", "--out", str(tmp_path), "--name", "x")
    assert r.returncode == 0 and "another configuration" not in r.stderr
    man = json.loads(man_file.read_text())
    man["config"]["perturb_ulp"] = 2
    man_file.write_text(json.dumps(man))
    r = duipai("run", "-b", "torch", "--steps", "30", "--out", str(tmp_path), "--name", "x", "--json")
    assert r.returncode == 0 and "another configuration (perturb_ulp 2 -> None)" in r.stderr
    assert len(list((tmp_path / ".replaced").iterdir())) == 2
    said = json.loads(r.stdout)["replaced"]     # --json says it too, for a script
    assert said["differs"] == "perturb_ulp 2 -> None" and Path(said["kept"]).parent == tmp_path / ".replaced"


def test_a_folder_that_is_no_result_is_never_replaced(tmp_path, capsys, monkeypatch):
    """`--name` naming a folder of the user's (no manifest.json in it): refused in one line, exit 2, untouched."""
    mine = tmp_path / "mydata"
    mine.mkdir()
    (mine / "train.csv").write_text("label,p0\n1,0\n")
    code, out, err = duipai_in_process(["run", "-b", "torch", "--steps", "3", "--out", str(tmp_path), "--name",
                                        "mydata"], monkeypatch, capsys)
    assert code == 2 and "mydata exists and holds no manifest.json: not a result folder, not replaced" in err
    assert len(err.strip().splitlines()) == 1
    assert (mine / "train.csv").read_text() == "label,p0\n1,0\n" and sorted(q.name for q in mine.iterdir()) == ["train.csv"]


def test_a_framework_rng_dropout_run_is_named_apart_from_the_harness_masked_one():
    """Both go into one results folder (compare's automatic --stat trains seeds of each next to the other)."""
    from algorithms.contract import RunConfig
    assert RunConfig(backend="jax").default_name("m") == "m__jax__momentum-constant__s0"
    assert RunConfig(backend="jax", dropout="native").default_name("m") == "m__jax__momentum-constant__s0__dropout-native"


def test_a_cached_probe_job_is_reused_only_for_the_same_code(torch_run, tmp_path, monkeypatch):
    """Probe and replay jobs are cached under RESULTS/.localize. A job cached before the wrapper's code (or a
    framework version) changed must run again: a re-compare after a fix once reused stale replays (mobilenet_tiny
    keras-jax, 2026-12-01) and reported the old computation. The job's manifest carries the content key
    (matrix.run_key: the backend's sources and versions, with the mode and the job's own extra)."""
    import harness.probe_jobs as PJ
    from harness.runs import load_run
    run = load_run(torch_run / NAME)
    jobs = PJ.ProbeJobs(tmp_path, log=lambda m: None)
    first = jobs.probe0(run)
    folder, = (tmp_path / ".localize").glob("probe__*")     # not the .tmp folder runs are staged in
    stamp = (folder / "manifest.json").stat().st_mtime_ns
    again = jobs.probe0(run)                                  # same code: the cached folder, not re-run
    assert (folder / "manifest.json").stat().st_mtime_ns == stamp
    assert set(first) == set(again)
    real = PJ.run_key
    monkeypatch.setattr(PJ, "run_key", lambda cfg, prep: real(cfg, prep) + "-changed-sources")
    jobs.probe0(run)                                          # the wrapper's sources changed: run again
    assert (folder / "manifest.json").stat().st_mtime_ns != stamp


def test_a_cached_envelope_run_is_reused_only_for_the_same_code(torch_run, tmp_path, monkeypatch):
    """The reference's envelope runs (--perturb-ulp, float64) are cached next to it. One made by other code (the
    reference's wrapper edited, a framework upgraded) is not the envelope of this reference: it is trained again.
    Before, the cache compared the configuration only, so an edited reference was judged inside its old
    envelope (found by bench/source_bugs.py, whose torch mutations would otherwise reuse a buggy envelope)."""
    import harness.envelope as E
    import harness.runner as R
    from harness.runs import load_run
    run = load_run(torch_run / NAME)

    def envelope_run():
        return E._cached_run(run, {"perturb_ulp": 1}, tmp_path, None, lambda m: None)

    folder = envelope_run().path
    stamp = (folder / "manifest.json").stat().st_mtime_ns
    assert envelope_run().path == folder and (folder / "manifest.json").stat().st_mtime_ns == stamp   # reused
    monkeypatch.setattr(R, "code_hash", lambda backend: "other-code")
    assert envelope_run().path == folder
    assert (folder / "manifest.json").stat().st_mtime_ns != stamp                                     # made again
    assert json.loads((folder / "manifest.json").read_text())["code_hash"] == "other-code"
