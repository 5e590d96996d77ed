"""keras.optimizers whose mathematics are the reference's (what Keras cannot compute is a declared
difference), the coupled-L2 coefficient the train step adds, and the optimizer state in canonical names.

Keras SGD keeps the velocity v (v = mu v - lr_t g; p += v). The canonical 'momentum/<param>' is torch's
buffer b (b = mu b + g; p -= lr_t b): exported as b = -v / lr_t with lr_t the (float32) learning rate of the
last update, loaded as v = -b * lr_{step-1}. Equal to torch's b for a constant lr; under a schedule the two
recursions differ (declared difference keras_momentum_velocity). Adam/AdamW: Keras' momentums/velocities are
exp_avg/exp_avg_sq, 'step' = optimizer.iterations. And the label-smoothed objective of fault label_smoothing.
"""
from __future__ import annotations

from typing import Any

import keras
import numpy as np
from keras import ops

from algorithms.faults import Seams
from algorithms.optim import HParams


def make_optimizer(hp: HParams, fault: str | None) -> tuple[keras.optimizers.Optimizer, float]:
    """The keras.optimizers optimizer, and the coupled-L2 coefficient the train step adds to the gradient."""
    lr = float(hp.lr)
    coupled_adamw = Seams(fault).coupled_adamw
    coupled = hp.weight_decay if (hp.optimizer != "adamw" or coupled_adamw) else 0.0
    if hp.optimizer == "sgd":
        return keras.optimizers.SGD(learning_rate=lr, momentum=0.0), coupled
    if hp.optimizer in ("momentum", "nesterov"):
        return keras.optimizers.SGD(learning_rate=lr, momentum=hp.momentum,
                                    nesterov=hp.optimizer == "nesterov"), coupled
    kw = dict(learning_rate=lr, beta_1=hp.beta1, beta_2=hp.beta2, epsilon=hp.eps)
    if hp.optimizer == "adam" or coupled_adamw:
        return keras.optimizers.Adam(**kw), coupled
    return keras.optimizers.AdamW(weight_decay=hp.weight_decay, **kw), 0.0


def slots(optimizer: keras.optimizers.Optimizer, hp: HParams, var: Any) -> dict[str, Any]:
    """canonical state kind -> the Keras optimizer variable of the parameter held by `var`."""
    i = optimizer._get_variable_index(var)
    if hp.optimizer in ("momentum", "nesterov"):
        return {"momentum": optimizer.momentums[i]}
    if hp.optimizer in ("adam", "adamw"):
        return {"exp_avg": optimizer._momentums[i], "exp_avg_sq": optimizer._velocities[i]}
    return {}


def to_canonical(kind: str, a: np.ndarray, last_lr: np.float32 | None) -> np.ndarray:
    """A Keras slot value as the canonical state: the momentum velocity as torch's buffer b = -v / lr_t."""
    if kind == "momentum":
        return (-a.astype(np.float64) / np.float64(last_lr)).astype(a.dtype)
    return a


def from_canonical(kind: str, a: np.ndarray, lr_prev: np.float32) -> np.ndarray:
    """The canonical state as a Keras slot value: torch's buffer as the velocity v = -lr_{step-1} * b."""
    if kind == "momentum":
        return -a.astype(np.float64) * np.float64(lr_prev)
    return a


def state_reload_exact(backend: Any) -> bool:
    """KerasBackend.state_reload_exact: does a load of the canonical state give the velocity the run had? Not
    with momentum: v = -lr * b rounds (measured: a re-training from a checkpoint bit-equal for 1-7 steps, then
    ~1e-7 off)."""
    return backend.hp.optimizer not in ("momentum", "nesterov")


class SmoothedSparseCrossentropy(keras.losses.Loss):
    """Fault label_smoothing: integer labels, one-hot with label smoothing, logits (what torch's
    F.cross_entropy(label_smoothing=...) computes); compiled like any Keras loss."""

    def __init__(self, num_classes: int, label_smoothing: float, **kw: Any) -> None:
        super().__init__(name="smoothed_sparse_categorical_crossentropy", reduction="sum", **kw)
        self.num_classes, self.label_smoothing = num_classes, label_smoothing

    def call(self, y_true, y_pred):
        onehot = ops.one_hot(ops.cast(ops.reshape(y_true, (-1,)), "int32"), self.num_classes, dtype=y_pred.dtype)
        return keras.losses.categorical_crossentropy(onehot, y_pred, from_logits=True,
                                                     label_smoothing=self.label_smoothing)
