"""Native TensorFlow optimizers: TF's own training kernels applied to the variables' handles, the slots,
the per-step scalars (where the optimizer faults are applied) and the optimizer state in canonical names.

  sgd       ResourceApplyGradientDescent
  momentum  ResourceApplyMomentum                   accum = mu*accum + g; var -= lr*accum (torch's buffer)
  nesterov  ResourceApplyMomentum(use_nesterov)     var -= lr*(g + mu*accum)
  adam(w)   ResourceApplyAdam                       'epsilon hat' form, made the reference (see below)

ResourceApplyAdam computes  var -= lr*sqrt(1-b2^t)/(1-b1^t) * m / (sqrt(v) + eps_k).  The reference
(torch) is  var -= lr * (m/(1-b1^t)) / (sqrt(v/(1-b2^t)) + eps); multiplying numerator and denominator
by sqrt(1-b2^t) gives  lr*sqrt(1-b2^t)/(1-b1^t) * m / (sqrt(v) + eps*sqrt(1-b2^t)):  the kernel computes
the reference exactly when fed  eps_k = eps * sqrt(1 - b2^t),  which this backend does every step, so no
difference needs declaring. The fault `adam_eps_hat` feeds the plain eps instead.

Weight decay: coupled L2 (grad + wd*var before the kernel) for sgd/momentum/nesterov/adam; adamw is
decoupled: var *= (1 - lr*wd), then the Adam kernel. The learning rate (and every per-step scalar)
enters the compiled step as a tensor, so the step is traced once.
"""
from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

# indices of the per-step scalars fed to the step as one tensor
LR, EPS, B1P, B2P, MOM_SCALE, DECAY = range(6)


def flat(tensors: list[tf.Tensor]) -> tf.Tensor:
    """The tensors flattened into one vector, in order (a new tensor: a snapshot of variables' reads)."""
    return tf.concat([tf.reshape(t, [-1]) for t in tensors], 0)


def update_and_param_norm(before: tf.Tensor, after: list[tf.Tensor]) -> tuple[tf.Tensor, tf.Tensor]:
    """(|after - before|, |after|) of the flattened parameters. One subtraction of the flat vectors is
    the concatenation of the per-parameter differences element by element: the same bits, fewer ops."""
    a = flat(after)
    return tf.norm(a - before), tf.norm(a)


SLOTS = {"momentum": ("momentum",), "nesterov": ("momentum",),
         "adam": ("exp_avg", "exp_avg_sq"), "adamw": ("exp_avg", "exp_avg_sq")}


class NativeOptimizer:
    """The optimizer half of TensorflowBackend (a mixin): slots `self.slots[kind][param]`, Adam's count `self.t`."""

    def _make_slots(self) -> None:
        """The optimizer's slot variables (inside the backend's variable scope)."""
        self.slots: dict[str, dict[str, tf.Variable]] = {
            s: {n: tf.Variable(tf.zeros_like(self.v[n]), trainable=False, name=f"{s}/{n.replace('.', '/')}")
                for n in self.trainable} for s in SLOTS.get(self.hp.optimizer, ())}

    def _apply(self, var: tf.Variable, name: str, g: tf.Tensor, hyper: tf.Tensor,
               slots: dict[str, tf.Variable] | None = None) -> None:
        """One parameter's update by TF's own training kernel (`slots`: its optimizer slots, by default
        self.slots[...][name]; the parallel backend passes one replica's components)."""
        h = self.hp
        slot = (lambda s: self.slots[s][name]) if slots is None else slots.__getitem__
        lr = hyper[LR]
        if h.weight_decay and not self.decoupled:
            g = g + h.weight_decay * var              # coupled L2: through momentum / Adam's moments
        if h.optimizer == "sgd":
            tf.raw_ops.ResourceApplyGradientDescent(var=var.handle, alpha=lr, delta=g)
        elif h.optimizer in ("momentum", "nesterov"):
            accum = slot("momentum")
            if self.fault == "keras_momentum_schedule":   # Keras velocity v = mu v - lr g == buffer * lr_prev/lr
                accum.assign(accum * hyper[MOM_SCALE])
            tf.raw_ops.ResourceApplyMomentum(var=var.handle, accum=accum.handle, lr=lr, grad=g,
                                             momentum=tf.constant(h.momentum, self.dtype),
                                             use_nesterov=h.optimizer == "nesterov")
        else:
            if self.decoupled and h.weight_decay:
                var.assign(var * hyper[DECAY])
            tf.raw_ops.ResourceApplyAdam(var=var.handle, m=slot("exp_avg").handle,
                                         v=slot("exp_avg_sq").handle,
                                         beta1_power=hyper[B1P], beta2_power=hyper[B2P], lr=lr,
                                         beta1=tf.constant(h.beta1, self.dtype),
                                         beta2=tf.constant(h.beta2, self.dtype), epsilon=hyper[EPS], grad=g)

    def _step_hyper(self, step: int) -> np.ndarray:
        h = self.hp
        lr = self.lr_for(step)
        eps = b1p = b2p = 0.0
        if self.adam:
            self.t += 1
            b1p, b2p = h.beta1 ** self.t, h.beta2 ** self.t
            eps = h.eps if self.fault == "adam_eps_hat" else h.eps * math.sqrt(1.0 - b2p)
        scale = 1.0
        if self.fault == "keras_momentum_schedule" and self.prev_lr is not None and self.prev_lr != lr:
            scale = self.prev_lr / lr
        self.prev_lr = lr
        return np.array([lr, eps, b1p, b2p, scale, 1.0 - lr * h.weight_decay], self.np_dtype)

    def _state_slots(self) -> dict[str, dict[str, tf.Variable]]:
        """The slot variables whose values are the exported optimizer state (the parallel backend: replica 0's)."""
        return self.slots

    def export_opt_state(self) -> dict[str, np.ndarray]:
        if not self.has_state:
            return {}
        out = {f"{s}/{n}": self._canon(n, var.numpy()) for s, slot in self._state_slots().items()
               for n, var in slot.items()}
        if self.adam:
            out["step"] = np.asarray(float(self.t))
        return out

    def load_opt_state(self, state: dict[str, np.ndarray], step: int) -> None:
        for s, slot in self.slots.items():
            for n, var in slot.items():
                if f"{s}/{n}" in state:
                    var.assign(self._native(n, state[f"{s}/{n}"]))
                    self.has_state = True
        if self.adam and "step" in state:
            self.t = int(round(float(state["step"])))
        self.prev_lr = self.lr_for(step - 1) if step > 0 else None

