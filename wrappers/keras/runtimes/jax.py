"""keras-jax: the custom stateless `train_step(state, data)` (the documented way to customise fit on
the JAX backend), the Stepper that runs it the way `fit` does, data parallelism with
keras.distribution.DataParallel, the step's own gradients for probes (Stepper.gradients), and the
JAX/XLA determinism record.

The Stepper (why not train_on_batch): `train_on_batch` reads every Keras variable into a state tuple,
runs the model's compiled `train_function` and assigns every variable back, on every call (about
1.1-1.3 ms a step here, more than the step itself). `fit` instead keeps the state tuple as JAX arrays
between batches and writes the variables back once, at the end (`jax_state_sync`). The Stepper does
what fit does between two callbacks: the state (trainable, non-trainable, optimizer and metric
variables) lives here as JAX arrays, each step calls the model's own `train_function` (made by
`make_train_function`: the jitted `train_step` below, state donated) on one batch, and the values
that change from outside between steps -- the learning rate (the optimizer's `learning_rate`
variable, an entry of the optimizer state: a schedule is a new value, never a retrace) and the
harness's dropout masks (non-trainable variables) -- are written into their slots of the state, and the step's
statistics come back packed in one array (one blocking device-to-host read a step, as fit's logs are not read
at all between callbacks).
`sync()` writes the state back into the Keras variables (before every export, evaluation, probe or
load), after which the variables are the state again until the next step.

Data parallel (`--devices N`, N forced host devices or GPUs): keras.distribution.DataParallel over
the first N JAX devices, set (keras.distribution.set_distribution) before the model exists, so every
variable is created replicated on the mesh and `make_train_function` compiles the step with the
state's shardings. The global batch is placed with the distribution's data layout (batch axis on the
mesh: device r holds the contiguous rows [r B/N, (r+1) B/N), base.shard_bounds) by
keras.distribution.distribute_tensor. One GSPMD program over the global batch: the loss is the
compiled loss over the global batch (sum / B), so its gradient is the global-batch mean, all-reduced
by XLA. BatchNormalization sees the global batch too: its statistics are the global batch's
(Keras' DataParallel on JAX has no per-replica statistics; BatchNormalization(synchronized=True) is
TensorFlow-only and not needed). The replica losses are the mean losses of the N contiguous groups
of B/N samples, i.e. of each device's shard.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

import jax
import keras
import numpy as np
from keras import ops

from ...base import STEP_STATS
from ..parallel import Parallel
from . import host_copies, traced_sum_of_squares as sum_of_squares  # noqa: F401  (this module's name for it)

PARALLEL = "keras.distribution.DataParallel"
FLOAT64_REFUSAL = ""           # float64 works (jax_enable_x64, switched on by `enable_float64`)
FLOAT64_NOTE = ""
FLOAT32_HYPERPARAMETERS = False
SYNCHRONIZED_BN = False        # BatchNormalization(synchronized=True) is TensorFlow-only (and not needed: GSPMD)
REPLICA_GRADIENTS_SUMMED = False   # one program over the global batch: each gradient is already the global one
AVGPOOL_SAME_REPLICATES = False
# float64: the kinds lowered by the spec's formula (layers.py) because Keras' own op is not float64 here: Keras
# 3.15's dtypes.result_type maps float64 to float32 on every backend but TensorFlow, and BatchNormalization.call,
# ops.mean (LayerNormalization, GlobalAveragePooling2D) and ops.tanh compute in it (measured: 1e-7, 1e-7, 5e-8,
# 1.8e-7 relative)
FLOAT64_FORMULA = frozenset({"batchnorm2d", "layernorm", "global_avgpool2d", "tanh"})


def enable_float64() -> None:
    """Before any array exists (the model is built after this)."""
    jax.config.update("jax_enable_x64", True)


def train_step(self, state, data):
    """One jitted step: value_and_grad of THIS batch's data loss through stateless_call, then
    optimizer.stateless_apply. BatchNorm's moving statistics come back in non_trainable_variables. The logs
    keep Keras' names (train_on_batch and fit read them) and add `packed`, what the Stepper reads."""
    self.traces += 1                                    # Python: counts traces, not steps
    logs, new_state, _ = step_with_gradients(self, state, data)
    # the statistics in STEP_STATS' order (then the replica losses) in one array: one device-to-host read a step
    parts = [logs[k] for k in STEP_STATS] + ([logs["replica_losses"]] if "replica_losses" in logs else [])
    dtype = logs["loss"].dtype                          # float32, or float64 (accuracy is exact in either)
    logs["packed"] = ops.concatenate([ops.reshape(ops.cast(t, dtype), (-1,)) for t in parts])
    return logs, new_state


def step_with_gradients(self, state, data):
    """The training step's body, also returning the gradients of the data loss (before the fault seam
    and the coupled L2 term): the step trains with it, the probes compile it with the same jit options
    (Stepper.gradients), so a probe's gradient is the program that trained, not an eager re-derivation
    (eager op-by-op and XLA-fused kernels round differently: a ReLU6 kink can flip in one and not the other)."""
    trainable, non_trainable, opt_vars, metric_vars = state
    x, y = data[0], data[1]

    def loss_fn(tv):
        return forward_loss(self, tv, non_trainable, x, y)

    (_, (loss, logits, non_trainable, reps)), raw_grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
    grads, grad_norm = self.prepare_grads(raw_grads, trainable)
    new_trainable, opt_vars = self.optimizer.stateless_apply(opt_vars, grads, trainable)
    logs = self.step_logs(loss, logits, y, grad_norm, trainable, new_trainable)
    if reps is not None:
        logs["replica_losses"] = reps
    return logs, (new_trainable, non_trainable, opt_vars, metric_vars), raw_grads


def forward_loss(self, tv, non_trainable, x, y):
    """The step's forward and objective (differentiated by step_with_gradients; run alone, recording every
    layer, by the forward probes: Stepper.layer_outputs), with its auxiliaries (loss, logits, new
    non-trainable values, the replica losses)."""
    logits, ntv = self.stateless_call(tv, non_trainable, x, training=True)
    loss = self.data_loss(y, logits)
    reps = self.replica_losses(y, logits) if self.replicas > 1 else None   # each device's shard
    objective = ops.sum(reps) if self.sum_replicas else loss   # fault grad_sum_replicas: N x the gradient
    return objective, (loss, logits, ntv, reps)


class Stepper:
    """Runs the model's compiled train_function on state kept as JAX arrays (fit's way; see above)."""

    def __init__(self, net, optimizer, parallel: "JaxDataParallel | None" = None) -> None:
        self.net, self.optimizer, self.parallel = net, optimizer, parallel
        self.groups = (list(net.trainable_variables), list(net.non_trainable_variables),
                       list(optimizer.variables), list(net.metrics_variables))
        self.slots = {id(v): (g, i) for g, vs in enumerate(self.groups) for i, v in enumerate(vs)}
        # data parallel: a value written into the state takes its variable's sharding (replicated on the mesh),
        # which is also the step's output sharding of that slot (the state is donated: in and out must match)
        self.shardings = ({id(v): v.value.sharding for vs in self.groups for v in vs}
                          if parallel is not None else None)
        self.state: list[list[Any]] | None = None      # None: the Keras variables hold the state
        self.written: dict[int, tuple] = {}            # (shape, bytes) last written into each slot (since the pull)
        self.dtypes: dict[int, Any] = {}               # each written variable's dtype
        self.probe: Callable | None = None             # the step with its gradients, compiled as the step is
        self.layers_probe: tuple | None = None          # (recorder, the step's forward recording every layer)
        self.joint_probe: tuple | None = None           # (recorder, that forward differentiated: layers_and_gradients)

    def step(self, x: np.ndarray, y: np.ndarray, values: list[tuple[Any, np.ndarray]]) -> dict[str, np.ndarray]:
        """One batch; `values`: (Keras variable, new value) written into the state first."""
        net = self.net
        if net.train_function is None:
            net.make_train_function()
        if self.state is None:
            self.state = [[v.value for v in vs] for vs in self.groups]
        for var, val in values:
            k = id(var)
            if k not in self.dtypes:
                self.dtypes[k] = var.dtype    # a Keras property that standardizes its dtype on every read
            val = np.asarray(val, self.dtypes[k])
            raw = (val.shape, val.tobytes())
            if self.written.get(k) == raw:
                continue                  # the slot holds it already (a constant lr: no transfer at all)
            self.written[k] = raw
            g, i = self.slots[k]
            self.state[g][i] = val if self.shardings is None else jax.device_put(val, self.shardings[k])
        if self.parallel is not None:
            x, y = self.parallel.distribute(x), self.parallel.distribute(y)
        logs, state = net.train_function(tuple(self.state), iter([(x, y, None)]))
        self.state = [list(s) for s in state]
        packed = np.asarray(logs["packed"])                # the one blocking read of the step
        out = dict(zip(STEP_STATS, packed))
        if len(packed) > len(STEP_STATS):
            out["replica_losses"] = packed[len(STEP_STATS):]
        return out

    def gradients(self, x: np.ndarray, y: np.ndarray) -> tuple[Any, list]:
        """(data loss, gradients) of one batch from the training step's own program (step_with_gradients,
        jitted as make_train_function jits train_step: same out_shardings, no donation), on the state the
        Keras variables hold (call after sync); the stepped state is discarded."""
        net = self.net
        if self.probe is None:
            def probe(state, data):
                return step_with_gradients(net, state, data)
            if not net.run_eagerly and net.jit_compile:
                shardings = None
                if keras.distribution.distribution() is not None:
                    shardings = (None, net._get_state_sharding_spec(), None)
                probe = jax.jit(probe, out_shardings=shardings)
            self.probe = probe
        state = tuple([v.value for v in vs] for vs in self.groups)
        if self.parallel is not None:
            x, y = self.parallel.distribute(x), self.parallel.distribute(y)
        logs, _, grads = self.probe(state, (x, y, None))
        return logs["loss"], list(grads)

    def layer_outputs(self, x: np.ndarray, y: np.ndarray, recorder) -> list:
        """Every layer's output of the training step's forward (forward_loss, jitted as the step is, the model
        calling `recorder` in its place: its training flag and masks; data parallel: the global batch on
        the mesh), on the state the Keras variables hold (call after sync); nothing is written."""
        net = self.net

        def forward(state, data):
            forward_loss(net, state[0], state[1], data[0], data[1])
            return net.layer_record.take()
        return self._recording("layers_probe", recorder, forward, x, y)

    def layers_and_gradients(self, x: np.ndarray, y: np.ndarray, recorder) -> tuple[list, Any, list] | None:
        """(every layer's output, the data loss, the gradients before the fault seam) from one program: the
        forward probes' recording forward (forward_loss with `recorder`) differentiated as step_with_gradients
        differentiates it, the layers returned beside the loss (Backend.layers_and_gradients); nothing written.
        None when the step is not compiled: the probes then run the same eager operations."""
        net = self.net
        if net.run_eagerly or not net.jit_compile:
            return None

        def joint(state, data):
            def loss_fn(tv):
                objective, aux = forward_loss(net, tv, state[1], data[0], data[1])
                return objective, (aux[0], net.layer_record.take())
            (_, (loss, layers)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state[0])
            return layers, loss, grads
        return self._recording("joint_probe", recorder, joint, x, y)

    def _recording(self, slot: str, recorder, body: Callable, x: np.ndarray, y: np.ndarray):
        """body(state, data) with the model calling `recorder` in its place, jitted as the step is and kept in
        `slot` per recorder, on the (trainable, non-trainable) state the Keras variables hold."""
        net = self.net
        if getattr(self, slot) is None or getattr(self, slot)[0] is not recorder:
            def recording(state, data):
                net.layer_record.recorder = recorder
                try:
                    return body(state, data)
                finally:
                    net.layer_record.recorder = None
            compiled = recording if (net.run_eagerly or not net.jit_compile) else jax.jit(recording)
            setattr(self, slot, (recorder, compiled))
        state = tuple([v.value for v in vs] for vs in self.groups[:2])
        if self.parallel is not None:
            x, y = self.parallel.distribute(x), self.parallel.distribute(y)
        return getattr(self, slot)[1](state, (x, y))

    def sync(self) -> None:
        """The state into the Keras variables (fit's jax_state_sync); they hold it again afterwards."""
        if self.state is None:
            return
        for vs, vals in zip(self.groups, self.state):
            for v, a in zip(vs, vals):
                v.assign(a)
        self.state = None
        self.written.clear()

    def read(self, variables: list) -> list[np.ndarray]:
        """The variables' values (host copies)."""
        return host_copies(variables)


class JaxDataParallel(Parallel):
    """keras.distribution.DataParallel over the first N JAX devices (see the module docstring)."""
    backend = "keras-jax"
    hosts_missing = ("a multi-process keras.distribution run needs jax.distributed and per-process data feeding, "
                     "not wired for Keras")

    def __init__(self, replicas: int, hosts: int, sync_bn: bool, fault: str | None, extra: dict[str, Any]) -> None:
        from ...base import UnsupportedError
        super().__init__(replicas, hosts, sync_bn, fault)
        have = jax.devices()
        if len(have) < replicas:
            raise UnsupportedError(f"keras-jax: --devices {replicas} but jax sees {len(have)} {jax.default_backend()} "
                                   f"device(s) (XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r})")
        self.dist = keras.distribution.DataParallel(devices=have[:replicas])
        # before any Keras object exists: variables are then created replicated on the mesh
        keras.distribution.set_distribution(self.dist)
        self.devices = [f"{d.platform}:{d.id}" for d in np.asarray(self.dist.device_mesh.devices).flat]
        self.checked = False

    def scope(self):
        return contextlib.nullcontext()       # set_distribution above: the distribution is global

    def distribute(self, a: np.ndarray):
        """A global batch on the mesh with the distribution's data layout (batch axis sharded)."""
        out = keras.distribution.distribute_tensor(a, self.dist.get_data_layout(a.shape))
        if not self.checked:      # once: the layout gives mesh device r the rows [r B/N, (r+1) B/N)
            n = len(a) // self.replicas
            where = out.sharding.devices_indices_map(a.shape)
            for r, d in enumerate(np.asarray(self.dist.device_mesh.devices).flat):
                rows = where[d][0]
                if (rows.start or 0, len(a) if rows.stop is None else rows.stop) != (r * n, (r + 1) * n):
                    raise RuntimeError(f"keras-jax: DataParallel placed rows {rows} of the batch on mesh device {r} "
                                       f"({d}); the harness's shard {r} is [{r * n}, {(r + 1) * n})")
            self.checked = True
        return out

    def info(self, fault: str | None, has_bn: bool) -> dict[str, Any]:
        mesh = self.dist.device_mesh
        return {
            "strategy": PARALLEL, "replicas": self.replicas, "processes": 1, "hosts": 1, "devices": self.devices,
            "mesh": {"shape": list(mesh.shape), "axis_names": list(mesh.axis_names)}, "sync_bn": self.sync_bn,
            "sharding": f"keras.distribution.distribute_tensor with DataParallel.get_data_layout: batch axis "
                        f"'{self.dist.batch_dim_name}' on the mesh, replica r takes samples [r*B/N, (r+1)*B/N)"
                        + (" (fault overlapping_shards: every replica takes [0, B/N))"
                           if fault == "overlapping_shards" else ""),
            "params": "replicated (DataParallel.get_variable_layout), optimizer state replicated",
            "step": "the model's train_function (make_train_function: jit with the state's shardings), one GSPMD "
                    "program over the global batch",
            "gradient_reduction": ("the SUM of the replicas' mean losses differentiated: N x the mean gradient "
                                   "(fault grad_sum_replicas)" if fault == "grad_sum_replicas" else
                                   "gradient of the global-batch loss (sum / B): XLA GSPMD all-reduce"),
            "loss": "the compiled loss over the global batch; replica losses: mean loss of each device's shard",
            "batchnorm": ("n/a (no BatchNorm)" if not has_bn else
                          "global-batch statistics, with or without --sync-bn (GSPMD: BatchNormalization over the "
                          "sharded global batch; Keras on JAX has no per-replica statistics)"),
        }


def make_parallel(replicas: int, hosts: int, sync_bn: bool, fault: str | None, extra: dict[str, Any]):
    if replicas <= 1:
        keras.distribution.set_distribution(None)     # a process may build backends one after another
        return None
    return JaxDataParallel(replicas, hosts, sync_bn, fault, extra)


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
