"""keras-torch: the custom `train_step` (loss.backward(), the documented way to customise fit on the
torch backend), the Stepper that runs it (and its body, for the gradient probes), and torch's determinism
switches."""
from __future__ import annotations

import os
import platform
from typing import Any, Callable

import numpy as np
import torch
from keras import ops

from . import host_copies

# Keras 3.15's dtypes.result_type maps 64-bit to 32-bit (BIT64_TO_BIT32_DTYPE), and the torch backend's matmul
# casts to that result type: Dense would silently run in float32
FLOAT64_REFUSAL = ("keras-torch: float64 is not float64 in Keras 3.15 (ops.matmul computes float64 inputs in "
                   "float32 on the torch backend); use keras-tensorflow or keras-jax")
FLOAT64_NOTE = ""
FLOAT32_HYPERPARAMETERS = False
SYNCHRONIZED_BN = False
REPLICA_GRADIENTS_SUMMED = False
# 'same' average pooling padded by replication where the TF padding is asymmetric (layers.torch_avgpool_replicates)
AVGPOOL_SAME_REPLICATES = True
# float64 is refused (FLOAT64_REFUSAL): no formula substitutes
FLOAT64_FORMULA = frozenset()


def sum_of_squares(tensors: list) -> Any:
    """traced_sum_of_squares in torch's own calls: the step runs eagerly here, and these are the kernels
    keras.ops.sum(ops.square(t)) reaches, bit for bit, without Keras' dispatch around each of them."""
    return sum(torch.sum(torch.square(t)) for t in tensors)


def enable_float64() -> None:
    """Never reached: float64 is refused (FLOAT64_REFUSAL)."""


def train_step(self, data):
    """One eager step: backward of THIS batch's data loss, then optimizer.apply under no_grad."""
    return step_with_gradients(self, data)[0]


def step_with_gradients(self, data):
    """The training step's body, also returning the gradients of the data loss before the fault seam and
    the coupled L2 term: the step trains with it, the probe runs it (Stepper.gradients), so the probe's
    gradient is the step's own (and torch.compile'd like the step's when the run asks for it)."""
    x, y = data[0], data[1]
    x, y = ops.convert_to_tensor(x), ops.convert_to_tensor(y)
    tv = self.trainable_variables
    self.zero_grad()
    logits = self(x, training=True)
    loss = self.data_loss(y, logits)
    loss.backward()
    with torch.no_grad():
        raw_grads = [torch.zeros_like(v.value) if v.value.grad is None else v.value.grad.clone() for v in tv]
        before = [v.value.detach().clone() for v in tv]
        grads, grad_norm = self.prepare_grads(raw_grads, before)
        self.optimizer.apply(grads, tv)
        after = [v.value.detach() for v in tv]
        return self.step_logs(loss.detach(), logits.detach(), y, grad_norm, before, after), raw_grads


class Stepper:
    """The model's own train_function (Keras' make_train_function) on one batch, as fit and train_on_batch
    call it, without train_on_batch's per-call symbolic-build check and metric reset (two walks over every
    layer, ~0.3 ms a step; this train_step uses no compiled metric). The Keras variables are the state; the
    learning rate and the harness's dropout masks are assigned to their variables first."""

    def __init__(self, net, optimizer, distribution=None) -> None:
        self.net, self.optimizer = net, optimizer
        self.probe: Callable | None = None      # the step with its gradients, compiled as the step is

    def step(self, x, y, values):
        for var, val in values:
            var.assign(val)
        if self.net.train_function is None:
            self.net.make_train_function()
        return self.net.train_function([(x, y, None)])

    def gradients(self, x: np.ndarray, y: np.ndarray) -> tuple[Any, list]:
        """(data loss, gradients) of one batch from the training step's own body (step_with_gradients,
        torch.compile'd where make_train_function compiles the step); the step's writes are undone."""
        net = self.net
        if self.probe is None:
            def probe(data):
                return step_with_gradients(net, data)
            self.probe = torch.compile(probe) if (net.jit_compile and not net.run_eagerly) else probe
        logs, grads = self._undone(self.probe, (x, y))
        return logs["loss"], grads

    def layer_outputs(self, x: np.ndarray, y: np.ndarray, recorder) -> list:
        """Every layer's output of the training step's own forward (step_with_gradients, eager, the model
        calling `recorder` in its place: its training flag and masks); the step's writes are undone."""
        net = self.net
        net.layer_record.recorder = recorder
        try:
            self._undone(lambda data: step_with_gradients(net, data), (x, y))
            return [t.detach() for t in net.layer_record.take()]
        finally:
            net.layer_record.recorder = None

    def _undone(self, body: Callable, data):
        """body(data), then everything the step writes back as it was: the variables (parameters, moving
        statistics, optimizer state) and the parameters' .grad buffers (not cleared: a step that forgets to
        zero them must meet the gradients it left, as in training)."""
        net = self.net
        written = list(net.trainable_variables) + list(net.non_trainable_variables) + list(self.optimizer.variables)
        saved = [v.value.detach().clone() for v in written]
        grads = [(v.value, None if v.value.grad is None else v.value.grad.clone()) for v in net.trainable_variables]
        try:
            return body(data)
        finally:
            with torch.no_grad():
                for v, value in zip(written, saved):
                    v.assign(value)
                for t, g in grads:
                    t.grad = g

    def sync(self) -> None:
        """Nothing to do: the variables are the state."""

    def read(self, variables: list) -> list[np.ndarray]:
        """The variables' values (host copies)."""
        return host_copies(variables)


def make_parallel(replicas: int, hosts: int, sync_bn: bool, fault: str | None, extra: dict[str, Any]):
    """Keras 3 has no data parallelism on its torch backend: refused loudly."""
    if replicas > 1 or hosts > 1:
        from ...base import UnsupportedError
        from .. import KerasTorchEntry      # the one wording, which the harness also reads before starting us
        raise UnsupportedError(f"keras-torch: {KerasTorchEntry.no_data_parallel} (--devices {replicas}"
                               f"{f', --hosts {hosts}' if hosts > 1 else ''})")
    return None


def no_grad():
    return torch.no_grad()


def setup(threads: int, deterministic: bool) -> dict[str, Any]:
    torch.set_num_threads(threads)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = False   # a debugging aid, as in wrappers/torch/backend.py
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    return {"torch.use_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "torch.fill_uninitialized_memory": torch.utils.deterministic.fill_uninitialized_memory,
            "torch.num_threads": torch.get_num_threads(),
            "cudnn.deterministic": torch.backends.cudnn.deterministic,
            "cudnn.benchmark": torch.backends.cudnn.benchmark,
            "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}


def versions() -> dict[str, str]:
    return {"torch": torch.__version__}


def devices() -> list[str]:
    if torch.cuda.is_available():
        return [f"cuda:0 {torch.cuda.get_device_name(0)}"]
    return [f"cpu ({platform.processor() or platform.machine()})"]


def jit_options(jit: bool, extra: dict[str, Any]) -> dict[str, Any]:
    """Eager (Keras' 'auto' on torch); torch.compile only on request (extra torch_compile=true)."""
    return {"run_eagerly": False, "jit_compile": bool(jit and extra.get("torch_compile", False))}
