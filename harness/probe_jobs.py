"""The probe and replay jobs of one comparison, run and cached under RESULTS/.localize.

Framework-free: a job is a backend run in another process (runner.execute, `probe` or `replay` mode of
wrappers/worker.py) from a run's own manifest, checked to reproduce it; what comes back is .npz probes.
harness.localize decides from them where a bug is; harness.resync judges the shared-state steps; the
arbiter runs its backend's jobs through the same cache. A job two pairs share (the reference's probe, its
replay) runs once.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np

from algorithms.contract import WORKER_FILE, Replay, checkpoints_in, probe_file_stem, replay_probe_stem, replay_state_file
from algorithms.params import REPLAY_ACTIVATION_ROWS, load_npz

from . import finite_range, reported, runner
from .batch_rows import align
from .errors import BackendFailed, BadInput
from .localize_cache import CacheBudget
from .matrix import run_key, up_to_date
from .probe_analysis import spec_layers
from .probe_files import LazyProbeMap, ReplayProbes
from .resync import parameters_at
from .runs import Run, check_reproduces, config_of


def same_path(a: Run, b: Run) -> bool:
    """Same backend and options (a fault or a weight perturbation aside): the same arithmetic."""
    keys = ("dtype", "threads", "devices", "jit", "extra", "deterministic", "dropout")
    return a.backend == b.backend and all(getattr(a.options, k) == getattr(b.options, k) for k in keys)


def has_float64_reference(ref: Run, cand: Run) -> bool:
    """Whether a float64 run of the reference tells the candidate's rounding apart: not when the reference is
    float64 already, nor when the candidate runs the reference's own code path (its correct probes are bitwise
    equal)."""
    return ref.options.dtype != "float64" and not same_path(ref, cand)


def change_tag(change: dict[str, Any]) -> str:   # a job-name part; a dict value as its pairs, file-name safe
    return "__".join(f"{k}-" + (".".join(f"{a}={b}" for a, b in sorted(v.items())) or "none" if isinstance(v, dict)
                                else str(v)) for k, v in sorted(change.items()))


def checkpoints(run: Run) -> dict[int, Path]:
    """The run's saved states: step -> checkpoints/step_NNNNNNN.npz (taken after that many steps)."""
    return checkpoints_in(run.path)


def _at_tag(at: list[int]) -> str:
    """A job-name part for the replayed steps; hashed when there are many (file names stay short)."""
    text = "-".join(map(str, at))
    head = f"at{text}" if len(at) <= 4 else f"at{at[0]}-{at[-1]}-n{len(at)}-{hashlib.sha256(text.encode()).hexdigest()[:8]}"
    return f"{head}-rows{REPLAY_ACTIVATION_ROWS}"   # a cache of replays written with other rows is not mixed in


def _nudged_files(folder: Path, at: list[int], seeds: tuple[int, ...]) -> dict[int, list[Path]]:
    """Step -> the 1-ULP-nudged probes a replay job in `folder` wrote there, one per seed."""
    return {t: [folder / f"{replay_probe_stem(i, s)}.npz" for s in seeds] for i, t in enumerate(at)}


def _tag(run: Run) -> str:
    return hashlib.sha256(json.dumps(run.manifest, sort_keys=True, default=str).encode()).hexdigest()[:8]


# a replay's entries that read probes from files when asked (not results to write)
PROBE_KEYS = ("probes", "emulated64", "sensitivity", "plain_sensitivity")
# seeds of the 1-ULP-nudged reference replays that measure each resync point's own sensitivity; when a resynced
# step disagrees in the backward pass only, MORE_SENSITIVITY_SEEDS more at every point (ProbeJobs.more_sensitivity)
SENSITIVITY_SEEDS = (1, 2)
MORE_SENSITIVITY_SEEDS = (3, 4, 5, 6, 7, 8)


class ProbeJobs:
    """Runs and caches the probe and replay jobs of one comparison (under RESULTS/.localize)."""

    def __init__(self, root: Path, *, timeout: float | None = None, log: Callable[[str], None] | None = None,
                 parallel: int = 1):
        self.root = Path(root)
        self.parallel = parallel   # the jobs of one replay that need only the reference's states run this many at once
        self.jobs = self.root / ".localize"
        self.timeout = timeout
        self.log = log or (lambda m: print(m, file=sys.stderr))
        self._replays: dict[tuple[str, str, str], dict[str, Any]] = {}   # the resync's, by (ref, cand, change)
        # pairs are localized in parallel threads (compare's `jobs`); a job two pairs share (the reference's
        # probe, its replay) runs once: the second waits on the first's lock and finds its folder
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self.cache = CacheBudget(self.jobs, self.log)   # the cache's size limit (harness.localize_cache)

    def _job(self, run: Run, name: str, mode: str, replay: Replay | None = None, fresh_process: bool = False,
             **change: Any) -> Path:
        with self._locks_guard:
            lock = self._locks.setdefault(name, threading.Lock())
        with lock:
            folder = self._job_once(run, name, mode, replay, fresh_process=fresh_process, **change)
            self.cache.used(folder, run.name)
            return folder

    def release(self, run_name: str) -> None:
        """The pairs that needed `run_name`'s jobs are judged: the cache may drop them (least recently used first)."""
        self.cache.release(run_name)

    def close(self) -> None:
        """This comparison is done: the cache is trimmed to its limit."""
        self.cache.release_all()

    def _job_once(self, run: Run, name: str, mode: str, replay: Replay | None = None, fresh_process: bool = False,
                  **change: Any) -> Path:
        """The job's folder, run unless a complete one with the same content key is there: the key covers
        the backend's sources and framework versions (matrix.run_key), so a job cached before a change of
        the wrapper's code or an upgrade is run again, not reused."""
        folder = self.jobs / name
        cfg = config_of(run.manifest, self.root, **change)
        prep = runner.prepare(cfg, self.root)
        key = hashlib.sha256(json.dumps([run_key(cfg, prep), mode, self._relocatable(replay)], sort_keys=True,
                                        default=str).encode()).hexdigest()[:20]
        if (folder / WORKER_FILE).is_file() and up_to_date(folder, key):
            return folder
        check_reproduces(run.manifest, cfg, prep, f"the {mode} job")
        self.log(f"localize: {mode} {cfg.backend} ({name})")
        return runner.execute(cfg, self.jobs, name, mode=mode, prepared=prep, timeout=self.timeout,
                              replay=replay, manifest_extra={"run_key": key}, fresh_process=fresh_process)

    def _relocatable(self, replay: Replay | None) -> dict[str, Any] | None:
        """A replay's part of a job's key with the results folder's own path taken out of its checkpoint and state
        files: the same job in a copied or moved results folder (a CI artefact compared again) is the same job,
        found in the cache, not run again. Files outside the folder keep their path."""
        if replay is None:
            return None
        d = replay.to_dict()
        roots = {str(self.root) + os.sep, str(self.root.resolve()) + os.sep}
        for k in ("checkpoints", "states"):
            for t, p in (d.get(k) or {}).items():
                for r in roots:
                    if p.startswith(r):
                        d[k][t] = "<results>/" + p[len(r):]
                        break
        return d

    def _probe0_job(self, run: Run, **change: Any) -> Path:
        """The folder of the step-0 probe job of `run` (with `change`), run once and cached."""
        tag = "__" + change_tag(change) if change else ""
        return self._job(run, f"probe__{run.name}__{_tag(run)}{tag}", "probe", **change)

    def probe0(self, run: Run, **change: Any) -> dict[str, np.ndarray]:
        return load_npz(self._probe0_job(run, **change) / f"{probe_file_stem(0)}.npz")

    def first_batch(self, run: Run) -> tuple[dict[str, np.ndarray], np.ndarray] | None:
        """(the weights the run started from, its first batch's labels), as its jobs prepare them."""
        return reported.first_batch(run, self.root)

    def report_at(self, pair, rep: dict[str, Any], logits_layer: str) -> dict[str, Any] | None:
        """harness.reported.localize at the points of `rep` (a replay of `pair`), first to last: each backend's
        training step from the reference's state there must report what its probe from that state computes
        (the jobs' `reported` rows; a replay keeps the logits whole). None: every report agrees."""
        done = {who: {int(r[0]): dict(zip(reported.REPORTED, r[1:])) for r in rows}
                for who, rows in (rep.get("reported") or {}).items()}
        labels = None
        for t, cand_probe, compared, _p64, plain in rep["probes"]:
            rows = {who: done.get(who, {}).get(int(t)) for who in ("reference", "candidate")}
            params = parameters_at(rep, int(t))
            if None in rows.values() or params is None:
                continue
            labels = reported.batch_labels(pair.a, self.root) if labels is None else labels
            against = compared if plain is None else plain
            got = reported.localize(pair, against, align(cand_probe, against, spec_layers(pair.a.manifest))[0],
                                    logits_layer, lambda run: (params, labels[int(t)]), step=int(t), rows=rows)
            if got is not None:
                return got
        return None

    def restart0(self, run: Run) -> dict[str, Any]:
        """The step-0 probe job's restart check (wrappers.base.Backend.restart_check): {} when not recorded
        (or the job failed: the localization says so on its own)."""
        try:
            f = self._probe0_job(run)
            return json.loads((f / f"{probe_file_stem(0)}.json").read_text()).get("restart") or {}
        except (BackendFailed, OSError, ValueError):
            return {}

    def probe64(self, ref: Run, cand: Run, **change: Any) -> dict[str, np.ndarray] | None:
        """The reference configuration (with `change`) probed in float64, for the tolerance of probes computed
        by two different code paths. None when the candidate runs the reference's own code path (same backend
        and options: its correct probes are bitwise equal), when the reference is float64 already, or
        when the backend cannot run float64; another backend's (`change`) always differs."""
        if not has_float64_reference(ref, cand) and "backend" not in change:
            return None
        try:
            return self.probe0(ref, dtype="float64", **change)
        except BackendFailed as e:
            self.log(f"localize: no float64 reference probe ({str(e).splitlines()[0]}); fixed tolerance")
            return None

    def replay(self, ref: Run, cand: Run, at: list[int], change: dict[str, Any] | None = None) -> dict[str, Any]:
        """Probe steps `at` of both backends from the reference's own states there. With `change` (the
        emulation of the candidate's declared differences) the reference also probes those states computing
        the declared formula: each entry of `probes` is (step, candidate, reference compared against, its
        float64 probe, the plain reference's probe or None without `change`); `emulated64` the float64 probes
        of the emulating reference per step; `sensitivity` the 1-ULP-nudged probes of the side compared against
        (`plain_sensitivity` the plain reference's)."""
        cks = checkpoints(ref)
        usable = [s for s in cks if s <= at[0]]
        if not usable:
            return {"error": f"no checkpoint of {ref.name} at or before step {at[0]}"}
        s0 = usable[-1]
        tag = _at_tag(at)
        # every checkpoint is offered: a step that has one is probed from it directly, any other is re-trained
        # from the latest one before it (one reference process for all the steps)
        # the reference's own 1-ULP-nudged steps (SENSITIVITY_SEEDS) are probed by the same process, from the
        # same states (a process start costs more than the probes)
        rf = self._job(ref, f"replay__{ref.name}__{_tag(ref)}__{tag}", "replay",
                       Replay(at, checkpoints={t: str(f) for t, f in cks.items()},
                              perturb_state_ulps=[None, *SENSITIVITY_SEEDS], report_steps=True))
        done = json.loads((rf / WORKER_FILE).read_text()).get("states") or {}

        def state_of(t: int) -> str:
            """A state the job saved (relative to its folder), or a checkpoint it probed directly (the job names
            it by its absolute path): the run's own checkpoint of that step where the run is now, so that a
            cached job in a moved or copied results folder reads no file of the old place."""
            p = done.get(str(t), replay_state_file(t))
            return str(cks.get(t, p) if Path(p).is_absolute() else rf / p)
        states = {str(t): state_of(t) for t in at}
        from_states = Replay(at, states={int(t): p for t, p in states.items()})
        # every job below needs only the reference's states: they run `self.parallel` at a time
        def candidate_job() -> Path:
            return self._job(cand, f"replay__{cand.name}__{_tag(cand)}__from-{_tag(ref)}__{tag}", "replay",
                             Replay(at, states=from_states.states, report_steps=True))

        def float64_job() -> Path | None:
            if not has_float64_reference(ref, cand):
                return None
            try:
                return self._job(ref, f"replay__{ref.name}__{_tag(ref)}__float64__{tag}", "replay",
                                 from_states, dtype="float64")
            except BackendFailed as e:
                self.log(f"localize: no float64 reference replay ({str(e).splitlines()[0]}); fixed tolerance")
                return None

        with ThreadPoolExecutor(max_workers=max(1, self.parallel)) as pool:
            f_cand, f_64 = pool.submit(candidate_job), pool.submit(float64_job)
            cf, r64 = f_cand.result(), f_64.result()
        emu, emu64 = None, LazyProbeMap({})
        if change is not None:
            # the side compared is the emulating one: its own 1-ULP nudges, probed in its process, are the
            # sensitivity (the plain reference's nudges differ from it by the declared formula itself)
            emu = self._job(ref, f"replay__{ref.name}__{_tag(ref)}__{change_tag(change)}__nudged__{tag}", "replay",
                            Replay(at, states=from_states.states, perturb_state_ulps=[None, *SENSITIVITY_SEEDS]),
                            **change)
            if has_float64_reference(ref, cand) or "backend" in change:
                try:
                    e64 = self._job(ref, f"replay__{ref.name}__{_tag(ref)}__{change_tag(change)}__float64__{tag}",
                                    "replay", from_states, **dict(change, dtype="float64"))
                    emu64 = LazyProbeMap({t: e64 / f"{probe_file_stem(i)}.npz" for i, t in enumerate(at)})
                except BackendFailed as e:
                    self.log(f"localize: no float64 emulating replay ({str(e).splitlines()[0]}); fixed tolerance")
        worker = json.loads((rf / WORKER_FILE).read_text())
        reported_rows = {}
        for who, w in (("reference", worker), ("candidate", json.loads((cf / WORKER_FILE).read_text()))):
            reported_rows[who] = w.get("reported") or []
            if w.get("report_error"):
                self.log(f"localize: the {who}'s replayed training steps reported nothing ({w['report_error']})")
        rows = np.asarray(worker.get("replayed") or [], np.float64).reshape(-1, 6)
        repro = None
        if len(rows):
            idx = rows[:, 0].astype(int)
            cols = ["loss", "accuracy", "grad_norm", "update_norm", "param_norm"]
            got, want = rows[:, 1:], np.stack([ref.values[c][idx] for c in cols], axis=1)
            repro = {"from_step": int(s0), "to_step": int(idx[-1]), "bitwise": bool(np.array_equal(got, want)),
                     "max_abs_diff": float(np.max(np.abs(got - want)))}
        return {"checkpoint_step": s0, "at": at, "reference_job": str(rf), "candidate_job": str(cf), "states": states,
                "nudged_with": dict(change or {}), "jobs": 2 + (r64 is not None) + (emu is not None) + bool(emu64),
                "reproduced": repro,
                "float64_job": str(r64) if r64 else None, "reported": reported_rows,
                "emulated64": emu64, "sensitivity": LazyProbeMap(_nudged_files(emu or rf, at, SENSITIVITY_SEEDS)),
                "plain_sensitivity": LazyProbeMap(_nudged_files(rf, at, SENSITIVITY_SEEDS)),
                "probes": ReplayProbes([(t, (cf / f"{probe_file_stem(i)}.npz", (emu or rf) / f"{probe_file_stem(i)}.npz",
                                              r64 / f"{probe_file_stem(i)}.npz" if r64 else None,
                                              rf / f"{probe_file_stem(i)}.npz" if emu else None))
                                         for i, t in enumerate(at)])}

    def _nudged(self, ref: Run, at: list[int], states: dict[str, str], seeds: tuple[int, ...], **change: Any) -> dict[int, list[Path]]:
        """The reference's own (with `change`: another backend's) sensitivity at each state: one step with the
        parameters moved by one ULP, per seed, in one job. A correct candidate's rounding flips a ReLU kink or a
        max-pool tie; so does, now and then, a 1-ULP nudge. Step -> the probe files (none where the job failed)."""
        name = f"replay__{ref.name}__{_tag(ref)}__{change_tag(change) + '__' if change else ''}nudge{'-'.join(map(str, seeds))}__{_at_tag(at)}"
        try:
            folder = self._job(ref, name, "replay", Replay(at, states={int(t): p for t, p in states.items()},
                                                           perturb_state_ulps=list(seeds)), **change)
        except BackendFailed as e:
            self.log(f"localize: no 1-ULP sensitivity replay ({str(e).splitlines()[0]}); calibrated on float64 only")
            return {t: [] for t in at}
        return _nudged_files(folder, at, seeds)

    def more_sensitivity(self, ref: Run, rep: dict[str, Any]) -> dict[str, Any]:
        """`rep` (a replay) with MORE_SENSITIVITY_SEEDS more nudged reference steps at EVERY point (a fair yardstick
        for the count of the candidate's flips), asked when a resynced step disagrees in the backward pass only."""
        at = list(rep["at"])
        n = max(1, min(self.parallel, len(MORE_SENSITIVITY_SEEDS)))
        groups = [MORE_SENSITIVITY_SEEDS[g::n] for g in range(n)]
        with ThreadPoolExecutor(max_workers=n) as pool:
            found = list(pool.map(lambda sd: self._nudged(ref, at, rep["states"], sd, **rep.get("nudged_with", {})), groups))
        more = {t: [f for got in found for f in got[t]] for t in at}
        return dict(rep, sensitivity=rep["sensitivity"].extended(more),
                    sensitivity_seeds=len(SENSITIVITY_SEEDS) + sum(len(g) for g, got in zip(groups, found) if got[at[0]]))

    def every_sample(self, ref: Run, cand: Run, rep: dict[str, Any], t: int, change: dict[str, Any] | None
                     ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray] | None] | None:
        """Step `t` of a replay probed again by the candidate and by the float64 reference (computing the
        candidate's declared formulas, with `change`), every sample's activations kept: the evidence of a kink
        the candidate's rounding crossed there (harness.kinks); and the candidate's own step in float64 (None
        where it has none). None where there is no float64 reference (a float64 or same-path reference) or a
        job failed."""
        if not has_float64_reference(ref, cand):
            return None
        extra = Replay([t], states={t: rep["states"][str(t)]}, activation_rows=0)
        tag, wide, stem = f"at{t}-rows-all", dict(change or {}, dtype="float64"), probe_file_stem(0)
        with ThreadPoolExecutor(max_workers=max(1, self.parallel)) as pool:
            fc = pool.submit(self._job, cand, f"replay__{cand.name}__{_tag(cand)}__from-{_tag(ref)}__{tag}",
                             "replay", extra)
            fz = pool.submit(self._job, ref, f"replay__{ref.name}__{_tag(ref)}__{change_tag(wide)}__{tag}",
                             "replay", extra, **wide)
            f64 = pool.submit(self._job, cand, f"replay__{cand.name}__{_tag(cand)}__float64__from-{_tag(ref)}__at{t}",
                              "replay", Replay([t], states=extra.states), dtype="float64")   # its gradients only
            try:   # the candidate's rows in the reference's order (harness.batch_rows)
                z, layers = load_npz(fz.result() / f"{stem}.npz"), spec_layers(ref.manifest)
                got = align(load_npz(fc.result() / f"{stem}.npz"), z, layers)[0], z
            except BackendFailed as e:
                self.log(f"localize: no every-sample probe of step {t} ({str(e).splitlines()[0]}); no kink evidence")
                return None
            try:
                return (*got, align(load_npz(f64.result() / f"{stem}.npz"), z, layers)[0])
            except (BackendFailed, BadInput) as e:
                self.log(f"localize: no float64 step of {cand.name} at {t} ({str(e).splitlines()[0]})")
                return (*got, None)

    def self_replay(self, run: Run) -> dict[str, Any]:
        """harness.self_replay: `run`'s backend re-trains every stretch between two of the run's checkpoints from
        the first, in a fresh process (one job, about one run's training); its rows must be the run's, and its
        evaluation of each checkpoint as loaded, before any step, the run's evaluation at that step.
        {"checked": False, "why": ...} where no such comparison is exact: framework-RNG dropout, a run not in
        deterministic mode, a run trained on another machine, fewer than two checkpoints; or a job that failed.
        A run of several processes standing in for hosts is re-trained in its backend's replay layout (one process
        where the backend replays such a run in one), both layouts recorded (`processes`, `replay_processes`): a
        row it does not reproduce in fewer processes may be the multi-process path (harness.self_replay.placed); a
        layout that rounds otherwise leaves a stretch judged up to its first row that is not bit-equal (an accuracy
        within one sample not judged)."""
        from . import self_replay as S
        o = run.options
        host = run.manifest.get("host") or {}
        elsewhere = host and (host.get("hostname"), host.get("platform")) != (socket.gethostname(), platform.platform())
        why = ("framework-RNG dropout" if o.dropout == "native" else "not in deterministic mode" if not o.deterministic
               else f"trained on another machine ({host.get('hostname')}, {host.get('platform')}): re-trained here it "
                    f"need not be the same computation to the bit" if elsewhere else None)
        last = min((t for t in (run.compared_to, finite_range.left_range_at(run)) if t is not None), default=None)
        cks = {c: p for c, p in checkpoints(run).items() if last is None or c <= last}   # its finite states only
        at = [] if why else S.stretches(run.steps_compared, sorted(cks))
        if why or not at:
            return {"checked": False, "why": why or f"{run.name} has no two checkpoints with a step between them"}
        try:
            folder = self._job(run, f"replay__{run.name}__{_tag(run)}__self-{_at_tag(at)}-eval-fresh", "replay",
                               Replay(at, checkpoints={c: str(p) for c, p in cks.items()}, perturb_state_ulps=[],
                                      evaluate_checkpoints=True, reload_each_step=True),
                               fresh_process=True)   # nothing but the checkpoint: no state of earlier jobs
        except BackendFailed as e:
            return {"checked": False, "why": f"the self-replay job failed: {str(e).splitlines()[0]}"}
        worker = json.loads((folder / WORKER_FILE).read_text())
        layouts = {"hosts": o.hosts, "processes": (run.manifest.get("parallel") or {}).get("processes"),
                   "replay_processes": (worker.get("parallel") or {}).get("processes")}
        return {**S.judge(run.step, run.values, worker.get("replayed") or [], sorted(cks),
                          reload_exact=worker.get("reload_exact", True),    # Backend.state_reload_exact
                          batch=int(run.manifest.get("hparams", {}).get("batch_size") or 0)),
                **S.judge_evaluations(run.eval_step, run.values, worker.get("evaluated") or []), **layouts}

    def replayed_rows(self, ref: Run, cand: Run, step: int, change: dict[str, Any] | None) -> dict[str, Any] | None:
        """What each backend's training step reported at `step` in the pair's resync replay (None: not replayed)."""
        rep = self._cached_replay(ref, cand, [step], change)
        return reported.rows_at(rep, step) if rep else None

    def _cached_replay(self, ref: Run, cand: Run, at: list[int], change: dict[str, Any] | None):
        """The resync's replay restricted to `at`, when it probed every step of `at`."""
        rep = self._replays.get((ref.name, cand.name, change_tag(change or {})))
        if rep is None or not set(at) <= set(rep["at"]):
            return None
        return dict(rep, at=at, probes=rep["probes"].restricted(at))


__all__ = ["LazyProbeMap", "MORE_SENSITIVITY_SEEDS", "PROBE_KEYS", "ProbeJobs", "ReplayProbes", "SENSITIVITY_SEEDS", "change_tag", "checkpoints",
           "has_float64_reference", "same_path"]
