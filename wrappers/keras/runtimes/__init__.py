"""Keras' per-backend code, one module per Keras backend (jax.py, tensorflow.py, torch.py), each with the same
names: the custom `train_step` (its body `step_with_gradients`), the `Stepper` that runs it (and, for the
gradient probes, its body on the state, undone: `Stepper.gradients`), `make_parallel` (its data-parallel strategy,
a wrappers.keras.parallel.Parallel, or a refusal), `no_grad` for the forward probes, `setup` (threads and
determinism), `sum_of_squares` (the step statistics' norms), `Stepper.read` (variables to the host), `versions`, `devices`, `jit_options`,
`enable_float64`, and the constants that say how this Keras backend differs (FLOAT64_REFUSAL, FLOAT64_NOTE,
FLOAT64_FORMULA, FLOAT32_HYPERPARAMETERS, SYNCHRONIZED_BN, REPLICA_GRADIENTS_SUMMED, AVGPOOL_SAME_REPLICATES). The
Keras wrapper imports the one module of the running Keras backend, once
(`current()`), and never branches on the backend's name.
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


def current() -> ModuleType:
    """The module of the Keras backend this process runs (KERAS_BACKEND, read by keras at import)."""
    import keras
    return importlib.import_module(f".{keras.backend.backend()}", __name__)


def host_copies(variables: list) -> list:
    """The variables' values as host copies (never views of live state), one at a time: `Stepper.read` where a
    read needs no compiled function (jax, torch)."""
    import numpy as np
    from keras import ops
    return [np.array(ops.convert_to_numpy(v.value), copy=True) for v in variables]


def traced_sum_of_squares(tensors: list) -> Any:
    """The sum over `tensors` of each one's sum of squares, in order, in keras.ops: the step statistics' norms where
    the step is traced once (jax, tensorflow); torch's eager step calls the same kernels directly."""
    from keras import ops
    return sum(ops.sum(ops.square(t)) for t in tensors)
