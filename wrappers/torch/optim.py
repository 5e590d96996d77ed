"""torch.optim optimizers whose mathematics are the reference's, their state in the canonical names, and the
optimizer-hyper-parameter seam where the optimizer faults (and the reference's emulations of Keras'
optimizers) are applied."""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import torch

from algorithms.faults import Seams, parts as fault_parts
from algorithms.optim import HParams, float32_bias_corrections

# torch.optim state key -> the canonical optimizer-state kind
STATE_KEYS = (("momentum_buffer", "momentum"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"))


def make_optimizer(hp: HParams, params: list[torch.Tensor], fault: str | None) -> torch.optim.Optimizer:
    """The native torch.optim optimizer whose mathematics are the reference's."""
    if hp.optimizer == "sgd":
        return torch.optim.SGD(params, lr=hp.lr, weight_decay=hp.weight_decay)
    if hp.optimizer in ("momentum", "nesterov"):
        return torch.optim.SGD(params, lr=hp.lr, momentum=hp.momentum, nesterov=hp.optimizer == "nesterov",
                               weight_decay=hp.weight_decay)
    betas = (hp.beta1, hp.beta2)
    if hp.optimizer == "adam" or (hp.optimizer == "adamw" and Seams(fault).coupled_adamw):
        return torch.optim.Adam(params, lr=hp.lr, betas=betas, eps=hp.eps, weight_decay=hp.weight_decay)
    return torch.optim.AdamW(params, lr=hp.lr, betas=betas, eps=hp.eps, weight_decay=hp.weight_decay)


def set_hyper(opt: torch.optim.Optimizer, params: list[torch.Tensor], hp: HParams, step: int, lr: float,
              prev_lr: float | None, fault: str | None) -> None:
    """The step's learning rate into every group; the optimizer faults / emulations at this one seam:
    adam_eps_hat (Keras/TF's eps-hat form == torch eps / sqrt(1 - b2^t)), adam_float32_betas (Keras' bias
    corrections from float32 betas, through lr and eps) and keras_momentum_schedule (Keras' velocity
    v = mu v - lr g == torch's buffer rescaled by lr_prev / lr when the lr changes)."""
    emulate = fault_parts(fault)
    t = step + 1
    bc1, bc2 = 1.0 - hp.beta1 ** t, 1.0 - hp.beta2 ** t      # torch's own bias corrections (float64)
    gain, eps_gain = 1.0, 1.0
    if "adam_float32_betas" in emulate:
        # Keras' corrections k1, k2 (float32 betas): lr' = lr sqrt(k2/bc2) bc1/k1 and eps' = eps sqrt(k2/bc2)
        # make torch's lr'/bc1 m / (sqrt(v/bc2) + eps') equal lr/k1 m / (sqrt(v/k2) + eps)
        k1, k2 = float32_bias_corrections(hp, t)
        gain, eps_gain = math.sqrt(k2 / bc2) * bc1 / k1, math.sqrt(k2 / bc2)
    for g in opt.param_groups:
        g["lr"] = lr * gain
        if "adam_eps_hat" in emulate:
            g["eps"] = hp.eps / math.sqrt(bc2)
        elif "adam_float32_betas" in emulate:
            g["eps"] = hp.eps * eps_gain
        if "adam_float32_betas" in emulate and isinstance(opt, torch.optim.AdamW):
            g["weight_decay"] = hp.weight_decay / gain     # the decoupled decay stays lr * wd
    if "keras_momentum_schedule" in emulate and prev_lr is not None and prev_lr != lr:
        for q in params:
            buf = opt.state.get(q, {}).get("momentum_buffer")
            if buf is not None:
                buf.mul_(prev_lr / lr)


def export_state(opt: torch.optim.Optimizer, p: dict[str, torch.Tensor], trainable: list[str],
                 canon: Callable[[str, torch.Tensor], np.ndarray]) -> dict[str, np.ndarray]:
    """The optimizer state as canonical 'momentum/<param>', 'exp_avg/<param>', 'exp_avg_sq/<param>', 'step'."""
    out: dict[str, np.ndarray] = {}
    for n in trainable:
        st = opt.state.get(p[n], {})
        for key, kind in STATE_KEYS:
            if key in st and st[key] is not None:
                out[f"{kind}/{n}"] = canon(n, st[key])
        if "step" in st:
            out["step"] = np.asarray(float(st["step"]))
    return out


def load_state(opt: torch.optim.Optimizer, p: dict[str, torch.Tensor], trainable: list[str],
               state: dict[str, np.ndarray], native: Callable[[str, np.ndarray], torch.Tensor]) -> None:
    """The canonical optimizer state into torch.optim's per-parameter state."""
    for n in trainable:
        st: dict[str, Any] = {}
        for key, kind in STATE_KEYS:
            if f"{kind}/{n}" in state:
                st[key] = native(n, state[f"{kind}/{n}"])
        if "step" in state and "exp_avg" in st:
            st["step"] = torch.tensor(float(state["step"]))
        if st:
            opt.state[p[n]] = st
