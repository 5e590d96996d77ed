"""Golden baselines and `duipai check` through the real command line (issue 7, part 3 and 4):
unchanged code -> 0, an injected fault -> 1 with the BUG localized, a corrupt or truncated baseline
-> 2 naming the file (nothing run), a backend killed mid-run -> 3 (the rest reported), `--update`
prints what changed, JUnit XML and the Markdown summary, and the pytest helper."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from .conftest import ROOT, duipai_in_process, need

MATRIX = """name = "tcheck"
models = ["cnn2d_2conv_2fc"]
backends = ["torch", "jax"]
steps = 12
envelope_k = 1
envelope_fp64 = false
timeout_s = 300
"""
TORCH = "cnn2d_2conv_2fc__torch__momentum-constant__s0"
ULP1 = TORCH + "__ulp1"
JAX = "cnn2d_2conv_2fc__jax__momentum-constant__s0"
FAULTY = JAX + "__fault-flatten_no_permute"


def duipai(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """A baseline set of a 3-run matrix (torch, its 1-ULP run, jax; 12 steps)."""
    need("torch")
    need("jax")
    root = tmp_path_factory.mktemp("check")
    (root / "tcheck.toml").write_text(MATRIX)
    d = {"root": root, "matrix": root / "tcheck.toml", "baselines": root / "baselines", "out": root / "results"}
    r = duipai("baseline", "save", "--matrix", str(d["matrix"]), "--baselines", str(d["baselines"]),
               "--out", str(d["out"]), "-j", "2")
    assert r.returncode == 0, r.stderr
    assert "new baseline set: 3 runs" in r.stdout
    return d


def args(d: dict[str, Path], *more: str, baselines: Path | None = None, out: Path | None = None) -> list[str]:
    return ["check", "--matrix", str(d["matrix"]), "--baselines", str(baselines or d["baselines"]),
            "--out", str(out or d["out"]), *more]


def test_save_writes_a_self_checking_set_with_exact_floats(saved):
    from harness import baseline_file as BL
    folder = saved["baselines"] / "tcheck"
    idx = json.loads((folder / "index.json").read_text())
    assert sorted(r["name"] for r in idx["runs"]) == sorted([TORCH, ULP1, JAX])
    assert idx["matrix"]["definition"]["steps"] == 12 and idx["platform"]["machine"]
    b = BL.load_baseline(folder / f"{JAX}.json")
    assert b.fingerprint["run"]["versions"]["jax"] and b.fingerprint["platform"]["python"]
    csv_loss = [line.split(",")[2] for line in (saved["out"] / "tcheck/runs" / JAX / "steps.csv").read_text().splitlines()[1:]]
    assert [repr(float(x)) for x in b.series.steps["loss"]] == csv_loss      # the exact values, as written
    assert "step_time_s" not in b.series.steps


def test_unchanged_code_passes_bitwise(saved, tmp_path):
    junit, summary = tmp_path / "junit.xml", tmp_path / "summary.md"
    r = duipai(*args(saved, "-j", "2", "--junit", str(junit), "--summary", str(summary)))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "# duipai check: tcheck: PASS" in r.stdout
    assert "**bitwise** for 3 run(s)" in r.stdout and r.stdout.count("bitwise identical") == 3
    assert "3 to run" in r.stderr or "[3/3] ran" in r.stderr            # rerun, not reused
    suite = ET.parse(junit).getroot().find("testsuite")
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("3", "0", "0")
    assert summary.read_text().startswith("# duipai check: tcheck: PASS")


@pytest.fixture(scope="module")
def faulty(saved):
    r = duipai(*args(saved, "--reuse", "--fault", "jax:flatten_no_permute"))
    return r


def test_injected_fault_fails_with_the_bug_localized(saved, faulty):
    r = faulty
    assert r.returncode == 1, r.stdout + r.stderr
    out = r.stdout
    assert "FAIL (exit 1: numerical regression)" in out
    row = next(line for line in out.splitlines() if line.startswith(f"| {FAULTY}"))
    assert "**FAIL (BUG)**" in row and "forward: fc1" in row
    assert "bitwise: step 0 loss 3." in row and " -> 2." in row          # first difference, both values
    assert "- bitwise difference: step 0 loss: baseline 3." in out and "(0x1." in out
    assert "localized by step-0 probes: forward, layer fc1" in out
    assert out.count("bitwise identical") == 2                           # torch and its envelope run pass
    suite = ET.parse(saved["out"] / "tcheck/check/junit.xml").getroot().find("testsuite")
    fails = [tc for tc in suite.iter("testcase") if tc.find("failure") is not None]
    assert [tc.get("name") for tc in fails] == [FAULTY]
    assert fails[0].find("failure").get("type") == "numerical-regression"
    doc = json.loads((saved["out"] / "tcheck/check/check.json").read_text())
    bad = [x for x in doc["runs"] if x["status"] == "FAIL"]
    assert bad[0]["localized"] == "forward: fc1" and bad[0]["bitwise_difference"]["first"]["step"] == 0


@pytest.mark.parametrize("damage", ["truncate", "edit", "delete", "index"])
def test_corrupt_or_missing_baseline_is_bad_input_naming_the_file(saved, tmp_path, damage, monkeypatch, capsys):
    """In the test process (refused before anything runs); the cases below run the check as a real process."""
    bl = tmp_path / "bl"
    shutil.copytree(saved["baselines"], bl)
    f = bl / "tcheck" / f"{JAX}.json"
    if damage == "truncate":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif damage == "edit":
        f.write_text(f.read_text().replace('"momentum"', '"nesterov"', 1))
    elif damage == "delete":
        f.unlink()
    else:
        f = bl / "tcheck" / "index.json"
        f.write_text(f.read_text()[:100])
    out = tmp_path / "results"
    code, stdout, stderr = duipai_in_process(args(saved, baselines=bl, out=out), monkeypatch, capsys)
    assert code == 2, stdout + stderr
    assert str(f) in stderr and stderr.startswith("duipai: error:")
    assert not out.exists()                                              # nothing run


def _kill_when_training(root: Path, name: str, stop: threading.Event, killed: list[int]) -> None:
    """SIGKILL the backend process (started by the check under test) that runs job `name` under
    `root` (`wrappers run JOB`, or a warm `wrappers serve` whose stderr is that job's log), once it has begun
    writing steps.csv (or 20 s after it started)."""
    seen: dict[int, float] = {}
    while not stop.is_set():
        for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            job = next((c.decode() for c in cmd if c.endswith(b"job.json")), None)
            if b"wrappers" in cmd and b"serve" in cmd:   # a warm process: its stderr is the running job's log
                try:
                    job = str(Path(os.readlink(f"/proc/{pid}/fd/2")).parent / "job.json")
                except OSError:
                    continue
            elif not (b"wrappers" in cmd and b"run" in cmd):
                continue
            if not (job and job.startswith(str(root)) and Path(job).parent.name.startswith(name + ".")):
                continue
            seen.setdefault(int(pid), time.time())
            if (Path(job).parent / "steps.csv").exists() or time.time() - seen[int(pid)] > 20:
                os.kill(int(pid), signal.SIGKILL)
                killed.append(int(pid))
                return
        time.sleep(0.02)


def test_backend_killed_mid_run_is_a_crash_and_the_rest_is_reported(saved, tmp_path):
    out = tmp_path / "results"
    shutil.copytree(saved["out"] / "tcheck" / "runs" / TORCH, out / "tcheck" / "runs" / TORCH)   # reused: only
    shutil.copytree(saved["out"] / "tcheck" / "runs" / ULP1, out / "tcheck" / "runs" / ULP1)     # jax runs
    stop, killed = threading.Event(), []
    t = threading.Thread(target=_kill_when_training, args=(out, JAX, stop, killed), daemon=True)
    t.start()
    try:
        r = duipai(*args(saved, "--reuse", out=out))
    finally:
        stop.set()
        t.join()
    assert killed, "the jax backend process was never seen"
    assert r.returncode == 3, r.stdout + r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith(f"| {JAX}"))
    assert "**ERROR**" in row and "backend crashed" in row and "exited with code -9" in row
    assert r.stdout.count("bitwise identical") == 2                      # the rest completed and is reported
    suite = ET.parse(out / "tcheck/check/junit.xml").getroot().find("testsuite")
    assert suite.get("errors") == "1"
    err = next(tc for tc in suite.iter("testcase") if tc.get("name") == JAX).find("error")
    assert err.get("type") == "backend-crash"


def test_update_rewrites_and_prints_what_changed(saved, tmp_path):
    import math
    from harness import baseline_file as BL
    bl = tmp_path / "bl"
    shutil.copytree(saved["baselines"], bl)

    def one_ulp_off(doc):   # as if saved by other code: torch's loss at step 3 one ULP away
        i = doc["steps"]["columns"].index("loss")
        doc["steps"]["rows"][3][i] = math.nextafter(doc["steps"]["rows"][3][i], 10.0)
    _resave(bl / "tcheck", TORCH, one_ulp_off)
    f = bl / "tcheck" / f"{TORCH}.json"
    r = duipai(*args(saved, "--reuse", baselines=bl))          # any bit is a regression, diagnosed as drift
    assert r.returncode == 1, r.stdout + r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith(f"| {TORCH} "))
    assert "**FAIL**" in row and "bitwise: step 3 loss" in row
    assert "inside the envelope (DRIFT" in r.stdout and "a change of rounding" in r.stdout
    r = duipai(*args(saved, "--reuse", "--allow-drift", baselines=bl))   # reported, not failed
    assert r.returncode == 0, r.stdout + r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith(f"| {TORCH} "))
    assert "**PASS**" in row and "drift allowed (--allow-drift): bitwise: step 3 loss" in row, row
    r = duipai(*args(saved, "--reuse", "--update", baselines=bl))
    assert r.returncode == 0, r.stderr
    assert f"changed  {TORCH}: loss max|diff|" in r.stdout and "(1/12 points)" in r.stdout
    assert "unchanged 2 run(s)" in r.stdout
    assert BL.load_baseline(f).series.steps["loss"][3] == BL.load_baseline(
        saved["baselines"] / "tcheck" / f"{TORCH}.json").series.steps["loss"][3]
    r = duipai(*args(saved, "--reuse", baselines=bl))
    assert r.returncode == 0, r.stdout + r.stderr


def _resave(folder: Path, name: str, change) -> None:
    """Rewrite one baseline of a set consistently (its sha256 and the index's)."""
    from harness import baseline_file as BL
    f = folder / f"{name}.json"
    doc = json.loads(f.read_text())
    change(doc)
    BL.write_baseline(f, doc)
    idx = json.loads((folder / "index.json").read_text())
    for x in idx["runs"]:
        if x["name"] == name:
            x["sha256"] = json.loads(f.read_text())["sha256"]
    (folder / "index.json").write_text(json.dumps(dict(idx, sha256=BL.digest(idx))))


def test_other_versions_switch_to_the_envelope_and_say_why(saved, tmp_path):
    bl = tmp_path / "bl"
    shutil.copytree(saved["baselines"], bl)

    def older_jax(doc):
        doc["fingerprint"]["run"]["versions"]["jax"] = "0.9.0"
    _resave(bl / "tcheck", JAX, older_jax)
    r = duipai(*args(saved, "--reuse", baselines=bl))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "**envelope** for 1 run(s) (jax): jax 0.9.0 -> " in r.stdout
    assert "**bitwise** for 2 run(s) (torch)" in r.stdout
    row = next(line for line in r.stdout.splitlines() if line.startswith(f"| {JAX}"))
    assert "| envelope | **PASS** | bitwise identical" in row


def test_bad_check_arguments_are_bad_input(saved):
    r = duipai(*args(saved, "--fault", "tensorflow:flatten_no_permute"))
    assert r.returncode == 2 and "backend 'tensorflow' is not in matrix tcheck" in r.stderr
    r = duipai(*args(saved, "--fault", "jax:no_such_fault"))
    assert r.returncode == 2 and "unknown fault 'no_such_fault'" in r.stderr


# --------------------------------------------------------------------------- the pytest helper
def test_assert_matches_baseline(saved, faulty):
    from harness.baseline_file import BaselineError
    from harness.testing import BaselineMismatch, assert_matches_baseline
    runs, folder = saved["out"] / "tcheck" / "runs", saved["baselines"] / "tcheck"
    m = assert_matches_baseline(runs / JAX, folder / f"{JAX}.json")
    assert (m.mode, m.verdict) == ("bitwise", "IDENTICAL")
    m = assert_matches_baseline(runs / JAX, folder / f"{JAX}.json", mode="envelope")   # the set's envelope
    assert m.mode == "envelope" and m.verdict in ("IDENTICAL", "DRIFT")
    with pytest.raises(BaselineMismatch, match=r"bitwise difference .*step 0 loss: baseline .*; against the "
                                                r"envelope baselines of .*: BUG from step 0"):
        assert_matches_baseline(runs / FAULTY, folder / f"{JAX}.json")
    with pytest.raises(BaselineMismatch, match=r"envelope mode .*: BUG from step 0 loss: .* the envelope"):
        assert_matches_baseline(runs / FAULTY, folder / f"{JAX}.json", mode="envelope")
    with pytest.raises(BaselineMismatch, match="backend torch, the baseline's is jax"):
        assert_matches_baseline(runs / TORCH, folder / f"{JAX}.json")
    with pytest.raises(BaselineError, match="missing baseline file"):
        assert_matches_baseline(runs / JAX, folder / "nope.json")


def test_standalone_baseline_with_a_stored_envelope(saved, tmp_path):
    from harness import baseline_file as BL
    from harness.testing import assert_matches_baseline, save_baseline
    runs = saved["out"] / "tcheck" / "runs"
    p = save_baseline(runs / TORCH, tmp_path / "torch.json", envelope=[runs / ULP1])
    b = BL.load_baseline(p)
    assert b.doc["envelope"]["perturb_ulp_seeds"] == [1] and max(b.doc["envelope"]["spread"]["loss"]) > 0
    m = assert_matches_baseline(runs / TORCH, p, mode="envelope")       # the spread stored in the file
    assert (m.mode, m.verdict) == ("envelope", "IDENTICAL") and "stored in the baseline" in m.detail


def test_pytest_fixture_creates_then_checks_baselines(saved, tmp_path):
    """The documented use: `pytest_plugins = ["harness.testing"]`, the duipai_baseline fixture."""
    run = saved["out"] / "tcheck" / "runs" / JAX
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["harness.testing"]\n')
    (tmp_path / "pytest.ini").write_text("[pytest]\nduipai_baselines = golden\n")
    (tmp_path / "test_user.py").write_text(textwrap.dedent(f"""
        def test_jax_12_steps(duipai_baseline):
            duipai_baseline({str(run)!r})
    """))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
           "-c", str(tmp_path / "pytest.ini"), str(tmp_path / "test_user.py")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 1 and "no baseline" in r.stdout and "--duipai-update-baselines" in r.stdout, r.stdout
    r = subprocess.run(cmd + ["--duipai-update-baselines"], capture_output=True, text=True, cwd=tmp_path, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stdout
    assert (tmp_path / "golden" / "test_jax_12_steps.json").is_file()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 0, r.stdout
    (tmp_path / "test_user.py").write_text(textwrap.dedent(f"""
        def test_jax_12_steps(duipai_baseline):
            duipai_baseline({str(saved["out"] / "tcheck" / "runs" / FAULTY)!r})
    """))
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 1 and "BaselineMismatch" in r.stdout and "step 0 loss" in r.stdout, r.stdout
