"""keras-jax: the custom stateless `train_step(state, data)` (the documented way to customise fit on
the JAX backend), a stateless value-and-gradient for probes, and the JAX/XLA determinism record."""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

import jax


def train_step(self, state, data):
    """One jitted step: value_and_grad of THIS batch's data loss through stateless_call, then
    optimizer.stateless_apply. BatchNorm's moving statistics come back in non_trainable_variables."""
    trainable, non_trainable, opt_vars, metric_vars = state
    x, y = data[0], data[1]

    def loss_fn(tv):
        logits, ntv = self.stateless_call(tv, non_trainable, x, training=True)
        return self.data_loss(y, logits), (logits, ntv)

    (loss, (logits, non_trainable)), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
    grads, grad_norm = self.prepare_grads(grads, trainable)
    new_trainable, opt_vars = self.optimizer.stateless_apply(opt_vars, grads, trainable)
    logs = self.step_logs(loss, logits, y, grad_norm, trainable, new_trainable)
    return logs, (new_trainable, non_trainable, opt_vars, metric_vars)


def value_and_grad(fn: Callable, values: list) -> tuple[Any, Any, list]:
    """fn(values) -> (loss, aux); returns (loss, aux, d loss / d values), no state change."""
    (loss, aux), grads = jax.value_and_grad(fn, has_aux=True)(list(values))
    return loss, aux, grads


def no_grad():
    return contextlib.nullcontext()


def setup(threads: int, deterministic: bool) -> dict[str, Any]:
    # XLA on CPU is deterministic for a fixed thread setting; the flags are set before jax is imported
    return {"XLA_FLAGS": os.environ.get("XLA_FLAGS", ""), "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS"),
            "jax_default_matmul_precision": str(jax.config.jax_default_matmul_precision),
            "jax_enable_x64": bool(jax.config.jax_enable_x64),
            "deterministic": deterministic,
            "note": "XLA CPU has no op-determinism switch; --xla_gpu_deterministic_ops applies on GPU only"}


def versions() -> dict[str, str]:
    import jaxlib
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__}


def devices() -> list[str]:
    return [str(d) for d in jax.devices()]


def jit_options(jit: bool, extra: dict[str, Any]) -> dict[str, Any]:
    return {"run_eagerly": not jit, "jit_compile": bool(jit)}
