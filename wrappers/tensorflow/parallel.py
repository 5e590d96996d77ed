"""Data parallelism for the native TensorFlow backend: tf.distribute with a custom training loop.

  --devices N            tf.distribute.MirroredStrategy over N logical CPU devices (configured before
                         TF's runtime starts), or over N visible GPUs when there are GPUs
  --hosts H              tf.distribute.MultiWorkerMirroredStrategy: H worker processes on 127.0.0.1
                         (TF_CONFIG set by TensorflowEntry.process_command), N/H devices each; worker 0
                         is the primary and writes the results

One step (one tf.function, traced once):
  1. The GLOBAL batch is cut into N contiguous shards by base.shard_bounds (replica r gets rows
     [r B/N, (r+1) B/N); the fault `overlapping_shards` gives every replica the first shard) and
     handed out with strategy.experimental_distribute_values_from_function.
  2. strategy.run: each replica runs the forward of backend.py on its shard, with its per-sample
     losses scaled for the global batch, tf.nn.compute_average_loss(l, global_batch_size=B) =
     sum(l)/B, and takes its gradients with a GradientTape. (The fault `grad_sum_replicas` uses the
     per-replica reduce_mean instead: with the SUM all-reduce below, N x the gradient.)
  3. strategy.extended.batch_reduce_to(SUM, ...): the gradients all-reduced, sum over replicas of
     sum(l_r)/B = the global mean's gradient.
  4. strategy.extended.update: the same TF training kernel as dp=1 (ResourceApply*) on every mirrored
     component, with that replica's own slot components, in cross-replica context.

Reported: loss = sum over replicas of sum(l_r)/B (the global mean), accuracy = correct/B, gradient
norm of the all-reduced gradient, update and parameter norms of replica 0's variables, and each
replica's mean loss on its shard (each replica scatters its value into a length-N vector, SUM-reduced:
x + 0 is exact). export_params checks that every local replica holds bit-identical parameters.

BatchNorm: per-replica batch statistics by default (the declared difference `per_replica_batchnorm`);
the running statistics are then the MEAN over replicas of the per-replica updates (TF's
VariableAggregation.MEAN convention; torch DDP instead broadcasts rank 0's buffers). `--sync-bn`
synchronizes them as BatchNormalization(synchronized=True) does, with the replica context's
all_reduce of sums, two-pass like tf.nn.moments: mean = all_reduce(sum x)/n, then
var = all_reduce(sum (x - mean)^2)/n (stop_gradient on the mean there, as in tf.nn.moments); the
gradient flows through the all-reduce (its gradient is an all-reduce). Every replica then computes
the same running statistics and replica 0's are kept.

Multi-host on CPU: MultiWorkerMirroredStrategy gives a CPU worker exactly one device (TF's
CollectiveAllReduceExtended._initialize_local_devices); with N/H > 1 this module replaces that choice
by the worker's N/H logical CPU devices (a private hook, checked at start-up).

GPU: with visible GPUs (and not extra['platform'] == 'cpu') the replicas are the first N GPUs (worker
i of H local workers: GPUs [i N/H, (i+1) N/H)), with enable_op_determinism and TF's default
cross-device ops. This path is not exercised by the tests (no GPU build of TF here).

XLA (--xla) is refused under data parallelism: jit_compile cannot span the replicas of a
MirroredStrategy step.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np
import tensorflow as tf

from ..base import Masks, StepStats, UnsupportedError, shard_bounds
from .layers import per_example_cross_entropy
from .optim import flat, update_and_param_norm

SUM, MEAN = tf.distribute.ReduceOp.SUM, tf.distribute.ReduceOp.MEAN
_STRATEGIES: dict[tuple, tf.distribute.Strategy] = {}   # (hosts, devices per process, kind) -> the strategy


def tf_config() -> dict[str, Any] | None:
    raw = os.environ.get("TF_CONFIG")
    return json.loads(raw) if raw else None


def _cpu_workers_use_local_devices(k: int) -> None:
    """Let MultiWorkerMirroredStrategy use k logical CPU devices per worker (TF picks one on CPU)."""
    from tensorflow.python.distribute import collective_all_reduce_strategy as cars
    orig = cars.CollectiveAllReduceExtended._initialize_local_devices
    if getattr(orig, "_duipai", False):
        return

    def local_devices(self, cluster_resolver, worker_device):
        devices, kind = orig(self, cluster_resolver, worker_device)
        if kind == "CPU":
            devices = tuple(f"{worker_device}/device:CPU:{i}" for i in range(k))
        return devices, kind
    local_devices._duipai = True
    cars.CollectiveAllReduceExtended._initialize_local_devices = local_devices


class DataParallel:
    """The data-parallel half of backend.ParallelTensorflowBackend (a mixin over TensorflowBackend: its hooks
    `_before_runtime`, `_after_runtime`, `_variable_scope`, and the state and computation methods below)."""

    # ---- set-up (hooks of TensorflowBackend.__init__)
    def _before_runtime(self) -> None:
        o = self.opts
        self.replicas = int(o.devices)
        self.hosts = int(o.extra.get("hosts", 1))
        self.sync_bn = bool(o.extra.get("sync_bn", False))
        if self.replicas < 1 or self.hosts < 1 or self.replicas % self.hosts:
            raise UnsupportedError(f"backend tensorflow: --hosts {self.hosts} must divide --devices {self.replicas}")
        if o.extra.get("xla"):
            raise UnsupportedError("backend tensorflow: --xla with data parallelism is not supported (jit_compile "
                                   "cannot span the replicas of a tf.distribute step); drop --xla")
        self.local = self.replicas // self.hosts
        self.task = 0
        if self.hosts > 1:
            cfg = tf_config()
            if not cfg:
                raise UnsupportedError("backend tensorflow: --hosts needs TF_CONFIG, set by the launcher "
                                       "(python -m wrappers run JOB.json)")
            workers = cfg["cluster"].get("worker", [])
            if len(workers) != self.hosts:
                raise UnsupportedError(f"backend tensorflow: TF_CONFIG lists {len(workers)} workers "
                                       f"for --hosts {self.hosts}")
            self.task = int(cfg["task"]["index"])
        gpus = [] if o.extra.get("platform", "auto") == "cpu" else tf.config.list_physical_devices("GPU")
        self.kind = "GPU" if gpus else "CPU"
        if gpus:   # untested here: no GPU build of TensorFlow on the test machine
            first = self.task * self.local if len(gpus) >= self.replicas else 0
            if len(gpus) < first + self.local:
                raise UnsupportedError(f"backend tensorflow: {self.local} devices per worker need {self.local} GPUs, "
                                       f"{len(gpus)} visible (extra platform=cpu uses logical CPU devices)")
            try:
                tf.config.set_visible_devices(gpus[first:first + self.local], "GPU")
            except RuntimeError as e:
                raise UnsupportedError(f"backend tensorflow: cannot choose GPUs after TF's runtime "
                                       f"started: {e}") from None
        else:
            cpu = tf.config.list_physical_devices("CPU")[0]
            have = len(tf.config.get_logical_device_configuration(cpu) or [None])
            if have < self.local:
                try:
                    tf.config.set_logical_device_configuration(
                        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(self.local)])
                except RuntimeError:
                    raise UnsupportedError(
                        f"backend tensorflow: {self.local} logical CPU devices are needed but TF's runtime already "
                        f"started in this process with {have}; logical devices can only be configured before it "
                        "starts (run each data-parallel job in a fresh process: python -m wrappers run)") from None
            if self.hosts > 1 and self.local > 1:
                _cpu_workers_use_local_devices(self.local)
        if self.opts.fault in self.PARALLEL_FAULTS and self.replicas < 2:
            raise UnsupportedError(f"backend tensorflow: fault {self.opts.fault} needs --devices > 1")

    def _after_runtime(self) -> None:
        key = (self.hosts, self.local, self.kind)
        if key not in _STRATEGIES:      # one per process: a second MultiWorkerMirroredStrategy cannot start
            if self.hosts > 1:
                _STRATEGIES[key] = tf.distribute.MultiWorkerMirroredStrategy()
            else:
                devs = [d.name for d in tf.config.list_logical_devices(self.kind)][:self.local]
                # CPU: the sum is taken on replica 0's device (TF's choice for CPUs too), spelled out
                cross = tf.distribute.ReductionToOneDevice(reduce_to_device=devs[0]) if self.kind == "CPU" else None
                _STRATEGIES[key] = tf.distribute.MirroredStrategy(devices=devs, cross_device_ops=cross)
        self.strategy = _STRATEGIES[key]
        self.strategy_name = "MultiWorkerMirroredStrategy" if self.hosts > 1 else "MirroredStrategy"
        ext = self.strategy.extended
        if self.strategy.num_replicas_in_sync != self.replicas or len(ext.worker_devices) != self.local:
            raise UnsupportedError(f"backend tensorflow: {self.strategy_name} has {self.strategy.num_replicas_in_sync} "
                                   f"replicas ({len(ext.worker_devices)} local) where {self.replicas} "
                                   f"({self.local} per worker) were asked for")
        self.device = ext.worker_devices[0]

    def _variable_scope(self):
        return self.strategy.scope()

    def __init__(self, model, hp, opts) -> None:
        super().__init__(model, hp, opts)
        local = self.strategy.experimental_local_results
        self.v0 = {n: local(v)[0] for n, v in self.v.items()}       # replica 0's components
        self.slot0 = {s: {n: local(v)[0] for n, v in slot.items()} for s, slot in self.slots.items()}
        # each variable component -> that replica's slot components (for strategy.extended.update)
        self.slots_of: dict[int, dict[str, tf.Variable]] = {}
        for n in self.trainable:
            for i, comp in enumerate(self.v[n].values):
                self.slots_of[id(comp)] = {s: slot[n].values[i] for s, slot in self.slots.items()}
        self._moments = self._sync_moments if self.sync_bn else None
        self.mode += f" + {self.strategy_name}"

    # ---- environment
    def devices(self) -> list[str]:
        return list(self.strategy.extended.worker_devices)

    def determinism(self) -> dict[str, Any]:
        d = super().determinism()
        d["cross_device_ops"] = (type(self.strategy.extended._cross_device_ops).__name__
                                 if getattr(self.strategy.extended, "_cross_device_ops", None) else "default")
        return d

    def declared_differences(self) -> list[str]:
        out = super().declared_differences()
        if self.model.has("batchnorm2d") and not self.sync_bn:
            out.append("per_replica_batchnorm")
        return out

    def parallel_info(self) -> dict[str, Any]:
        return {"strategy": self.strategy_name, "replicas": self.replicas, "devices": self.devices(),
                "devices_per_process": self.local, "processes": self.hosts, "hosts": self.hosts,
                "process_index": self.task, "sync_bn": self.sync_bn, "device_kind": self.kind,
                "sharding": "contiguous B/N shards (base.shard_bounds), experimental_distribute_values_from_function",
                "loss_scaling": "tf.nn.compute_average_loss(per_sample, global_batch_size=B), SUM all-reduce",
                "batchnorm": "synchronized (all_reduce of sums)" if self.sync_bn else
                             "per replica; running statistics = MEAN over replicas"}

    def is_primary(self) -> bool:
        return self.task == 0

    # ---- state
    def _check_in_sync(self) -> None:
        for name, v in self.v.items():
            comps = [c.numpy() for c in v.values]
            for i, c in enumerate(comps[1:], 1):
                if not np.array_equal(c, comps[0], equal_nan=True):
                    raise RuntimeError(f"replica {i} holds a different {name} than replica 0: the mirrored "
                                       "variables diverged")

    def load_params(self, params: dict[str, np.ndarray]) -> None:
        with self.strategy.scope():
            super().load_params(params)

    def load_opt_state(self, state: dict[str, np.ndarray], step: int) -> None:
        with self.strategy.scope():
            super().load_opt_state(state, step)

    def export_params(self) -> dict[str, np.ndarray]:
        self._check_in_sync()
        return {n: self._canon(n, v.numpy()) for n, v in self.v0.items()}

    def _state_slots(self) -> dict[str, dict[str, tf.Variable]]:
        return self.slot0

    # ---- computation
    def _forward(self, x, train, masks, record=None, new_buffers=None, seed=None, params=None, moments=None):
        # outside strategy.run (evaluation): replica 0's variables on replica 0's device
        return super()._forward(x, train, masks, record, new_buffers, seed,
                                params=self.v0 if params is None else params, moments=moments)

    def _sync_moments(self, x):
        """Global batch statistics from every replica's sums (BatchNormalization(synchronized=True))."""
        ctx = tf.distribute.get_replica_context()
        n = math.prod(int(d) for d in x.shape[:3]) * self.replicas
        mean = ctx.all_reduce(SUM, tf.reduce_sum(x, axis=[0, 1, 2])) / n
        sq = tf.reduce_sum(tf.math.squared_difference(x, tf.stop_gradient(mean)), axis=[0, 1, 2])
        var = ctx.all_reduce(SUM, sq) / n
        return mean, var, n

    def _replica_seed(self, seed):
        rid = tf.distribute.get_replica_context().replica_id_in_sync_group
        return seed + tf.cast(tf.stack([0, rid]), tf.int64) * tf.constant([0, 1 << 20], tf.int64)

    def _replica_step(self, x, y, masks, seed, record=None):
        """One replica: forward on its shard, loss scaled for the global batch, gradients (not reduced);
        `record`: every layer's output of this forward (the joint probe)."""
        n, b = self.replicas, self.hp.batch_size
        new_buffers: dict[str, tf.Tensor] = {}
        params = [self.v[k] for k in self.trainable]
        with tf.GradientTape() as tape:
            logits = self._train_forward(x, masks, record, new_buffers, self._replica_seed(seed),
                                   params=self.v, moments=self._moments)
            per_sample = per_example_cross_entropy(logits, y, self.seams.label_smoothing)
            mean = tf.reduce_mean(per_sample)
            if self.fault == "grad_sum_replicas":
                loss = mean                      # the bug: a per-replica mean, then the SUM all-reduce
            else:
                loss = tf.nn.compute_average_loss(per_sample, global_batch_size=b)
        grads = tape.gradient(loss, params)
        grads = self._fault_grads([tf.zeros_like(q) if g is None else g for g, q in zip(grads, params)])
        correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, 1, output_type=tf.int32), y), self.dtype))
        rid = tf.distribute.get_replica_context().replica_id_in_sync_group
        stats = tf.tensor_scatter_nd_update(
            tf.zeros([n + 2], self.dtype), tf.stack([[rid], [n], [n + 1]]),
            tf.stack([mean, tf.reduce_sum(per_sample) / b, correct]))
        return grads, stats, new_buffers

    def _apply_component(self, var, name, g, hyper):
        self._apply(var, name, g, hyper, slots=self.slots_of[id(var)])

    def _step_impl(self, x, y, masks, hyper, seed):
        self.traces["train"] += 1
        s, n = self.strategy, self.replicas
        local0 = lambda d: s.experimental_local_results(d)[0]  # noqa: E731
        grads, stats, new_buffers = s.run(self._replica_step, args=(x, y, masks, seed))
        params = [self.v[k] for k in self.trainable]
        reduced = s.extended.batch_reduce_to(SUM, list(zip(grads, params)))
        before = flat([local0(q).read_value() for q in params])
        grad_norm = tf.norm(flat([local0(g) for g in reduced]))
        for k, q, g in zip(self.trainable, params, reduced):
            s.extended.update(q, self._apply_component, args=(k, g, hyper), group=False)
        for k, val in new_buffers.items():
            self.v[k].assign(local0(val) if self.sync_bn else s.reduce(MEAN, val, axis=None))
        upd, pn = update_and_param_norm(before, [local0(q).read_value() for q in params])
        tot = s.reduce(SUM, stats, axis=None)
        return tf.concat([tf.stack([tot[n], tot[n + 1] / self.hp.batch_size, grad_norm, upd, pn]), tot[:n]], 0)

    def _distribute(self, x: np.ndarray, y: np.ndarray, masks: Masks):
        """The global batch as per-replica shards (base.shard_bounds: contiguous, or the fault's overlap)."""
        bounds = shard_bounds(len(x), self.replicas, self.fault)
        xs = np.asarray(x, self.np_dtype)
        ys = np.asarray(y, np.int32)
        ms = {k: np.asarray(v, self.np_dtype) for k, v in masks.items()}
        devices = self.strategy.extended.worker_devices

        def value(ctx):
            lo, hi = bounds[ctx.replica_id_in_sync_group]
            with tf.device(devices[ctx.replica_id_in_sync_group - self.task * self.local]):
                return (tf.constant(xs[lo:hi]), tf.constant(ys[lo:hi]),
                        {k: tf.constant(m[lo:hi]) for k, m in ms.items()})
        return self.strategy.experimental_distribute_values_from_function(value)

    def train_step(self, step: int, x: np.ndarray, y: np.ndarray, masks: Masks) -> StepStats:
        hyper = tf.constant(self._step_hyper(step))
        xs, ys, ms = self._distribute(x, y, masks)
        with self.strategy.scope():
            out = self._step(xs, ys, ms, hyper, self._seed(self.hp.seed, step)).numpy()
        self.has_state = True
        return StepStats(*(float(v) for v in out[:5]), replica_losses=[float(v) for v in out[5:]])

    def _probe_impl(self, x, y, masks, seed, record=False):
        """The gradient probe: every replica's _replica_step and the step's own all-reduce, compiled as the
        step is (no state change); `record`: with every layer's output over the global batch (the replicas'
        shards gathered in order) from the same program (the joint probe)."""
        s = self.strategy
        grads, stats, rec = s.run(self._replica_probe, args=(x, y, masks, seed, record))
        reduced = s.extended.batch_reduce_to(SUM, list(zip(grads, [self.v[k] for k in self.trainable])))
        out = s.reduce(SUM, stats, axis=None)[self.replicas], [s.experimental_local_results(g)[0] for g in reduced]
        return (({k: s.experimental_local_results(v)[0] for k, v in rec.items()},) + out) if record else out

    def _replica_probe(self, x, y, masks, seed, record):
        rec: dict[str, tf.Tensor] = {}
        grads, stats, _ = self._replica_step(x, y, masks, seed, rec if record else None)
        return grads, stats, tf.distribute.get_replica_context().all_gather(rec, axis=0) if record else {}

    def _joint_impl(self, x, y, masks, seed):
        return self._probe_impl(x, y, masks, seed, record=True)

    def gradients(self, x: np.ndarray, y: np.ndarray, masks: Masks) -> tuple[float, dict[str, np.ndarray]]:
        """The all-reduced gradient, as train_step applies it (no state change)."""
        xs, ys, ms = self._distribute(x, y, masks)
        with self.strategy.scope():
            loss, g = self._probe(xs, ys, ms, self._seed(self.hp.seed, 0))
        return float(loss.numpy()), {k: self._canon(k, gi.numpy()) for k, gi in zip(self.trainable, g)}

    def _replica_record(self, x, masks, seed):
        rec: dict[str, tf.Tensor] = {}
        self._train_forward(x, masks, rec, None, self._replica_seed(seed), params=self.v, moments=self._moments)
        return tf.distribute.get_replica_context().all_gather(rec, axis=0)

    def layers_and_gradients(self, x: np.ndarray, y: np.ndarray, masks: Masks
                             ) -> tuple[dict[str, np.ndarray], float, dict[str, np.ndarray]] | None:
        """The gradient probe's program (every replica, the all-reduce) with every layer's output recorded and
        gathered over the replicas (Backend.layers_and_gradients)."""
        if self.mode == "eager":
            return None
        xs, ys, ms = self._distribute(x, y, masks)
        with self.strategy.scope():
            rec, loss, g = self._joint(xs, ys, ms, self._seed(self.hp.seed, 0))
        return ({k: v.numpy() for k, v in rec.items()}, float(loss.numpy()),
                {k: self._canon(k, gi.numpy()) for k, gi in zip(self.trainable, g)})

    def forward_layers(self, x: np.ndarray, masks: Masks) -> dict[str, np.ndarray]:
        """Every layer's training-mode output over the global batch: the replicas' shards gathered in order."""
        xs, _, ms = self._distribute(x, np.zeros(len(x), np.int32), masks)
        s = self.strategy
        with s.scope():
            rec = s.run(self._replica_record, args=(xs, ms, self._seed(self.hp.seed, 0)))
        return {k: s.experimental_local_results(v)[0].numpy() for k, v in rec.items()}


__all__ = ["DataParallel", "tf_config"]
