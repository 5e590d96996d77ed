"""The one contract between the harness and a backend process: what a job asks, what a run folder holds.

The harness writes a `Job` (job.json) and reads what the worker leaves in the job's folder (the file names
and CSV columns below); the worker reads the `Job` and writes those files. Both sides import this module and
nothing of each other, and it imports no framework. `RunConfig` is the user's description of one run; it is
stored verbatim in the run's manifest, so a run can be regenerated (seed runs, envelopes, probe and replay
jobs) from its folder alone.
"""
from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from .optim import HParams

# --------------------------------------------------------------------------- a run folder's files
JOB_FILE = "job.json"                  # the job (removed when the run is published)
MANIFEST_FILE = "manifest.json"        # written by the harness: identity, configuration, versions
WORKER_FILE = "worker.json"            # written by the worker: framework, devices, declared differences, timings
RUN_LOG = "run.log"                    # the worker's stderr
STEPS_FILE = "steps.csv"               # one row per training step (STEP_COLUMNS)
EVAL_FILE = "eval.csv"                 # one row per evaluation (EVAL_COLUMNS)
ORDER_FILE = "order.npy"               # the batch order: (steps, batch) sample indices
INIT_PARAMS_FILE = "init_params.npz"   # the canonical initial weights the job loads
FINAL_PARAMS_FILE = "final_params.npz"
CHECKPOINT_DIR = "checkpoints"         # step_<7 digits>.npz: 'param/<name>' and 'opt/<key>' after that many steps

STEP_SERIES = ("loss", "accuracy", "grad_norm", "update_norm", "param_norm", "lr")
EVAL_SERIES = ("eval_loss", "eval_accuracy")
STEP_COLUMNS = ("step", "epoch") + STEP_SERIES + ("batch_checksum", "step_time_s")
EVAL_COLUMNS = ("step",) + EVAL_SERIES


def replica_loss_columns(replicas: int) -> tuple[str, ...]:
    """The step columns a data-parallel run adds after STEP_COLUMNS: each replica's loss on its shard."""
    return tuple(f"replica_loss_{r}" for r in range(replicas)) if replicas > 1 else ()


def checkpoint_file(step: int) -> str:
    """A checkpoint's path inside a run folder: the state after `step` optimizer steps."""
    return f"{CHECKPOINT_DIR}/step_{step:07d}.npz"


def checkpoints_in(run_folder: Path) -> dict[int, Path]:
    """A run folder's checkpoints: step -> file, in step order (none: {})."""
    d = Path(run_folder) / CHECKPOINT_DIR
    return {int(p.stem.split("_")[1]): p for p in sorted(d.glob("step_*.npz"))} if d.is_dir() else {}


def probe_file_stem(case: int) -> str:
    """A probe job's file stem for its `case`-th optimizer case (.npz probes, .json declared differences)."""
    return f"probe-{case}"


def replay_probe_stem(point: int, nudge: int | None = None) -> str:
    """A replay job's file stem for its `point`-th step: probe-<point>, or probe-<point>-ulp<seed> from that
    state with the parameters moved 1 ULP (`nudge`, a seed; one job probes every seed it is given)."""
    return probe_file_stem(point) if nudge is None else f"{probe_file_stem(point)}-ulp{nudge}"


def replay_state_file(step: int) -> str:
    """The state a replay job re-trained to at `step` ('param/' and 'opt/' keys, as a checkpoint)."""
    return f"state_{step:07d}.npz"


def state_arrays(params: dict[str, Any], opt: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's or replay state's arrays: the parameters under 'param/<name>', the optimizer state under
    'opt/<key>' (what `split_state` reads back)."""
    return {**{f"param/{n}": v for n, v in params.items()}, **{f"opt/{k}": v for k, v in opt.items()}}


def split_state(flat: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(parameters by name, optimizer state by key) of a checkpoint or replay state (`state_arrays`)."""
    return ({k[len("param/"):]: v for k, v in flat.items() if k.startswith("param/")},
            {k[len("opt/"):]: v for k, v in flat.items() if k.startswith("opt/")})


# --------------------------------------------------------------------------- options and configuration
def _check_fields(cls: type, d: dict[str, Any], what: str) -> None:
    """ValueError naming the fields of `d` that `cls` does not have, or the required ones it lacks."""
    if not isinstance(d, dict):
        raise ValueError(f"{what}: expected an object, got {type(d).__name__}")
    unknown = set(d) - {f.name for f in fields(cls)}
    if unknown:
        raise ValueError(f"{what}: unknown field(s) {', '.join(sorted(unknown))}")
    missing = [f.name for f in fields(cls) if f.name not in d and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise ValueError(f"{what}: missing field(s) {', '.join(missing)}")


def _from_dict(cls: type, d: dict[str, Any], what: str) -> Any:
    _check_fields(cls, d, what)
    return cls(**d)


@dataclass(frozen=True)
class RunOptions:
    """How a backend runs a job (what is computed is the model, the data and the hyper-parameters)."""
    threads: int = 1
    deterministic: bool = True
    dropout: str = "harness"        # harness: masks from algorithms.data.dropout_keep_mask; native: framework RNG
    fault: str | None = None
    devices: int = 1
    jit: bool = True                # compiled step (torch: eager is the norm; tf.function/XLA; jax.jit)
    dtype: str = "float32"
    extra: dict[str, Any] = field(default_factory=dict)   # backend-specific switches (channels_last, xla, hosts, ...)

    @property
    def hosts(self) -> int:
        """Processes standing in for hosts (`--hosts`); 1 = one process."""
        return max(1, int(self.extra.get("hosts", 1) or 1))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunOptions":
        return _from_dict(cls, d, "run options")


@dataclass
class RunConfig:
    """One run as the user asked for it: which model, backend, data, hyper-parameters and options."""
    backend: str                         # a registered backend's name (the harness checks it)
    model: str = "cnn2d_2conv_2fc"       # a built-in model's name or a model file's path
    hparams: HParams = field(default_factory=HParams)
    data: str = "digits"
    threads: int = 1
    deterministic: bool = True
    dropout: str = "harness"
    fault: str | None = None
    devices: int = 1
    jit: bool = True
    dtype: str = "float32"
    perturb_ulp: int | None = None       # seed of a 1-ULP perturbation of the initial weights
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def options(self) -> RunOptions:
        """What the worker is told about how to run (the job's options)."""
        return RunOptions(threads=self.threads, deterministic=self.deterministic, dropout=self.dropout,
                          fault=self.fault, devices=self.devices, jit=self.jit, dtype=self.dtype, extra=dict(self.extra))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["hparams"] = self.hparams.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunConfig":
        _check_fields(cls, d, "run configuration")
        d = dict(d)
        d["hparams"] = HParams.from_dict(d.get("hparams") or {})
        return _from_dict(cls, d, "run configuration")

    def default_name(self, model_name: str) -> str:
        h = self.hparams
        parts = [model_name, self.backend, f"{h.optimizer}-{h.schedule}", f"s{h.seed}"]
        if h.init_seed:
            parts.append(f"init{h.init_seed}")
        if self.devices > 1:
            parts.append(f"dp{self.devices}")
        if self.dtype != "float32":
            parts.append(self.dtype)
        if self.perturb_ulp is not None:
            parts.append(f"ulp{self.perturb_ulp}")
        if self.fault:
            parts.append(f"fault-{self.fault}")
        if self.threads != 1:
            parts.append(f"t{self.threads}")
        if not self.jit:
            parts.append("eager")
        if self.dropout != "harness":     # framework-RNG masks: another run than the harness-masked one
            parts.append(f"dropout-{self.dropout}")
        for k, v in sorted(self.extra.items()):
            if k != "port":          # where to meet, not what is computed
                parts.append(k if v is True else f"{k}-{v}")
        return "__".join(parts)


# --------------------------------------------------------------------------- the job
Mode = Literal["train", "probe", "replay"]
MODES: tuple[str, ...] = ("train", "probe", "replay")


@dataclass(frozen=True)
class Replay:
    """What a replay job probes: the steps `at`, each from a state that is either re-trained from the run's
    `checkpoints` ({step: file}) or given in `states` ({step: file}: exactly another job's states)."""
    at: list[int]
    checkpoints: dict[int, str] | None = None
    states: dict[int, str] | None = None
    probe_steps: int = 1
    activation_rows: int | None = None            # None: algorithms.params.REPLAY_ACTIVATION_ROWS; 0: every sample
    perturb_state_ulps: list[int | None] = field(default_factory=lambda: [None])   # None: the state itself
    evaluate_checkpoints: bool = False            # evaluate each checkpoint as loaded, before anything is trained
    # after the probes, one training step from each state of `at`: the statistics its training reports from the
    # state it was probed from (a slip in what a wrapper reports is then seen at any step, not only at step 0)
    report_steps: bool = False
    # re-training from a checkpoint, the state exported and loaded back after every step: each step then starts
    # from nothing but its state, so what a run carries outside its state (a host-side cache, a counter) shows
    reload_each_step: bool = False

    def __post_init__(self) -> None:   # the worker walks the steps in order; probe file i is the i-th of them
        object.__setattr__(self, "at", sorted(int(t) for t in self.at))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("checkpoints", "states"):
            if d[k] is not None:
                d[k] = {str(t): str(p) for t, p in d[k].items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Replay":
        _check_fields(cls, d, "replay")
        d = dict(d)
        for k in ("checkpoints", "states"):
            if d.get(k) is not None:
                d[k] = {int(t): str(p) for t, p in d[k].items()}
        if d.get("perturb_state_ulps") is not None:
            d["perturb_state_ulps"] = [None if s is None else int(s) for s in d["perturb_state_ulps"]]
        return _from_dict(cls, d, "replay")


@dataclass(frozen=True)
class Job:
    """One job for one backend process. Every path is absolute: a worker does not depend on its working directory."""
    mode: str
    backend: str
    model: dict[str, Any]            # the model declaration (ModelSpec.to_dict)
    model_source: str                # where it came from (a file's absolute path, or a label)
    hparams: HParams
    data: str                        # the prepared data arrays (.npz)
    order: str                       # the batch order (.npy)
    params: str                      # the initial weights (.npz)
    out: str                         # the folder the worker writes into
    options: RunOptions = field(default_factory=RunOptions)
    probe_steps: int = 3             # probe jobs: optimizer steps probed from the initial weights
    cases: list[HParams] | None = None   # probe jobs: one probe file per case (default: [hparams])
    replay: Replay | None = None     # replay jobs

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"job: unknown mode {self.mode!r}; known: {', '.join(MODES)}")
        if (self.mode == "replay") != (self.replay is not None):
            raise ValueError(f"job: mode {self.mode!r} {'needs' if self.mode == 'replay' else 'takes no'} a replay")

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "backend": self.backend, "model": self.model, "model_source": self.model_source,
                "hparams": self.hparams.to_dict(), "data": self.data, "order": self.order, "params": self.params,
                "out": self.out, "options": self.options.to_dict(), "probe_steps": self.probe_steps,
                "cases": None if self.cases is None else [c.to_dict() for c in self.cases],
                "replay": None if self.replay is None else self.replay.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Job":
        _check_fields(cls, d, "job")
        d = dict(d)
        d["hparams"] = HParams.from_dict(d["hparams"])
        d["options"] = RunOptions.from_dict(d.get("options") or {})
        d["cases"] = None if d.get("cases") is None else [HParams.from_dict(c) for c in d["cases"]]
        d["replay"] = None if d.get("replay") is None else Replay.from_dict(d["replay"])
        return _from_dict(cls, d, "job")

    def write(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def read(cls, path: str | Path) -> "Job":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def paths(self) -> list[tuple[str, str]]:
        """(field, path) of every file or folder the job names."""
        out = [(k, getattr(self, k)) for k in ("data", "order", "params", "out")]
        if self.replay is not None:
            out += [(f"replay.checkpoints.{t}", p) for t, p in (self.replay.checkpoints or {}).items()]
            out += [(f"replay.states.{t}", p) for t, p in (self.replay.states or {}).items()]
        return out


__all__ = ["JOB_FILE", "MANIFEST_FILE", "WORKER_FILE", "RUN_LOG", "STEPS_FILE", "EVAL_FILE", "ORDER_FILE",
           "INIT_PARAMS_FILE", "FINAL_PARAMS_FILE", "CHECKPOINT_DIR", "STEP_SERIES", "EVAL_SERIES", "STEP_COLUMNS",
           "EVAL_COLUMNS", "replica_loss_columns", "checkpoint_file", "checkpoints_in", "probe_file_stem", "replay_probe_stem",
           "replay_state_file", "state_arrays", "split_state", "RunOptions", "RunConfig", "Mode", "MODES", "Replay", "Job"]
