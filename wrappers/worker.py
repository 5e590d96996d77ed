"""The generic training loop every backend runs in its own process: `python -m wrappers run JOB.json`.

The job file (written by the harness) names the model declaration, hyper-parameters, the
prepared data (.npz), the batch order (.npy of sample indices), the canonical initial weights
and the output folder. This loop gathers each step's batch, builds the harness dropout masks,
calls the backend's `train_step`, and writes rows into the output folder (buffered, written at
each evaluation and checkpoint); it knows no framework.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from algorithms import data as D
from algorithms.contract import (CHECKPOINT_DIR, EVAL_COLUMNS, EVAL_FILE, FINAL_PARAMS_FILE, STEP_COLUMNS, STEPS_FILE,
                                 WORKER_FILE, Job, RunOptions, checkpoint_file, probe_file_stem, replay_probe_stem,
                                 replay_state_file, replica_loss_columns, split_state, state_arrays)
from algorithms.params import JOINT, REPLAY_ACTIVATION_ROWS, load_npz, perturb_ulp, save_npz, thin_activations
from algorithms.spec import ModelSpec, build_model

from .base import Backend, Entry, Masks, effective_model_decl, eval_inputs


# failures this process survived but whose framework state it cannot vouch for (wrappers.__main__.serve ends
# the process after the job instead of keeping it warm)
LEFT_IN_DOUBT: list[str] = []

def fmt(v: Any) -> str:
    """Floats as their shortest round-trip repr: the CSV holds the exact value."""
    if isinstance(v, (float, np.floating)):
        return repr(float(v))
    return str(v)


def masks_for(model: ModelSpec, seed: int, step: int, batch: int, mode: str) -> Masks:
    if mode != "harness":
        return {}
    return {l.name: D.dropout_keep_mask(seed, step, l.index, (batch, *l.out_shape), l.spec["rate"])
            for l in model.layers if l.kind == "dropout"}


# A running run's progress line at most this often (and after its last step): enough for a live display;
# a line every 1 % of the steps cost a 300-step default-model run ~13 us a step (the write, the parent's wake-up)
PROGRESS_EVERY_S = 0.2

# Packages a framework imports only because they happen to be installed: Keras' set_random_seed imports
# TensorFlow whatever Keras' backend, Keras' scikit-learn wrapper imports scikit-learn (with pandas and
# matplotlib), TensorFlow loads Keras eagerly and Keras loads JAX. None of them computes anything of a run,
# and together they cost 2-4 s of every process start (bench/process_start.py).
OPTIONAL_IMPORTS = ("tensorflow", "jax", "torch", "keras", "sklearn", "pandas", "matplotlib")


def keep_to_own_framework(entry: type[Entry]) -> list[str]:
    """Make the OPTIONAL_IMPORTS that a backend's Entry neither requires nor also_imports unimportable in this
    process (importing one raises ModuleNotFoundError, which every optional import catches), so that its process
    runs the framework it names and no other. Call before the framework is imported; returns the names blocked."""
    allowed = (*entry.requires, *entry.also_imports)
    blocked = [m for m in OPTIONAL_IMPORTS if m not in allowed and m not in sys.modules]
    for m in blocked:
        sys.modules[m] = None   # the import system's own marker for "not importable"
    return blocked


def imported_frameworks() -> list[str]:
    """Which of OPTIONAL_IMPORTS this process has imported (worker.json records it)."""
    return [m for m in OPTIONAL_IMPORTS if sys.modules.get(m) is not None]


def progress(out: TextIO, **kw: Any) -> None:
    out.write(json.dumps(kw) + "\n")
    out.flush()


def backend_class(cls: type[Backend], opts: RunOptions) -> type[Backend]:
    """The class that runs a job with these options: a backend whose data parallelism is a subclass of its own
    names it through the classmethod `for_options(opts)`; every other backend runs every job in one class."""
    choose = getattr(cls, "for_options", None)
    return cls if choose is None else choose(opts)


def build_backend(job: Job, cls: type[Backend]) -> Backend:
    model = build_model(effective_model_decl(job.model, job.options.fault), job.model_source)
    return backend_class(cls, job.options)(model, job.hparams, job.options)


def fixed_columns(backend: Backend, x_tr: np.ndarray, y_tr: np.ndarray, order: np.ndarray
                  ) -> tuple[list[str], list[str]]:
    """Each step's row columns that do not depend on training, formatted before the loop: "step,epoch" and
    "lr,batch checksum" (the checksums follow from the known order)."""
    hp = backend.hp
    heads = [f"{s},{D.epoch_of(s, len(x_tr), hp.batch_size)}" for s in range(hp.steps)]
    tails = [f"{fmt(backend.logged_lr(s))},{D.batch_checksum(x_tr[order[s]], y_tr[order[s]])}" for s in range(hp.steps)]
    return heads, tails


def evaluate_test_set(backend: Backend, arrays: dict[str, np.ndarray]) -> tuple[float, float]:
    """(eval loss, accuracy) of the job's test set: the one evaluation call of a training run and of a self-replay's
    evaluation of its checkpoints, so the two can be compared to the bit."""
    loss, acc = backend.evaluate(eval_inputs(arrays["x_test"], backend.opts.fault), arrays["y_test"])
    return float(loss), float(acc)


def run_train(job: Job, backend: Backend, out_dir: Path, channel: TextIO) -> dict[str, Any]:
    model, hp, opts = backend.model, backend.hp, backend.opts
    arrays = load_npz(job.data)
    x_tr, y_tr = arrays["x_train"], arrays["y_train"]
    order = np.load(job.order)
    if opts.fault == "data_shift_one_batch":   # the loader skips the first batch
        order = np.concatenate([order[1:], order[:1]])
    backend.load_params(load_npz(job.params))
    (out_dir / CHECKPOINT_DIR).mkdir(exist_ok=True)

    def checkpoint(step: int) -> None:
        save_npz(out_dir / checkpoint_file(step), state_arrays(backend.export_params(), backend.export_opt_state()))

    def evaluate(step: int, f: TextIO) -> None:
        f.write(",".join(fmt(v) for v in (step, *evaluate_test_set(backend, arrays))) + "\n")
        f.flush()

    replicas = opts.devices
    # what the loop needs that does not depend on training, computed once before it: the rows' fixed columns,
    # and a model without dropout layers needs no masks
    heads, tails = fixed_columns(backend, x_tr, y_tr, order)
    dropout = opts.dropout == "harness" and any(l.kind == "dropout" for l in model.layers)
    rows: list[str] = []   # CSV rows, written at each evaluation, checkpoint and the end
    with open(out_dir / STEPS_FILE, "w") as fs, open(out_dir / EVAL_FILE, "w") as fe:
        fs.write(",".join(STEP_COLUMNS + replica_loss_columns(replicas)) + "\n")
        fe.write(",".join(EVAL_COLUMNS) + "\n")
        checkpoint(0)
        evaluate(0, fe)
        # the framework's objects (graphs, traced functions, modules) out of the collector's sight: a full
        # collection scans them all, ~250 ms in a TensorFlow process, and the loop's own objects trigger
        # one every few hundred steps (measured: 0.6 ms a step of keras-tensorflow's 6.5 ms); again after
        # the first step, which traces or compiles. Nothing computed depends on it.
        gc.freeze()
        t_total = time.perf_counter()
        last_progress = -PROGRESS_EVERY_S
        periodic = 0.0   # of which in the evaluations and checkpoints (for bench/bench_step.py)
        try:
            for step in range(hp.steps):
                idx = order[step]
                x, y = x_tr[idx], y_tr[idx]
                masks = masks_for(model, hp.seed, step, hp.batch_size, opts.dropout) if dropout else {}
                t0 = time.perf_counter()
                st = backend.train_step(step, x, y, masks)
                dt = time.perf_counter() - t0
                if step == 0:
                    gc.freeze()
                row = (heads[step], st.loss, st.accuracy, st.grad_norm, st.update_norm, st.param_norm, tails[step], dt)
                if replicas > 1:
                    if not st.replica_losses or len(st.replica_losses) != replicas:
                        raise RuntimeError(f"backend {backend.name} ran {replicas} replicas but returned "
                                           f"{len(st.replica_losses or [])} replica losses")
                    row = row + tuple(st.replica_losses)
                rows.append(",".join(map(fmt, row)) + "\n")
                done = step + 1
                at_checkpoint = done % hp.checkpoint_every == 0 or done == hp.steps
                at_eval = done % hp.eval_every == 0 or done == hp.steps
                if at_checkpoint or at_eval:
                    fs.writelines(rows)
                    fs.flush()
                    rows.clear()
                t_periodic = time.perf_counter()
                if at_checkpoint:
                    checkpoint(done)
                if at_eval:
                    evaluate(done, fe)
                if at_checkpoint or at_eval:
                    periodic += time.perf_counter() - t_periodic
                if t0 - last_progress >= PROGRESS_EVERY_S or done == hp.steps:
                    last_progress = t0
                    progress(channel, step=done, of=hp.steps, loss=float(st.loss))
        finally:   # rows of a run that stops with an error are kept too
            fs.writelines(rows)
        wall = time.perf_counter() - t_total
    final = backend.export_params()
    save_npz(out_dir / FINAL_PARAMS_FILE, final)
    return {"train_wall_s": wall, "train_eval_checkpoint_s": periodic}


def run_probe(job: Job, backend: Backend, out_dir: Path) -> dict[str, Any]:
    """Probe on the first batch of the order, from the canonical weights: one file per case.

    A job may carry `cases` (hyper-parameter sets): each gets a fresh backend, so one
    process (one framework import) serves every optimizer of a test."""
    arrays = load_npz(job.data)
    idx = np.load(job.order)[0]
    x, y = arrays["x_train"][idx], arrays["y_train"][idx]
    params = load_npz(job.params)
    k = job.probe_steps
    cases = job.cases or [job.hparams]
    for i, hp in enumerate(cases):
        b = backend if i == 0 and hp == job.hparams else type(backend)(backend.model, hp, backend.opts)
        b.name = backend.name
        b.load_params(params)
        masks = [masks_for(b.model, b.hp.seed, s, len(idx), b.opts.dropout) for s in range(k)]
        probed = b.probe(x, y, masks)
        save_npz(out_dir / f"{probe_file_stem(i)}.npz", probed)
        side: dict[str, Any] = {"declared_differences": b.declared_differences()}
        if i == 0:
            side["restart"] = restart_check(b, x, y, masks, probed)
        (out_dir / f"{probe_file_stem(i)}.json").write_text(json.dumps(side))
    return {"probe_cases": len(cases)}


def restart_check(b: Backend, x: np.ndarray, y: np.ndarray, masks: list[Masks], probed: dict[str, np.ndarray]
                  ) -> dict[str, Any]:
    """Backend.restart_check, never fatal to the probe: one process per job only (a second backend in a
    multi-process job would need every process to build it in step), any failure recorded, not raised."""
    if os.environ.get("DUIPAI_PROCESS_INDEX") is not None:
        return {"checked": False, "why": "a multi-process job"}
    try:
        return b.restart_check(x, y, masks, probed)
    except Exception as e:        # noqa: BLE001 -- the probe stands without it
        return {"checked": False, "why": f"{type(e).__name__}: {str(e)[:200]}"}


def run_replay(job: Job, backend: Backend, out_dir: Path) -> dict[str, Any]:
    """Probe the training steps `replay.at` from a saved state instead of the canonical weights.

    `replay.checkpoints` ({step: file} of the run's train checkpoints, 'param/<name>' and 'opt/<key>',
    each taken after that many steps) are loaded as needed and the run is advanced deterministically, this backend's own steps on the job's batch order, up to
    each step of `at`; the state there is saved as state_<step>.npz (a step with a checkpoint of its own
    uses that file). Or `replay.states` ({step: state file}) gives those states directly, so a
    second backend probes from exactly the first one's states. Then, per step t of `at`:
    probe-<i>.npz = probe(batch t, start_step=t) from the state at t, its feature maps thinned to
    REPLAY_ACTIVATION_ROWS samples (thin_activations), or `replay.activation_rows` (0: every sample).
    `replay.perturb_state_ulps` (default [null]) lists what is probed at each t: null the state itself, a seed
    the state with its parameters moved 1 ULP (probe-<i>-ulp<seed>.npz; algorithms.contract.replay_probe_stem).
    `replay.evaluate_checkpoints`: first, each checkpoint loaded and evaluated on the test set, the last first
    (`evaluated`). `replay.report_steps`: last, one training step from each state, its statistics (`reported`)."""
    r = job.replay
    assert r is not None    # Job checks that a replay job has its replay
    model, hp, opts = backend.model, backend.hp, backend.opts
    arrays = load_npz(job.data)
    x_tr, y_tr = arrays["x_train"], arrays["y_train"]
    order = np.load(job.order)
    if opts.fault == "data_shift_one_batch":   # as in run_train
        order = np.concatenate([order[1:], order[:1]])
    at, k = r.at, r.probe_steps

    def load(state: dict[str, np.ndarray], step: int) -> None:
        params, opt = split_state(state)
        backend.load_params(params)
        backend.load_opt_state(opt, step)

    def batch(step: int):
        idx = order[step]
        return x_tr[idx], y_tr[idx], len(idx)

    replayed = []
    # each checkpoint evaluated as loaded in this fresh process, before any step, the last first (not the run's
    # order: an evaluation that keeps a copy from its first call gets the final state): the run's evaluation at
    # that step must be the evaluation of that state (harness.self_replay.judge_evaluations)
    evaluated = []
    for c, path in sorted((r.checkpoints or {}).items(), reverse=True) if r.evaluate_checkpoints else ():
        load(load_npz(path), c)
        evaluated.append([c, *evaluate_test_set(backend, arrays)])
    if r.states:
        states = dict(r.states)
    else:
        # A step of `at` that has a checkpoint is that file itself (nothing re-trained); any other is re-trained
        # from the latest checkpoint at or before it, or from the previous step of `at` when that is later
        # (one pass over the steps, however many points).
        cks = dict(r.checkpoints or {})
        states = {}
        pos: int | None = None   # the step the backend's current state is at (None: nothing loaded)
        for t in at:
            if t in cks:
                states[t] = cks[t]
                continue
            start = max((c for c in cks if c <= t), default=None)
            if start is None:
                raise ValueError(f"replay: no checkpoint at or before step {t}")
            if pos is None or pos > t or start > pos:
                load(load_npz(cks[start]), start)
                pos = start
            while pos < t:
                x, y, b = batch(pos)
                s = backend.train_step(pos, x, y, masks_for(model, hp.seed, pos, b, opts.dropout))
                replayed.append([pos, s.loss, s.accuracy, s.grad_norm, s.update_norm, s.param_norm])
                pos += 1
                if r.reload_each_step:   # the next step from its state alone (copied out, loaded back)
                    load({k: np.array(v) for k, v in state_arrays(backend.export_params(),
                                                                   backend.export_opt_state()).items()}, pos)
            states[t] = replay_state_file(t)
            save_npz(out_dir / states[t], state_arrays(backend.export_params(), backend.export_opt_state()))
    rows = REPLAY_ACTIVATION_ROWS if r.activation_rows is None else r.activation_rows
    # the reference's own sensitivity at each state: params moved 1 ULP, once per seed (one process for all seeds);
    # None: the state itself (the default)
    for i, t in enumerate(at):
        params, opt = split_state(load_npz(out_dir / states[t]))   # an absolute path stays itself
        x, y, b = batch(t)
        masks = [masks_for(model, hp.seed, t + j, b, opts.dropout) for j in range(k)]
        for seed in r.perturb_state_ulps:
            backend.load_params(params if seed is None else perturb_ulp(params, seed * 1_000_003 + t))
            backend.load_opt_state(opt, t)
            name = replay_probe_stem(i, seed)
            # every sample kept: a kink witness, with the activations its gradients saw where another program has them
            joint = backend.layers_and_gradients(x, y, masks[0]) if rows == 0 and seed is None else None
            probed = backend.probe(x, y, masks, start_step=t)
            if joint is not None:
                probed.update({f"{JOINT}forward/{l.name}": np.asarray(joint[0][l.name]) for l in model.layers})
                probed.update({f"{JOINT}grad/{p.name}": np.asarray(joint[2][p.name]) for p in model.trainable})
                probed[f"{JOINT}loss"] = np.asarray(joint[1], np.float64)
            save_npz(out_dir / f"{name}.npz", thin_activations(probed, rows))
            (out_dir / f"{name}.json").write_text(json.dumps(
                {"declared_differences": backend.declared_differences(), "step": t, "state": states[t]}))
    # last, after every probe (a step leaves state behind: a schedule's previous rate), one step of the training
    # from each state, and what it reports: [step, loss, accuracy, grad, update and parameter norms]
    reported, report_error = [], None
    try:
        for t in at if r.report_steps else ():
            load(load_npz(out_dir / states[t]), t)
            x, y, b = batch(t)
            s = backend.train_step(t, x, y, masks_for(model, hp.seed, t, b, opts.dropout))
            reported.append([t, s.loss, s.accuracy, s.grad_norm, s.update_norm, s.param_norm])
    except Exception as e:   # the probes stand without the reports: the failure is returned, not raised
        report_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        LEFT_IN_DOUBT.append(report_error)   # the framework may be left in any state: this process serves no more
    return {"replay_at": at, "replayed": replayed, "evaluated": evaluated, "reload_exact": backend.state_reload_exact(),
            "states": {str(t): p for t, p in states.items()}, "reported": reported, "report_error": report_error}


def main(job_path: str) -> int:
    from .base import REGISTRY, UnsupportedError
    job = Job.read(job_path)
    out_dir = Path(job.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    entry = REGISTRY[job.backend]
    channel = sys.stdout
    cls = entry.load()
    try:
        backend = build_backend(job, cls)
        backend.name = entry.name
        info: dict[str, Any] = {
            "backend": entry.name, "framework": cls.framework, "versions": backend.versions(),
            "devices": backend.devices(), "determinism": backend.determinism(),
            "declared_differences": backend.declared_differences(), "fault": backend.opts.fault,
            "parallel": backend.parallel_info(), "pid": os.getpid(),
        }
        if not backend.is_primary():   # another rank / host: compute in lock-step, write nothing that stays
            import tempfile
            out_dir = Path(tempfile.mkdtemp(prefix="duipai-rank-"))
            channel = open(os.devnull, "w")
        t0 = time.perf_counter()
        modes = {"train": lambda: run_train(job, backend, out_dir, channel), "probe": lambda: run_probe(job, backend, out_dir),
                 "replay": lambda: run_replay(job, backend, out_dir)}
        extra = modes[job.mode]()
        info.update(extra or {})
        info["wall_s"] = time.perf_counter() - t0
        info["imported"] = imported_frameworks()
    except UnsupportedError as e:
        progress(channel, unsupported=str(e))
        return 3
    (out_dir / WORKER_FILE).write_text(json.dumps(info, indent=2, default=str))
    progress(channel, done=True)
    if not backend.is_primary():
        import shutil
        shutil.rmtree(out_dir, ignore_errors=True)
    return 0
