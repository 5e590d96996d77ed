"""JAX backend: the spec lowered to jax.lax in NHWC (layers.py), optax optimizers, one jit-compiled step.

The whole training step (forward, loss, backward, optax update, the step statistics) is one pure
function, compiled once per process by jax.jit. The learning rate (and Adam's eps) enter as traced
arguments and are written into the `optax.inject_hyperparams` state inside the step, so a schedule
never triggers a recompilation. For Adam the injected lr / eps / weight decay are rescaled so that
optax's float32 bias correction (1 - b2^t from a float32-rounded b2) becomes the exact one of the
reference (see `adam_hyperparams`).

Data parallelism (the mesh, the sharded batch, the multi-host processes) is parallel.py; the optax
optimizer, its state and the optimizer-fault seam are optim.py; the lowering is layers.py.
"""
from __future__ import annotations

import functools
import os
import platform
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax import tree_utils as otu

from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from algorithms.contract import RunOptions
from algorithms.faults import Seams
from algorithms.optim import HParams
from algorithms.spec import ModelSpec

from ..base import STEP_STATS, Backend, Masks, StepStats, UnsupportedError
from . import JaxEntry
from .layers import cross_entropy, forward, from_native, per_example_cross_entropy, to_native
from .optim import (ADAM_STATE, in_tuple, adam_hyperparams, export_state, keras_velocity, load_state, make_optimizer,
                    step_eps)
from .parallel import DataParallel, host_value


def _global_norm(tree) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(v)) for v in jax.tree.leaves(tree)))


class Lowering:
    """The pure functions of one lowering (model, fault, dropout mode, dtype), jit-compiled once per
    process and shared by every backend instance that needs the same graph: a probe that runs six
    optimizer cases compiles the forward pass and the gradients once, each optimizer's step once."""

    def __init__(self, model: ModelSpec, fault: str | None, native_dropout: bool, dtype: Any, jit: bool,
                 mesh: Mesh | None = None, bn_groups: int = 1) -> None:
        self.model, self.fault, self.native_dropout, self.dtype = model, fault, native_dropout, dtype
        self.mesh = mesh                                    # None: the single-device path
        self.replicas = mesh.size if mesh is not None else 1
        self.bn_groups = bn_groups
        self.seams = Seams(fault)
        self.label_smoothing = self.seams.label_smoothing
        self.wrap = jax.jit if jit else (lambda f: f)
        self.fwd = self.wrap(self._forward_layers_fn)
        self.grads = self.wrap(self._grads_fn)
        self.joint = self.wrap(self._joint_fn)
        self.eval = self.wrap(self._eval_fn)
        self.eval_fwd = self.wrap(self._eval_layers_fn)
        self.steps: dict[tuple, tuple[optax.GradientTransformationExtraArgs, Callable]] = {}

    def step_for(self, hp: HParams) -> tuple[optax.GradientTransformationExtraArgs, Callable]:
        """The optax transform and the compiled train step for these hyper-parameters (lr and eps
        are arguments of the step, so only what shapes the graph is part of the key)."""
        key = (hp.optimizer, hp.momentum, hp.beta1, hp.beta2, hp.weight_decay)
        if key not in self.steps:
            tx = make_optimizer(hp, self.fault)
            adam = (hp.beta1, hp.beta2, hp.weight_decay) if hp.optimizer in ("adam", "adamw") else None
            self.steps[key] = (tx, self.wrap(functools.partial(self._step_fn, tx, adam)))
        return self.steps[key]

    def _train_forward(self, params, buffers, x, masks, key, record=None):
        """The training-mode forward, one for the step (one device or the mesh) and the forward probes: a mode,
        mask or layer slip here shows in the forward probes too, not first in the loss."""
        return forward(self.model, params, buffers, x, train=True, masks=masks, fault=self.fault, key=key,
                       native_dropout=self.native_dropout, record=record, bn_groups=self.bn_groups)

    def _eval_forward(self, params, buffers, x, key, record=None):
        """The inference forward, one for `evaluate` and the evaluation probes."""
        return forward(self.model, params, buffers, x, train=False, masks=None, fault=self.fault, key=key, record=record)

    def _loss_fn(self, params, buffers, x, y, masks, key, record=None):
        if self.mesh is not None:
            return self._dp_loss_fn(params, buffers, x, y, masks, key, record)
        logits, new_buffers = self._train_forward(params, buffers, x, masks, key, record)
        return cross_entropy(logits, y, self.label_smoothing), (logits, new_buffers)

    def _dp_loss_fn(self, params, buffers, x, y, masks, key, record=None):
        """Data parallel: the objective is the mean of the replicas' mean losses (the global-batch
        mean; with grad_sum_replicas their sum). aux carries the replica losses."""
        logits, new_buffers = self._train_forward(params, buffers, x, masks, key, record)
        per = per_example_cross_entropy(logits, y, self.label_smoothing)
        reps = jnp.mean(per.reshape(self.replicas, -1), axis=1)
        objective = jnp.sum(reps) if self.fault == "grad_sum_replicas" else jnp.mean(reps)
        return objective, (logits, new_buffers, reps)

    def _grads_of(self, params, buffers, x, y, masks, key):
        (loss, aux), grads = jax.value_and_grad(self._loss_fn, has_aux=True)(params, buffers, x, y, masks, key)
        return loss, aux, self._seam_grads(grads)

    def _seam_grads(self, grads):
        """The gradient seam (grad_double), one path for training, the probes and the recorded program."""
        scale = self.seams.grad_scale
        return jax.tree.map(lambda g: g * scale, grads) if scale != 1.0 else grads

    def _step_fn(self, tx, adam, params, buffers, opt_state, x, y, masks, base_key, step, lr, eps):
        key = jax.random.fold_in(base_key, step)          # native dropout only; harness masks otherwise
        loss, aux, grads = self._grads_of(params, buffers, x, y, masks, key)
        logits, new_buffers = aux[0], aux[1]
        if self.mesh is not None:
            loss = jnp.mean(aux[2])                   # the reported loss: the mean, whatever was differentiated
        # every injected value is set afresh here (the state carries last step's, already rescaled)
        hyper = dict(opt_state.hyperparams, learning_rate=lr.astype(self.dtype))
        if adam is not None:
            b1, b2, wd = adam
            hyper["eps"] = eps.astype(self.dtype)
            if "weight_decay" in hyper:
                hyper["weight_decay"] = jnp.asarray(wd, self.dtype)
            hyper = adam_hyperparams(hyper, otu.tree_get(opt_state, "count", filtering=in_tuple(ADAM_STATE)), b1, b2)
        opt_state = opt_state._replace(hyperparams=hyper)
        updates, opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        # one vector (loss, accuracy, grad/update/param norms, then the replica losses): one device-to-host
        # fetch per step instead of one per statistic (stacking promotes exactly, it never rounds)
        parts = [loss, jnp.mean((jnp.argmax(logits, axis=-1) == y).astype(self.dtype)), _global_norm(grads),
                 _global_norm(jax.tree.map(lambda a, b: a - b, new_params, params)), _global_norm(new_params)]
        stats = jnp.stack(parts)
        if self.mesh is not None:
            stats = jnp.concatenate([stats, aux[2].astype(stats.dtype)])
            replicated = NamedSharding(self.mesh, P())
            new_params, new_buffers, opt_state, stats = jax.lax.with_sharding_constraint(
                (new_params, new_buffers, opt_state, stats), replicated)
        return new_params, new_buffers, opt_state, stats

    def _eval_fn(self, params, buffers, x, y, base_key, calls):
        # the evaluation's key derived inside the compiled function (no eager dispatch per evaluation); loss and
        # accuracy in one array: one device-to-host read
        key = jax.random.fold_in(jax.random.fold_in(base_key, 0x0E7A1), calls)
        logits, _ = self._eval_forward(params, buffers, x, key)
        return jnp.stack([cross_entropy(logits, y), jnp.mean((jnp.argmax(logits, axis=-1) == y).astype(self.dtype))])

    def _probe_loss(self, loss, aux):
        """The loss a probe reports: under a mesh the mean of the replica losses (aux[2]), as the step's."""
        return jnp.mean(aux[2]) if self.mesh is not None else loss

    def _grads_fn(self, params, buffers, x, y, masks, key):
        loss, aux, grads = self._grads_of(params, buffers, x, y, masks, key)
        return self._probe_loss(loss, aux), grads

    def _joint_fn(self, params, buffers, x, y, masks, key):
        """The gradient probe with every layer's output returned by the same program (layers_and_gradients):
        the layers are outputs of the differentiated function (aux), so they are the values its backward saw."""
        def loss_and_layers(p):
            rec: dict[str, jax.Array] = {}
            loss, aux = self._loss_fn(p, buffers, x, y, masks, key, rec)
            return loss, (aux, rec)
        (loss, (aux, rec)), grads = jax.value_and_grad(loss_and_layers, has_aux=True)(params)
        return rec, self._probe_loss(loss, aux), self._seam_grads(grads)

    def _eval_layers_fn(self, params, buffers, x, key):
        rec: dict[str, jax.Array] = {}
        self._eval_forward(params, buffers, x, key, rec)
        return rec

    def _forward_layers_fn(self, params, buffers, x, masks, key):
        rec: dict[str, jax.Array] = {}
        self._train_forward(params, buffers, x, masks, key, rec)
        return rec


_LOWERINGS: dict[tuple, Lowering] = {}


def lowering(model: ModelSpec, opts: RunOptions, dtype: Any, mesh: Mesh | None = None, bn_groups: int = 1) -> Lowering:
    key = (model.hash(), opts.fault, opts.dropout == "native", str(jnp.dtype(dtype)), bool(opts.jit),
           None if mesh is None else (mesh.size, tuple(d.id for d in mesh.devices.flat)), bn_groups)
    if key not in _LOWERINGS:
        _LOWERINGS[key] = Lowering(model, opts.fault, opts.dropout == "native", dtype, opts.jit, mesh, bn_groups)
    return _LOWERINGS[key]


class JaxBackend(DataParallel, Backend):
    framework = "jax"
    faults = JaxEntry.faults
    emulations = JaxEntry.emulations
    layer_kinds = JaxEntry.layer_kinds

    def __init__(self, model: ModelSpec, hp: HParams, opts: RunOptions) -> None:
        super().__init__(model, hp, opts)
        self._init_mesh()
        if opts.dtype not in ("float32", "float64"):
            raise UnsupportedError(f"backend jax: dtype {opts.dtype!r} is not supported (float32, float64)")
        if opts.dtype == "float64" and not jax.config.jax_enable_x64:
            raise UnsupportedError("backend jax: float64 needs JAX_ENABLE_X64=1 set before jax is imported")
        self.dtype = jnp.float64 if opts.dtype == "float64" else jnp.float32
        self.np_dtype = np.dtype(opts.dtype)
        self.permute = Seams(opts.fault).permute
        self.channel_major = Seams(opts.fault).depthwise_channel_major
        self.native_dropout = opts.dropout == "native"
        self.trainable: list[str] = [q.name for q in model.trainable]
        self.buffer_names: list[str] = [q.name for q in model.buffers]
        self.bn_groups = 1 if (self.mesh is None or self.sync_bn) else self.replicas
        self.lowering = lowering(model, opts, self.dtype, self.mesh, self.bn_groups)
        self.tx, self._step = self.lowering.step_for(self.hp)
        self.is_adam = self.hp.optimizer in ("adam", "adamw")
        self.has_momentum = self.hp.optimizer in ("momentum", "nesterov")
        self.base_key = jax.random.key(self.hp.seed)
        self.params: dict[str, jax.Array] = {}
        self.buffers: dict[str, jax.Array] = {}
        self.opt_state: Any = None
        self.prev_lr: float | None = None
        self.eval_calls = 0

    # ---- environment
    def versions(self) -> dict[str, str]:
        import jaxlib
        return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "optax": optax.__version__,
                "python": platform.python_version(), "numpy": np.__version__}

    def devices(self) -> list[str]:
        proc = platform.processor() or platform.machine()
        return [f"{d.platform}:{d.id} {getattr(d, 'device_kind', '')}".strip() + (f" ({proc})" if d.platform == "cpu" else "")
                for d in jax.devices()][:self.replicas]

    def is_primary(self) -> bool:
        return self.process_id == 0

    def determinism(self) -> dict[str, Any]:
        return {"XLA_FLAGS": os.environ.get("XLA_FLAGS", ""), "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS"),
                "jax_enable_x64": bool(jax.config.jax_enable_x64), "dtype": str(jnp.dtype(self.dtype)),
                "threads": self.opts.threads, "jit": self.opts.jit,
                "default_matmul_precision": jax.config.jax_default_matmul_precision,
                "default_prng_impl": jax.config.jax_default_prng_impl,
                "dropout": self.opts.dropout, "backend_platform": jax.default_backend()}

    def declared_differences(self) -> list[str]:
        out = ["native_dropout_masks"] if self.model.has("dropout") and self.native_dropout else []
        if self.replicas > 1 and self.model.has("batchnorm2d") and not self.sync_bn:
            out.append("per_replica_batchnorm")
        return out

    # ---- state
    def _to_jax(self, name: str, a: np.ndarray) -> jax.Array:
        # a private copy first: on CPU jnp.asarray may alias the caller's NumPy buffer
        return jnp.asarray(np.array(to_native(self.model, name, np.asarray(a), self.permute, self.channel_major),
                                    dtype=self.np_dtype, copy=True))

    def _canon(self, name: str, a: jax.Array) -> np.ndarray:
        return from_native(self.model, name, np.array(host_value(a), copy=True), self.permute, self.channel_major)   # never a view of live state

    def load_params(self, params: dict[str, np.ndarray]) -> None:
        self.params = self._place({n: self._to_jax(n, params[n]) for n in self.trainable})
        self.buffers = self._place({n: self._to_jax(n, params[n]) for n in self.buffer_names})
        self.opt_state = self._place(self.tx.init(self.params))
        self.prev_lr = None

    def export_params(self) -> dict[str, np.ndarray]:
        out = {n: self._canon(n, self.params[n]) for n in self.trainable}
        out.update({n: self._canon(n, self.buffers[n]) for n in self.buffer_names})
        return {q.name: out[q.name] for q in self.model.params}

    def export_opt_state(self) -> dict[str, np.ndarray]:
        return export_state(self.opt_state, self.trainable, self._canon, self.has_momentum, self.is_adam, host_value)

    def load_opt_state(self, state: dict[str, np.ndarray], step: int) -> None:
        """The optimizer state exactly as given (absent entries start from zero), ready for `step`."""
        st = load_state(self.tx.init(self.params), state, step, self.trainable, self._to_jax, self.has_momentum,
                        self.is_adam)
        self.opt_state = self._place(st)
        self.prev_lr = self.lr_for(step - 1) if step > 0 else None

    # ---- computation
    # numpy in, converted by jit's own argument handling (the fast path): no per-array dispatch
    def _x(self, x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x, dtype=self.np_dtype)

    def _y(self, y: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(y, dtype=np.int32)

    def _masks(self, masks: Masks) -> dict[str, np.ndarray]:
        return {k: np.asarray(v, dtype=self.np_dtype) for k, v in masks.items()}

    def train_step(self, step: int, x: np.ndarray, y: np.ndarray, masks: Masks) -> StepStats:
        lr = self.lr_for(step)
        self.opt_state = keras_velocity(self.opt_state, self.prev_lr, lr, self.opts.fault, self.has_momentum)
        self.prev_lr = lr
        eps = step_eps(self.hp, step, self.opts.fault)
        xb, yb, mb = self._batch(x, y, masks)
        self.params, self.buffers, self.opt_state, stats = self._step(
            self.params, self.buffers, self.opt_state, xb, yb, mb,
            self.base_key, np.int32(step), np.asarray(lr, self.np_dtype), np.asarray(eps, self.np_dtype))
        s = np.asarray(host_value(stats))     # one blocking read (np.asarray: no device_get tree walk)
        reps = [float(v) for v in s[len(STEP_STATS):]] if self.mesh is not None else None
        return StepStats(*(float(v) for v in s[:len(STEP_STATS)]), reps)

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        calls = np.int32(self.eval_calls)
        self.eval_calls += 1
        xe, ye = (self._x(x), self._y(y)) if not self.multi else self._place((self._x(x), self._y(y)))
        loss, acc = np.asarray(host_value(self.lowering.eval(self.params, self.buffers, xe, ye, self.base_key, calls)))
        return float(loss), float(acc)

    def _probe_key(self) -> jax.Array:
        return jax.random.fold_in(self.base_key, 0)

    def forward_layers(self, x: np.ndarray, masks: Masks) -> dict[str, np.ndarray]:
        xb, _, mb = self._batch(x, np.zeros(len(x), np.int32), masks)
        rec = self.lowering.fwd(self.params, self.buffers, xb, mb, self._probe_key())
        # in layer order (a jit-returned dict comes back sorted by key; probe consumers read the order)
        return {l.name: np.array(rec[l.name]) for l in self.model.layers}

    def eval_layers(self, x: np.ndarray) -> dict[str, np.ndarray]:
        xe = self._x(x) if not self.multi else self._place(self._x(x))
        rec = self.lowering.eval_fwd(self.params, self.buffers, xe, jax.random.fold_in(self.base_key, 0x0E7A1))
        return {l.name: np.array(rec[l.name]) for l in self.model.layers}

    def gradients(self, x: np.ndarray, y: np.ndarray, masks: Masks) -> tuple[float, dict[str, np.ndarray]]:
        xb, yb, mb = self._batch(x, y, masks)
        loss, grads = self.lowering.grads(self.params, self.buffers, xb, yb, mb, self._probe_key())
        return float(host_value(loss)), {n: self._canon(n, grads[n]) for n in self.trainable}

    def layers_and_gradients(self, x: np.ndarray, y: np.ndarray, masks: Masks
                             ) -> tuple[dict[str, np.ndarray], float, dict[str, np.ndarray]] | None:
        """Every layer's output, the loss and the gradients from one compiled program
        (Backend.layers_and_gradients): XLA compiles forward_layers and gradients as two programs, free to
        fuse each its own way. None without jit: the probes then run the same eager operations."""
        if not self.opts.jit:
            return None
        xb, yb, mb = self._batch(x, y, masks)
        rec, loss, grads = self.lowering.joint(self.params, self.buffers, xb, yb, mb, self._probe_key())
        return ({l.name: np.array(rec[l.name]) for l in self.model.layers}, float(host_value(loss)),
                {n: self._canon(n, grads[n]) for n in self.trainable})


BACKEND = JaxBackend
