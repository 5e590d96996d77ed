"""PyTorch backend: eager torch, the spec lowered in layers.py, torch.optim optimizers."""
from __future__ import annotations

import math
import os
import platform
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from algorithms.optim import HParams
from algorithms.spec import ModelSpec

from ..base import Backend, Masks, RunOptions, StepStats
from .layers import flat_from_canonical, flat_sources, flat_to_canonical, forward, from_torch_layout, nhwc, to_torch_layout

BUFFER_ROLES = ("running_mean", "running_var")


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
    faults = frozenset({"flatten_no_permute", "symmetric_same_padding", "bn_momentum_flipped", "bn_eps_keras",
                        "adam_eps_hat", "keras_momentum_schedule", "l2_not_decoupled", "label_smoothing",
                        "dropout_in_eval", "missing_bias", "maxpool_ceil", "grad_double"})

    def __init__(self, model: ModelSpec, hp: HParams, opts: RunOptions) -> None:
        super().__init__(model, hp, opts)
        torch.set_num_threads(opts.threads)
        if opts.deterministic:
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.deterministic = True
            torch.backends.cudnn.benchmark = False
        want = opts.extra.get("platform", "auto")
        self.device = torch.device("cuda" if want in ("auto", "gpu") and torch.cuda.is_available() else "cpu")
        self.dtype = torch.float64 if opts.dtype == "float64" else torch.float32
        self.channels_last = bool(opts.extra.get("channels_last", False))
        self.p: dict[str, torch.Tensor] = {}
        self.trainable: list[str] = [q.name for q in model.trainable]
        self.opt: torch.optim.Optimizer | None = None
        self.prev_lr: float | None = None
        self.permute = opts.fault != "flatten_no_permute"
        torch.manual_seed(hp.seed)   # only native dropout draws from it

    # ---- environment
    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__, "python": platform.python_version(), "numpy": np.__version__}

    def devices(self) -> list[str]:
        if self.device.type == "cuda":
            return [f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())][:1]
        return [f"cpu ({platform.processor() or platform.machine()})"]

    def determinism(self) -> dict[str, Any]:
        return {"use_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
                "num_threads": torch.get_num_threads(), "cudnn.deterministic": torch.backends.cudnn.deterministic,
                "cudnn.benchmark": torch.backends.cudnn.benchmark, "dtype": str(self.dtype),
                "channels_last": self.channels_last,
                "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}

    def declared_differences(self) -> list[str]:
        return ["native_dropout_masks"] if self.model.has("dropout") and self.opts.dropout == "native" else []

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
            self.p[q.name] = t.requires_grad_(q.trainable)
        self.opt = make_optimizer(self.hp, [self.p[n] for n in self.trainable], self.opts.fault)
        self.prev_lr = None

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
        flat = flat_sources(self.model)
        return {k: self._t(flat_from_canonical(v, flat[k]) if k in flat else
                           (v.transpose(0, 3, 1, 2) if v.ndim == 4 else v)) for k, v in masks.items()}

    def _loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ls = 0.1 if self.opts.fault == "label_smoothing" else 0.0
        return F.cross_entropy(logits, y, label_smoothing=ls)

    def _forward(self, x, train, masks, record=None, p=None):
        return forward(self.model, p or self.p, x, train=train, masks=masks, fault=self.opts.fault, record=record,
                       native_dropout=self.opts.dropout == "native")

    def train_step(self, step: int, x: np.ndarray, y: np.ndarray, masks: Masks) -> StepStats:
        xt, yt = self._input(x), torch.as_tensor(y, dtype=torch.long, device=self.device)
        params = [self.p[n] for n in self.trainable]
        before = [q.detach().clone() for q in params]
        self.opt.zero_grad(set_to_none=False)
        logits = self._forward(xt, True, self._masks(masks))
        loss = self._loss(logits, yt)
        loss.backward()
        for q in params:
            if q.grad is None:
                q.grad = torch.zeros_like(q)
            elif self.opts.fault == "grad_double":
                q.grad.mul_(2.0)
        lr = self.lr_for(step)
        for g in self.opt.param_groups:
            g["lr"] = lr
            if self.opts.fault == "adam_eps_hat":   # eps-hat form == torch eps / sqrt(1 - b2^t)
                g["eps"] = self.hp.eps / math.sqrt(1.0 - self.hp.beta2 ** (step + 1))
        if self.opts.fault == "keras_momentum_schedule" and self.prev_lr is not None and self.prev_lr != lr:
            for q in params:  # Keras velocity v = mu v - lr g  <=>  torch buffer rescaled by lr_prev / lr
                buf = self.opt.state.get(q, {}).get("momentum_buffer")
                if buf is not None:
                    buf.mul_(self.prev_lr / lr)
        self.prev_lr = lr
        with torch.no_grad():
            grad_norm = torch.linalg.vector_norm(torch.cat([q.grad.reshape(-1) for q in params]))
            self.opt.step()
            upd = torch.linalg.vector_norm(torch.cat([(q - b).reshape(-1) for q, b in zip(params, before)]))
            pn = torch.linalg.vector_norm(torch.cat([q.reshape(-1) for q in params]))
            acc = (logits.argmax(1) == yt).to(self.dtype).mean()
        return StepStats(loss.item(), acc.item(), grad_norm.item(), upd.item(), pn.item())

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
        rec: dict[str, torch.Tensor] = {}
        self._forward(self._input(x), True, self._masks(masks), rec, self._scratch())
        flat = flat_sources(self.model)
        return {k: flat_to_canonical(nhwc(v), flat[k]) if k in flat else nhwc(v) for k, v in rec.items()}

    def gradients(self, x: np.ndarray, y: np.ndarray, masks: Masks) -> tuple[float, dict[str, np.ndarray]]:
        params = [self.p[n] for n in self.trainable]
        logits = self._forward(self._input(x), True, self._masks(masks), None, self._scratch())
        loss = self._loss(logits, torch.as_tensor(y, dtype=torch.long, device=self.device))
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        scale = 2.0 if self.opts.fault == "grad_double" else 1.0
        return loss.item(), {n: self._canon(n, (g if g is not None else torch.zeros_like(q)) * scale)
                             for n, g, q in zip(self.trainable, grads, params)}


BACKEND = TorchBackend
