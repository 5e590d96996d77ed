"""Training hyper-parameters, learning-rate schedules, and the reference optimizer mathematics.

`HParams` is what every backend receives. `lr_at` is the one schedule every wrapper feeds its
native optimizer step by step. The `reference_*` functions are the canonical update rules in
NumPy (optax-style pure `init`/`update` pairs); wrappers are tested against them, and declared
semantic differences are stated as formulas next to them.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import numpy as np

OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam", "adamw")
SCHEDULES = ("constant", "step", "cosine", "warmup")


class HParamError(ValueError):
    """A hyper-parameter that cannot be used; the message names the field and the value."""


@dataclass(frozen=True)
class HParams:
    optimizer: str = "momentum"
    lr: float = 0.05
    momentum: float = 0.9          # momentum / nesterov
    beta1: float = 0.9             # adam / adamw
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0      # sgd/momentum/nesterov/adam: L2 added to the gradient; adamw: decoupled
    schedule: str = "constant"
    step_size: int = 100           # schedule 'step': lr * gamma ** (t // step_size)
    gamma: float = 0.5
    warmup_steps: int = 20         # schedule 'warmup': lr * min(1, (t + 1) / warmup_steps)
    steps: int = 300
    batch_size: int = 64
    seed: int = 0                  # data order (per-epoch shuffles) and dropout masks
    init_seed: int = 0             # canonical initial weights
    eval_every: int = 50
    checkpoint_every: int = 50

    def __post_init__(self) -> None:
        def bad(f: str, msg: str):
            raise HParamError(f"hyper-parameter '{f}': {msg}, got {getattr(self, f)!r}")
        if self.optimizer not in OPTIMIZERS:
            bad("optimizer", f"unknown optimizer; known: {', '.join(OPTIMIZERS)}")
        if self.schedule not in SCHEDULES:
            bad("schedule", f"unknown schedule; known: {', '.join(SCHEDULES)}")
        for f in ("lr", "eps"):
            if not (isinstance(getattr(self, f), (int, float)) and getattr(self, f) > 0 and math.isfinite(getattr(self, f))):
                bad(f, "must be a positive finite number")
        for f in ("momentum", "beta1", "beta2"):
            if not 0 <= getattr(self, f) < 1:
                bad(f, "must be in [0, 1)")
        if not (isinstance(self.weight_decay, (int, float)) and self.weight_decay >= 0
                and math.isfinite(self.weight_decay)):
            bad("weight_decay", "must be a finite number >= 0")
        for f in ("seed", "init_seed"):      # numpy's generators take non-negative seeds only
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                bad(f, "must be a non-negative integer")
        for f in ("step_size", "warmup_steps", "steps", "batch_size", "eval_every", "checkpoint_every"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                bad(f, "must be a positive integer")
        if not 0 < self.gamma <= 1:
            bad("gamma", "must be in (0, 1]")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "HParams":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise HParamError(f"unknown hyper-parameter(s): {', '.join(sorted(unknown))}")
        return cls(**d)

    def with_(self, **kw: Any) -> "HParams":
        return replace(self, **kw)


def float32_bias_corrections(h: HParams, t: int) -> tuple[float, float]:
    """Adam's (1 - b1^t, 1 - b2^t) as Keras computes them in a float32 run: the betas and the step cast to
    float32, the power and the difference in float32. float32(0.999) is 0.99900001287, so 1 - b2^t is
    1.3e-5 relative low at t = 1 (the update 6.4e-6 low, about 50 float32 ULPs, the same sign every step)."""
    f = np.float32
    return (float(f(1) - np.power(f(h.beta1), f(t), dtype=f)),
            float(f(1) - np.power(f(h.beta2), f(t), dtype=f)))


def lr_at(h: HParams, t: int) -> float:
    """The learning rate used by the update of step t (0-based), in float64."""
    if h.schedule == "constant":
        return h.lr
    if h.schedule == "step":
        return h.lr * h.gamma ** (t // h.step_size)
    if h.schedule == "cosine":
        return h.lr * 0.5 * (1.0 + math.cos(math.pi * min(t, h.steps) / h.steps))
    if h.schedule == "warmup":
        return h.lr * min(1.0, (t + 1) / h.warmup_steps)
    raise AssertionError(h.schedule)


# --------------------------------------------------------------------------- reference maths
State = dict[str, Any]


def reference_init(h: HParams, params: dict[str, np.ndarray]) -> State:
    """Canonical optimizer state: momentum -> 'momentum' (PyTorch's buffer b); adam -> exp_avg, exp_avg_sq, step."""
    z = {k: np.zeros_like(v, np.float64) for k, v in params.items()}
    if h.optimizer in ("momentum", "nesterov"):
        return {"momentum": z}
    if h.optimizer in ("adam", "adamw"):
        return {"exp_avg": z, "exp_avg_sq": {k: v.copy() for k, v in z.items()}, "step": 0}
    return {}


# the optimizer state's roles in the canonical flat layout every backend exports ('<role>/<param>', 'step')
STATE_ROLES = ("momentum", "exp_avg", "exp_avg_sq")


def load_flat_state(state: State, flat: dict[str, np.ndarray], dtype: Any = np.float64) -> bool:
    """Fill `state` (reference_init's layout) in place from the canonical flat optimizer state; entries that
    `flat` lacks stay as they are. True when some role was given (torch exports nothing before its first step)."""
    given = False
    for role in STATE_ROLES:
        for n in state.get(role, {}):
            if f"{role}/{n}" in flat:
                state[role][n] = np.asarray(flat[f"{role}/{n}"], dtype).copy()
                given = True
    if "step" in state and "step" in flat:
        state["step"] = int(round(float(flat["step"])))
    return given


def reference_update(h: HParams, t: int, params: dict[str, np.ndarray], grads: dict[str, np.ndarray],
                     state: State, *, adam_eps_hat: bool = False, lr: float | None = None,
                     bias_corrections: tuple[float, float] | None = None
                     ) -> tuple[dict[str, np.ndarray], State]:
    """One step of the reference optimizer in float64; returns (new params, new state). `lr`: the rate
    applied, when it is not the schedule's value at step t (a wrapper's perturbed learning rate);
    `bias_corrections`: Adam's (1 - b1^n, 1 - b2^n), when they are not the float64 ones (Keras' float32 betas).

    With adam_eps_hat=True the Adam step is the Keras/TF-kernel 'epsilon hat' form:
    p -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)   (a declared difference).
    """
    lr = lr_at(h, t) if lr is None else lr
    new_p, new_s = {}, {k: (dict(v) if isinstance(v, dict) else v) for k, v in state.items()}
    if h.optimizer in ("adam", "adamw"):
        new_s["step"] = state["step"] + 1
    n = new_s.get("step", 0)
    for k, p in params.items():
        p = p.astype(np.float64)
        g = grads[k].astype(np.float64)
        if h.weight_decay and h.optimizer != "adamw":
            g = g + h.weight_decay * p
        if h.optimizer == "sgd":
            p = p - lr * g
        elif h.optimizer in ("momentum", "nesterov"):
            b = h.momentum * state["momentum"][k] + g
            new_s["momentum"][k] = b
            p = p - lr * (g + h.momentum * b if h.optimizer == "nesterov" else b)
        else:
            if h.optimizer == "adamw" and h.weight_decay:
                p = p * (1 - lr * h.weight_decay)
            m = h.beta1 * state["exp_avg"][k] + (1 - h.beta1) * g
            v = h.beta2 * state["exp_avg_sq"][k] + (1 - h.beta2) * g * g
            new_s["exp_avg"][k], new_s["exp_avg_sq"][k] = m, v
            bc1, bc2 = (1 - h.beta1 ** n, 1 - h.beta2 ** n) if bias_corrections is None else bias_corrections
            if adam_eps_hat:
                p = p - lr * math.sqrt(bc2) / bc1 * m / (np.sqrt(v) + h.eps)
            else:
                p = p - lr * (m / bc1) / (np.sqrt(v / bc2) + h.eps)
        new_p[k] = p
    return new_p, new_s


# the declared optimizer formulas (algorithms.differences), named by the fault that makes a backend compute them
DECLARED_FORMULAS = ("adam_eps_hat", "adam_float32_betas", "keras_momentum_schedule")


def declared_update(h: HParams, t: int, params: dict[str, np.ndarray], grads: dict[str, np.ndarray], state: State,
                    formulas: frozenset[str] = frozenset()) -> tuple[dict[str, np.ndarray], State]:
    """reference_update of step t computing the declared formulas named in `formulas`: Keras/TF's epsilon hat
    (adam_eps_hat), Keras' bias corrections from float32 betas (adam_float32_betas), Keras' velocity
    v = mu v - lr_t g, i.e. torch's buffer rescaled by lr_{t-1} / lr_t before the step (keras_momentum_schedule).
    `state` is the state before step t, as every backend exports it (torch's conventions)."""
    unknown = sorted(set(formulas) - set(DECLARED_FORMULAS))
    if unknown:
        raise ValueError(f"no declared optimizer formula for {', '.join(unknown)}")
    lr = lr_at(h, t)
    if "keras_momentum_schedule" in formulas and t > 0 and "momentum" in state and lr_at(h, t - 1) != lr:
        ratio = lr_at(h, t - 1) / lr
        state = dict(state, momentum={k: v * ratio for k, v in state["momentum"].items()})
    bc = (float32_bias_corrections(h, int(state["step"]) + 1)
          if "adam_float32_betas" in formulas and "step" in state else None)
    return reference_update(h, t, params, grads, state, adam_eps_hat="adam_eps_hat" in formulas, lr=lr,
                            bias_corrections=bc)
