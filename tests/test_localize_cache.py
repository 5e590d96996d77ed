"""The localization cache's size limit (harness.localize_cache): least recently used job folders go first,
never one that a pair still being judged may read, and a foreign folder only after its grace period."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from harness.errors import BadInput
from harness.localize_cache import ENV_VAR, CacheBudget, limit_bytes


def job(root: Path, name: str, size: int, age_s: float) -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "probe_000.npz").write_bytes(b"\0" * size)
    t = time.time() - age_s
    os.utime(d, (t, t))
    return d


def test_least_recently_used_folders_go_first_until_the_cache_is_within_its_limit(tmp_path):
    logged: list[str] = []
    for name, age in (("old", 5000), ("older", 6000), ("recent", 3000)):
        job(tmp_path, name, 1000, age)
    cache = CacheBudget(tmp_path, logged.append, limit=1500, grace_s=600)
    assert cache.trim() == ["older", "old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recent"]
    assert "removed 2 job folder(s)" in logged[0] and ENV_VAR in logged[0]


def test_a_folder_whose_pair_is_not_judged_stays_and_goes_once_released(tmp_path):
    ref = job(tmp_path, "probe__ref", 1000, 10)     # just written by this comparison's jobs
    cand = job(tmp_path, "replay__cand", 1000, 10)
    cache = CacheBudget(tmp_path, lambda m: None, limit=500, grace_s=600)
    cache.used(ref, "ref")
    cache.used(cand, "cand")
    assert ref.is_dir() and cand.is_dir()          # both still needed: nothing goes
    cache.release("cand")
    assert ref.is_dir() and not cand.exists()
    cache.release_all()
    assert not ref.exists()


def test_a_folder_another_process_used_recently_is_left_alone(tmp_path):
    job(tmp_path, "theirs_fresh", 1000, 10)
    job(tmp_path, "theirs_stale", 1000, 4000)
    cache = CacheBudget(tmp_path, lambda m: None, limit=0, grace_s=600)
    assert cache.trim() == ["theirs_stale"]
    assert (tmp_path / "theirs_fresh").is_dir()


def test_dot_folders_are_not_jobs(tmp_path):
    job(tmp_path, ".tmp", 1000, 9000)
    job(tmp_path, ".failed", 1000, 9000)
    assert CacheBudget(tmp_path, lambda m: None, limit=0).trim() == []
    assert (tmp_path / ".tmp").is_dir() and (tmp_path / ".failed").is_dir()


def test_the_limit_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert limit_bytes() == 4_000_000_000
    monkeypatch.setenv(ENV_VAR, "0.5")
    assert limit_bytes() == 500_000_000
    monkeypatch.setenv(ENV_VAR, "-1")
    assert limit_bytes() is None
    monkeypatch.setenv(ENV_VAR, "lots")
    with pytest.raises(BadInput, match=f"{ENV_VAR}='lots'"):
        limit_bytes()


def test_a_replay_key_does_not_name_the_results_folder(tmp_path):
    """The same replay in a copied or moved results folder (a CI artefact compared again) is the same job: its key
    names checkpoint and state files relative to the results folder, whatever spelling of the folder the files
    use; a file outside it keeps its path."""
    from algorithms.contract import Replay
    from harness.probe_jobs import ProbeJobs

    def key(root: Path, outside: str) -> dict:
        (root / "run" / "checkpoints").mkdir(parents=True, exist_ok=True)
        rep = Replay([0, 50], checkpoints={0: str(root.resolve() / "run/checkpoints/step_0000000.npz")},
                     states={50: str(root / ".localize/job/state_0000050.npz"), 0: outside})
        return ProbeJobs(root)._relocatable(rep)
    a, b = key(tmp_path / "a", "/elsewhere/x.npz"), key(tmp_path / "b", "/elsewhere/x.npz")
    assert a == b and a["checkpoints"]["0"] == "<results>/run/checkpoints/step_0000000.npz"
    assert a["states"] == {"0": "/elsewhere/x.npz", "50": "<results>/.localize/job/state_0000050.npz"}
    assert key(tmp_path / "a", "/elsewhere/y.npz") != a
    assert ProbeJobs(tmp_path)._relocatable(None) is None


def test_a_moved_results_folder_is_compared_again_from_its_cache(tmp_path):
    """numpy against numpy dp 2, compared (envelope, resync, replays), then the folder moved and compared again:
    no job runs again, the same verdicts and notes, and no file of the old place is read (it is gone)."""
    from algorithms.contract import RunConfig
    from algorithms.optim import HParams
    from harness import runner
    from harness.compare_runs import compare_folder
    first = tmp_path / "first"
    hp = HParams(steps=60)
    for devices in (1, 2):
        runner.execute(RunConfig(model="cnn2d_2conv_2fc", backend="numpy", hparams=hp, devices=devices), first)
    said: list[str] = []
    compare_folder(first, reference="numpy", log=said.append)
    before = json.loads((first / "comparison.json").read_text())
    assert any(m.startswith("localize:") for m in said), said
    moved = tmp_path / "moved"
    first.rename(moved)
    said.clear()
    compare_folder(moved, reference="numpy", log=said.append)
    after = json.loads((moved / "comparison.json").read_text())
    assert not [m for m in said if m.startswith(("localize:", "envelope: training"))], said
    strip = lambda doc: [(p["candidate"], p["verdict"], p["notes"]) for p in doc["pairs"]]   # noqa: E731
    assert strip(after) == strip(before)
