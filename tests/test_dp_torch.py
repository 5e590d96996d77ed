"""Data parallelism of the torch backend (DistributedDataParallel, gloo on CPU), through the real CLI.

The agreement rule: dp=N is a reordering of the same arithmetic, so its loss column may move away
from dp=1 by at most 3x what two dp=1 runs whose initial weights differ by one ULP (--perturb-ulp 1
and 2) move apart from each other. A wrong gradient reduction or a wrong sharding breaks that by
orders of magnitude.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from algorithms.contract import INIT_PARAMS_FILE, JOB_FILE, MANIFEST_FILE, ORDER_FILE, Job, RunOptions
from algorithms.optim import HParams

from .conftest import ROOT, need
from .dp_runs import Runs, max_diff, steps_column as loss

STEPS = 60
BASE = "cnn2d_2conv_2fc__torch__momentum-constant__s0"


class TorchRuns(Runs):
    def envelope(self) -> float:
        """3 x the loss distance of two dp=1 runs one ULP apart in their initial weights."""
        return 3 * self.ulp_spread()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> TorchRuns:
    need("torch")
    return TorchRuns(tmp_path_factory.mktemp("dp_torch"), "torch", STEPS)


def test_dp2_agrees_with_dp1_within_the_ulp_envelope(runs):
    one, two = runs.get(), runs.get(2)
    env = runs.envelope()
    d = max_diff(one, two)
    assert env > 0
    assert d <= env, f"dp=2 vs dp=1: max |loss diff| {d:.3g} > 3 x ulp envelope {env:.3g}"
    s = pd.read_csv(two / "steps.csv")
    assert len(s) == STEPS
    reps = s[["replica_loss_0", "replica_loss_1"]].to_numpy()
    np.testing.assert_allclose(reps.mean(axis=1), s["loss"], rtol=1e-12, atol=0)
    assert not np.array_equal(reps[:, 0], reps[:, 1])       # each replica saw its own shard
    man = json.loads((two / "manifest.json").read_text())
    par = man["parallel"]
    assert par["strategy"] == "DistributedDataParallel" and par["backend"] == "gloo"
    assert par["replicas"] == 2 and par["processes"] == 2 and par["launcher"] == "wrappers launcher"
    assert man["declared_differences"] == []


@pytest.mark.parametrize("fault", ["grad_sum_replicas",
                                   pytest.param("overlapping_shards", marks=pytest.mark.slow)])
def test_reduction_and_sharding_faults_break_the_agreement(runs, fault):
    one, bad = runs.get(), runs.get(2, fault=fault)
    env = runs.envelope()
    d = max_diff(one, bad)
    assert d > 1000 * env, f"{fault}: max |loss diff| {d:.3g} is not far outside the envelope {env:.3g}"
    if fault == "grad_sum_replicas":   # N x the mean gradient at step 0 (same weights, same batch)
        assert loss(bad, "grad_norm")[0] == pytest.approx(2 * loss(one, "grad_norm")[0], rel=1e-5)


def test_dp_faults_refused_without_replicas(runs):
    from harness.errors import BackendFailed
    with pytest.raises(BackendFailed, match="needs data parallelism") as e:
        runs.get(1, steps=2, fault="grad_sum_replicas")
    assert e.value.unsupported


@pytest.mark.slow
def test_two_torchrun_hosts_equal_one_launcher_bitwise(runs):
    """torchrun c10d with 2 node agents of 1 rank each == the launcher's 2 ranks: same ranks, same
    shards, same gloo reduction of 2 operands, so the same bits."""
    two = runs.get(2)
    hosts = runs.get(2, extra={"hosts": 2})
    assert np.array_equal(loss(two), loss(hosts))
    assert np.array_equal(loss(two, "grad_norm"), loss(hosts, "grad_norm"))
    par = json.loads((hosts / "manifest.json").read_text())["parallel"]
    assert par["launcher"] == "torchrun c10d" and par["hosts"] == 2 and par["rank0_host"] == 0


def _rank_pids(out: Path, index: int) -> list[int]:
    """The rank process `index` of a run whose job lies under `out` (not a torchrun agent)."""
    r = subprocess.run(["pgrep", "-af", f"wrappers rank {out}"], capture_output=True, text=True)
    pids = []
    for line in r.stdout.splitlines():
        pid, cmd = line.split(" ", 1)
        if "torch.distributed.run" not in cmd and cmd.split()[-1] == str(index):
            pids.append(int(pid))
    return pids


def test_a_killed_rank_fails_the_run_fast(tmp_path):
    need("torch")
    p = subprocess.Popen([sys.executable, "-m", "harness.cli", "run", "-b", "torch", "--devices", "2",
                          "--steps", "100000", "--out", str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 120
        rows = 0
        while time.time() < deadline and rows < 5 and p.poll() is None:
            csvs = list((tmp_path / ".tmp").glob("*/steps.csv"))
            rows = sum(1 for _ in open(csvs[0])) - 1 if csvs else 0
            time.sleep(0.2)
        assert rows >= 5, "the run never got going"
        pids = _rank_pids(tmp_path, 1)
        assert len(pids) == 1, pids
        os.kill(pids[0], signal.SIGKILL)
        t0 = time.time()
        _, err = p.communicate(timeout=60)
        took = time.time() - t0
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 3, err
    assert took < 30, f"took {took:.1f} s to fail"
    assert "process 1 of 2 exited with code -9" in err
    assert not [d for d in tmp_path.iterdir() if not d.name.startswith(".")]   # nothing published
    assert len(list((tmp_path / ".failed").glob("*/run.log"))) == 1
    time.sleep(0.5)
    assert not _rank_pids(tmp_path, 0) and not _rank_pids(tmp_path, 1)       # no orphan rank left


def test_sync_bn_is_refused_on_cpu_with_the_reason(runs):
    from harness.errors import BackendFailed
    with pytest.raises(BackendFailed, match="SyncBatchNorm refuses CPU tensors") as e:
        runs.get(2, model="cnn2d_hard", steps=2, extra={"sync_bn": True})
    assert e.value.unsupported
    assert not list(runs.out.glob("*sync_bn*"))      # nothing published


def test_a_port_in_use_is_refused(runs):
    import socket
    from harness.errors import BackendFailed
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(BackendFailed, match=f"port {port} on 127.0.0.1 is already in use"):
            runs.get(2, steps=2, extra={"port": port})


def _emulate(folder: Path, out: Path) -> Path:
    """Re-run a dp=N train job in ONE process (the replicas emulated, as probes and replays do)."""
    man = json.loads((folder / MANIFEST_FILE).read_text())
    job = Job(mode="train", backend="torch", model=man["spec"], model_source="<test>",
              hparams=HParams.from_dict(man["hparams"]),
              data=str(folder.parent / ".cache" / f"data-{man['data_hash']}.npz"),
              order=str(folder / ORDER_FILE), params=str(folder / INIT_PARAMS_FILE), out=str(out),
              options=RunOptions.from_dict(man["options"]))
    out.mkdir(parents=True)
    job.write(out / JOB_FILE)
    code = ("import sys; from algorithms.contract import Job; from wrappers.__main__ import set_backend_env; "
            "from wrappers.registry import REGISTRY; set_backend_env(REGISTRY['torch'], Job.read(sys.argv[1]).options); "
            "from wrappers.worker import main; sys.exit(main(sys.argv[1]))")
    r = subprocess.run([sys.executable, "-c", code, str(out / JOB_FILE)], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    return out


@pytest.mark.slow
def test_batchnorm_dp2_declares_per_replica_statistics_and_emulation_is_exact(runs, tmp_path):
    """cnn2d_hard (BatchNorm, dropout) at dp=2: the manifest declares per_replica_batchnorm, and the
    one-process emulation (multi-host probes and replays, and a probe's forward and gradient) reproduces the DDP ranks bit for bit,
    running statistics (rank 0's) and evaluation included."""
    run = runs.get(2, model="cnn2d_hard", steps=4)
    man = json.loads((run / "manifest.json").read_text())
    assert [d["id"] for d in man["declared_differences"]] == ["per_replica_batchnorm"]
    assert "rank 0" in man["parallel"]["running_stats_exported"]
    emu = _emulate(run, tmp_path / "emu")
    assert json.loads((emu / "worker.json").read_text())["parallel"]["processes"] == 1
    a, b = pd.read_csv(run / "steps.csv"), pd.read_csv(emu / "steps.csv")
    cols = [c for c in a.columns if c != "step_time_s"]
    pd.testing.assert_frame_equal(a[cols], b[cols], check_exact=True)
    pd.testing.assert_frame_equal(pd.read_csv(run / "eval.csv"), pd.read_csv(emu / "eval.csv"), check_exact=True)
    pa, pb = np.load(run / "final_params.npz"), np.load(emu / "final_params.npz")
    assert any("running_mean" in k for k in pa.files)
    assert all(np.array_equal(pa[k], pb[k]) for k in pa.files)


def test_batchnorm_dp2_manifest_declares_per_replica_statistics(runs):
    run = runs.get(2, model="cnn2d_hard", steps=4)
    man = json.loads((run / "manifest.json").read_text())
    assert [d["id"] for d in man["declared_differences"]] == ["per_replica_batchnorm"]
    assert man["parallel"]["batchnorm_statistics"].startswith("per replica")


def test_probes_of_a_dp2_run_step_through_ddp_ranks(runs, tmp_path):
    """A probe job of a --devices 2 run runs as two gloo DDP ranks (what trained is what is probed), and its
    optimizer step is DDP's: under the grad_sum_replicas fault (a SUM comm hook on DDP) the update is twice
    the clean one's (SGD)."""
    from algorithms.optim import HParams
    from algorithms.params import load_npz
    from harness import runner
    hp = HParams(steps=4, optimizer="sgd", eval_every=4, checkpoint_every=4)
    probes = {}
    for fault in (None, "grad_sum_replicas"):
        cfg = runner.RunConfig(model="cnn2d_2conv_2fc", backend="torch", hparams=hp, devices=2, fault=fault)
        folder = runner.execute(cfg, tmp_path, f"probe-{fault}", mode="probe", probe_steps=1)
        info = json.loads((folder / "worker.json").read_text())["parallel"]
        assert info["processes"] == 2 and info["backend"] == "gloo", info
        probes[fault] = load_npz(folder / "probe-0.npz")
    clean, summed = probes[None], probes["grad_sum_replicas"]
    for k in (k for k in clean if k.startswith("update0/")):
        np.testing.assert_allclose(summed[k], 2 * clean[k], rtol=1e-3, atol=1e-7, err_msg=k)   # update = float32 params differenced


def test_replica_mean_running_stats_emulation_on_ddp_ranks(tmp_path):
    """The reference's emulation of tf.distribute's MEAN of the replicas' running statistics
    (bn_replica_mean_running_stats) also holds in a probe job run as DDP ranks: the running mean after
    step 0 is the mean of the replicas' (for equal shards, the global batch's, as at --devices 1), where
    DDP alone keeps rank 0's (its half batch's)."""
    from algorithms.optim import HParams
    from algorithms.params import load_npz
    from harness import runner
    hp = HParams(steps=4, optimizer="sgd", eval_every=4, checkpoint_every=4)
    got = {}
    for devices, fault in ((1, None), (2, None), (2, "bn_replica_mean_running_stats")):
        cfg = runner.RunConfig(model="cnn2d_hard", backend="torch", hparams=hp, devices=devices, fault=fault)
        folder = runner.execute(cfg, tmp_path, f"probe-{devices}-{fault}", mode="probe", probe_steps=1)
        if devices == 2:
            assert json.loads((folder / "worker.json").read_text())["parallel"]["processes"] == 2
        got[(devices, fault)] = load_npz(folder / "probe-0.npz")["buffer0/bn1.running_mean"]
    one, rank0, mean = got[(1, None)], got[(2, None)], got[(2, "bn_replica_mean_running_stats")]
    np.testing.assert_allclose(mean, one, rtol=1e-5, atol=1e-7)
    assert np.max(np.abs(rank0 - one)) > 1e-4      # without the emulation: rank 0's half batch

