"""What every wrapper is: a registry entry (cheap, imports nothing heavy) and a Backend (imports
exactly one framework). The harness never imports this; it talks to `python -m wrappers`.

einops-style: an entry subclass per framework registers itself by being defined; the framework
is imported only when `Entry.load()` is called, after the entry has set its environment.
"""
from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import numpy as np

from algorithms.contract import Job, RunOptions
from algorithms.faults import DECLARATION_FAULTS, FAULTS, parts, perturbation, rewrite_declaration
from algorithms.optim import HParams, lr_at
from algorithms.spec import BASE_LAYER_KINDS, LAYER_FIELDS, ModelSpec

REGISTRY: dict[str, type["Entry"]] = {}
# the capabilities an Entry may declare, with the option each one makes possible
CAPABILITIES: dict[str, str] = {
    "data_parallel": "--devices N > 1: data parallelism over N replicas",
    "hosts": "--hosts H: the N replicas in H processes standing in for hosts",
    "sync_bn": "--sync-bn: BatchNorm statistics over the global batch under data parallelism",
    "float64": "--dtype float64",
    "eager": "--no-jit: the uncompiled step next to the compiled default",
    "xla": "--xla: the step compiled by XLA",
    "channels_last": "--channels-last: channels-last memory format for the convolutions",
    "onednn": "--onednn on|off: TensorFlow's oneDNN kernels switched",
    "threads": "--threads N: N compute threads",
}
# module -> the distributions that may provide it (first found wins)
DISTRIBUTIONS = {"tensorflow": ("tensorflow-cpu", "tensorflow", "tensorflow-gpu", "tf-nightly")}


def jax_platform_env(opts: RunOptions, local_devices: int | None = None) -> dict[str, str]:
    """JAX's platform and XLA flags, set before jax is imported (jax and keras-jax). CPU unless a JAX GPU plugin
    is installed (or `extra.platform` says otherwise): on CPU, N data-parallel devices are forced host devices;
    on GPU the visible GPUs are used with XLA's deterministic GPU ops."""
    import importlib.util
    extra = opts.extra
    gpu_plugin = any(importlib.util.find_spec(m) is not None for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin"))
    platform = extra.get("platform") or ("gpu" if gpu_plugin else "cpu")
    flags = []
    if platform == "cpu":
        if opts.threads == 1:
            flags.append("--xla_cpu_multi_thread_eigen=false")
        flags.append(f"--xla_force_host_platform_device_count={local_devices or opts.devices}")
    elif opts.deterministic:
        flags.append("--xla_gpu_deterministic_ops=true")
    return {"XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": platform}


def onednn_env(opts: RunOptions) -> dict[str, str]:
    """--onednn on/off: TF_ENABLE_ONEDNN_OPTS, read when TensorFlow is imported (tensorflow and keras-tensorflow)."""
    mode = opts.extra.get("onednn")
    return {"TF_ENABLE_ONEDNN_OPTS": "1" if mode == "on" else "0"} if mode in ("on", "off") else {}


class Entry:
    """One backend configuration as the harness sees it: a name, what it needs, how to load it."""
    name: ClassVar[str] = ""
    requires: ClassVar[tuple[str, ...]] = ()      # importable modules (checked without importing)
    # what its process may import of worker.OPTIONAL_IMPORTS besides `requires` (the rest are made unimportable)
    also_imports: ClassVar[tuple[str, ...]] = ()
    module: ClassVar[str] = ""                    # module holding the Backend subclass
    env: ClassVar[dict[str, str]] = {}            # set before the framework is imported
    description: ClassVar[str] = ""
    # why it has no data parallelism ("" = it has): the harness refuses --devices N without starting a process
    no_data_parallel: ClassVar[str] = ""
    # what it can do (names from CAPABILITIES): the harness and the tests read these, never a backend's name
    capabilities: ClassVar[frozenset[str]] = frozenset()
    replica_running_stats: ClassVar[str] = "replica 0"   # at dp N: replica 0's, "mean", or "global" (no replicas' own)
    # the catalogued faults (algorithms/faults.py) its wrapper implements; WORKER_FAULTS come on top for every backend
    faults: ClassVar[frozenset[str]] = frozenset()
    emulations: ClassVar[frozenset[str]] = frozenset()   # of declared differences, '+'-joinable: harness/emulating.py
    # the layer kinds (algorithms.spec.LAYER_FIELDS) its wrapper lowers, plus the features `conv2d:groups` and
    # `conv2d:dilation`: the harness refuses a model needing anything else before starting a process
    # (ModelSpec.required_features). The default is the first spec's straight-line kinds.
    layer_kinds: ClassVar[frozenset[str]] = BASE_LAYER_KINDS

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if cls.name:
            REGISTRY[cls.name] = cls

    @classmethod
    def job_env(cls, opts: RunOptions) -> dict[str, str]:
        """Extra environment for a job with these options (e.g. a forced host device count), set before import."""
        return {}

    @classmethod
    def implemented_faults(cls) -> frozenset[str]:
        """Every fault this configuration implements (what `duipai backends` and the self-test read)."""
        return implemented_faults(cls.faults, cls.layer_kinds)

    @classmethod
    def processes(cls, job: Job) -> int:
        """OS processes this job needs (ranks or host agents); 1 = this process runs the job itself."""
        return 1

    @classmethod
    def process_command(cls, job: Job, job_path: str, index: int, port: int) -> tuple[list[str], dict[str, str]]:
        """Command line and extra environment of process `index` of a multi-process job."""
        import sys
        return [sys.executable, "-m", "wrappers", "rank", job_path, str(index)], {}

    @classmethod
    def sources(cls) -> list[str]:
        """The files whose content determines this backend's numbers (for run cache keys)."""
        here = Path(__file__).resolve().parent
        pkg = here / cls.module.split(".")[1]
        files = [here / "base.py", here / "worker.py", here / "__main__.py", *sorted(pkg.rglob("*.py"))]
        files += sorted((here.parent / "algorithms").glob("*.py"))
        return [str(f) for f in files]

    @classmethod
    def versions(cls) -> dict[str, str]:
        """Installed versions of the frameworks this backend uses, from package metadata (no import)."""
        import importlib.metadata as md
        out = {}
        mods = list(cls.requires) + (["jaxlib"] if "jax" in cls.requires else [])
        for m in mods:
            for dist in DISTRIBUTIONS.get(m, (m,)):
                try:
                    out[m] = md.version(dist)
                    break
                except md.PackageNotFoundError:
                    continue
        return out

    @classmethod
    def missing(cls) -> list[str]:
        return [m for m in cls.requires if importlib.util.find_spec(m) is None]

    @classmethod
    def load(cls) -> type["Backend"]:
        mod = importlib.import_module(cls.module)
        return mod.BACKEND


@dataclass
class StepStats:
    loss: float
    accuracy: float
    grad_norm: float
    update_norm: float
    param_norm: float
    replica_losses: list[float] | None = None   # data parallel: each replica's mean loss on its shard


STEP_STATS = tuple(f.name for f in fields(StepStats) if f.name != "replica_losses")   # one vector's order


def shard_bounds(batch: int, replicas: int, fault: str | None = None) -> list[tuple[int, int]]:
    """The harness's sharding: N contiguous shards of B/N in the harness-defined order.
    With the `overlapping_shards` fault every replica gets the first shard (a sampler without rank offsets)."""
    if batch % replicas:
        raise UnsupportedError(f"global batch {batch} is not divisible by {replicas} replicas")
    n = batch // replicas
    return [(0, n) if fault == "overlapping_shards" else (r * n, (r + 1) * n) for r in range(replicas)]


Masks = dict[str, np.ndarray]   # dropout layer name -> bool keep mask (B, *shape)


class Backend:
    """One framework's lowering of the spec, its native optimizer and its training step. Canonical layout in and
    out (see algorithms.spec). Subclasses implement the primitives; the probe protocol is built on them here, once.
    """
    framework: ClassVar[str] = ""
    faults: ClassVar[frozenset[str]] = frozenset()   # fault names this backend can inject
    emulations: ClassVar[frozenset[str]] = frozenset()   # accepted as a fault alone or '+'-joined (Entry.emulations)
    layer_kinds: ClassVar[frozenset[str]] = BASE_LAYER_KINDS   # what it lowers (its Entry's layer_kinds)

    def __init__(self, model: ModelSpec, hp: HParams, opts: RunOptions) -> None:
        self.model, self.hp, self.opts = model, effective_hparams(hp, opts.fault), opts
        # the data-parallel layout, read once here for every backend
        self.replicas = max(1, int(opts.devices))
        self.hosts = int(opts.extra.get("hosts", 1) or 1)
        self.sync_bn = bool(opts.extra.get("sync_bn", False))
        if opts.fault in DP_FAULTS and self.replicas < 2:
            raise UnsupportedError(f"fault {opts.fault} needs data parallelism (--devices N with N > 1)")
        cannot = sorted(model.required_features() - self.layer_kinds)
        if cannot:
            raise UnsupportedError(f"{type(self).__name__} cannot lower layer kind(s) {', '.join(map(repr, cannot))} "
                                   f"(model {model.name}); it lowers: {', '.join(sorted(self.layer_kinds))}")
        implemented = implemented_faults(self.faults, self.layer_kinds)
        if (opts.fault is not None and opts.fault not in implemented and perturbation(opts.fault) is None
                and not parts(opts.fault) <= self.emulations):
            raise UnsupportedError(f"fault {opts.fault!r} is not implemented in this backend's wrapper; "
                                   f"it implements: {', '.join(sorted(implemented)) or 'none'}")

    name: str = ""

    def lr_for(self, step: int) -> float:
        """The learning rate of the update at `step` (the schedule, with any lr fault applied)."""
        lr = lr_at(self.hp, effective_step_for_lr(step, self.opts.fault))
        p = perturbation(self.opts.fault)
        return p.apply(lr) if p is not None and p.target == "lr" and step >= p.start else lr

    def logged_lr(self, step: int) -> float:
        """The learning rate the run reports at `step`: the schedule's, whatever fault moves the one applied (a
        perturbed lr, a schedule stepped early: a bug in what is applied, not in what is logged, so that the
        exactly compared lr column does not give it away)."""
        return lr_at(self.hp, step)

    # ---- environment
    def versions(self) -> dict[str, str]:
        raise NotImplementedError(f"{type(self).__name__}.versions")

    def devices(self) -> list[str]:
        raise NotImplementedError(f"{type(self).__name__}.devices")

    def determinism(self) -> dict[str, Any]:
        """The determinism switches actually set, for the manifest."""
        raise NotImplementedError(f"{type(self).__name__}.determinism")

    def declared_differences(self) -> list[str]:
        """Ids from algorithms.differences that apply to this model and these hyper-parameters."""
        return []

    def parallel_info(self) -> dict[str, Any]:
        """For the manifest: the data-parallel strategy, replicas, devices and process layout."""
        if self.opts.devices != 1:
            raise UnsupportedError(f"backend {self.name} has no data-parallel implementation (--devices {self.opts.devices})")
        return {"strategy": "single device", "replicas": 1, "processes": 1}

    def is_primary(self) -> bool:
        """Whether this process writes the results (rank 0 / chief / process 0 in multi-process runs)."""
        return True

    # ---- state
    def load_params(self, params: dict[str, np.ndarray]) -> None:
        raise NotImplementedError(f"{type(self).__name__}.load_params")

    def export_params(self) -> dict[str, np.ndarray]:
        raise NotImplementedError(f"{type(self).__name__}.export_params")

    def export_opt_state(self) -> dict[str, np.ndarray]:
        """Flat canonical optimizer state: 'momentum/<param>', 'exp_avg/<param>', 'exp_avg_sq/<param>', 'step'."""
        raise NotImplementedError(f"{type(self).__name__}.export_opt_state")

    def load_opt_state(self, state: dict[str, np.ndarray], step: int) -> None:
        raise NotImplementedError(f"{type(self).__name__}.load_opt_state")

    # ---- computation
    def train_step(self, step: int, x: np.ndarray, y: np.ndarray, masks: Masks) -> StepStats:
        raise NotImplementedError(f"{type(self).__name__}.train_step")

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        """(mean loss, accuracy) in inference mode (BatchNorm running stats, no dropout)."""
        raise NotImplementedError(f"{type(self).__name__}.evaluate")

    def forward_layers(self, x: np.ndarray, masks: Masks) -> dict[str, np.ndarray]:
        """Every layer's output in training mode, canonical layout (NHWC), no state change."""
        raise NotImplementedError(f"{type(self).__name__}.forward_layers")

    def eval_layers(self, x: np.ndarray) -> dict[str, np.ndarray]:
        """Every layer's output in inference mode (running statistics, no dropout), as `evaluate`
        computes it, canonical layout (NHWC), no state change."""
        raise NotImplementedError(f"{type(self).__name__}.eval_layers")

    def gradients(self, x: np.ndarray, y: np.ndarray, masks: Masks) -> tuple[float, dict[str, np.ndarray]]:
        """(loss, d loss / d param) for every trainable parameter, canonical layout, no state change."""
        raise NotImplementedError(f"{type(self).__name__}.gradients")

    def layers_and_gradients(self, x: np.ndarray, y: np.ndarray, masks: Masks) -> tuple[dict, float, dict] | None:
        """Every layer's training-mode output, the loss and the gradients from ONE program (a compiler that fuses
        a BatchNorm with its ReLU in the plain step may round a near-kink input across unseen). None: not had."""
        return None

    # ---- the probe protocol, built on the primitives
    def probe(self, x: np.ndarray, y: np.ndarray, masks_per_step: list[Masks], start_step: int = 0) -> dict[str, np.ndarray]:
        """Forward per layer, the inference-mode forward per layer from the same state (`eval/<layer>`:
        the evaluation path, separated from what training does to the running statistics), gradient
        per parameter, then len(masks_per_step) optimizer steps on this batch: the update per
        parameter, the buffers and the optimizer state after each."""
        out: dict[str, np.ndarray] = {}
        fwd = self.forward_layers(x, masks_per_step[0])
        for layer in self.model.layers:          # spec order, whatever order the framework returned
            out[f"forward/{layer.name}"] = np.asarray(fwd[layer.name])
        ev = self.eval_layers(eval_inputs(x, self.opts.fault))
        for layer in self.model.layers:
            out[f"eval/{layer.name}"] = np.asarray(ev[layer.name])
        loss, grads = self.gradients(x, y, masks_per_step[0])
        out["loss"] = np.asarray(loss, np.float64)
        for p in self.model.trainable:
            out[f"grad/{p.name}"] = np.asarray(grads[p.name])
        self.after_first: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None = None
        for i, masks in enumerate(masks_per_step):
            before = self.export_params()
            self.train_step(start_step + i, x, y, masks)
            after = self.export_params()
            for k in before:
                tag = "buffer" if k.endswith(("running_mean", "running_var")) else "update"
                out[f"{tag}{i}/{k}"] = (after[k].astype(np.float64) - before[k].astype(np.float64)) if tag == "update" else after[k]
            state = self.export_opt_state()
            for k, v in state.items():
                out[f"opt{i}/{k}"] = np.asarray(v)
            if i == 0:
                self.after_first = (after, state)
        return out

    def state_reload_exact(self) -> bool:
        """Does loading an exported state give this backend the very state it had (so that re-training from a
        checkpoint repeats the run bit for bit)? False where the load converts (harness.self_replay then
        judges a re-training on its first step only)."""
        return True

    def restart_check(self, x: np.ndarray, y: np.ndarray, masks_per_step: list[Masks], probed: dict[str, np.ndarray],
                      start_step: int = 0) -> dict[str, Any]:
        """After `probe`: a fresh backend loads the state exported after the probe's first step and takes the
        second; its update should be `update1/` up to the optimizer-state conversion's rounding. A difference is
        state no checkpoint holds (accumulated gradients, a counter kept outside the optimizer state): the resync,
        which starts every step from a loaded checkpoint, cannot see such a bug. {'checked', 'rel', 'key'}."""
        if len(masks_per_step) < 2 or self.after_first is None:
            return {"checked": False, "why": "fewer than two probe steps"}
        if self.opts.dropout == "native" and self.model.has("dropout"):
            return {"checked": False, "why": "native dropout: the framework's RNG is state no checkpoint holds"}
        params, state = self.after_first
        fresh = type(self)(self.model, self.hp, self.opts)
        fresh.load_params({k: np.array(v, copy=True) for k, v in params.items()})
        fresh.load_opt_state({k: np.array(v, copy=True) for k, v in state.items()}, start_step + 1)
        fresh.train_step(start_step + 1, x, y, masks_per_step[1])
        after = fresh.export_params()
        worst, key = 0.0, None
        for p in self.model.trainable:
            cont = np.asarray(probed[f"update1/{p.name}"], np.float64)
            mine = after[p.name].astype(np.float64) - params[p.name].astype(np.float64)
            rel = float(np.max(np.abs(mine - cont))) / max(float(np.max(np.abs(cont))), 1e-30)
            if rel > worst or key is None:
                worst, key = rel, f"update1/{p.name}"
        return {"checked": True, "rel": worst, "key": key}


class UnsupportedError(RuntimeError):
    """This backend cannot do what was asked; said loudly, never silently degraded."""


# the lowering/optimizer faults a full wrapper implements, and those that exist only across replicas
LOWERING_FAULTS = frozenset({"flatten_no_permute", "symmetric_same_padding", "bn_momentum_flipped", "bn_eps_keras",
                             "adam_eps_hat", "keras_momentum_schedule", "l2_not_decoupled", "label_smoothing",
                             "dropout_in_eval", "missing_bias", "maxpool_ceil", "grad_double"})
DP_FAULTS = frozenset({"grad_sum_replicas", "overlapping_shards"})
# the graph layers' lowering faults (algorithms.faults.Seams: concat_axis, bypassed_norms, depthwise_channel_major)
GRAPH_LOWERING_FAULTS = frozenset({"concat_wrong_axis", "projection_without_bn", "depthwise_multiplier_order"})

# faults the generic worker loop injects for every backend (data handling, not lowering), and the catalogued
# perturbations (every wrapper applies them through effective_hparams, lr_for, effective_model_decl, eval_inputs)
WORKER_FAULTS = frozenset({"data_shift_one_batch", "lr_scale_1.001", "lr_schedule_off_by_one"}
                          | {n for n in FAULTS if perturbation(n) is not None})


def implemented_faults(wrapper_faults: frozenset[str], layer_kinds: frozenset[str]) -> frozenset[str]:
    """A backend's faults: its wrapper's own, the worker's, and each declaration rewrite
    (algorithms.faults.DECLARATION_FAULTS) of a layer kind it lowers: the rewrite asks nothing else of it."""
    return (wrapper_faults | WORKER_FAULTS
            | {f for f, kind in DECLARATION_FAULTS.items() if kind in layer_kinds})


def effective_hparams(hp: HParams, fault: str | None) -> HParams:
    """Hyper-parameter-level faults, applied identically in every wrapper (a perturbed lr: Backend.lr_for)."""
    if fault == "lr_scale_1.001":
        return hp.with_(lr=hp.lr * 1.001)
    p = perturbation(fault)
    if p is not None and p.target in ("momentum", "beta1", "beta2", "eps", "weight_decay"):
        return hp.with_(**{p.target: p.apply(getattr(hp, p.target))})
    return hp


def effective_model_decl(decl: dict, fault: str | None) -> dict:
    """The model declaration with a BatchNorm perturbation applied to every batchnorm2d layer (bn_eps,
    bn_momentum), or rewritten as a port with a declaration-level fault declares it (gelu_tanh_approx, ...:
    algorithms.faults.rewrite_declaration): every wrapper builds its layers from it, all alike."""
    if fault in DECLARATION_FAULTS:
        return rewrite_declaration(decl, fault)
    p = perturbation(fault)
    if p is None or p.target not in ("bn_eps", "bn_momentum") or not isinstance(decl, dict):
        return decl
    key = p.target[3:]
    default = LAYER_FIELDS["batchnorm2d"][key][1]
    layers = [dict(l, **{key: p.apply(float(l.get(key, default)))}) if isinstance(l, dict) and l.get("type") == "batchnorm2d"
              else l for l in decl.get("layers", [])]
    return dict(decl, layers=layers)


def eval_inputs(x: np.ndarray, fault: str | None) -> np.ndarray:
    """The inputs of the evaluation path (`evaluate`, the `eval/` probes), with an eval_input perturbation."""
    p = perturbation(fault)
    if p is None or p.target != "eval_input":
        return x
    return p.apply(x.astype(np.float64)).astype(x.dtype)


def effective_step_for_lr(step: int, fault: str | None) -> int:
    return step + 1 if fault == "lr_schedule_off_by_one" else step
