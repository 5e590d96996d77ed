"""keras-tensorflow: the custom `train_step` (GradientTape, the documented way to customise fit on
the TensorFlow backend), a stateless value-and-gradient for probes, and TF's determinism switches."""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

import tensorflow as tf


def train_step(self, data):
    """One step inside Keras' tf.function: gradients of THIS batch's data loss, then optimizer.apply."""
    x, y = data[0], data[1]
    tv = self.trainable_variables
    with tf.GradientTape() as tape:
        logits = self(x, training=True)
        loss = self.data_loss(y, logits)
    grads = tape.gradient(loss, tv)
    grads = [tf.zeros_like(v.value) if g is None else g for g, v in zip(grads, tv)]  # unused parameter
    before = [tf.identity(v.value) for v in tv]          # ordered before the update by tf.function's ACD
    grads, grad_norm = self.prepare_grads(grads, before)
    self.optimizer.apply(grads, tv)
    after = [tf.identity(v.value) for v in tv]
    return self.step_logs(loss, logits, y, grad_norm, before, after)


def value_and_grad(fn: Callable, values: list) -> tuple[Any, Any, list]:
    """fn(values) -> (loss, aux); returns (loss, aux, d loss / d values), no state change."""
    values = [tf.convert_to_tensor(v) for v in values]
    with tf.GradientTape() as tape:
        tape.watch(values)
        loss, aux = fn(values)
    grads = tape.gradient(loss, values)
    return loss, aux, [tf.zeros_like(v) if g is None else g for g, v in zip(grads, values)]


def no_grad():
    return contextlib.nullcontext()


def setup(threads: int, deterministic: bool) -> dict[str, Any]:
    rec: dict[str, Any] = {}
    try:   # only possible before the TF runtime starts (TF_NUM_*_THREADS are set by the launcher too)
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    except RuntimeError as e:  # pragma: no cover - runtime already initialised
        rec["threading_error"] = str(e)
    if deterministic:
        tf.config.experimental.enable_op_determinism()
    rec.update({"tf.config.experimental.enable_op_determinism": deterministic,
                "intra_op_parallelism_threads": tf.config.threading.get_intra_op_parallelism_threads(),
                "inter_op_parallelism_threads": tf.config.threading.get_inter_op_parallelism_threads(),
                "TF_NUM_INTRAOP_THREADS": os.environ.get("TF_NUM_INTRAOP_THREADS"),
                "TF_DETERMINISTIC_OPS": os.environ.get("TF_DETERMINISTIC_OPS")})
    return rec


def versions() -> dict[str, str]:
    return {"tensorflow": tf.__version__}


def devices() -> list[str]:
    return [f"{d.name} ({d.device_type})" for d in tf.config.list_logical_devices()]


def jit_options(jit: bool, extra: dict[str, Any]) -> dict[str, Any]:
    """tf.function always (unless --no-jit: run_eagerly); XLA only on request (Keras' 'auto' is off on CPU)."""
    return {"run_eagerly": not jit, "jit_compile": bool(jit and extra.get("xla", False))}
