"""PyTorch backend: eager torch, the spec lowered in layers.py, torch.optim optimizers.

Data parallelism (DDP ranks, or the replicas emulated in one process for probes) is parallel.py; the
optimizer, its state and the optimizer-fault seam are optim.py; the lowering and the layouts are layers.py.
"""
from __future__ import annotations

import os
import platform
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from algorithms.contract import RunOptions
from algorithms.faults import Seams

from algorithms.optim import HParams
from algorithms.spec import ModelSpec

from ..base import Backend, Masks, StepStats
from . import TorchEntry
from .layers import (flat_from_canonical, flat_sources, flat_to_canonical, forward, from_native, nhwc,
                     to_native)
from .optim import export_state, load_state, make_optimizer, set_hyper
from .parallel import DataParallel

BUFFER_ROLES = ("running_mean", "running_var")


class TorchBackend(DataParallel, Backend):
    framework = "torch"
    # the catalogued faults it declares, and the emulations of declared differences the verdict engine asks of
    # the reference (not catalogued: the self-test does not inject them)
    faults = TorchEntry.faults
    emulations = TorchEntry.emulations   # every one, alone or '+'-joined (Backend.__init__)
    layer_kinds = TorchEntry.layer_kinds

    def __init__(self, model: ModelSpec, hp: HParams, opts: RunOptions) -> None:
        super().__init__(model, hp, opts)
        self._init_rank()
        torch.set_num_threads(opts.threads)
        if opts.deterministic:
            torch.use_deterministic_algorithms(True)
            # the NaN fill of torch.empty & co. is a debugging aid, not part of determinism: a valid program never
            # reads that memory, so the results are bit-identical without it (torch.utils.deterministic's docs);
            # it cost ~4 % of a default-model step (bench/step_breakdown.py -b torch)
            torch.utils.deterministic.fill_uninitialized_memory = False
            torch.backends.cudnn.deterministic = True
            torch.backends.cudnn.benchmark = False
        want = opts.extra.get("platform", "auto")
        self.device = torch.device("cuda" if want in ("auto", "gpu") and torch.cuda.is_available() else "cpu")
        self._init_group(model)
        self.dtype = torch.float64 if opts.dtype == "float64" else torch.float32
        self.channels_last = bool(opts.extra.get("channels_last", False))
        self.p: dict[str, torch.Tensor] = {}
        self.trainable: list[str] = [q.name for q in model.trainable]
        self.opt: torch.optim.Optimizer | None = None
        self.prev_lr: float | None = None
        # (parameters, their version counters, their flat copy) after the last step: the next step's `before`
        self._after: tuple[list[torch.Tensor], list[int], torch.Tensor] | None = None
        # (parameters, gradients) as one flat vector each, the trainable tensors views of them (_flatten_trainable)
        self._flat_storage: tuple[torch.Tensor, torch.Tensor] | None = None
        self.seams = Seams(opts.fault)
        self.permute = self.seams.permute
        self.channel_major = self.seams.depthwise_channel_major
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
                "fill_uninitialized_memory": torch.utils.deterministic.fill_uninitialized_memory,
                "num_threads": torch.get_num_threads(), "cudnn.deterministic": torch.backends.cudnn.deterministic,
                "cudnn.benchmark": torch.backends.cudnn.benchmark, "dtype": str(self.dtype),
                "channels_last": self.channels_last,
                "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}

    def declared_differences(self) -> list[str]:
        out = ["native_dropout_masks"] if self.model.has("dropout") and self.opts.dropout == "native" else []
        if self.replicas > 1 and self.model.has("batchnorm2d") and not self.sync_bn:
            out.append("per_replica_batchnorm")
        return out

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
            t = self._t(to_native(self.model, q.name, params[q.name], self.permute, self.channel_major))
            if self.channels_last and t.ndim == 4:
                t = t.contiguous(memory_format=torch.channels_last)
            if self.distributed and not q.name.endswith(BUFFER_ROLES):
                self.p[q.name] = nn.Parameter(t, requires_grad=q.trainable)
            else:
                self.p[q.name] = t.requires_grad_(q.trainable)
        self._flatten_trainable()
        self.opt = make_optimizer(self.hp, [self.p[n] for n in self.trainable], self.opts.fault)
        self.prev_lr = None
        self._after = None
        self._wrap_ddp()

    def _flatten_trainable(self) -> None:
        """One process, one replica, contiguous layout: the trainable parameters become views of one flat
        vector and their gradients views of another (apex / DeepSpeed's contiguous buffers), so that the
        step's statistics read one vector each instead of concatenating every tensor every step. The
        vectors hold the same values in the same order as the concatenation: the same norms, bit for bit.
        DDP, emulated replicas (their gradients are combined into new tensors) and channels_last keep
        separate tensors."""
        self._flat_storage = None
        if self.distributed or self.replicas > 1 or self.channels_last or not self.trainable:
            return
        params = [self.p[n] for n in self.trainable]
        flat = torch.cat([q.detach().reshape(-1) for q in params])
        grads = torch.zeros_like(flat)
        offset = 0
        for q in params:
            n = q.numel()
            q.data = flat[offset:offset + n].view_as(q)
            q.grad = grads[offset:offset + n].view_as(q)
            offset += n
        self._flat_storage = (flat, grads)

    def _canon(self, name: str, t: torch.Tensor) -> np.ndarray:
        # a copy: .numpy() and the layout transposes are views of the live tensor
        return np.array(from_native(self.model, name, t.detach().cpu().numpy(), self.permute, self.channel_major), copy=True)

    def export_params(self) -> dict[str, np.ndarray]:
        return {n: self._canon(n, t) for n, t in self.p.items()}

    def export_opt_state(self) -> dict[str, np.ndarray]:
        return export_state(self.opt, self.p, self.trainable, self._canon)

    def load_opt_state(self, state: dict[str, np.ndarray], step: int) -> None:
        load_state(self.opt, self.p, self.trainable, state,
                   lambda n, a: self._t(to_native(self.model, n, a, self.permute, self.channel_major)))
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
        return F.cross_entropy(logits, y, label_smoothing=self.seams.label_smoothing)

    def _train_forward(self, x, masks, record=None, p=None):
        """The training-mode forward, one for the step (every data-parallel path) and its probes: a mode, mask or
        layer slip here shows in the forward probes too, not first in the loss."""
        return forward(self.model, p or self.p, x, train=True, masks=masks, fault=self.opts.fault, record=record,
                       native_dropout=self.opts.dropout == "native", sync_bn=self._sync_bn_group())

    def _eval_forward(self, x, record=None, p=None):
        """The inference forward, one for `evaluate` and the evaluation probes (`eval_layers`)."""
        return forward(self.model, p or self.p, x, train=False, masks=None, fault=self.opts.fault, record=record,
                       native_dropout=self.opts.dropout == "native", sync_bn=self._sync_bn_group())

    def _grads_single(self, xt, yt, masks):
        logits = self._train_forward(xt, self._masks(masks))
        loss = self._loss(logits, yt)
        loss.backward()
        acc = (logits.argmax(1) == yt).to(self.dtype).mean()
        return loss.detach(), None, acc      # not read here: train_step reads them with its statistics, in one go

    def _fault_grad(self, g: torch.Tensor) -> torch.Tensor:
        """The gradient seam, one for training and probes: grad_double counts every gradient twice (in place)."""
        scale = self.seams.grad_scale
        return g.mul_(scale) if scale != 1.0 else g

    def _zero_grads(self) -> None:
        """Every .grad to zero, kept (not set to None): under the flat layout each is a view of one vector,
        zeroed by one kernel instead of one per tensor."""
        if self._flat_storage is not None:
            self._flat_storage[1].zero_()
        else:
            self.opt.zero_grad(set_to_none=False)

    def _step_gradients(self, x: np.ndarray, y: np.ndarray, masks: Masks
                        ) -> tuple[float | torch.Tensor, list[float] | None, float | torch.Tensor]:
        """(loss, replica losses, accuracy); the gradients left in each parameter's .grad, computed on the
        path the run trains on (DDP ranks, emulated replicas, one process), the gradient seam applied: one
        for the step and the gradient probe (`gradients`), so a slip here shows in both. In one process the
        loss and accuracy are 0-d tensors not yet read (the caller reads them in one go with what else it
        needs); the data-parallel paths have read them to combine the replicas'."""
        params = [self.p[n] for n in self.trainable]
        flat = self._flat_storage
        self._zero_grads()
        if self.distributed:
            loss, replica_losses, acc = self._grads_ddp(x, y, masks)
        elif self.replicas > 1:
            loss, replica_losses, acc = self._grads_emulated(x, y, masks)
        else:
            xt, yt = self._input(x), torch.as_tensor(y, dtype=torch.long, device=self.device)
            loss, replica_losses, acc = self._grads_single(xt, yt, masks)
        if flat is not None:          # every gradient is a view of flat[1], accumulated in place by backward
            self._fault_grad(flat[1])
        else:
            for q in params:
                if q.grad is None:
                    q.grad = torch.zeros_like(q)
                else:
                    self._fault_grad(q.grad)
        return loss, replica_losses, acc

    def train_step(self, step: int, x: np.ndarray, y: np.ndarray, masks: Masks) -> StepStats:
        params = [self.p[n] for n in self.trainable]
        flat = self._flat_storage
        before = self._params_flat(params)
        loss, replica_losses, acc = self._step_gradients(x, y, masks)
        lr = self.lr_for(step)
        set_hyper(self.opt, params, self.hp, step, lr, self.prev_lr, self.opts.fault)
        self.prev_lr = lr
        with torch.no_grad():
            grads = flat[1] if flat is not None else self._flat([q.grad for q in params])
            grad_norm = torch.linalg.vector_norm(grads)
            self.opt.step()
            after = flat[0].clone() if flat is not None else self._flat(params)
            self._after = (params, [q._version for q in params], after)
            # (after - before) is the concatenation of the per-parameter differences, element by element:
            # the same vector, the same norm kernel, the same bits
            scalars = [grad_norm, torch.linalg.vector_norm(after - before), torch.linalg.vector_norm(after)]
            unread = isinstance(loss, torch.Tensor)
            if unread:
                scalars += [loss, acc]
            values = torch.stack(scalars).tolist()   # one read of everything the step reports
        grad_norm, upd, pn = values[:3]
        if unread:
            loss, acc = values[3:]
        return StepStats(loss, acc, grad_norm, upd, pn, replica_losses)

    def _params_flat(self, params: list[torch.Tensor]) -> torch.Tensor:
        """The parameters flattened (a copy), for update_norm: the last step's `after` while no parameter
        has been written since (same tensors, same version counters: torch bumps a tensor's version at
        every in-place write, the optimizer's, a load's or a DDP broadcast's); else a new copy."""
        if self._after is not None:
            prev, versions, flat = self._after
            if len(prev) == len(params) and all(a is b and a._version == v for a, b, v in zip(prev, params, versions)):
                return flat
        return self._flat_storage[0].clone() if self._flat_storage is not None else self._flat(params)

    @staticmethod
    def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
        """The tensors flattened (logical order, whatever their memory format) into one new vector."""
        return torch.cat([t.detach().reshape(-1) for t in tensors])

    @torch.no_grad()
    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        xt, yt = self._input(x), torch.as_tensor(y, dtype=torch.long, device=self.device)
        logits = self._eval_forward(xt)
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
            self._train_forward(self._input(x[lo:hi]), self._masks(self._shard_masks(masks, lo, hi)), rec,
                                self._scratch())
            recs.append(rec)
        return self._canonical_record(recs)

    @torch.no_grad()
    def eval_layers(self, x: np.ndarray) -> dict[str, np.ndarray]:
        """Inference mode, as `evaluate`: per sample, so one pass over the whole batch whatever --devices."""
        rec: dict[str, torch.Tensor] = {}
        self._eval_forward(self._input(x), rec, self._scratch())
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
        """(loss, gradient) from the training step's own gradient code (`_step_gradients`: its data-parallel
        path, its seam); the running statistics it moved are put back and the gradients zeroed."""
        buffers = {n: t.detach().clone() for n, t in self.p.items() if n.endswith(BUFFER_ROLES)}
        # the .grad buffers put back as they were, not cleared: a step that forgets to zero them must meet the
        # gradients it left, as in training
        grads = [(q, None if q.grad is None else q.grad.detach().clone()) for q in (self.p[n] for n in self.trainable)]
        try:
            loss = float(self._step_gradients(x, y, masks)[0])
            return loss, {n: self._canon(n, self.p[n].grad) for n in self.trainable}
        finally:
            with torch.no_grad():
                for n, v in buffers.items():
                    self.p[n].copy_(v)
                for q, g in grads:
                    if g is None:
                        q.grad = None
                    else:
                        q.grad.copy_(g)       # in place: under the flat layout each .grad is a view of one vector


BACKEND = TorchBackend
