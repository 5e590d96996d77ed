"""Native TensorFlow backend: tf.Variable state, tf.nn ops in NHWC (layers.py), tf.GradientTape,
one tf.function training step (XLA with `extra={'xla': True}`, eager with `jit=False`), and TF's own
training kernels applied to the variables' handles:

(optim.py: the kernels, their per-step scalars and the optimizer faults applied there).

Data parallelism (`--devices N`, `--hosts H`) is parallel.py (tf.distribute): ParallelTensorflowBackend, the
DataParallel mixin over this class, which `TensorflowBackend.for_options` names for such a job (the worker asks
it before constructing). The single-device step here is left exactly as it was; the parallel one reuses its
forward, loss and training kernels.
"""
from __future__ import annotations

import os
import platform
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import config as tf_config  # is_op_determinism_enabled is not public

from algorithms.contract import RunOptions
from algorithms.optim import HParams
from algorithms.spec import ModelSpec

from algorithms.faults import Seams

from ..base import DP_FAULTS, Backend, Masks, StepStats, UnsupportedError
from . import TensorflowEntry
from .layers import cross_entropy, forward, from_native, to_native
from .optim import NativeOptimizer, flat, update_and_param_norm
from .parallel import DataParallel

def _pin_threads(n: int) -> None:
    """Pin TF's thread pools; possible only before the runtime starts (a second backend in the same
    process finds them already set, and determinism() records what is in force)."""
    th = tf.config.threading
    for get, put in ((th.get_intra_op_parallelism_threads, th.set_intra_op_parallelism_threads),
                     (th.get_inter_op_parallelism_threads, th.set_inter_op_parallelism_threads)):
        if get() != n:
            try:
                put(n)
            except RuntimeError:
                pass


def _outside_op_determinism(fn):
    """Call an XLA-compiled function with TF op determinism switched off, then back on.

    tf2xla refuses to lower MaxPoolGrad while op determinism is on ("GPU MaxPool gradient ops do not
    yet have a deterministic XLA implementation", raised on CPU too): the flag guards GPU atomics.
    XLA:CPU's SelectAndScatter is sequential, so the compiled step stays deterministic; the flag
    governs only kernel creation (compilation), and every other op keeps it on."""
    def call(*args):
        if not tf_config.is_op_determinism_enabled():
            return fn(*args)
        tf_config.disable_op_determinism()
        try:
            return fn(*args)
        finally:
            tf.config.experimental.enable_op_determinism()
    return call


class TensorflowBackend(NativeOptimizer, Backend):
    framework = "tensorflow"
    faults = TensorflowEntry.faults
    emulations = TensorflowEntry.emulations
    layer_kinds = TensorflowEntry.layer_kinds
    PARALLEL_FAULTS = DP_FAULTS

    @classmethod
    def for_options(cls, opts: RunOptions) -> type[TensorflowBackend]:
        """The class that runs `opts`: ParallelTensorflowBackend for --devices or --hosts other than 1, else
        this one (its single-device step carries no strategy)."""
        parallel = opts.devices != 1 or int(opts.extra.get("hosts", 1)) != 1
        return ParallelTensorflowBackend if parallel else TensorflowBackend

    def _before_runtime(self) -> None:
        """What must be configured before TF's runtime starts (the parallel backend: its devices)."""
        if self.opts.devices != 1:
            raise UnsupportedError(f"backend tensorflow: --devices {self.opts.devices} needs the parallel backend")
        if self.opts.fault in self.PARALLEL_FAULTS:
            raise UnsupportedError(f"backend tensorflow: fault {self.opts.fault} needs data parallelism "
                                   "(--devices > 1)")

    def _variable_scope(self):
        """Where the variables are created (the parallel backend: its strategy's scope)."""
        return tf.device(self.device)

    def __init__(self, model: ModelSpec, hp: HParams, opts: RunOptions) -> None:
        super().__init__(model, hp, opts)
        self._before_runtime()
        _pin_threads(opts.threads)                 # before any op runs
        if opts.deterministic:
            tf.config.experimental.enable_op_determinism()
        tf.random.set_seed(hp.seed)
        if opts.extra.get("platform", "auto") == "cpu" or not tf.config.list_physical_devices("GPU"):
            self.device = "/CPU:0"
        else:
            self.device = "/GPU:0"
        self._after_runtime()
        self.dtype = tf.float64 if opts.dtype == "float64" else tf.float32
        self.np_dtype = np.float64 if opts.dtype == "float64" else np.float32
        self.fault = opts.fault
        self.seams = Seams(opts.fault)
        self.permute = self.seams.permute
        self.channel_major = self.seams.depthwise_channel_major   # depthwise_multiplier_order: the load order
        self.native_dropout = opts.dropout == "native"
        self.trainable: list[str] = [q.name for q in model.trainable]
        h = self.hp
        self.adam = h.optimizer in ("adam", "adamw")
        self.decoupled = h.optimizer == "adamw" and not self.seams.coupled_adamw
        with self._variable_scope():
            self.v: dict[str, tf.Variable] = {
                q.name: tf.Variable(tf.zeros(q.shape, self.dtype), trainable=q.trainable,
                                    name=q.name.replace(".", "/")) for q in model.params}
            self._make_slots()
        self.t = 0                  # Adam's step count
        self.has_state = False      # torch creates optimizer state at the first step: export nothing before
        self.prev_lr: float | None = None
        self.eval_calls = 0
        self.traces = {"train": 0, "eval": 0}
        if opts.jit:
            xla = bool(opts.extra.get("xla", False))
            # autograph=False: the step's Python control flow is static (the spec, the options), so tracing runs it
            # as Python; autograph's source rewriting of every called function cost ~10 s of each process
            self._step = tf.function(self._step_impl, jit_compile=xla, autograph=False)
            self._eval = tf.function(self._eval_impl, jit_compile=xla, autograph=False)
            self._probe = tf.function(self._probe_impl, jit_compile=xla, autograph=False)
            self._joint = tf.function(self._joint_impl, jit_compile=xla, autograph=False)
            self.mode = "xla" if xla else "tf.function"
            if xla and self.device == "/CPU:0":   # on a GPU, TF's own refusal stands
                self._step, self._eval, self._probe, self._joint = (
                    _outside_op_determinism(f) for f in (self._step, self._eval, self._probe, self._joint))
        else:
            self._step, self._eval, self.mode = self._step_impl, self._eval_impl, "eager"
            self._probe, self._joint = self._probe_impl, self._joint_impl
        self._concrete: dict[tuple, Any] = {}

    def _call(self, fn, key: tuple, *args):
        """fn(*args); a tf.function through its concrete function for `key` (the arguments' shapes),
        looked up once: the polymorphic call checks every argument's tracing type each time, ~0.2 ms
        a step on CPU. The same traced graph runs either way."""
        if self.mode != "tf.function":
            return fn(*args)
        cf = self._concrete.get((fn, key))
        if cf is None:
            cf = self._concrete[(fn, key)] = fn.get_concrete_function(*args)
        return cf(*args)

    def _after_runtime(self) -> None:
        """After threads and determinism are set, before the variables exist (the parallel backend: its strategy)."""

    # ---- environment
    def versions(self) -> dict[str, str]:
        return {"tensorflow": tf.__version__, "python": platform.python_version(), "numpy": np.__version__}

    def devices(self) -> list[str]:
        return [f"{self.device} ({platform.processor() or platform.machine()})"]

    def determinism(self) -> dict[str, Any]:
        th = tf.config.threading
        return {"enable_op_determinism": tf_config.is_op_determinism_enabled(),
                "intra_op_parallelism_threads": th.get_intra_op_parallelism_threads(),
                "inter_op_parallelism_threads": th.get_inter_op_parallelism_threads(),
                "tf.random.set_seed": self.hp.seed, "step": self.mode, "dtype": self.dtype.name,
                "xla_op_determinism": ("suspended while compiling the XLA step (tf2xla refuses MaxPoolGrad "
                                       "under it); XLA:CPU is deterministic") if self.mode == "xla" else None,
                "TF_NUM_INTRAOP_THREADS": os.environ.get("TF_NUM_INTRAOP_THREADS"),
                "TF_NUM_INTEROP_THREADS": os.environ.get("TF_NUM_INTEROP_THREADS"),
                "TF_ENABLE_ONEDNN_OPTS": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "default (on)")}

    def declared_differences(self) -> list[str]:
        return ["native_dropout_masks"] if self.model.has("dropout") and self.native_dropout else []

    # ---- state
    def _canon(self, name: str, a: np.ndarray) -> np.ndarray:
        return from_native(self.model, name, a, self.permute, self.channel_major)

    def _native(self, name: str, a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(to_native(self.model, name, np.asarray(a), self.permute, self.channel_major),
                                    self.np_dtype)

    def load_params(self, params: dict[str, np.ndarray]) -> None:
        for q in self.model.params:
            self.v[q.name].assign(self._native(q.name, params[q.name]))
        for slot in self.slots.values():          # a fresh optimizer, as torch builds one
            for var in slot.values():
                var.assign(tf.zeros_like(var))
        self.t, self.has_state, self.prev_lr = 0, False, None

    def export_params(self) -> dict[str, np.ndarray]:
        return {n: self._canon(n, v.numpy()) for n, v in self.v.items()}

    # ---- computation
    def _tensors(self, x: np.ndarray, masks: Masks) -> tuple[tf.Tensor, dict[str, tf.Tensor]]:
        xt = tf.constant(np.asarray(x, self.np_dtype))
        return xt, {k: tf.constant(np.asarray(v, self.np_dtype)) for k, v in masks.items()}

    def _forward(self, x, train, masks, record=None, new_buffers=None, seed=None, params=None, moments=None):
        return forward(self.model, self.v if params is None else params, x, train=train, masks=masks,
                       fault=self.fault, record=record, new_buffers=new_buffers,
                       native_dropout=self.native_dropout, dropout_seed=seed, moments=moments)

    def _train_forward(self, x, masks, record=None, new_buffers=None, seed=None, params=None, moments=None):
        """The training-mode forward, one for the step (every replica) and the forward probes: a mode, mask or
        layer slip here shows in the forward probes too, not first in the loss."""
        return self._forward(x, True, masks, record, new_buffers, seed, params, moments)

    def _eval_forward(self, x, record=None, seed=None):
        """The inference forward, one for `evaluate` and the evaluation probes."""
        return self._forward(x, False, None, record, None, seed)

    def _loss(self, logits, y):
        return cross_entropy(logits, y, self.seams.label_smoothing)

    def _grads(self, x, y, masks, new_buffers, seed, record=None):
        params = [self.v[n] for n in self.trainable]
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            tape.watch(params)
            logits = self._train_forward(x, masks, record, new_buffers, seed)
            loss = self._loss(logits, y)
        grads = tape.gradient(loss, params)
        grads = [tf.zeros_like(q) if g is None else g for g, q in zip(grads, params)]  # e.g. missing_bias
        return logits, loss, self._fault_grads(grads)

    def _probe_impl(self, x, y, masks, seed):
        """The gradient probe: the step's own forward and backward (_grads), compiled as the step is (an
        eager GradientTape runs other kernels than the step's graph: 0 of 35 gradients bit-equal on
        mobilenet_tiny, one 1.2 relative off where a ReLU6 kink flipped)."""
        _, loss, grads = self._grads(x, y, masks, None, seed)
        return loss, grads

    def _joint_impl(self, x, y, masks, seed):
        """The gradient probe with every layer's output recorded in the same program (layers_and_gradients)."""
        rec: dict[str, tf.Tensor] = {}
        _, loss, grads = self._grads(x, y, masks, None, seed, rec)
        return rec, loss, grads

    def _fault_grads(self, grads: list[tf.Tensor]) -> list[tf.Tensor]:
        """The gradient seam, one for training and probes (and every replica): grad_double counts them twice."""
        scale = self.seams.grad_scale
        return [g * scale for g in grads] if scale != 1.0 else grads

    def _step_impl(self, x, y, masks, hyper, seed):
        self.traces["train"] += 1          # Python side effect: counts traces under tf.function
        new_buffers: dict[str, tf.Tensor] = {}
        logits, loss, grads = self._grads(x, y, masks, new_buffers, seed)
        params = [self.v[n] for n in self.trainable]
        before = flat([q.read_value() for q in params])
        grad_norm = tf.norm(flat(grads))
        for n, q, g in zip(self.trainable, params, grads):
            self._apply(q, n, g, hyper)
        for n, val in new_buffers.items():
            self.v[n].assign(val)
        upd, pn = update_and_param_norm(before, [q.read_value() for q in params])
        acc = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1, output_type=tf.int32), y), self.dtype))
        return tf.stack([loss, acc, grad_norm, upd, pn])

    def _seed(self, a: int, b: int) -> tf.Tensor:
        return tf.constant([a, b], tf.int64)

    def train_step(self, step: int, x: np.ndarray, y: np.ndarray, masks: Masks) -> StepStats:
        xt, mt = self._tensors(x, masks)
        hyper = tf.constant(self._step_hyper(step))
        with tf.device(self.device):
            key = (x.shape, tuple((k, v.shape) for k, v in masks.items()))
            out = self._call(self._step, key, xt, tf.constant(np.asarray(y, np.int32)), mt, hyper,
                             self._seed(self.hp.seed, step)).numpy()
        self.has_state = True
        return StepStats(*(float(v) for v in out))

    def _eval_impl(self, x, y, seed):
        self.traces["eval"] += 1
        logits = self._eval_forward(x, seed=seed)
        loss = cross_entropy(logits, y)
        acc = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1, output_type=tf.int32), y), tf.float64))
        return loss, acc

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        self.eval_calls += 1
        xt, _ = self._tensors(x, {})
        with tf.device(self.device):
            loss, acc = self._call(self._eval, (x.shape,), xt, tf.constant(np.asarray(y, np.int32)),
                                   self._seed(self.hp.seed + 1, self.eval_calls))
        return float(loss.numpy()), float(acc.numpy())

    def forward_layers(self, x: np.ndarray, masks: Masks) -> dict[str, np.ndarray]:
        xt, mt = self._tensors(x, masks)
        rec: dict[str, tf.Tensor] = {}
        with tf.device(self.device):
            self._train_forward(xt, mt, rec, None, self._seed(self.hp.seed, 0))
        return {k: v.numpy() for k, v in rec.items()}

    def eval_layers(self, x: np.ndarray) -> dict[str, np.ndarray]:
        """Inference mode, as `evaluate` (data parallel: replica 0's variables, the whole batch)."""
        xt, _ = self._tensors(x, {})
        rec: dict[str, tf.Tensor] = {}
        with tf.device(self.device):
            self._eval_forward(xt, rec, self._seed(self.hp.seed + 1, 0))
        return {k: v.numpy() for k, v in rec.items()}

    def gradients(self, x: np.ndarray, y: np.ndarray, masks: Masks) -> tuple[float, dict[str, np.ndarray]]:
        xt, mt = self._tensors(x, masks)
        with tf.device(self.device):
            loss, grads = self._probe(xt, tf.constant(np.asarray(y, np.int32)), mt, self._seed(self.hp.seed, 0))
        return float(loss.numpy()), {n: self._canon(n, g.numpy()) for n, g in zip(self.trainable, grads)}


    def layers_and_gradients(self, x: np.ndarray, y: np.ndarray, masks: Masks
                             ) -> tuple[dict[str, np.ndarray], float, dict[str, np.ndarray]] | None:
        """The gradient probe's program with every layer's output recorded (Backend.layers_and_gradients): the
        plain one lets Grappler fuse a BatchNorm with the ReLU after it (resnet_tiny, step 0: an input 7.8e-7
        below the kink in float64, -6e-8 in every recorded program, on the active side in the fused one)."""
        if self.mode == "eager":
            return None                 # forward_layers and gradients run the same eager kernels
        xt, mt = self._tensors(x, masks)
        with tf.device(self.device):
            rec, loss, grads = self._joint(xt, tf.constant(np.asarray(y, np.int32)), mt, self._seed(self.hp.seed, 0))
        return ({k: v.numpy() for k, v in rec.items()}, float(loss.numpy()),
                {n: self._canon(n, g.numpy()) for n, g in zip(self.trainable, grads)})


class ParallelTensorflowBackend(DataParallel, TensorflowBackend):
    """TensorflowBackend with devices > 1 or hosts > 1 (`TensorflowBackend.for_options` names it): parallel.py."""


BACKEND = TensorflowBackend
__all__ = ["TensorflowBackend", "ParallelTensorflowBackend", "BACKEND"]
