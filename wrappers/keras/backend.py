"""Keras 3 backend (one module for keras-tensorflow, keras-jax and keras-torch): the spec as a functional
keras.Model of Keras layers (layers.py), keras.optimizers (optim.py), a logits cross-entropy, trained by the
model's own compiled train function around a custom `train_step` per Keras backend (runtimes/<backend>.py,
chosen once: `RT`), driven by its Stepper (keras-jax keeps the state as JAX arrays between steps, as `fit`
does: train_on_batch's per-call read and write of every variable cost more than the step itself).

Conventions and conversions (canonical <-> Keras):
* parameters: Keras layouts are the canonical ones; BatchNormalization(momentum = 1 - spec momentum,
  epsilon = spec eps). Keras stores the BIASED running variance: exported as stored
  (declared difference running_var_biased).
* optimizer state: Keras' velocity as torch's momentum buffer (optim.py).
* weight decay: Keras' weight_decay is decoupled, which is AdamW's; for sgd/momentum/nesterov/adam the
  reference is coupled L2, added to the gradient (g + wd * p) inside the train step; the reported loss
  and grad_norm are the DATA loss and its gradient (as torch reports them).
* learning rate: the value of the optimizer's learning_rate variable, set before every step (assigned,
  or on keras-jax written into the optimizer state): a schedule never retraces.
* dropout: harness masks live in a non-trainable variable of a small layer, set before each step.
* data parallelism (--devices N): keras-jax keras.distribution.DataParallel, keras-tensorflow MirroredStrategy,
  contiguous shards (parallel.py, runtimes/); keras-torch refuses (Keras has none on torch), as --hosts.
* probes: the training step's own body, compiled as the step is, its writes undone: its gradients and every
  layer's output (the recorder called in the model's place: DuipaiModel.call, runtimes/<backend>.Stepper).
* float64: keras-tensorflow and keras-jax (jax_enable_x64 on before the model exists); refused on
  keras-torch, where Keras 3.15 computes float64 matmuls in float32.
"""
from __future__ import annotations

import contextlib
import os
import platform
import threading
from typing import Any

# XLA reads its flags when jax is first imported (the keras import below does that on keras-jax):
# pin XLA CPU to one thread when the run asks for one thread (as the native jax backend does).
if (os.environ.get("KERAS_BACKEND") == "jax" and os.environ.get("OMP_NUM_THREADS", "1") == "1"
        and "xla_cpu_multi_thread_eigen" not in os.environ.get("XLA_FLAGS", "")):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

from algorithms.contract import RunOptions
from algorithms.faults import Seams  # noqa: E402
from algorithms.optim import HParams  # noqa: E402
from algorithms.spec import ModelSpec  # noqa: E402

from ..base import Backend, Masks, StepStats, UnsupportedError  # noqa: E402
from ..registry import REGISTRY  # noqa: E402
from . import optim, runtimes  # noqa: E402
from .layers import from_native, lower, to_native, torch_avgpool_replicates  # noqa: E402

KBACKEND = keras.backend.backend()
RT = runtimes.current()          # this Keras backend's module: every per-backend difference is asked of it


def batch_mean(loss_fn: keras.losses.Loss, y, logits):
    """loss_fn (reduction='sum') / batch size: Keras' 'sum_over_batch_size' bit for bit in float32, without its
    ops.divide_no_nan, whose result type rounds a float64 loss (Keras 3.15 maps 64-bit to 32-bit)."""
    total = loss_fn(ops.convert_to_tensor(y), logits)
    return total / ops.cast(ops.shape(logits)[0], total.dtype)


class LayerRecord:
    """While a forward probe runs the step: the recorder (every layer's output) and what it recorded, per thread
    (a MirroredStrategy runs each replica's step in a thread). A plain object: Keras and torch.nn track models."""

    def __init__(self, logits_at: int) -> None:
        self.logits_at = logits_at
        self.recorder: "keras.Model | None" = None
        self._outputs: dict[int, list] = {}

    def keep(self, outputs: list) -> None:
        self._outputs[threading.get_ident()] = outputs

    def take(self) -> list:
        return self._outputs.pop(threading.get_ident())


class DuipaiModel(keras.Model):
    """A functional keras.Model whose `train_step` is the per-backend custom step; backend-neutral helpers."""

    train_step = RT.train_step

    def call(self, inputs, training=None, mask=None, **kwargs):
        """The functional model's call; while a forward probe runs the step (`layer_record.recorder` set), the
        recorder's: the same layers, variables, training flag and masks, every layer's output kept."""
        rec = self.layer_record
        if rec.recorder is None:
            return super().call(inputs, training=training, mask=mask, **kwargs)
        outs = list(rec.recorder.call(inputs, training=training, mask=mask, **kwargs))
        rec.keep(outs)
        return outs[rec.logits_at]

    def configure(self, *, grad_scale: float, coupled_wd: float, replicas: int = 1, sum_replicas: bool = False,
                  wd_share: float = 1.0) -> None:
        """grad_scale: fault grad_double; coupled_wd: the reference's L2 coefficient, of which each
        replica adds wd_share (1/N where the replicas' gradients are summed); replicas: the data-parallel
        replicas (replica losses reported); sum_replicas: fault grad_sum_replicas."""
        self.grad_scale, self.coupled_wd = grad_scale, coupled_wd
        self.replicas, self.sum_replicas, self.wd_share = replicas, sum_replicas, wd_share
        self.traces = 0               # traces of train_step (a Python side effect: once per compilation)

    def data_loss(self, y, logits):
        """The compiled loss (integer labels, logits) on this batch: the mean over the batch."""
        return batch_mean(self.loss, y, logits)

    def replica_losses(self, y, logits):
        """The mean loss of each of the N contiguous groups of B/N samples (each replica's shard)."""
        n = self.replicas
        k = ops.shape(logits)[0] // n
        return ops.stack([batch_mean(self.loss, y[r * k:(r + 1) * k], logits[r * k:(r + 1) * k]) for r in range(n)])

    def prepare_grads(self, grads, values, reduce=None):
        """(gradients the optimizer sees, norm of the data gradients); `reduce`: the replicas' sum of
        the gradients, for the norm, where the optimizer all-reduces them itself."""
        grads = self.fault_grads(grads)
        summed = grads if reduce is None else reduce(grads)
        grad_norm = ops.sqrt(RT.sum_of_squares(summed))
        if self.coupled_wd:           # reference L2 for sgd/momentum/nesterov/adam: g + wd * p
            wd = self.coupled_wd * self.wd_share   # straight to g.dtype: TF casts a Python float via float32
            grads = [g + ops.convert_to_tensor(wd, dtype=g.dtype) * v for g, v in zip(grads, values)]
        return grads, grad_norm

    def fault_grads(self, grads):
        """The gradient seam, one for training and probes: grad_double counts every gradient twice."""
        return [g * self.grad_scale for g in grads] if self.grad_scale != 1.0 else grads

    def step_logs(self, loss, logits, y, grad_norm, before, after):
        upd = ops.sqrt(RT.sum_of_squares([a - b for a, b in zip(after, before)]))
        pn = ops.sqrt(RT.sum_of_squares(after))
        hit = ops.equal(ops.cast(ops.argmax(logits, axis=-1), "int32"), ops.cast(ops.convert_to_tensor(y), "int32"))
        return {"loss": loss, "accuracy": ops.mean(ops.cast(hit, "float32")), "grad_norm": grad_norm,
                "update_norm": upd, "param_norm": pn}


def _np(t) -> np.ndarray:
    return np.asarray(ops.convert_to_numpy(t))


class KerasBackend(Backend):
    framework = "keras"
    faults = REGISTRY[f"keras-{KBACKEND}"].faults
    layer_kinds = REGISTRY[f"keras-{KBACKEND}"].layer_kinds

    def __init__(self, model: ModelSpec, hp: HParams, opts: RunOptions) -> None:
        super().__init__(model, hp, opts)
        if opts.dtype not in ("float32", "float64"):
            raise UnsupportedError(f"keras-{KBACKEND}: dtype {opts.dtype!r} is not supported")
        if opts.dtype == "float64":
            if RT.FLOAT64_REFUSAL:
                raise UnsupportedError(RT.FLOAT64_REFUSAL)
            RT.enable_float64()          # before any array exists (the model is built below)
        # both: the global dtype policy, once created, no longer follows floatx (several backends per process)
        keras.config.set_floatx(opts.dtype)
        keras.config.set_dtype_policy(opts.dtype)
        self._det = RT.setup(opts.threads, opts.deterministic)
        # data parallelism (before any Keras object: devices and the strategy / distribution come first)
        self.par = RT.make_parallel(self.replicas, self.hosts, self.sync_bn, opts.fault, opts.extra)
        keras.utils.set_random_seed(hp.seed)
        self.seams = Seams(opts.fault)
        self.permute = self.seams.permute
        self.channel_major = self.seams.depthwise_channel_major   # depthwise_multiplier_order: the load order
        with self.par.scope() if self.par else contextlib.nullcontext():
            self.low = lower(model, batch_size=hp.batch_size, fault=opts.fault,
                             native_dropout=opts.dropout == "native", seed=hp.seed,
                             synchronized_bn=self.sync_bn and RT.SYNCHRONIZED_BN,
                             formula_kinds=RT.FLOAT64_FORMULA if opts.dtype == "float64" else frozenset())
            self.net = DuipaiModel(self.low.inputs, self.low.logits, name=f"duipai_{model.name}")
            self.recorder = keras.Model(self.low.inputs, list(self.low.outputs.values()), name="duipai_recorder")
            self.net.layer_record = LayerRecord(next(i for i, t in enumerate(self.low.outputs.values())
                                                     if t is self.low.logits))
            self.optimizer, coupled = optim.make_optimizer(self.hp, opts.fault)
            loss = (optim.SmoothedSparseCrossentropy(model.num_classes, self.seams.label_smoothing)
                    if self.seams.label_smoothing
                    else keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum"))
            self.eval_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
            self._jit = RT.jit_options(opts.jit, opts.extra)
            self.net.compile(optimizer=self.optimizer, loss=loss, **self._jit)
            # the replicas' gradients summed by the optimizer (TF): each adds its share of the L2 term
            self.net.configure(grad_scale=self.seams.grad_scale, coupled_wd=float(coupled),
                               replicas=self.replicas, sum_replicas=opts.fault == "grad_sum_replicas",
                               wd_share=1.0 / self.replicas if RT.REPLICA_GRADIENTS_SUMMED else 1.0)
            self.optimizer.build(self.net.trainable_variables)
        if self.par is not None:
            self.par.attach_dropouts(self.low.dropouts, hp.batch_size)
        by_id = {id(v): n for n, v in self.low.variables.items()}
        self.trainable = [by_id[id(v)] for v in self.net.trainable_variables]
        assert sorted(self.trainable) == sorted(q.name for q in model.trainable), self.trainable
        self.stepper = RT.Stepper(self.net, self.optimizer, self.par)
        self.last_lr: np.float32 | None = None

    # ---- environment
    def versions(self) -> dict[str, str]:
        return {"keras": keras.__version__, "keras_backend": KBACKEND, **RT.versions(),
                "python": platform.python_version(), "numpy": np.__version__}

    def devices(self) -> list[str]:
        return self.par.devices if self.par is not None else RT.devices()

    def parallel_info(self) -> dict[str, Any]:
        if self.par is None:
            return super().parallel_info()
        return self.par.info(self.opts.fault, self.model.has("batchnorm2d"))

    def determinism(self) -> dict[str, Any]:
        return {"keras_backend": KBACKEND, "keras.utils.set_random_seed": self.hp.seed, "threads": self.opts.threads,
                "floatx": keras.config.floatx(), "jit_compile": bool(self.net.jit_compile),
                "run_eagerly": bool(self.net.run_eagerly), "dropout": self.opts.dropout,
                "lowering_notes": self.low.notes, **self._det,
                **({"float64_note": RT.FLOAT64_NOTE} if self.opts.dtype == "float64" and RT.FLOAT64_NOTE else {})}

    def declared_differences(self) -> list[str]:
        h, out = self.hp, []
        if h.optimizer in ("adam", "adamw"):
            out.append("adam_epsilon_hat")
            # the betas are float32 in a float32 run, and in a float64 one where Python floats are cast through
            # float32 (keras-tensorflow: measured, a float64 run's updates 43 ULPs low at 13 of 14 points)
            if self.opts.dtype == "float32" or RT.FLOAT32_HYPERPARAMETERS:
                out.append("keras_float32_betas")
        if h.optimizer in ("momentum", "nesterov") and h.schedule != "constant":
            out.append("keras_momentum_velocity")
        # keras-torch: replicate padding of an asymmetric 'same' average pool, where it changes the numbers
        if RT.AVGPOOL_SAME_REPLICATES and any(torch_avgpool_replicates(l) for l in self.model.layers):
            out.append("keras_torch_avgpool_same")
        if self.model.has("batchnorm2d"):
            out.append("running_var_biased")
            # keras-jax's DataParallel normalizes over the global batch (one GSPMD program): nothing to declare
            if self.par is not None and self.par.per_replica_batchnorm:
                out.append("per_replica_batchnorm")
        if self.model.has("dropout") and self.opts.dropout == "native":
            out.append("native_dropout_masks")
        return out

    # ---- state
    def _native(self, name: str, a: np.ndarray) -> np.ndarray:
        """A canonical parameter-shaped array in Keras' layout (with the load-order faults' seams)."""
        return to_native(self.model, name, a, self.permute, self.channel_major)

    def _canonical(self, name: str, a: np.ndarray) -> np.ndarray:
        return from_native(self.model, name, a, self.permute, self.channel_major)

    def _var(self, name: str):
        return self.low.variables[name]

    def _opt_slots(self, name: str) -> dict[str, Any]:
        return optim.slots(self.optimizer, self.hp, self._var(name))

    def _per_replica(self) -> bool:
        """Whether the strategy's replicas run their own programs (read, evaluate, record, differentiate apart)."""
        return self.par is not None and self.par.replica_programs

    def _read(self, variables: list) -> list[np.ndarray]:
        """The variables' values, in one read where the runtime can (data parallel on TF: replica 0's component)."""
        if self._per_replica():
            return [self.par.primary(v) for v in variables]
        return self.stepper.read(variables)

    def _sync(self) -> None:
        """The Keras variables current (keras-jax keeps the training state outside them between steps)."""
        self.stepper.sync()

    def load_params(self, params: dict[str, np.ndarray]) -> None:
        self._sync()
        for q in self.model.params:
            var = self._var(q.name)
            var.assign(self._native(q.name, np.asarray(params[q.name])).astype(var.dtype))
        lr_var = self.optimizer._learning_rate
        for v in self.optimizer.variables:       # fresh optimizer state
            if v is not lr_var:
                v.assign(np.zeros(v.shape, v.dtype))
        self.last_lr = None

    def export_params(self) -> dict[str, np.ndarray]:
        self._sync()
        if self._per_replica():   # the mirrored parameters must not have diverged
            self.par.check_in_sync({n: self._var(n) for n in self.trainable})
        values = self._read([self._var(q.name) for q in self.model.params])
        return {q.name: self._canonical(q.name, a) for q, a in zip(self.model.params, values)}

    def export_opt_state(self) -> dict[str, np.ndarray]:
        self._sync()
        it = int(self._read([self.optimizer.iterations])[0])
        if it == 0:              # as torch: no optimizer state before the first step (nor its slots)
            return {}
        slots = [(n, kind, slot) for n in self.trainable for kind, slot in self._opt_slots(n).items()]
        values = self._read([slot for _, _, slot in slots])
        out = {f"{kind}/{n}": self._canonical(n, optim.to_canonical(kind, a, self.last_lr))
               for (n, kind, _), a in zip(slots, values)}
        if self.hp.optimizer in ("adam", "adamw"):
            out["step"] = np.asarray(float(it))
        return out

    def load_opt_state(self, state: dict[str, np.ndarray], step: int) -> None:
        self._sync()
        lr_prev = np.float32(self.lr_for(max(step - 1, 0)))
        for n in self.trainable:
            for kind, slot in self._opt_slots(n).items():
                if f"{kind}/{n}" not in state:
                    continue
                a = optim.from_canonical(kind, self._native(n, np.asarray(state[f"{kind}/{n}"])), lr_prev)
                slot.assign(a.astype(slot.dtype))
        it = int(float(state["step"])) if "step" in state else (step if state else 0)
        self.optimizer.iterations.assign(it)
        self.last_lr = lr_prev

    state_reload_exact = optim.state_reload_exact   # Backend.state_reload_exact: not with momentum
    # ---- computation
    def _mask_values(self, masks: Masks) -> list[tuple[Any, np.ndarray]]:
        """(keep-mask variable, harness mask) of every dropout layer ([] with --dropout native)."""
        if self.opts.dropout != "harness":
            return []
        out = []
        for name, layer in self.low.dropouts.items():
            m = masks.get(name)
            if m is None:
                raise ValueError(f"no harness dropout mask for layer {name!r}")
            out.append((layer.keep_mask, np.asarray(m, layer.keep_mask.dtype)))
        return out

    def _xy(self, x: np.ndarray, y: np.ndarray | None = None):
        x = np.ascontiguousarray(x, keras.config.floatx())
        return x if y is None else (x, np.asarray(y, np.int32))

    def _arrange(self, x: np.ndarray, y: np.ndarray, masks: Masks):
        """Data parallel: the global batch as the replicas see it (the fault overlapping_shards repeats shard 0)."""
        return (x, y, masks) if self.par is None else self.par.arrange(x, y, masks)

    def train_step(self, step: int, x: np.ndarray, y: np.ndarray, masks: Masks) -> StepStats:
        x, y, masks = self._arrange(x, y, masks)
        lr_var = self.optimizer._learning_rate
        lr = np.asarray(self.lr_for(step), lr_var.dtype)   # a value of the optimizer's variable: no retrace
        x, y = self._xy(x, y)
        logs = self.stepper.step(x, y, [(lr_var, lr)] + self._mask_values(masks))
        self.last_lr = np.float32(lr)
        reps = [float(v) for v in np.asarray(logs["replica_losses"])] if self.replicas > 1 else None
        return StepStats(float(logs["loss"]), float(logs["accuracy"]), float(logs["grad_norm"]),
                         float(logs["update_norm"]), float(logs["param_norm"]), reps)

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        self._sync()
        x, y = self._xy(x, y)
        if self._per_replica():
            logits = self.par.predict(self.net, x)
        else:
            logits = _np(self.net.predict_on_batch(x))
        # the loss's own per-sample function and its 'sum' (what Loss.__call__ computes, without its eager bookkeeping)
        loss = float(_np(batch_mean(lambda t, p: ops.sum(self.eval_loss.call(t, p)), y, ops.convert_to_tensor(logits))))
        return loss, float(np.mean(np.argmax(logits, -1) == y))

    def forward_layers(self, x: np.ndarray, masks: Masks) -> dict[str, np.ndarray]:
        """Every layer's output of the training step's own forward (Stepper.layer_outputs: its training flag,
        masks and replicas, compiled as the step is), no state change; labels zeros (the forward reads none)."""
        return self._named(self.stepper.layer_outputs(*self._probe_batch(x, np.zeros(len(x), np.int32), masks),
                                                      self.recorder))

    def layers_and_gradients(self, x: np.ndarray, y: np.ndarray, masks: Masks) -> tuple[dict, float, dict] | None:
        """The forward probes' recorded step program, with its loss and gradients (Backend.layers_and_gradients);
        None where the runtime's Stepper does not record them jointly."""
        joint = getattr(self.stepper, "layers_and_gradients", None)
        got = None if joint is None else joint(*self._probe_batch(x, y, masks), self.recorder)
        return None if got is None else (self._named(got[0]), float(_np(got[1])), {
            n: self._canonical(n, _np(g)) for n, g in zip(self.trainable, self.net.fault_grads(list(got[2])))})

    def eval_layers(self, x: np.ndarray) -> dict[str, np.ndarray]:
        """Inference-mode outputs as `evaluate` computes them (TF data parallel: replica 0's), stateless."""
        self._sync()
        if self._per_replica():
            return self._named(self.par.predict(self.recorder, self._xy(x)))
        m = self.recorder
        tv, ntv = [v.value for v in m.trainable_variables], [v.value for v in m.non_trainable_variables]
        with RT.no_grad():
            outs, _ = self.recorder.stateless_call(tv, ntv, ops.convert_to_tensor(self._xy(x)), training=False)
        return self._named(outs)

    def _probe_batch(self, x: np.ndarray, y: np.ndarray, masks: Masks):
        """A probe's batch as the step takes it (the replicas' arrangement), its dropout masks in their variables."""
        self._sync()
        x, y, masks = self._arrange(x, y, masks)
        for var, m in self._mask_values(masks):
            var.assign(m)
        return self._xy(x, y)

    def _named(self, outs) -> dict[str, np.ndarray]:
        return {name: _np(o) for name, o in zip(self.low.outputs, outs)}

    def gradients(self, x: np.ndarray, y: np.ndarray, masks: Masks) -> tuple[float, dict[str, np.ndarray]]:
        """The gradient the optimizer is given (data parallel: the replicas' combined one), no state change."""
        loss, grads = self.stepper.gradients(*self._probe_batch(x, y, masks))   # the step's own program, replicas
        grads = self.net.fault_grads(list(grads))
        return float(_np(loss)), {n: self._canonical(n, _np(g)) for n, g in zip(self.trainable, grads)}


BACKEND = KerasBackend
