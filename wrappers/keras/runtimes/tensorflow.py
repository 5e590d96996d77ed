"""keras-tensorflow: the custom `train_step` (GradientTape, the documented way to customise fit on
the TensorFlow backend), the Stepper that runs it (and its body, for the gradient probes), data
parallelism with tf.distribute, and TF's determinism switches.

Data parallel (`--devices N`): tf.distribute.MirroredStrategy over N logical CPU devices (configured
before TF's runtime starts) or the first N GPUs; the model, its variables and the optimizer are
created under strategy.scope() (Keras' rule: a model is trained by the strategy it was made under).
Each step runs the model's own compiled `train_function` (Keras' `make_train_function`: a
tf.function of strategy.run(train_step) and Keras' reduce_per_replica, mean over replicas) on the
global batch cut into N contiguous shards in the harness's order (base.shard_bounds; the fault
`overlapping_shards` gives every replica shard 0) and handed to the replicas by
strategy.experimental_distribute_values_from_function -- not by fit's tf.data pipeline
(experimental_distribute_dataset), whose rebatching does not promise replica r the rows
[r B/N, (r+1) B/N). In each replica the step is Keras' own recipe for a strategy: the replica's mean
loss scaled by 1/N (what keras' scale_loss_for_distribution does to a compiled loss), the tape's
gradient, and optimizer.apply, whose TF optimizer all-reduces the gradients with a SUM
(TFOptimizer._all_reduce_sum_gradients) and updates every mirrored component: the global-batch
mean gradient. The fault `grad_sum_replicas` leaves out the 1/N: N x the gradient. Coupled L2 adds
wd * p / N per replica (what a regularisation loss becomes under Keras' scaling), wd * p after the sum.

Reported: loss and accuracy = Keras' mean over replicas of the replicas' shard means (equal shards:
the global means); grad_norm = the norm of the SUM all-reduce of the replicas' (scaled) gradients,
a second all-reduce of the same values taken for the statistic; update/param norms from the
replica's own components (identical in every replica); replica losses: each replica's shard mean,
scattered into a length-N vector and SUM all-reduced (x + 0 is exact).

BatchNorm: per-replica batch statistics by default (declared difference per_replica_batchnorm); the
moving statistics are then each replica's own (Keras' moving_mean is a MirroredVariable with
aggregation NONE: every replica updates its own component); the exported and evaluated ones are
replica 0's (what a Keras checkpoint saves: the primary component). `--sync-bn`:
BatchNormalization(synchronized=True) (global-batch statistics through the replica context's
all-reduce); every replica then holds the same moving statistics.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Callable

import numpy as np
import tensorflow as tf

from ..parallel import Parallel
from . import traced_sum_of_squares as sum_of_squares  # noqa: F401  (this module's name for it)

PARALLEL = "tf.distribute.MirroredStrategy"
FLOAT64_REFUSAL = ""
FLOAT64_NOTE = ("Keras' float64: the TF backend's ops.cast(python float, float64) goes through float32, so SGD "
                "momentum 0.9 acts as 0.89999998 (~3e-8 relative per momentum update)")
FLOAT32_HYPERPARAMETERS = True   # ops.cast(python float, float64) goes through float32 (FLOAT64_NOTE): Adam's betas too
SYNCHRONIZED_BN = True         # --sync-bn: BatchNormalization(synchronized=True) under the strategy
REPLICA_GRADIENTS_SUMMED = True    # the optimizer SUMs the replicas' gradients: each adds its share of the L2 term
AVGPOOL_SAME_REPLICATES = False
# float64: the kinds lowered by the spec's formula (layers.py) because Keras' own op is not float64 here:
# tf.nn.gelu casts its constants (1/sqrt(2); 0.044715) through float32 (5e-10 / 9e-11 relative),
# tf.nn.leaky_relu holds alpha in a float32 attribute (alpha 0.2: 3e-9 relative)
FLOAT64_FORMULA = frozenset({"gelu", "leaky_relu"})


def enable_float64() -> None:
    """Nothing to switch on: TensorFlow has float64."""
_STRATEGIES: dict[tuple, tf.distribute.Strategy] = {}


def train_step(self, data):
    """One step inside Keras' tf.function (inside strategy.run under data parallelism): gradients of
    THIS batch's (this replica's shard's) data loss, then optimizer.apply."""
    self.traces += 1                                    # Python: counts traces, not steps
    return step_with_gradients(self, data)[0]


def step_with_gradients(self, data):
    """The training step's body, also returning the gradients of the (scaled) data loss before the fault
    seam and the coupled L2 term: the step trains with it, the probe compiles it as Keras compiles the step
    (Stepper.gradients), so the probe's gradient is the step's (an eager GradientTape runs other
    kernels than the step's graph: 5.6e-7 relative on a small conv net)."""
    x, y = data[0], data[1]
    tv = self.trainable_variables
    n = self.replicas
    with tf.GradientTape() as tape:
        logits = self(x, training=True)
        loss = self.data_loss(y, logits)
        # Keras' scaling of a replica's loss under a strategy (scale_loss_for_distribution): x 1/N
        objective = loss if (n == 1 or self.sum_replicas) else loss * tf.cast(1.0 / n, loss.dtype)
    grads = tape.gradient(objective, tv)
    raw_grads = grads = [tf.zeros_like(v.value) if g is None else g for g, v in zip(grads, tv)]  # unused parameter
    before = [tf.identity(v.value) for v in tv]          # ordered before the update by tf.function's ACD
    ctx = tf.distribute.get_replica_context() if n > 1 else None
    grads, grad_norm = self.prepare_grads(grads, before, reduce=(lambda g: ctx.all_reduce("sum", g)) if ctx else None)
    self.optimizer.apply(grads, tv)                      # under a strategy: SUM all-reduce, then the update
    after = [tf.identity(v.value) for v in tv]
    logs = self.step_logs(loss, logits, y, grad_norm, before, after)
    if ctx is not None:
        rid = ctx.replica_id_in_sync_group
        logs["replica_losses"] = ctx.all_reduce("sum", tf.one_hot(rid, n, dtype=loss.dtype) * loss)
    return logs, raw_grads


class Stepper:
    """The model's own train_function (Keras' make_train_function) on one batch, as train_on_batch
    calls it, without train_on_batch's per-call symbolic-build check and metric reset (this train_step
    uses no compiled metric). The Keras variables are the state; the learning rate and the harness's
    dropout masks are assigned to their variables first (an assign: no retrace). Data parallel: the
    batch as the replicas' shards (see the module docstring)."""

    def __init__(self, net, optimizer, parallel: "MirroredDataParallel | None" = None) -> None:
        self.net, self.optimizer, self.parallel = net, optimizer, parallel
        self.probe = None             # the step with its gradients, compiled as the step is
        self.layers_probe = None      # (recorder, the step recording every layer's output, compiled as the step is)
        self.readers: dict[tuple, tuple[list, Callable]] = {}   # `read`: one compiled read per set of variables

    def gradients(self, x: np.ndarray, y: np.ndarray):
        """(data loss, gradients) of one batch from the training step's own body (step_with_gradients) in a
        tf.function made as Keras' _make_function makes the step's (reduce_retracing, the model's
        jit_compile); the step's writes (parameters, optimizer state, moving statistics) are undone."""
        net, par = self.net, self.parallel
        if self.probe is None:
            def probe(data):
                if par is None:
                    return step_with_gradients(net, data)
                # each replica's step on its shard; the gradients SUMmed as the optimizer's all-reduce sums them
                logs, grads = par.strategy.run(step_with_gradients, args=(net, data))
                return ({"loss": par.strategy.reduce("MEAN", logs["loss"], axis=None)},
                        [par.strategy.reduce("SUM", g, axis=None) for g in grads])
            self.probe = self._compiled(probe)
        logs, grads = self._undone(self.probe, x, y)
        return logs["loss"], list(grads)

    def layer_outputs(self, x: np.ndarray, y: np.ndarray, recorder) -> list:
        """Every layer's output of the training step's own forward (step_with_gradients compiled as the
        step, the model calling `recorder` in its place: its training flag, masks and replicas; data
        parallel: each replica's shard, concatenated in replica order); the step's writes are undone."""
        return list(self._recorded(x, y, recorder)[0])

    def layers_and_gradients(self, x: np.ndarray, y: np.ndarray, recorder) -> tuple[list, Any, list] | None:
        """(every layer's output, the data loss, the gradients) of that one recorded program
        (Backend.layers_and_gradients; data parallel: the loss and gradients combined as `gradients` combines
        them)."""
        return self._recorded(x, y, recorder)

    def _recorded(self, x: np.ndarray, y: np.ndarray, recorder):
        net, par = self.net, self.parallel
        if self.layers_probe is None or self.layers_probe[0] is not recorder:
            def replica(data):
                logs, grads = step_with_gradients(net, data)
                return net.layer_record.take(), logs["loss"], grads

            def record(data):
                net.layer_record.recorder = recorder     # before the replicas' threads start
                try:
                    if par is None:
                        return replica(data)
                    layers, loss, grads = par.strategy.run(replica, args=(data,))
                    return ([tf.concat(par.strategy.experimental_local_results(v), 0) for v in layers],
                            par.strategy.reduce("MEAN", loss, axis=None),
                            [par.strategy.reduce("SUM", g, axis=None) for g in grads])
                finally:
                    net.layer_record.recorder = None
            self.layers_probe = (recorder, self._compiled(record))
        return self._undone(self.layers_probe[1], x, y)

    def _compiled(self, fn: Callable) -> Callable:
        """As Keras' one_step_on_data: tf.function(do_not_convert(step)), no autograph rewriting of the body."""
        net = self.net
        return fn if net.run_eagerly else tf.function(tf.autograph.experimental.do_not_convert(fn),
                                                      reduce_retracing=True, jit_compile=net.jit_compile)

    def _undone(self, fn: Callable, x: np.ndarray, y: np.ndarray):
        """fn(batch), then every variable the step writes back to its value before."""
        net, par = self.net, self.parallel
        written = list(net.trainable_variables) + list(net.non_trainable_variables) + list(self.optimizer.variables)
        saved = [tf.identity(v.value) for v in written]
        try:
            return fn((x, y) if par is None else par.distribute(x, y))
        finally:
            for v, value in zip(written, saved):
                v.assign(value)

    def step(self, x, y, values):
        for var, val in values:
            var.assign(val)
        if self.net.train_function is None:
            self.net.make_train_function()
        data = (x, y) if self.parallel is None else self.parallel.distribute(x, y)
        return {k: np.asarray(v) for k, v in self.net.train_function([data]).items()}

    def sync(self) -> None:
        """Nothing to do: the variables are the state."""

    def read(self, variables: list) -> list[np.ndarray]:
        """The variables' values in one call of a tf.function reading them all (made once per set of variables):
        eagerly each read is a ReadVariableOp, an identity and a conversion, ~0.15 ms each, 3 ms a checkpoint of
        the default model."""
        key = tuple(id(v) for v in variables)
        if key not in self.readers:     # the variables kept with their reader: no id of theirs is reused
            values = [v.value for v in variables]
            self.readers[key] = (variables, tf.function(lambda: [tf.identity(v) for v in values]))
        return [t.numpy() for t in self.readers[key][1]()]


class MirroredDataParallel(Parallel):
    """MirroredStrategy over N local devices, one per replica, and the harness's sharding."""
    replica_programs = True
    backend = "keras-tensorflow"
    hosts_missing = "MultiWorkerMirroredStrategy with the harness's exact shards per worker is not wired for Keras"

    def __init__(self, replicas: int, hosts: int, sync_bn: bool, fault: str | None, extra: dict[str, Any]) -> None:
        from ...base import UnsupportedError
        super().__init__(replicas, hosts, sync_bn, fault)
        if extra.get("xla"):
            raise UnsupportedError("keras-tensorflow: --xla with data parallelism is not supported (jit_compile "
                                   "cannot span the replicas of a MirroredStrategy step); drop --xla")
        gpus = [] if extra.get("platform", "auto") == "cpu" else tf.config.list_physical_devices("GPU")
        self.kind = "GPU" if gpus else "CPU"
        if gpus:    # untested here: no GPU build of TensorFlow on the test machine
            if len(gpus) < replicas:
                raise UnsupportedError(f"keras-tensorflow: --devices {replicas} needs {replicas} GPUs, {len(gpus)} "
                                       "visible (extra platform=cpu uses logical CPU devices)")
        else:
            cpu = tf.config.list_physical_devices("CPU")[0]
            have = len(tf.config.get_logical_device_configuration(cpu) or [None])
            if have < replicas:
                try:
                    tf.config.set_logical_device_configuration(
                        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(replicas)])
                except RuntimeError:
                    raise UnsupportedError(
                        f"keras-tensorflow: {replicas} logical CPU devices are needed but TF's runtime already "
                        f"started in this process with {have}; they can only be configured before it starts "
                        "(run each data-parallel job in a fresh process: python -m wrappers run)") from None
        key = (replicas, self.kind)
        if key not in _STRATEGIES:
            devs = [d.name for d in tf.config.list_logical_devices(self.kind)][:replicas]
            # CPU: the sum is taken on replica 0's device (TF's choice for CPUs too), spelled out
            cross = tf.distribute.ReductionToOneDevice(reduce_to_device=devs[0]) if self.kind == "CPU" else None
            _STRATEGIES[key] = tf.distribute.MirroredStrategy(devices=devs, cross_device_ops=cross)
        self.strategy = _STRATEGIES[key]
        self.devices = list(self.strategy.extended.worker_devices)
        if self.strategy.num_replicas_in_sync != replicas:
            raise UnsupportedError(f"keras-tensorflow: MirroredStrategy has {self.strategy.num_replicas_in_sync} "
                                   f"replicas where {replicas} were asked for")
        self.eval_fns: dict[int, Callable] = {}     # id(model) -> its inference tf.function

    def scope(self):
        return self.strategy.scope()

    def arrange(self, x: np.ndarray, y: np.ndarray, masks: dict[str, np.ndarray]):
        """The global batch as given: the shards (and the overlapping_shards fault) are cut by distribute."""
        return x, y, masks

    @property
    def per_replica_batchnorm(self) -> bool:
        return not self.sync_bn

    def attach_dropouts(self, dropouts: dict[str, Any], batch: int) -> None:
        for layer in dropouts.values():     # each replica takes its rows of the (B, ...) mask
            layer.select = self.mask_rows(batch)

    def bounds(self, batch: int) -> list[tuple[int, int]]:
        from ...base import shard_bounds
        return shard_bounds(batch, self.replicas, self.fault)

    def distribute(self, *arrays: np.ndarray):
        """The global batch as per-replica shards: replica r gets rows bounds[r] of every array."""
        bounds = self.bounds(len(arrays[0]))

        def value(ctx):
            r = ctx.replica_id_in_sync_group
            lo, hi = bounds[r]
            with tf.device(self.devices[r]):
                return tuple(tf.constant(a[lo:hi]) for a in arrays)
        return self.strategy.experimental_distribute_values_from_function(value)

    def mask_rows(self, batch: int) -> Callable:
        """For the harness dropout layers: this replica's rows of a (B, ...) keep mask."""
        starts = tf.constant([lo for lo, _ in self.bounds(batch)], tf.int32)
        rows = batch // self.replicas

        def select(mask):
            ctx = tf.distribute.get_replica_context()
            if ctx is None or ctx.num_replicas_in_sync == 1:
                return mask
            return tf.gather(mask, tf.range(rows) + tf.gather(starts, ctx.replica_id_in_sync_group))
        return select

    def check_in_sync(self, named: dict[str, Any]) -> None:
        """Every replica holds the same values of these (mirrored) variables."""
        for name, var in named.items():
            comps = [np.asarray(c.numpy()) for c in self.strategy.experimental_local_results(var.value)]
            for i, c in enumerate(comps[1:], 1):
                if not np.array_equal(c, comps[0], equal_nan=True):
                    raise RuntimeError(f"replica {i} holds a different {name} than replica 0: the mirrored "
                                       "variables diverged")

    def primary(self, var) -> np.ndarray:
        """Replica 0's component (what a Keras checkpoint of a MirroredVariable saves)."""
        return np.asarray(self.strategy.experimental_local_results(var.value)[0].numpy())

    def predict(self, net, x: np.ndarray) -> Any:
        """Inference on replica 0's variables, on replica 0's device (cross-replica context); the model's
        outputs as numpy (a list for a model with several outputs, as the layer recorder)."""
        if id(net) not in self.eval_fns:
            self.eval_fns[id(net)] = tf.function(lambda t: net(t, training=False), autograph=False)   # as Keras' predict
        with tf.device(self.devices[0]):
            return tf.nest.map_structure(lambda t: t.numpy(), self.eval_fns[id(net)](tf.constant(x)))

    def info(self, fault: str | None, has_bn: bool) -> dict[str, Any]:
        return {
            "strategy": "MirroredStrategy", "replicas": self.replicas, "devices": self.devices,
            "devices_per_process": self.replicas, "processes": 1, "hosts": 1, "device_kind": self.kind,
            "sync_bn": self.sync_bn,
            "cross_device_ops": type(self.strategy.extended._cross_device_ops).__name__
            if getattr(self.strategy.extended, "_cross_device_ops", None) else "default",
            "sharding": "contiguous B/N shards (base.shard_bounds) by experimental_distribute_values_from_function"
                        + (" (fault overlapping_shards: every replica takes [0, B/N))"
                           if fault == "overlapping_shards" else ""),
            "step": "the model's train_function (Keras make_train_function: tf.function of strategy.run(train_step), "
                    "outputs averaged over replicas)",
            "loss_scaling": ("none (fault grad_sum_replicas): each replica's mean loss, SUM all-reduce: N x the "
                             "gradient" if fault == "grad_sum_replicas" else
                             "each replica's mean loss x 1/N (keras scale_loss_for_distribution), SUM all-reduce "
                             "in the Keras TF optimizer"),
            "batchnorm": ("n/a (no BatchNorm)" if not has_bn else
                          "BatchNormalization(synchronized=True): global-batch statistics" if self.sync_bn else
                          "per replica; moving statistics per replica, replica 0's exported and evaluated"),
        }


def make_parallel(replicas: int, hosts: int, sync_bn: bool, fault: str | None, extra: dict[str, Any]):
    return MirroredDataParallel(replicas, hosts, sync_bn, fault, extra) if replicas > 1 else None


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
