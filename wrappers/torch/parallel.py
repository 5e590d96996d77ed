"""PyTorch data parallelism: DistributedDataParallel ranks for train, probe and replay jobs (the training
step a probe or a resynced step runs is DDP's); the same replicas emulated in one process for the probe and
replay jobs of a multi-host run, and for the parts of a probe that are not a training step.

  * train, probe and replay jobs run as N processes (see wrappers/torch/__init__.py for how they are started), each a
    DistributedDataParallel rank: gloo on CPU, NCCL on cuda:LOCAL_RANK when CUDA is present. Every
    rank receives the global batch and takes its contiguous shard shard_bounds(B, N, fault)[rank];
    DDP all-reduces the gradients divided by N (the mean of the per-rank mean losses of equal
    shards = the global-batch mean gradient). Rank 0 writes the results.
  * a probe's per-layer forward and its gradient (`forward_layers`, `gradients`) emulate the N replicas
    shard by shard in rank 0 (per-replica BatchNorm statistics, gradients averaged, the grad_sum_replicas /
    overlapping_shards faults); its optimizer steps (`update0/...`) are DDP's own steps on every rank. The
    probe and replay jobs of a --hosts > 1 run stay in one process, everything emulated.
  * BatchNorm: per-replica statistics (declared difference per_replica_batchnorm). DDP broadcasts
    rank 0's buffers at every forward (forward_sync_buffers=True, its default), so the running
    statistics of the run, and those exported, are rank 0's: rank 0's shard statistics folded in
    every step. `--sync-bn`: torch.nn.SyncBatchNorm's statistics over the global batch, on GPU only
    (torch refuses CPU tensors; refused here with that reason).
"""
from __future__ import annotations

import atexit
import os
import sys
import time
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..base import Masks, UnsupportedError, shard_bounds
from .layers import fold_replica_buffers, replica_mean_stats

DIST_TIMEOUT_S = 60      # gloo/NCCL collectives and the rendezvous: a lost peer fails the run, never hangs it
# DDP's reducer warns when a gradient's strides differ from its bucket view's, which they do only in the
# stride of a size-1 dimension (a conv kernel with one input channel): harmless, and noise in run.log
warnings.filterwarnings("ignore", message="Grad strides do not match bucket view strides")
# torch.nn.SyncBatchNorm.forward: "SyncBatchNorm expected input tensor to be on GPU or XPU or <privateuse1>"
SYNC_BN_DEVICES = ("cuda", "hpu", "xpu")


def _die_with_parent() -> None:
    """A rank process is killed with its parent (the launcher or the torchrun agent): no orphan ranks
    waiting on a dead peer, holding the harness's pipe open."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        import signal
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))   # PR_SET_PDEATHSIG
    except Exception:  # pragma: no cover - best effort
        pass


def _sum_allreduce_hook(state, bucket):   # no annotations: DDP checks them, and they are strings here
    """The grad_sum_replicas fault: a SUM all-reduce of the per-rank mean-loss gradients (no 1/N)."""
    fut = dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.SUM, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


class _Replica(nn.Module):
    """The functional model as a module, so that DDP can hook its parameters and broadcast its buffers.
    Parameters and buffers ARE the backend's tensors (self.p): DDP's in-place broadcasts land there."""

    def __init__(self, backend: "DataParallel") -> None:
        super().__init__()
        self._backend = backend
        for n, t in backend.p.items():
            key = n.replace(".", "__")
            if isinstance(t, nn.Parameter):
                self.register_parameter(key, t)
            else:
                self.register_buffer(key, t)

    def forward(self, x: torch.Tensor, masks: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._backend._train_forward(x, masks)


class DataParallel:
    """The data-parallel half of TorchBackend (a mixin: it uses the backend's `_train_forward`, `_input`, `_masks`,
    `_loss`, `_scratch` and its parameters `p`)."""

    def _init_rank(self) -> None:
        """A rank of a multi-process job (started by `python -m wrappers rank`), or one process for all."""
        self.distributed = self.replicas > 1 and "DUIPAI_PROCESS_INDEX" in os.environ
        self.rank, self.local_rank = 0, 0
        if self.distributed:
            _die_with_parent()
            self.rank, self.local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
            world = int(os.environ["WORLD_SIZE"])
            if world != self.replicas:
                raise RuntimeError(f"WORLD_SIZE {world} != --devices {self.replicas}")

    def _init_group(self, model) -> None:
        """This rank's device, the --sync-bn refusals, the process group (after threads and determinism)."""
        if self.device.type == "cuda" and self.distributed:
            self.device = torch.device("cuda", self.local_rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        if self.sync_bn and self.replicas > 1 and model.has("batchnorm2d") and self.device.type not in SYNC_BN_DEVICES:
            msg = (f"--sync-bn: torch.nn.SyncBatchNorm refuses {self.device.type.upper()} tensors (\"SyncBatchNorm "
                   f"expected input tensor to be on GPU or XPU or ...\"); on this machine the BatchNorm statistics "
                   f"can only be per replica: run without --sync-bn (declared difference per_replica_batchnorm)")
            if self.rank != 0:
                time.sleep(2.0)   # let rank 0 report the reason before the launcher stops everyone
            raise UnsupportedError(msg)
        if self.sync_bn and self.replicas > 1 and model.has("batchnorm2d") and not self.distributed:
            raise UnsupportedError("--sync-bn: probes and replays of a synchronized-BatchNorm run are not emulated "
                                   "in one process; compare its training runs")
        self.ddp: nn.parallel.DistributedDataParallel | None = None
        if self.distributed and not dist.is_initialized():   # a probe job's further cases reuse the group
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, init_method="env://", rank=self.rank, world_size=self.replicas,
                                    timeout=timedelta(seconds=DIST_TIMEOUT_S))
            atexit.register(_destroy_group)

    def _wrap_ddp(self) -> None:
        """The model under DDP (a collective: every rank loads in lock-step, rank 0's state is broadcast), at
        every load (train, probe and replay jobs alike); grad_sum_replicas replaces DDP's mean all-reduce by a SUM."""
        if not self.distributed:
            return
        self.ddp = nn.parallel.DistributedDataParallel(
            _Replica(self), device_ids=[self.device] if self.device.type == "cuda" else None,
            forward_sync_buffers=True, find_unused_parameters=self.seams.leaves_unused_parameters)
        if self.opts.fault == "grad_sum_replicas":
            self.ddp.register_comm_hook(None, _sum_allreduce_hook)

    def _sync_bn_group(self) -> tuple[Any, int] | None:
        return (dist.group.WORLD, self.replicas) if self.distributed and self.sync_bn else None

    def parallel_info(self) -> dict[str, Any]:
        if self.replicas == 1:
            return super().parallel_info()
        bn = ("n/a (no BatchNorm)" if not self.model.has("batchnorm2d") else
              "synchronized over the global batch (torch.nn.SyncBatchNorm)" if self.sync_bn else
              "per replica, over each rank's B/N samples")
        info: dict[str, Any] = {
            "strategy": "DistributedDataParallel", "replicas": self.replicas, "hosts": self.hosts,
            "sync_bn": self.sync_bn, "batchnorm_statistics": bn,
            "sharding": "contiguous: rank r takes samples [r*B/N, (r+1)*B/N) of the global batch"
                        + (" (fault overlapping_shards: every rank takes [0, B/N))"
                           if self.opts.fault == "overlapping_shards" else ""),
            "gradient_reduction": ("SUM all-reduce of the per-rank mean-loss gradients (fault grad_sum_replicas)"
                                   if self.opts.fault == "grad_sum_replicas" else
                                   "DDP all-reduce, each gradient divided by N: the global-batch mean"),
            "running_stats_exported": ("rank 0's: DDP (forward_sync_buffers=True, formerly broadcast_buffers) "
                                       "broadcasts rank 0's buffers before every forward, so the run's running "
                                       "statistics are rank 0's, updated from rank 0's shard each step"
                                       if self.model.has("batchnorm2d") else "n/a"),
            "loss": "mean of the replicas' mean losses (all_gather), accuracy over the global batch",
        }
        if self.distributed:
            info.update(backend=dist.get_backend(), processes=self.replicas,
                        launcher="wrappers launcher" if self.hosts <= 1 else "torchrun c10d",
                        timeout_s=DIST_TIMEOUT_S, rank=self.rank,
                        rank0_host=int(os.environ.get("GROUP_RANK", 0)))
            if self.hosts > 1:
                info["agents"] = self.hosts
                info["ranks_per_host"] = self.replicas // self.hosts
        else:
            info.update(strategy="DistributedDataParallel, emulated in one process (probe / replay job)",
                        backend=None, processes=1, launcher=None)
        return info

    def _shards(self, batch: int) -> list[tuple[int, int]]:
        return shard_bounds(batch, self.replicas, self.opts.fault)

    @staticmethod
    def _shard_masks(masks: Masks, lo: int, hi: int) -> Masks:
        return {k: v[lo:hi] for k, v in masks.items()}

    def _replica_scratch(self) -> list[dict[str, torch.Tensor]]:
        """Emulated replicas' tensors: parameters shared; rank 0 updates the real buffers, every other
        rank works on a copy of them (DDP broadcasts rank 0's buffers before each forward)."""
        return [self.p] + [self._scratch() for _ in range(self.replicas - 1)]

    def _grads_ddp(self, x, y, masks):
        """This rank's shard through DDP: backward all-reduces the gradients (mean, or SUM under the fault)."""
        lo, hi = self._shards(len(x))[self.rank]
        xt = self._input(x[lo:hi])
        yt = torch.as_tensor(y[lo:hi], dtype=torch.long, device=self.device)
        logits = self.ddp(xt, self._masks(self._shard_masks(masks, lo, hi)))
        loss = self._loss(logits, yt)
        loss.backward()
        self._fold_rank_buffers()
        with torch.no_grad():
            mine = torch.stack([loss.detach().to(torch.float64), (logits.argmax(1) == yt).sum().to(torch.float64)])
            every = [torch.empty_like(mine) for _ in range(self.replicas)]
            dist.all_gather(every, mine)
        losses = [float(t[0]) for t in every]
        return sum(losses) / len(losses), losses, sum(float(t[1]) for t in every) / len(x)

    def _fold_rank_buffers(self) -> None:
        """On DDP ranks: replica_mean_stats' running statistics replaced by their mean over the ranks (what
        fold_replica_buffers does to emulated replicas)."""
        with torch.no_grad():
            for name in replica_mean_stats(self.p, self.opts.fault):
                dist.all_reduce(self.p[name], op=dist.ReduceOp.SUM)
                self.p[name].div_(self.replicas)

    def _grads_emulated(self, x, y, masks):
        """The N replicas one after another in this process, gradients combined as DDP combines them."""
        params = [self.p[n] for n in self.trainable]
        total = [torch.zeros_like(q) for q in params]
        scale = 1.0 if self.opts.fault == "grad_sum_replicas" else 1.0 / self.replicas
        losses, correct = [], 0.0
        reps = self._replica_scratch()
        for (lo, hi), p in zip(self._shards(len(x)), reps):
            xt = self._input(x[lo:hi])
            yt = torch.as_tensor(y[lo:hi], dtype=torch.long, device=self.device)
            logits = self._train_forward(xt, self._masks(self._shard_masks(masks, lo, hi)), None, p)
            loss = self._loss(logits, yt)
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            with torch.no_grad():
                for t, g in zip(total, grads):
                    if g is not None:
                        t.add_(g * scale)
            losses.append(float(loss.item()))
            correct += float((logits.argmax(1) == yt).sum().item())
        fold_replica_buffers(reps, self.opts.fault)
        for q, t in zip(params, total):
            q.grad = t
        return sum(losses) / len(losses), losses, correct / len(x)


def _destroy_group() -> None:
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # pragma: no cover - a peer already gone
        pass


