"""duipai as a user runs it (issue 14, part 1): from a folder of their own outside this repository, with
relative and absolute paths. Every path the user gives is resolved against the user's working directory;
the worker processes never depend on theirs. The slow test does the same from a wheel installed into a fresh
virtual environment, with no path to the source tree."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from algorithms.contract import Job, Replay
from algorithms.optim import HParams

from .conftest import ROOT, need

NAME = "cnn2d_2conv_2fc__torch__momentum-constant__s0"
MATRIX = """name = "mine"
models = ["cnn2d_2conv_2fc"]
backends = ["torch"]
faults = ["missing_bias"]
steps = 5
envelope_k = 1
envelope_fp64 = false
timeout_s = 300
"""


def duipai(cwd: Path, *args: str, exe: list[str] | None = None, env: dict | None = None,
           timeout: float = 600) -> subprocess.CompletedProcess:
    """The command line from the user's folder `cwd`; by default this checkout's code (as an editable install)."""
    if env is None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([*(exe or [sys.executable, "-m", "harness.cli"]), *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


def numbers(run: Path) -> pd.DataFrame:
    """A run's step rows without the timing column."""
    return pd.read_csv(run / "steps.csv", dtype=str).drop(columns=["step_time_s"])


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> Path:
    """A user's project folder outside the repository: their own CSV data and a model file."""
    need("torch")
    d = tmp_path_factory.mktemp("user-project")
    assert ROOT not in d.parents and d != ROOT
    (d / "data").mkdir()
    rng = np.random.default_rng(7)
    rows = np.column_stack([rng.integers(0, 10, 240), rng.integers(0, 256, (240, 64))])
    np.savetxt(d / "data" / "train.csv", rows, fmt="%d", delimiter=",")
    shutil.copy(ROOT / "algorithms" / "models" / "cnn2d_2conv_2fc.toml", d / "net.toml")
    return d


def test_run_compare_report_from_the_users_folder(user):
    # relative --data and --model, the default relative --out
    r = duipai(user, "run", "-b", "torch", "--steps", "5", "--data", "data/train.csv", "--model", "net.toml")
    assert r.returncode == 0, r.stderr
    first = user / "results" / NAME
    assert str(first) in r.stdout
    man = json.loads((first / "manifest.json").read_text())
    assert man["data"]["source"] == f"csv:{user / 'data' / 'train.csv'}"   # recorded absolute
    # from another folder: relative data and model there, an absolute --out
    r = duipai(user / "data", "run", "-b", "torch", "--steps", "5", "--data", "train.csv", "--model", "../net.toml",
               "--out", str(user / "results"), "--name", NAME + "__again")
    assert r.returncode == 0, r.stderr
    pd.testing.assert_frame_equal(numbers(first), numbers(user / "results" / (NAME + "__again")))
    # compare from a third folder: the envelope run is regenerated from the manifest, where data/train.csv
    # would not resolve relatively
    elsewhere = user / "elsewhere"
    elsewhere.mkdir()
    r = duipai(elsewhere, "compare", "../results", "-k", "1", "--no-fp64")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (user / "results" / "comparison.json").is_file()
    assert len(list((user / "results").glob("*__ulp1/steps.csv"))) == 1
    for where, arg in ((elsewhere, "../results"), (user / "data", str(user / "results"))):
        r = duipai(where, "report", arg)
        assert r.returncode == 0, r.stderr
        assert Path(r.stdout.strip()) == user / "results" / "report" / "index.html"
        assert (user / "results" / "report" / "summary.md").is_file()


def test_matrix_all_and_check_of_a_users_project(user):
    """Their matrix file and their baselines folder: `matrix`, `check --update`, a check that passes, `all`."""
    proj = user / "project"
    proj.mkdir()
    (proj / "my.toml").write_text(MATRIX)
    r = duipai(proj, "matrix", "my.toml")
    assert r.returncode == 0, r.stderr
    runs = proj / "results" / "mine" / "runs"
    assert sorted(p.parent.name for p in runs.glob("*/manifest.json")) == sorted(
        [NAME, NAME + "__ulp1", NAME + "__fault-missing_bias"])
    r = duipai(proj, "check", "--matrix", "my.toml", "--baselines", "baselines", "--update", "--reuse")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "new baseline set: 3 runs" in r.stdout
    index = json.loads((proj / "baselines" / "mine" / "index.json").read_text())
    assert len(index["runs"]) == 3
    # rerun (not reused) and compared with the baselines just written: bitwise
    r = duipai(proj, "check", "--matrix", str(proj / "my.toml"), "--baselines", str(proj / "baselines"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("bitwise identical") == 3
    assert (proj / "results" / "mine" / "check" / "junit.xml").is_file()
    # all: the runs reused, compared (the injected fault is a BUG: exit 1), the report written
    r = duipai(proj, "all", "--matrix", str(proj / "my.toml"), "--out", str(proj / "results"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "fault-missing_bias  BUG" in r.stdout
    assert (proj / "results" / "mine" / "report" / "index.html").is_file()


@pytest.mark.parametrize("field, job_change", [
    ("order", {"order": "order.npy"}),
    ("replay.checkpoints.0", {"mode": "replay", "replay": Replay([0], checkpoints={0: "checkpoints/step_0000000.npz"})}),
    ("replay.states.3", {"mode": "replay", "replay": Replay([3], states={3: "state_0000003.npz"})}),
])
def test_worker_refuses_a_relative_path_in_a_job(tmp_path, field, job_change):
    """A job's paths must be absolute: a relative one would be read against the worker's own folder."""
    job = Job(mode="train", backend="torch", model={}, model_source="<test>", hparams=HParams(), data="/abs/data.npz",
              order="/abs/order.npy", params="/abs/p.npz", out="/abs/out")
    dataclasses.replace(job, **job_change).write(tmp_path / "job.json")
    r = subprocess.run([sys.executable, "-m", "wrappers", "run", "job.json"], capture_output=True, text=True,
                       cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert r.returncode == 2
    value = dict(job.paths() + dataclasses.replace(job, **job_change).paths())[field]
    assert f"job {tmp_path / 'job.json'}: field {field!r} is a relative path ({value!r})" in r.stderr


def test_worker_refuses_a_job_file_that_is_not_a_job(tmp_path):
    """A job file with a field the contract does not know: one line naming the file and the field, exit 2."""
    (tmp_path / "job.json").write_text(json.dumps({"mode": "train", "backend": "torch", "steps": 5}))
    r = subprocess.run([sys.executable, "-m", "wrappers", "run", str(tmp_path / "job.json")], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert r.returncode == 2
    assert r.stderr.startswith(f"job {tmp_path / 'job.json'}: not a valid job file: ")
    assert "job: unknown field(s) steps" in r.stderr


@pytest.mark.slow
def test_from_a_wheel_in_a_fresh_virtual_environment(tmp_path):
    """Build the wheel, install it into a new venv and run from a user's folder with that venv's `duipai`.
    The dependencies are borrowed from this interpreter's site-packages by a .pth file (a path line: the
    editable install's finder there is not activated), so nothing is downloaded; duipai itself comes only
    from the wheel (asserted)."""
    need("torch")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    src, dist = tmp_path / "src", tmp_path / "dist"     # a copy: the build leaves build/ and *.egg-info behind
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".*", "results", "build", "*.egg-info", "__pycache__"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", str(src), "-w", str(dist)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr
    wheel = next(dist.glob("duipai-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for pkg, folder in (("algorithms", "models"), ("harness", "matrices")):
        have = {n for n in names if n.startswith(f"{pkg}/{folder}/")}   # sub-folders too (models/scenarios/)
        assert have == {p.relative_to(ROOT).as_posix() for p in (ROOT / pkg / folder).rglob("*.toml")}, have
    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True, timeout=600, env=env)
    (Path(site) / "borrowed-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")   # after: pip must not
    # see the editable install's metadata there and call duipai already installed
    user = tmp_path / "user"
    user.mkdir()
    where = subprocess.run([str(py), "-c", "import harness, algorithms.spec as s, harness.baseline_set as b; "
                            "print(harness.__file__, s.MODELS_DIR, b.BASELINES_DIR)"],
                           capture_output=True, text=True, cwd=user, env=env, check=True)
    *code, baselines = where.stdout.split()
    assert all(p.startswith(site) for p in code), where.stdout
    assert baselines == "results/baselines"     # no committed baselines in an installed package: the user's folder
    exe = [str(venv / "bin" / "duipai")]
    for extra in ([], ["--name", NAME + "__again"]):
        r = duipai(user, "run", "-b", "torch", "--steps", "5", *extra, exe=exe, env=env)
        assert r.returncode == 0, r.stderr
    r = duipai(user, "compare", "results", "-k", "1", "--no-fp64", exe=exe, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (user / "results" / "comparison.json").is_file()
    pd.testing.assert_frame_equal(numbers(user / "results" / NAME), numbers(user / "results" / (NAME + "__again")))
