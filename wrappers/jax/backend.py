"""JAX backend: the spec lowered to jax.lax in NHWC (layers.py), optax optimizers, one jit-compiled step.

The whole training step (forward, loss, backward, optax update, the step statistics) is one pure
function, compiled once per process by jax.jit. The learning rate (and Adam's eps) enter as traced
arguments and are written into the `optax.inject_hyperparams` state inside the step, so a schedule
never triggers a recompilation. For Adam the injected lr / eps / weight decay are rescaled so that
optax's float32 bias correction (1 - b2^t from a float32-rounded b2) becomes the exact one of the
reference (see `adam_hyperparams`).

Data parallel (`--devices N`): the same one jit-compiled step over a `jax.sharding.Mesh` of N
devices (N host devices on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N, set by
JaxEntry.job_env before jax is imported). The global batch, in the harness order, is placed with
NamedSharding(mesh, P('data')): N contiguous shards of B/N, replica r = shard_bounds(B, N)[r];
parameters, buffers and the optimizer state are replicated (NamedSharding(mesh, P())) and kept so by
sharding constraints on the step's outputs. The loss differentiated is the mean of the N
replicas' mean losses = the global-batch mean, so GSPMD's all-reduce yields the global mean
gradient, as on one device. Replica losses: the per-sample losses reshaped (N, B/N), mean over
axis 1. BatchNorm: per-replica statistics by default (each group of B/N samples, as the
frameworks' replicas do; declared difference per_replica_batchnorm), running statistics folded
from replica 0's statistics (what DDP's buffer broadcast leaves); `--sync-bn`: statistics over the
global batch, exactly the single-device math. Faults: grad_sum_replicas (the replicas' mean losses
summed, not averaged: N x the gradient), overlapping_shards (every replica gets shard 0).
`--hosts H` (train jobs): H processes (wrappers launcher, jax.distributed.initialize on
127.0.0.1, gloo CPU collectives), N/H local devices each, the same mesh over all N devices and the
same program; inputs and state are built per process with jax.make_array_from_callback, replicated
outputs read from the local shard; process 0 writes the results. Bitwise equal to one process.
"""
from __future__ import annotations

import functools
import math
import os
import platform
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax import tree_utils as otu

from algorithms.optim import HParams
from algorithms.spec import ModelSpec

from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..base import Backend, Masks, RunOptions, StepStats, UnsupportedError, shard_bounds
from . import JaxEntry
from .layers import cross_entropy, forward, from_internal, per_example_cross_entropy, to_internal


ADAM_STATE = "ScaleByAdamState"
INJECT_STATE = "InjectStatefulHyperparamsState"
TRACE_STATE = "TraceState"


def make_optimizer(hp: HParams, fault: str | None) -> optax.GradientTransformationExtraArgs:
    """The native optax optimizer whose mathematics are the reference's, with the learning rate
    (and eps, for Adam) as injected hyper-parameters. L2 weight decay (sgd, momentum, nesterov,
    adam) is added to the gradient before the transform; adamw's decay is decoupled."""
    wd = hp.weight_decay
    coupled = hp.optimizer != "adamw" or fault == "l2_not_decoupled"

    def l2(tx: optax.GradientTransformation) -> optax.GradientTransformation:
        return optax.chain(optax.add_decayed_weights(wd), tx) if wd and coupled else tx

    if hp.optimizer == "sgd":
        return optax.inject_hyperparams(lambda learning_rate: l2(optax.sgd(learning_rate)))(learning_rate=hp.lr)
    if hp.optimizer in ("momentum", "nesterov"):
        nesterov = hp.optimizer == "nesterov"
        return optax.inject_hyperparams(
            lambda learning_rate: l2(optax.sgd(learning_rate, momentum=hp.momentum, nesterov=nesterov))
        )(learning_rate=hp.lr)
    if coupled:   # adam, or adamw with the l2_not_decoupled fault (torch Adam(weight_decay=...))
        return optax.inject_hyperparams(
            lambda learning_rate, eps: l2(optax.adam(learning_rate, b1=hp.beta1, b2=hp.beta2, eps=eps))
        )(learning_rate=hp.lr, eps=hp.eps)
    return optax.inject_hyperparams(
        lambda learning_rate, eps, weight_decay: optax.adamw(learning_rate, b1=hp.beta1, b2=hp.beta2, eps=eps,
                                                             weight_decay=weight_decay)
    )(learning_rate=hp.lr, eps=hp.eps, weight_decay=wd)


def _in(tuple_name: str) -> Callable[[Any, Any], bool]:
    """optax.tree_utils filter: the field belongs to a NamedTuple called `tuple_name`."""
    return lambda path, _v: bool(path) and getattr(path[-1], "tuple_name", None) == tuple_name


def _set_field(tree: Any, tuple_name: str, field: str, value: Any) -> Any:
    """`tree` with `field` of every NamedTuple called `tuple_name` replaced by `value`. (Not
    optax.tree_utils.tree_set: it does not descend below a node that already has a field of that
    name, so it cannot reach ScaleByAdamState.count inside InjectStatefulHyperparamsState.)"""
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        kids = {f: _set_field(getattr(tree, f), tuple_name, field, value) for f in tree._fields}
        if type(tree).__name__ == tuple_name and field in kids:
            kids[field] = value
        return type(tree)(**kids)
    if isinstance(tree, (tuple, list)):
        return type(tree)(_set_field(t, tuple_name, field, value) for t in tree)
    if isinstance(tree, dict):
        return {k: _set_field(v, tuple_name, field, value) for k, v in tree.items()}
    return tree


def adam_hyperparams(hyper: dict[str, jax.Array], count: jax.Array, b1: float, b2: float) -> dict[str, jax.Array]:
    """The learning rate, eps (and adamw's weight decay) to inject so that optax's Adam step equals
    the reference's, whose bias corrections 1 - b^t are exact (float64 in torch and in
    algorithms.optim). optax computes 1 - b^t in the parameters' dtype: in float32, b2 = 0.999 rounds
    to 0.99900001287 and its 1 - b2^t is off by 1.3e-5 at t = 1 (up to 2e-5 later), a systematic
    6e-6 on every update. With c1, c2 the accurate corrections (-expm1(t log b), log b from float64)
    and c1', c2' optax's own, rho = sqrt(c2 / c2'):
        lr' = lr * rho * c1' / c1,   eps' = eps * rho,   weight_decay' = weight_decay * c1 / (rho * c1')
    turn optax's  lr' (m / c1') / (sqrt(v / c2') + eps') (+ lr' wd' p)  into  lr (m / c1) / (sqrt(v / c2) + eps)
    (+ lr wd p) exactly; the rescaling costs float32 rounding only (~1e-7 relative)."""
    dtype = hyper["learning_rate"].dtype
    t = optax.safe_increment(count)                              # the count optax's update will use
    ones = jnp.ones((), dtype)
    inv_c1q = optax.tree.bias_correction(ones, b1, t)            # 1 / c1', optax's own expression
    inv_c2q = optax.tree.bias_correction(ones, b2, t)
    tf = t.astype(dtype)
    c1 = -jnp.expm1(tf * jnp.asarray(math.log(b1), dtype))
    c2 = -jnp.expm1(tf * jnp.asarray(math.log(b2), dtype))
    rho = jnp.sqrt(c2 * inv_c2q)
    gain = rho / (c1 * inv_c1q)                                  # lr' / lr
    out = dict(hyper, learning_rate=hyper["learning_rate"] * gain, eps=hyper["eps"] * rho)
    if "weight_decay" in hyper:
        out["weight_decay"] = hyper["weight_decay"] / gain
    return out


STEP_STATS = ("loss", "accuracy", "grad_norm", "update_norm", "param_norm")   # the step's vector, in order


def _host(a: Any) -> Any:
    """A replicated array's value on this host (another host's devices are not addressable here)."""
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        return np.asarray(a.addressable_data(0))
    return a


def _global(tree: Any, sharding: NamedSharding) -> Any:
    """Multi-host: every process holds the whole value; each places the pieces its own devices hold."""
    def one(a):
        h = np.asarray(a)
        return jax.make_array_from_callback(h.shape, sharding, lambda idx: h[idx])
    return jax.tree.map(one, tree)


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
        self.label_smoothing = 0.1 if fault == "label_smoothing" else 0.0
        self.wrap = jax.jit if jit else (lambda f: f)
        self.fwd = self.wrap(self._forward_layers_fn)
        self.grads = self.wrap(self._grads_fn)
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

    def _loss_fn(self, params, buffers, x, y, masks, key):
        if self.mesh is not None:
            return self._dp_loss_fn(params, buffers, x, y, masks, key)
        logits, new_buffers = forward(self.model, params, buffers, x, train=True, masks=masks, fault=self.fault,
                                      key=key, native_dropout=self.native_dropout)
        return cross_entropy(logits, y, self.label_smoothing), (logits, new_buffers)

    def _dp_loss_fn(self, params, buffers, x, y, masks, key):
        """Data parallel: the objective is the mean of the replicas' mean losses (the global-batch
        mean; with grad_sum_replicas their sum). aux carries the replica losses."""
        logits, new_buffers = forward(self.model, params, buffers, x, train=True, masks=masks, fault=self.fault,
                                      key=key, native_dropout=self.native_dropout, bn_groups=self.bn_groups)
        per = per_example_cross_entropy(logits, y, self.label_smoothing)
        reps = jnp.mean(per.reshape(self.replicas, -1), axis=1)
        objective = jnp.sum(reps) if self.fault == "grad_sum_replicas" else jnp.mean(reps)
        return objective, (logits, new_buffers, reps)

    def _grads_of(self, params, buffers, x, y, masks, key):
        (loss, aux), grads = jax.value_and_grad(self._loss_fn, has_aux=True)(params, buffers, x, y, masks, key)
        if self.fault == "grad_double":      # the gradient counted twice
            grads = jax.tree.map(lambda g: g * 2.0, grads)
        return loss, aux, grads

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
            hyper = adam_hyperparams(hyper, otu.tree_get(opt_state, "count", filtering=_in(ADAM_STATE)), b1, b2)
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

    def _eval_fn(self, params, buffers, x, y, key):
        logits, _ = forward(self.model, params, buffers, x, train=False, masks=None, fault=self.fault, key=key)
        return cross_entropy(logits, y), jnp.mean((jnp.argmax(logits, axis=-1) == y).astype(self.dtype))

    def _grads_fn(self, params, buffers, x, y, masks, key):
        loss, aux, grads = self._grads_of(params, buffers, x, y, masks, key)
        if self.mesh is not None:
            loss = jnp.mean(aux[2])
        return loss, grads

    def _eval_layers_fn(self, params, buffers, x, key):
        rec: dict[str, jax.Array] = {}
        forward(self.model, params, buffers, x, train=False, masks=None, fault=self.fault, key=key, record=rec)
        return rec

    def _forward_layers_fn(self, params, buffers, x, masks, key):
        rec: dict[str, jax.Array] = {}
        forward(self.model, params, buffers, x, train=True, masks=masks, fault=self.fault, key=key,
                native_dropout=self.native_dropout, record=rec, bn_groups=self.bn_groups)
        return rec


_LOWERINGS: dict[tuple, Lowering] = {}


def lowering(model: ModelSpec, opts: RunOptions, dtype: Any, mesh: Mesh | None = None, bn_groups: int = 1) -> Lowering:
    key = (model.hash(), opts.fault, opts.dropout == "native", str(jnp.dtype(dtype)), bool(opts.jit),
           None if mesh is None else (mesh.size, tuple(d.id for d in mesh.devices.flat)), bn_groups)
    if key not in _LOWERINGS:
        _LOWERINGS[key] = Lowering(model, opts.fault, opts.dropout == "native", dtype, opts.jit, mesh, bn_groups)
    return _LOWERINGS[key]


class JaxBackend(Backend):
    framework = "jax"
    faults = JaxEntry.faults
    layer_kinds = JaxEntry.layer_kinds

    def __init__(self, model: ModelSpec, hp: HParams, opts: RunOptions) -> None:
        super().__init__(model, hp, opts)
        self.process_id, self.coordinator = 0, None
        if self.hosts > 1:
            if self.replicas % self.hosts:
                raise UnsupportedError(f"--hosts {self.hosts} must divide --devices {self.replicas}")
            if "DUIPAI_JAX_COORDINATOR" not in os.environ:
                raise UnsupportedError(f"backend jax: --hosts {self.hosts} runs train jobs only (one process per "
                                       "host, started by the wrappers launcher); probe / replay a multi-host run "
                                       "with --devices N and no --hosts")
            self.coordinator = os.environ["DUIPAI_JAX_COORDINATOR"]
            self.process_id = int(os.environ["DUIPAI_JAX_PROCESS_ID"])
            jax.distributed.initialize(coordinator_address=self.coordinator,
                                       num_processes=int(os.environ["DUIPAI_JAX_NUM_PROCESSES"]),
                                       process_id=self.process_id, initialization_timeout=60)
        self.multi = self.hosts > 1
        self.mesh: Mesh | None = None
        if self.replicas > 1:
            have = jax.devices()
            if len(have) < self.replicas:
                raise UnsupportedError(
                    f"backend jax: --devices {self.replicas} but jax sees {len(have)} {jax.default_backend()} "
                    f"device(s) (XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r})")
            self.mesh = Mesh(np.array(have[:self.replicas]), ("data",))
            self.replicated = NamedSharding(self.mesh, P())
            self.data_sharded = NamedSharding(self.mesh, P("data"))
        if opts.dtype not in ("float32", "float64"):
            raise UnsupportedError(f"backend jax: dtype {opts.dtype!r} is not supported (float32, float64)")
        if opts.dtype == "float64" and not jax.config.jax_enable_x64:
            raise UnsupportedError("backend jax: float64 needs JAX_ENABLE_X64=1 set before jax is imported")
        self.dtype = jnp.float64 if opts.dtype == "float64" else jnp.float32
        self.np_dtype = np.dtype(opts.dtype)
        self.no_permute = opts.fault == "flatten_no_permute"
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

    def parallel_info(self) -> dict[str, Any]:
        if self.mesh is None:
            return super().parallel_info()
        bn = ("n/a (no BatchNorm)" if not self.model.has("batchnorm2d") else
              "synchronized: statistics over the global batch (the single-device math)" if self.sync_bn else
              "per replica, over each replica's B/N samples; running statistics from replica 0's")
        return {
            "strategy": "jit over Mesh('data')", "replicas": self.replicas, "processes": self.hosts, "hosts": self.hosts,
            **({"launcher": "wrappers launcher, jax.distributed.initialize (gloo CPU collectives)",
                "coordinator": self.coordinator, "process_id": self.process_id,
                "local_devices": len(jax.local_devices()),
                "cpu_collectives": jax.config.jax_cpu_collectives_implementation} if self.multi else {}),
            "devices": [f"{d.platform}:{d.id}" for d in self.mesh.devices.flat],
            "sync_bn": self.sync_bn, "batchnorm_statistics": bn,
            "sharding": "NamedSharding(mesh, P('data')): contiguous, replica r takes samples [r*B/N, (r+1)*B/N)"
                        + (" (fault overlapping_shards: every replica takes [0, B/N))"
                           if self.opts.fault == "overlapping_shards" else ""),
            "params": "replicated, NamedSharding(mesh, P())",
            "gradient_reduction": ("the SUM of the replicas' mean losses differentiated: N x the mean gradient "
                                   "(fault grad_sum_replicas)" if self.opts.fault == "grad_sum_replicas" else
                                   "gradient of the mean of the replicas' mean losses (the global-batch mean); "
                                   "XLA GSPMD all-reduce"),
            "loss": "mean of the replicas' mean losses, accuracy over the global batch",
        }

    # ---- state
    def _to_jax(self, name: str, a: np.ndarray) -> jax.Array:
        # a private copy first: on CPU jnp.asarray may alias the caller's NumPy buffer
        return jnp.asarray(np.array(to_internal(self.model, name, np.asarray(a), self.no_permute),
                                    dtype=self.np_dtype, copy=True))

    def _canon(self, name: str, a: jax.Array) -> np.ndarray:
        return from_internal(self.model, name, np.array(_host(a), copy=True), self.no_permute)   # never a view of live state

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
        out: dict[str, np.ndarray] = {}
        if self.has_momentum:
            trace = otu.tree_get(self.opt_state, "trace")
            out.update({f"momentum/{n}": self._canon(n, trace[n]) for n in self.trainable})
        elif self.is_adam:
            mu = otu.tree_get(self.opt_state, "mu")
            nu = otu.tree_get(self.opt_state, "nu")
            out.update({f"exp_avg/{n}": self._canon(n, mu[n]) for n in self.trainable})
            out.update({f"exp_avg_sq/{n}": self._canon(n, nu[n]) for n in self.trainable})
            out["step"] = np.asarray(float(_host(otu.tree_get(self.opt_state, "count", filtering=_in(ADAM_STATE)))))
        return out

    def load_opt_state(self, state: dict[str, np.ndarray], step: int) -> None:
        """The optimizer state exactly as given (absent entries start from zero), ready for `step`."""
        st = self.tx.init(self.params)
        def tree(prefix: str, like: dict[str, jax.Array]) -> dict[str, jax.Array]:
            return {n: (self._to_jax(n, state[f"{prefix}/{n}"]) if f"{prefix}/{n}" in state else like[n])
                    for n in self.trainable}
        if self.has_momentum:
            st = _set_field(st, TRACE_STATE, "trace", tree("momentum", otu.tree_get(st, "trace")))
        elif self.is_adam:
            st = _set_field(st, ADAM_STATE, "mu", tree("exp_avg", otu.tree_get(st, "mu")))
            st = _set_field(st, ADAM_STATE, "nu", tree("exp_avg_sq", otu.tree_get(st, "nu")))
            n_done = int(round(float(state["step"]))) if "step" in state else 0
            st = _set_field(st, ADAM_STATE, "count", jnp.asarray(n_done, jnp.int32))
        st = _set_field(st, INJECT_STATE, "count", jnp.asarray(step, jnp.int32))
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

    def _place(self, tree: Any) -> Any:
        """Data parallel: replicated over the mesh (params, buffers, optimizer state)."""
        if self.mesh is None:
            return tree
        return _global(tree, self.replicated) if self.multi else jax.device_put(tree, self.replicated)

    def _batch(self, x: np.ndarray, y: np.ndarray, masks: Masks) -> tuple[Any, Any, Any]:
        """The step's inputs: as they are on one device; data parallel, the replicas' shards
        (shard_bounds, so the overlapping_shards fault gives every replica shard 0) laid out
        contiguously and placed with NamedSharding(mesh, P('data'))."""
        x, y, m = self._x(x), self._y(y), self._masks(masks)
        if self.mesh is None:
            return x, y, m
        if len(x) % self.replicas:
            raise UnsupportedError(f"global batch {len(x)} is not divisible by {self.replicas} replicas")
        if self.opts.fault == "overlapping_shards":
            idx = np.concatenate([np.arange(a, b) for a, b in shard_bounds(len(x), self.replicas, self.opts.fault)])
            x, y, m = x[idx], y[idx], {k: v[idx] for k, v in m.items()}
        if self.multi:
            return _global((x, y, m), self.data_sharded)
        return jax.device_put((x, y, m), self.data_sharded)

    def train_step(self, step: int, x: np.ndarray, y: np.ndarray, masks: Masks) -> StepStats:
        lr = self.lr_for(step)
        if self.opts.fault == "keras_momentum_schedule" and self.has_momentum \
                and self.prev_lr is not None and self.prev_lr != lr:
            # Keras velocity v = mu v - lr g  <=>  the torch/optax buffer rescaled by lr_prev / lr
            ratio = self.prev_lr / lr
            trace = otu.tree_get(self.opt_state, "trace")
            self.opt_state = _set_field(self.opt_state, TRACE_STATE, "trace", jax.tree.map(lambda t: t * ratio, trace))
        self.prev_lr = lr
        eps = self.hp.eps
        if self.opts.fault == "adam_eps_hat":   # eps-hat form == reference eps / sqrt(1 - b2^t)
            eps = self.hp.eps / math.sqrt(1.0 - self.hp.beta2 ** (step + 1))
        xb, yb, mb = self._batch(x, y, masks)
        self.params, self.buffers, self.opt_state, stats = self._step(
            self.params, self.buffers, self.opt_state, xb, yb, mb,
            self.base_key, np.int32(step), np.asarray(lr, self.np_dtype), np.asarray(eps, self.np_dtype))
        s = np.asarray(jax.device_get(_host(stats)))
        reps = [float(v) for v in s[len(STEP_STATS):]] if self.mesh is not None else None
        return StepStats(*(float(v) for v in s[:len(STEP_STATS)]), reps)

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        key = jax.random.fold_in(jax.random.fold_in(self.base_key, 0x0E7A1), self.eval_calls)
        self.eval_calls += 1
        xe, ye = (self._x(x), self._y(y)) if not self.multi else self._place((self._x(x), self._y(y)))
        loss, acc = self.lowering.eval(self.params, self.buffers, xe, ye, key)
        return float(_host(loss)), float(_host(acc))

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
        return float(_host(loss)), {n: self._canon(n, grads[n]) for n in self.trainable}


BACKEND = JaxBackend
