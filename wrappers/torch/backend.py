"""PyTorch backend: eager torch, the spec lowered in layers.py, torch.optim optimizers.

Data parallel (`--devices N`):
  * train jobs run as N processes (see wrappers/torch/__init__.py for how they are started), each a
    DistributedDataParallel rank: gloo on CPU, NCCL on cuda:LOCAL_RANK when CUDA is present. Every
    rank receives the global batch and takes its contiguous shard shard_bounds(B, N, fault)[rank];
    DDP all-reduces the gradients divided by N (the mean of the per-rank mean losses of equal
    shards = the global-batch mean gradient). Rank 0 writes the results.
  * probe and replay jobs run in one process: the N replicas are emulated there, shard by shard
    (per-replica BatchNorm statistics, rank 0's running buffers, gradients averaged, the
    grad_sum_replicas / overlapping_shards faults), so a probe of a dp=N run shows what the ranks do.
  * BatchNorm: per-replica statistics (declared difference per_replica_batchnorm). DDP broadcasts
    rank 0's buffers at every forward (forward_sync_buffers=True, its default), so the running
    statistics of the run, and those exported, are rank 0's: rank 0's shard statistics folded in
    every step. `--sync-bn`: torch.nn.SyncBatchNorm's statistics over the global batch, on GPU only
    (torch refuses CPU tensors; refused here with that reason).
"""
from __future__ import annotations

import atexit
import math
import os
import platform
import sys
import time
import warnings
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from algorithms.optim import HParams
from algorithms.spec import ModelSpec

from ..base import Backend, Masks, RunOptions, StepStats, UnsupportedError, shard_bounds
from . import TorchEntry
from .layers import (EMULATION_FAULTS, fault_parts, flat_from_canonical, fold_replica_buffers, flat_sources, flat_to_canonical, forward,
                     from_torch_layout, nhwc, to_torch_layout)

BUFFER_ROLES = ("running_mean", "running_var")
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

    def __init__(self, backend: "TorchBackend") -> None:
        super().__init__()
        self._backend = backend
        for n, t in backend.p.items():
            key = n.replace(".", "__")
            if isinstance(t, nn.Parameter):
                self.register_parameter(key, t)
            else:
                self.register_buffer(key, t)

    def forward(self, x: torch.Tensor, masks: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._backend._forward(x, True, masks)


def make_optimizer(hp: HParams, params: list[torch.Tensor], fault: str | None) -> torch.optim.Optimizer:
    """The native torch.optim optimizer whose mathematics are the reference's."""
    if hp.optimizer == "sgd":
        return torch.optim.SGD(params, lr=hp.lr, weight_decay=hp.weight_decay)
    if hp.optimizer in ("momentum", "nesterov"):
        return torch.optim.SGD(params, lr=hp.lr, momentum=hp.momentum, nesterov=hp.optimizer == "nesterov",
                               weight_decay=hp.weight_decay)
    betas = (hp.beta1, hp.beta2)
    if hp.optimizer == "adam" or (hp.optimizer == "adamw" and fault == "l2_not_decoupled"):
        return torch.optim.Adam(params, lr=hp.lr, betas=betas, eps=hp.eps, weight_decay=hp.weight_decay)
    return torch.optim.AdamW(params, lr=hp.lr, betas=betas, eps=hp.eps, weight_decay=hp.weight_decay)


class TorchBackend(Backend):
    framework = "torch"
    # the catalogued faults it declares, and the emulations of declared differences the verdict engine asks of
    # the reference (not catalogued: the self-test does not inject them)
    faults = TorchEntry.faults | EMULATION_FAULTS
    layer_kinds = TorchEntry.layer_kinds

    def __init__(self, model: ModelSpec, hp: HParams, opts: RunOptions) -> None:
        super().__init__(model, hp, opts)
        # a rank of a multi-process job (started by `python -m wrappers rank`), or one process for all
        self.distributed = self.replicas > 1 and "DUIPAI_PROCESS_INDEX" in os.environ
        self.rank, self.local_rank = 0, 0
        if self.distributed:
            _die_with_parent()
            self.rank, self.local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
            world = int(os.environ["WORLD_SIZE"])
            if world != self.replicas:
                raise RuntimeError(f"WORLD_SIZE {world} != --devices {self.replicas}")
        torch.set_num_threads(opts.threads)
        if opts.deterministic:
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.deterministic = True
            torch.backends.cudnn.benchmark = False
        want = opts.extra.get("platform", "auto")
        self.device = torch.device("cuda" if want in ("auto", "gpu") and torch.cuda.is_available() else "cpu")
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
        if self.distributed:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, init_method="env://", rank=self.rank, world_size=self.replicas,
                                    timeout=timedelta(seconds=DIST_TIMEOUT_S))
            atexit.register(_destroy_group)
        self.dtype = torch.float64 if opts.dtype == "float64" else torch.float32
        self.channels_last = bool(opts.extra.get("channels_last", False))
        self.p: dict[str, torch.Tensor] = {}
        self.trainable: list[str] = [q.name for q in model.trainable]
        self.opt: torch.optim.Optimizer | None = None
        self.prev_lr: float | None = None
        # (parameters, their version counters, their flat copy) after the last step: the next step's `before`
        self._after: tuple[list[torch.Tensor], list[int], torch.Tensor] | None = None
        self.permute = opts.fault != "flatten_no_permute"
        torch.manual_seed(hp.seed + self.rank)   # only native dropout draws from it (a stream per rank)

    # ---- environment
    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__, "python": platform.python_version(), "numpy": np.__version__}

    def devices(self) -> list[str]:
        n = self.replicas if self.distributed else 1
        if self.device.type == "cuda":
            k = torch.cuda.device_count()
            if self.distributed and self.hosts <= 1:
                return [f"rank {r}: cuda:{r % k} {torch.cuda.get_device_name(r % k)}" for r in range(n)]
            return [f"cuda:{self.device.index or 0} {torch.cuda.get_device_name(self.device.index or 0)}"]
        cpu = f"cpu ({platform.processor() or platform.machine()})"
        return [f"rank {r}: {cpu}" for r in range(n)] if self.distributed else [cpu]

    def determinism(self) -> dict[str, Any]:
        return {"use_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
                "num_threads": torch.get_num_threads(), "cudnn.deterministic": torch.backends.cudnn.deterministic,
                "cudnn.benchmark": torch.backends.cudnn.benchmark, "dtype": str(self.dtype),
                "channels_last": self.channels_last,
                "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}

    def declared_differences(self) -> list[str]:
        out = ["native_dropout_masks"] if self.model.has("dropout") and self.opts.dropout == "native" else []
        if self.replicas > 1 and self.model.has("batchnorm2d") and not self.sync_bn:
            out.append("per_replica_batchnorm")
        return out

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

    def is_primary(self) -> bool:
        return self.rank == 0

    # ---- state
    def _t(self, a: np.ndarray) -> torch.Tensor:
        # a copy: torch.as_tensor would share the NumPy buffer, and in-place optimizer updates would
        # then overwrite the caller's canonical arrays
        return torch.tensor(np.ascontiguousarray(a), dtype=self.dtype, device=self.device)

    def load_params(self, params: dict[str, np.ndarray]) -> None:
        self.p = {}
        for q in self.model.params:
            t = self._t(to_torch_layout(self.model, q.name, params[q.name], self.permute))
            if self.channels_last and t.ndim == 4:
                t = t.contiguous(memory_format=torch.channels_last)
            if self.distributed and not q.name.endswith(BUFFER_ROLES):
                self.p[q.name] = nn.Parameter(t, requires_grad=q.trainable)
            else:
                self.p[q.name] = t.requires_grad_(q.trainable)
        self.opt = make_optimizer(self.hp, [self.p[n] for n in self.trainable], self.opts.fault)
        self.prev_lr = None
        if self.distributed:   # a collective: every rank loads in lock-step (rank 0's state is broadcast)
            self.ddp = nn.parallel.DistributedDataParallel(
                _Replica(self), device_ids=[self.device] if self.device.type == "cuda" else None,
                forward_sync_buffers=True, find_unused_parameters=self.opts.fault == "missing_bias")
            if self.opts.fault == "grad_sum_replicas":
                self.ddp.register_comm_hook(None, _sum_allreduce_hook)

    def _canon(self, name: str, t: torch.Tensor) -> np.ndarray:
        # a copy: .numpy() and the layout transposes are views of the live tensor
        return np.array(from_torch_layout(self.model, name, t.detach().cpu().numpy(), self.permute), copy=True)

    def export_params(self) -> dict[str, np.ndarray]:
        return {n: self._canon(n, t) for n, t in self.p.items()}

    def export_opt_state(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for n in self.trainable:
            st = self.opt.state.get(self.p[n], {})
            for key, canon in (("momentum_buffer", "momentum"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
                if key in st and st[key] is not None:
                    out[f"{canon}/{n}"] = self._canon(n, st[key])
            if "step" in st:
                out["step"] = np.asarray(float(st["step"]))
        return out

    def load_opt_state(self, state: dict[str, np.ndarray], step: int) -> None:
        for n in self.trainable:
            st: dict[str, Any] = {}
            for key, canon in (("momentum_buffer", "momentum"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
                if f"{canon}/{n}" in state:
                    st[key] = self._t(to_torch_layout(self.model, n, state[f"{canon}/{n}"], self.permute))
            if "step" in state and "exp_avg" in st:
                st["step"] = torch.tensor(float(state["step"]))
            if st:
                self.opt.state[self.p[n]] = st
        self.prev_lr = self.lr_for(step - 1) if step > 0 else None

    # ---- computation
    def _input(self, x: np.ndarray) -> torch.Tensor:
        t = self._t(x).permute(0, 3, 1, 2)
        return t.contiguous(memory_format=torch.channels_last) if self.channels_last else t.contiguous()

    def _masks(self, masks: Masks) -> dict[str, torch.Tensor]:
        if not masks:
            return {}
        flat = flat_sources(self.model)
        return {k: self._t(flat_from_canonical(v, flat[k]) if k in flat else
                           (v.transpose(0, 3, 1, 2) if v.ndim == 4 else v)) for k, v in masks.items()}

    def _loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ls = 0.1 if self.opts.fault == "label_smoothing" else 0.0
        return F.cross_entropy(logits, y, label_smoothing=ls)

    def _forward(self, x, train, masks, record=None, p=None):
        sync = (dist.group.WORLD, self.replicas) if self.distributed and self.sync_bn else None
        return forward(self.model, p or self.p, x, train=train, masks=masks, fault=self.opts.fault, record=record,
                       native_dropout=self.opts.dropout == "native", sync_bn=sync)

    def _shards(self, batch: int) -> list[tuple[int, int]]:
        return shard_bounds(batch, self.replicas, self.opts.fault)

    @staticmethod
    def _shard_masks(masks: Masks, lo: int, hi: int) -> Masks:
        return {k: v[lo:hi] for k, v in masks.items()}

    def _replica_scratch(self) -> list[dict[str, torch.Tensor]]:
        """Emulated replicas' tensors: parameters shared; rank 0 updates the real buffers, every other
        rank works on a copy of them (DDP broadcasts rank 0's buffers before each forward)."""
        return [self.p] + [self._scratch() for _ in range(self.replicas - 1)]

    def _grads_single(self, xt, yt, masks):
        logits = self._forward(xt, True, self._masks(masks))
        loss = self._loss(logits, yt)
        loss.backward()
        acc = (logits.argmax(1) == yt).to(self.dtype).mean()
        loss_v, acc_v = torch.stack([loss.detach(), acc]).tolist()   # one read of both
        return loss_v, None, acc_v

    def _grads_ddp(self, x, y, masks):
        """This rank's shard through DDP: backward all-reduces the gradients (mean, or SUM under the fault)."""
        lo, hi = self._shards(len(x))[self.rank]
        xt = self._input(x[lo:hi])
        yt = torch.as_tensor(y[lo:hi], dtype=torch.long, device=self.device)
        logits = self.ddp(xt, self._masks(self._shard_masks(masks, lo, hi)))
        loss = self._loss(logits, yt)
        loss.backward()
        with torch.no_grad():
            mine = torch.stack([loss.detach().to(torch.float64), (logits.argmax(1) == yt).sum().to(torch.float64)])
            every = [torch.empty_like(mine) for _ in range(self.replicas)]
            dist.all_gather(every, mine)
        losses = [float(t[0]) for t in every]
        return sum(losses) / len(losses), losses, sum(float(t[1]) for t in every) / len(x)

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
            logits = self._forward(xt, True, self._masks(self._shard_masks(masks, lo, hi)), None, p)
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

    def train_step(self, step: int, x: np.ndarray, y: np.ndarray, masks: Masks) -> StepStats:
        params = [self.p[n] for n in self.trainable]
        before = self._params_flat(params)
        self.opt.zero_grad(set_to_none=False)
        if self.distributed:
            loss, replica_losses, acc = self._grads_ddp(x, y, masks)
        elif self.replicas > 1:
            loss, replica_losses, acc = self._grads_emulated(x, y, masks)
        else:
            xt, yt = self._input(x), torch.as_tensor(y, dtype=torch.long, device=self.device)
            loss, replica_losses, acc = self._grads_single(xt, yt, masks)
        for q in params:
            if q.grad is None:
                q.grad = torch.zeros_like(q)
            elif self.opts.fault == "grad_double":
                q.grad.mul_(2.0)
        lr = self.lr_for(step)
        for g in self.opt.param_groups:
            g["lr"] = lr
            if "adam_eps_hat" in fault_parts(self.opts.fault):   # eps-hat form == torch eps / sqrt(1 - b2^t)
                g["eps"] = self.hp.eps / math.sqrt(1.0 - self.hp.beta2 ** (step + 1))
        if "keras_momentum_schedule" in fault_parts(self.opts.fault) and self.prev_lr is not None and self.prev_lr != lr:
            for q in params:  # Keras velocity v = mu v - lr g  <=>  torch buffer rescaled by lr_prev / lr
                buf = self.opt.state.get(q, {}).get("momentum_buffer")
                if buf is not None:
                    buf.mul_(self.prev_lr / lr)
        self.prev_lr = lr
        with torch.no_grad():
            grad_norm = torch.linalg.vector_norm(self._flat([q.grad for q in params]))
            self.opt.step()
            after = self._flat(params)
            self._after = (params, [q._version for q in params], after)
            # (after - before) is the concatenation of the per-parameter differences, element by element:
            # the same vector, the same norm kernel, the same bits
            stats = torch.stack([grad_norm, torch.linalg.vector_norm(after - before), torch.linalg.vector_norm(after)])
        grad_norm, upd, pn = stats.tolist()   # one read of the three statistics
        return StepStats(loss, acc, grad_norm, upd, pn, replica_losses)

    def _params_flat(self, params: list[torch.Tensor]) -> torch.Tensor:
        """The parameters flattened (a copy), for update_norm: the last step's `after` while no parameter
        has been written since (same tensors, same version counters: torch bumps a tensor's version at
        every in-place write, the optimizer's, a load's or a DDP broadcast's); else a new copy."""
        if self._after is not None:
            prev, versions, flat = self._after
            if len(prev) == len(params) and all(a is b and a._version == v for a, b, v in zip(prev, params, versions)):
                return flat
        return self._flat(params)

    @staticmethod
    def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
        """The tensors flattened (logical order, whatever their memory format) into one new vector."""
        return torch.cat([t.detach().reshape(-1) for t in tensors])

    @torch.no_grad()
    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        xt, yt = self._input(x), torch.as_tensor(y, dtype=torch.long, device=self.device)
        logits = self._forward(xt, False, None)
        return F.cross_entropy(logits, yt).item(), (logits.argmax(1) == yt).double().mean().item()

    def _scratch(self) -> dict[str, torch.Tensor]:
        """Parameters shared, buffers copied: a probe must not move the running statistics."""
        return {n: (t.detach().clone() if n.endswith(BUFFER_ROLES) else t) for n, t in self.p.items()}

    @torch.no_grad()
    def forward_layers(self, x: np.ndarray, masks: Masks) -> dict[str, np.ndarray]:
        """Under --devices N (emulated replicas): each replica's shard forward, concatenated in rank order."""
        bounds = self._shards(len(x)) if self.replicas > 1 else [(0, len(x))]
        recs: list[dict[str, torch.Tensor]] = []
        for lo, hi in bounds:
            rec: dict[str, torch.Tensor] = {}
            self._forward(self._input(x[lo:hi]), True, self._masks(self._shard_masks(masks, lo, hi)), rec,
                          self._scratch())
            recs.append(rec)
        return self._canonical_record(recs)

    @torch.no_grad()
    def eval_layers(self, x: np.ndarray) -> dict[str, np.ndarray]:
        """Inference mode, as `evaluate`: per sample, so one pass over the whole batch whatever --devices."""
        rec: dict[str, torch.Tensor] = {}
        self._forward(self._input(x), False, None, rec, self._scratch())
        return self._canonical_record([rec])

    def _canonical_record(self, recs: list[dict[str, torch.Tensor]]) -> dict[str, np.ndarray]:
        """Recorded layer outputs (one record per replica shard) concatenated, in canonical layout."""
        flat = flat_sources(self.model)
        out = {}
        for k in recs[0]:
            v = nhwc(torch.cat([r[k] for r in recs])) if len(recs) > 1 else nhwc(recs[0][k])
            out[k] = flat_to_canonical(v, flat[k]) if k in flat else v
        return out

    def gradients(self, x: np.ndarray, y: np.ndarray, masks: Masks) -> tuple[float, dict[str, np.ndarray]]:
        """(loss, gradient); under --devices N the replicas' mean loss and their combined gradient."""
        params = [self.p[n] for n in self.trainable]
        bounds = self._shards(len(x)) if self.replicas > 1 else [(0, len(x))]
        rscale = 1.0 if self.replicas == 1 or self.opts.fault == "grad_sum_replicas" else 1.0 / self.replicas
        losses, grads = [], [None] * len(params)
        for lo, hi in bounds:
            logits = self._forward(self._input(x[lo:hi]), True, self._masks(self._shard_masks(masks, lo, hi)), None,
                                   self._scratch())
            loss_r = self._loss(logits, torch.as_tensor(y[lo:hi], dtype=torch.long, device=self.device))
            g_r = torch.autograd.grad(loss_r, params, allow_unused=True)
            losses.append(loss_r.item())
            if self.replicas == 1:
                grads = list(g_r)
                continue
            grads = [a if g is None else (g * rscale if a is None else a + g * rscale) for a, g in zip(grads, g_r)]
        loss = losses[0] if self.replicas == 1 else sum(losses) / len(losses)
        scale = 2.0 if self.opts.fault == "grad_double" else 1.0
        return loss, {n: self._canon(n, (g if g is not None else torch.zeros_like(q)) * scale)
                             for n, g, q in zip(self.trainable, grads, params)}


def _destroy_group() -> None:
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # pragma: no cover - a peer already gone
        pass


BACKEND = TorchBackend
