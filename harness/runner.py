"""Run one backend on one configuration in its own process and publish the result atomically.

The harness prepares everything that must be identical across backends (the model declaration,
the data arrays, the batch order, the canonical initial weights), writes a job file, hands it to a
backend process (`python -m wrappers serve`; a warm one of the same configuration when there is one,
harness.worker_pool) and streams its progress. The result folder appears under its final name only
when the run completed; a crashed or killed run leaves its log in `results/.failed/`.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import numpy as np

from algorithms import data as D
from algorithms.contract import (INIT_PARAMS_FILE, JOB_FILE, MANIFEST_FILE, ORDER_FILE, RUN_LOG,
                                 STEPS_FILE, WORKER_FILE, Job, Replay, RunConfig)
from algorithms.differences import describe
from algorithms.faults import check_fault
from algorithms.optim import HParams
from algorithms.params import check_params, init_params, params_hash, perturb_ulp, save_npz
from algorithms.spec import ModelSpec, load_model

from .config_diff import changed_settings, differences
from .errors import BackendFailed, BadInput, CannotLower
from .worker_pool import run_job, shared_pool

PROJECT_ROOT = Path(__file__).resolve().parent.parent
SCHEMA = 1

@functools.lru_cache(maxsize=1)
def backend_info() -> dict[str, dict[str, Any]]:
    """Which backends exist and which are installed, asked of the wrappers' own process."""
    r = subprocess.run([sys.executable, "-m", "wrappers", "info"], capture_output=True, text=True,
                       cwd=PROJECT_ROOT, env=_child_env())
    if r.returncode != 0:
        raise RuntimeError(f"python -m wrappers info failed: {r.stderr.strip()}")
    return json.loads(r.stdout)


def code_hash(backend: str) -> str:
    """The code that makes a backend's numbers: its wrapper's source files and its framework versions. A cached
    run (an envelope, a seed) made by other code is not the run this code would make."""
    info = backend_info()[backend]
    return hash_json({"versions": info.get("versions", {}), "sources": sources_hash(info.get("sources", []))})


def sources_hash(files: list[str]) -> str:
    """Content hash of source files (names and bytes, in the order given)."""
    h = hashlib.sha256()
    for f in files:
        h.update(Path(f).name.encode())
        h.update(Path(f).read_bytes())
    return h.hexdigest()[:16]


def sources_stamp(backend: str) -> list[tuple[str, int, int]]:
    """A backend's source files as (path, mtime_ns, size): a warm process that imported other code than these
    files hold now (a wrapper edited between two jobs of one harness process) never runs another job."""
    out = []
    for f in backend_info()[backend].get("sources", []):
        try:
            st = os.stat(f)
            out.append((f, st.st_mtime_ns, st.st_size))
        except OSError:
            out.append((f, 0, -1))
    return out


def check_backend(name: str) -> None:
    info = backend_info()
    if name not in info:
        raise BadInput(f"unknown backend {name!r}; known: {', '.join(info)}")
    if info[name]["missing"]:
        raise BadInput(f"backend {name!r} is not installed: missing Python package(s) "
                       f"{', '.join(info[name]['missing'])} (pip install 'duipai[{name.split('-')[0]}]')")


def check_lowers(backend: str, model: ModelSpec) -> None:
    """Refuse, before a process starts, a model with a layer kind the backend's Entry does not declare."""
    info = backend_info()
    kinds = info[backend].get("layer_kinds")
    if kinds is None:           # an Entry from before layer kinds were declared: the worker refuses instead
        return
    cannot = sorted(model.required_features() - set(kinds))
    if cannot:
        able = [n for n, i in info.items() if set(model.required_features()) <= set(i.get("layer_kinds", ()))]
        raise CannotLower(f"{backend}: cannot lower layer kind {', '.join(map(repr, cannot))} (model {model.name}); "
                          f"supported by: {', '.join(able) or 'no installed backend'}")


def installed_backends() -> list[str]:
    return [n for n, i in backend_info().items() if not i["missing"]]


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PROJECT_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONHASHSEED"] = "0"
    return env


def hash_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def user_path(path: str | Path) -> Path:
    """A path the user gave, made absolute against the user's working directory (symlinks kept): what is
    handed to a worker or written into a job or manifest must not depend on a process's working directory."""
    return Path(os.path.abspath(os.fspath(path)))


def is_folder_name(name: str) -> bool:
    """One plain folder name (a run's --name, a matrix's name): never a path out of the results root."""
    return name not in ("", ".", "..") and not re.search(r"[/\\\x00]", name)


def cache_dir(out_root: Path, create: bool = True) -> Path:
    """<out_root>/.cache: prepared data sets and specs, shared by every run under that root (created unless
    `create` is False: a reader that may refuse its input must leave nothing behind)."""
    d = user_path(out_root) / ".cache"
    if create:
        d.mkdir(parents=True, exist_ok=True)
    return d


@dataclass
class Prepared:
    model: ModelSpec
    dataset_path: Path
    dataset_meta: dict[str, Any]
    order: np.ndarray
    params: dict[str, np.ndarray]
    weights_hash: str          # of the weights actually loaded
    base_weights_hash: str     # of the unperturbed canonical weights (what comparability needs)


def fault_inert(cfg: RunConfig, model: ModelSpec) -> str | None:
    """Why the run's catalogued fault changes nothing in its configuration (algorithms.fault_reach), or None
    (no fault, one that applies, or an emulation of a declared difference, which is not catalogued)."""
    from algorithms.fault_reach import inert_reason
    if not cfg.fault:
        return None
    try:
        return inert_reason(cfg.fault, model, cfg.hparams, cfg.devices)
    except KeyError:
        return None


def prepare(cfg: RunConfig, out_root: Path) -> Prepared:
    """Everything the backends must share; raises BadInput with a message naming the problem."""
    out_root = user_path(out_root)
    from algorithms.spec import SpecError
    from algorithms.optim import HParamError
    try:
        check_fault(cfg.fault)
        model = load_model(cfg.model)
        ds = D.load_data(cfg.data, cache_dir=cache_dir(out_root, create=False), image_shape=model.input_shape,
                         classes=model.num_classes)
        D.check_fits(ds, model.input_shape, model.num_classes, model.name)
        h = cfg.hparams
        if cfg.devices < 1:
            raise BadInput(f"--devices must be >= 1, got {cfg.devices}")
        if cfg.devices > h.batch_size:
            raise BadInput(f"--devices {cfg.devices} is larger than the batch size {h.batch_size}")
        if h.batch_size % cfg.devices:
            raise BadInput(f"batch size {h.batch_size} is not divisible by --devices {cfg.devices}")
        if cfg.perturb_ulp is not None and cfg.perturb_ulp < 0:
            raise BadInput(f"--perturb-ulp must be a non-negative seed, got {cfg.perturb_ulp}")
        if cfg.threads < 1:
            raise BadInput(f"--threads must be >= 1, got {cfg.threads}")
        hosts = int(cfg.extra.get("hosts", 1))
        if hosts < 1 or cfg.devices % hosts:
            raise BadInput(f"--hosts {hosts} must divide --devices {cfg.devices} (devices per host)")
        try:
            order = D.batch_order(len(ds.x_train), h.batch_size, h.steps, h.seed)
        except D.DataError as e:   # the data's own limits (a batch larger than its train set): name the data
            raise BadInput(f"{ds.meta.get('source', cfg.data)}: {e}") from None
        except MemoryError:
            raise BadInput(f"--steps {h.steps} x batch size {h.batch_size}: the batch order "
                           f"({h.steps * h.batch_size * 8 / 2**30:.1f} GiB) does not fit in memory") from None
    except (SpecError, D.DataError, HParamError, ValueError) as e:
        raise BadInput(str(e)) from None
    cache = cache_dir(out_root)
    data_path = cache / f"data-{ds.meta['hash']}.npz"
    if not data_path.exists():
        save_npz(data_path, ds.arrays())
    params = init_params(model, h.init_seed)
    check_params(model, params)
    base_hash = params_hash(params)
    if cfg.perturb_ulp is not None:
        params = perturb_ulp(params, cfg.perturb_ulp)
    return Prepared(model, data_path, ds.meta, order, params, params_hash(params), base_hash)


def comparability_hashes(cfg: RunConfig, prep: Prepared) -> dict[str, str]:
    """What must be equal for two runs to be compared step by step (harness.config_diff.COMPARABILITY): the model,
    the data, the batch order, the unperturbed initial weights and the hyper-parameters, as hashes."""
    return {"spec_hash": prep.model.hash(), "data_hash": prep.dataset_meta["hash"],
            "order_hash": hashlib.sha256(prep.order.tobytes()).hexdigest()[:16],
            "base_weights_hash": prep.base_weights_hash, "hparams_hash": hash_json(cfg.hparams.to_dict())}


# the optimizer steps a probe job runs from its state (the localization's step-0 probes)
PROBE_STEPS = 3


def execute(cfg: RunConfig, out_root: Path, name: str | None = None, *, mode: str = "train",
            probe_steps: int = PROBE_STEPS, cases: list[HParams] | None = None, timeout: float | None = None,
            on_progress: Callable[[dict], None] | None = None, prepared: Prepared | None = None,
            replay: Replay | None = None, manifest_extra: dict[str, Any] | None = None,
            fresh_process: bool = False, on_replace: Callable[[Path, Path, str], None] | None = None) -> Path:
    """Run one job; returns the published folder (absolute). Raises BadInput or BackendFailed.
    Every path in the job file is absolute, so the worker's working directory does not matter.
    A training run (and a job asked `fresh_process`) starts in a new backend process, so that what it computes
    never depends on the jobs run before it, even with a wrapper that keeps state of its own between jobs;
    a probe or replay job may run in a warm process of its configuration (harness.worker_pool).
    `on_replace`: where the folder already holds a run of another configuration, it is not deleted but moved to
    out_root/.replaced/ once the new run is complete, and on_replace(folder, kept copy, what differs) is called."""
    out_root = user_path(out_root)
    check_backend(cfg.backend)
    refusal = backend_info()[cfg.backend].get("no_data_parallel")
    if refusal and cfg.devices > 1:    # refused here, without starting a process (the wrapper refuses too)
        raise BackendFailed(f"{cfg.backend}: {refusal} (--devices {cfg.devices})", None, unsupported=True)
    if name is not None and not is_folder_name(name):
        raise BadInput(f"--name must be a plain folder name (no '/', not '.' or '..'), got {name!r}")
    prep = prepared or prepare(cfg, out_root)
    check_lowers(cfg.backend, prep.model)
    name = name or cfg.default_name(prep.model.name) + ("" if mode == "train" else f"__{mode}")
    final = out_root / name
    if final.exists() and not (final / MANIFEST_FILE).is_file():   # a folder of the user's, not a result of ours
        raise BadInput(f"{final} exists and holds no {MANIFEST_FILE}: not a result folder, not replaced "
                       "(--name or --out another folder)")
    tmp_root = out_root / ".tmp"
    tmp_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{name}.", dir=tmp_root))
    np.save(tmp / ORDER_FILE, prep.order)
    save_npz(tmp / INIT_PARAMS_FILE, prep.params)
    options = cfg.options
    job = Job(mode=mode, backend=cfg.backend, model=prep.model.to_dict(), model_source=_source(prep.model.source),
              hparams=cfg.hparams, data=str(prep.dataset_path), order=str(tmp / ORDER_FILE),
              params=str(tmp / INIT_PARAMS_FILE), out=str(tmp), options=options, probe_steps=probe_steps,
              cases=cases or None, replay=replay)
    job.write(tmp / JOB_FILE)
    started = datetime.now(timezone.utc)
    t0 = time.time()
    inert = fault_inert(cfg, prep.model) if mode == "train" else None
    with open(tmp / RUN_LOG, "w") as log:
        log.write(f"# duipai {mode}: {name}\n# {' '.join(sys.argv)}\n")
        if inert:
            log.write(f"# warning: --fault {cfg.fault} does not apply here: {inert}\n")
    # a new process, or a warm one of this configuration (harness.worker_pool); the job's stderr goes to the log
    configuration = json.dumps([cfg.backend, options.to_dict(), sources_stamp(cfg.backend)], sort_keys=True)
    try:
        rc, last, jobs_before = run_job(shared_pool(PROJECT_ROOT), configuration, _child_env(), tmp / JOB_FILE,
                                        tmp / RUN_LOG, on_progress, t0 + timeout if timeout else None,
                                        fresh=fresh_process or mode == "train")
    except KeyboardInterrupt:     # the command was interrupted: nothing of this run is kept, nothing recorded
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except BaseException:
        _fail(tmp, out_root, name)
        raise
    if rc != 0 or not (tmp / WORKER_FILE).exists():
        kept = _fail(tmp, out_root, name)
        if "unsupported" in last:
            raise BackendFailed(str(last["unsupported"]), kept / RUN_LOG, unsupported=True)
        why = "timed out" if last.get("timeout") else f"exited with code {rc}"
        tail = log_tail(kept / RUN_LOG)
        raise BackendFailed(f"backend {cfg.backend} {why}; log: {kept / 'run.log'}\n{tail}", kept / RUN_LOG)
    worker = json.loads((tmp / WORKER_FILE).read_text())
    if mode == "train":  # a train run is complete only with every step's row
        n_rows = sum(1 for _ in open(tmp / STEPS_FILE)) - 1
        if n_rows != cfg.hparams.steps:
            kept = _fail(tmp, out_root, name)
            raise BackendFailed(f"backend {cfg.backend} wrote {n_rows} of {cfg.hparams.steps} steps; log: {kept / RUN_LOG}")
    manifest = {
        "schema": SCHEMA, "status": "complete", "kind": mode, "run": name, "backend": cfg.backend,
        "framework": worker.get("framework"), "model": prep.model.name, **comparability_hashes(cfg, prep),
        "spec": prep.model.to_dict(), "data": prep.dataset_meta, "weights_hash": prep.weights_hash,
        "init": {"seed": cfg.hparams.init_seed, "perturb_ulp_seed": cfg.perturb_ulp},
        "hparams": cfg.hparams.to_dict(),
        "options": options.to_dict(), "fault": cfg.fault, **({"fault_inert": inert} if inert else {}),
        "config": _stored_config(cfg),
        "versions": worker.get("versions", {}), "code_hash": code_hash(cfg.backend), "devices": worker.get("devices", []),
        "determinism": worker.get("determinism", {}), "parallel": worker.get("parallel", {}),
        "imported": worker.get("imported"),   # the frameworks its process imported (wrappers.worker)
        "declared_differences": describe(worker.get("declared_differences", [])),
        "host": {"hostname": socket.gethostname(), "platform": platform.platform(), "machine": platform.machine(),
                 "cpu_count": os.cpu_count(), "python": platform.python_version()},
        "started": started.isoformat(timespec="seconds"), "wall_s": round(time.time() - t0, 3),
        "process": {"pid": worker.get("pid"), "jobs_before": jobs_before},   # > 0: a warm process ran it
        "train_wall_s": worker.get("train_wall_s"),
        "command": " ".join(sys.argv),
        **(manifest_extra or {}),
    }
    (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, default=str))
    (tmp / JOB_FILE).unlink()
    other = _other_configuration(final, manifest) if on_replace is not None and mode == "train" else ""
    if other:   # a run of another configuration under this name: kept, not deleted
        kept = out_root / ".replaced" / f"{name}-{datetime.now().strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        kept.parent.mkdir(parents=True, exist_ok=True)
        os.replace(final, kept)
        os.replace(tmp, final)
        on_replace(final, kept, other)
    else:
        _publish(tmp, final)
    return final


def _other_configuration(final: Path, new: dict[str, Any]) -> str:
    """What differs, in words, between the run already in `final` and the one about to be published there (its
    manifest `new`): "" when nothing does or nothing is there. The stored configurations are compared key by
    key (the rendezvous port aside: where to meet, not what is computed), then the comparability hashes (the
    same data file with other contents)."""
    if not final.exists():
        return ""
    try:
        old = json.loads((final / MANIFEST_FILE).read_text())
    except (OSError, ValueError) as e:
        return f"its {MANIFEST_FILE} cannot be read: {type(e).__name__}"
    if not isinstance(old, dict):
        return f"its {MANIFEST_FILE} is not a run manifest"
    why = changed_settings(old.get("config"), new["config"]) if isinstance(old.get("config"), dict) else \
        ([f"backend {old.get('backend')} -> {new['backend']}"] if old.get("backend") != new["backend"] else []) \
        + changed_settings(old.get("options"), new["options"])
    return ", ".join(why or [words for _, _, _, words in differences(old, new)])


def _stored_config(cfg: RunConfig) -> dict[str, Any]:
    """The configuration as the manifest keeps it: a model or data file as an absolute path, so that the run
    can be regenerated from any working directory (algorithms.data.load_data's `path.csv[,test.csv]` too)."""
    d = cfg.to_dict()
    if Path(cfg.model).is_file():
        d["model"] = str(user_path(cfg.model))
    parts = cfg.data.split(",")
    if all(Path(p).is_file() for p in parts):
        d["data"] = ",".join(str(user_path(p)) for p in parts)
    return d


def _source(source: str) -> str:
    """A model file's path for the job, absolute (a spec built from a dict keeps its label)."""
    return str(user_path(source)) if Path(source).is_file() else source


def log_tail(path: Path, n: int = 8) -> str:
    """The last n lines of a log, indented (what a crash message shows)."""
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return "\n".join("    " + l for l in lines[-n:])


def _publish(tmp: Path, final: Path) -> None:
    """Atomic replace of a result folder: readers see the old complete run or the new one, never a mix."""
    if final.exists():
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def _fail(tmp: Path, out_root: Path, name: str) -> Path:
    failed = out_root / ".failed" / f"{name}-{datetime.now().strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    failed.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, failed)
    return failed
