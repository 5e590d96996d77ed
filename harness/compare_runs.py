"""Comparing runs as a library: the verdict on runs of one configuration by several backends, or on
every comparable group of runs in a results folder (`duipai compare`, `duipai all`, the self-test).
The engine is harness/compare.py; this module finds the runs, groups them, trains the envelope on
demand, writes comparison.{json,csv} and returns the outcome (the command prints it)."""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from .config_diff import differences
from .errors import EXIT_BAD_INPUT, EXIT_CRASH, BackendFailed, BadInput, error_line

DEFAULT_METRICS = "eval_loss,eval_accuracy,loss"
# resync cadence in steps: every reference checkpoint at least this far apart, re-trained in between when
# finer than the checkpoints (docs/verdict.md: the cost and the calibration measured)
DEFAULT_RESYNC_EVERY = 25


def stderr_line(msg: str) -> None:
    """The default log: one line on stderr."""
    print(msg, file=sys.stderr, flush=True)


@dataclass
class CompareOutcome:
    """A finished comparison: its exit status, the files written, comparison.json as printed by --json
    (json_text) and the table (text)."""
    code: int
    written: dict[str, Path]
    json_text: str
    text: str


def parse_ints(text: str | None, what: str) -> list[int] | None:
    """A comma-separated list of integers (--seeds, --at), or BadInput naming the option."""
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BadInput(f"{what}: expected comma-separated integers, got {text!r}") from None


def _resolve(paths: tuple[Path, ...]) -> tuple[list[Path], Path | None, list[str]]:
    """Run folders from the arguments; a single non-run folder is a results folder to scan (a matrix's folder,
    as `duipai all` prints it: the runs in its runs/, the comparison written beside them as `all` writes it)."""
    from .runs import discover, is_run_folder
    notes: list[str] = []
    if not paths:
        raise BadInput("give run folders, or one results folder")
    if len(paths) == 1 and paths[0].is_dir() and not is_run_folder(paths[0]):
        found = discover(paths[0], notes)
        if not found and (paths[0] / "runs").is_dir():
            found = discover(paths[0] / "runs", notes)
        if not found:
            raise BadInput(f"{paths[0]}: no complete run folders in it" + "".join(f"; {n}" for n in notes))
        return found, paths[0], notes
    for p in paths:
        if not p.exists():
            raise BadInput(f"{p}: no such run folder")
    return list(paths), None, notes


def _pick_reference(runs, reference: str):
    by_name = [r for r in runs if r.name == reference or str(r.path) == reference]
    if by_name:
        return by_name[0]
    of_backend = [r for r in runs if r.backend == reference]
    if not of_backend:
        raise BadInput(f"no run of reference {reference!r} among {', '.join(r.name for r in runs)} "
                       "(--reference BACKEND or RUN_FOLDER_NAME)")
    clean = [r for r in of_backend if r.is_clean()]
    return (clean or of_backend)[0]


def _groups(runs, scanned: bool, force: bool) -> tuple[list[list], list[str]]:
    """Explicit runs are one configuration (or refused); a scanned folder is split into comparable groups."""
    from .compare import check_comparable
    from .runs import comparability_key
    if not scanned:
        return [runs], check_comparable(runs, force)
    groups: dict[tuple, list] = {}
    for r in runs:
        groups.setdefault(comparability_key(r), []).append(r)
    return list(groups.values()), []


def _alone(run, groups: list[list], reference: str) -> str:
    """The note for a run with no other run of its configuration, saying how it differs from the reference's
    configuration (or the largest group's): a user who changed one flag by mistake sees which."""
    others = [r for g in groups for r in g if r is not run]
    try:   # the run -r picks, by the same rules as a group's reference
        base = _pick_reference(others, reference) if others else None
    except BadInput:
        largest = max(groups, key=len)
        base = largest[0] if len(largest) > 1 else None
    why = ", ".join(words for _, _, _, words in differences(base.manifest, run.manifest)) if base else ""
    return (f"{run.name}: no other run of its configuration, not compared"
            + (f" (against {base.name}: {why})" if why else ""))


def _out_dir(out: Path | None, scanned_root: Path | None, runs) -> Path:
    if out is not None:
        return out
    if scanned_root is not None:
        return scanned_root
    parents = {r.path.resolve().parent for r in runs}
    return parents.pop() if len(parents) == 1 else runs[0].path.resolve().parent


def _write_groups(results, out_dir: Path, notes: list[str], steps_csv: bool | None, verbose: bool = False):
    """Several comparable groups in one results folder: each group's files in a folder of its own,
    out_dir/<reference run>/ (every comparison.json is one comparison, as the report reads them)."""
    from .compare_output import render, write_outputs
    paths, docs, texts = {}, [], []
    for c in results:
        c.notes += notes
        written = write_outputs(c, out_dir / c.reference.name, per_step=steps_csv)
        paths.update({f"{c.reference.name}:{k}": v for k, v in written.items()})
        docs.append(json.loads(written["json"].read_text()))
        texts.append(render(c, verbose))
    doc = {"schema": 1, "tool": "duipai compare", "mode": "lockstep-groups", "comparisons": docs,
           "exit_code": max(c.exit_code for c in results)}
    return paths, doc, ("\n\n" + "=" * 78 + "\n").join(texts)


def compare_runs(*, paths: tuple[Path, ...] | list[Path], reference: str, k: int = 3,
                 envelope_paths: tuple[Path, ...] | list[Path] = (), fp64: bool = True, margin: float | None = None,
                 force: bool = False, localize: bool = True, out: Path | None = None, steps_csv: bool | None = None,
                 timeout: float | None = None, verbose: bool = False, resync_every: int = DEFAULT_RESYNC_EVERY,
                 arbiter: str | None = None, jobs: int = 1, auto_stat: bool = True,
                 log: Callable[[str], None] = stderr_line) -> CompareOutcome:
    """Compare runs of one configuration (run folders), or every comparable group of one results folder,
    against the reference's calibrated 1-ULP envelope; a BUG is localized unless localize=False. Every
    candidate is also compared one step at a time from the reference's states (resync, harness/resync.py)
    every `resync_every` steps (0: not at all; also off with localize=False); each BUG is arbitrated by the
    backend `arbiter` in float64 when given (harness/arbiter.py). `jobs`: backend processes at once (the
    envelope runs; the candidates' resync and localization jobs). `auto_stat`: a pair left INCONCLUSIVE by
    framework-RNG dropout is decided over data-order seeds (harness/autostat.py; needs localize).
    Raises BadInput (nothing compared) or BackendFailed (an envelope or localization job failed)."""
    from .compare import check_comparable, compare
    from .compare_output import render, write_outputs
    from .envelope import DEFAULT_RULE, compute, envelope_runs, envelope_seeds
    from .finite_range import cut, left_range_at, range_note
    from .localize import Localizer
    from .progress import Activity
    from .runs import load_run
    if k < 1:
        raise BadInput(f"-k must be >= 1, got {k}")
    if margin is not None and not (math.isfinite(margin) and margin > 0):   # <= 0: every step exceeds, a false BUG
        raise BadInput(f"--margin must be a finite number > 0, got {margin}")
    if resync_every < 0:
        raise BadInput(f"--resync-every must be >= 0 (0: off), got {resync_every}")
    check_timeout(timeout)
    if arbiter:   # before anything is trained
        from .arbiter import check_arbiter
        check_arbiter(arbiter)
    folders, scanned, notes = _resolve(tuple(paths))
    runs = [load_run(p) for p in folders]
    out_dir = _out_dir(out, scanned, runs)
    if scanned is not None:   # a results folder: envelope runs are members, not candidates
        perturbed = [r for r in runs if r.perturb_ulp is not None]
        runs = [r for r in runs if r.perturb_ulp is None]
        if perturbed:
            notes.append(f"{len(perturbed)} --perturb-ulp run(s) in {scanned} are envelope runs, not candidates")
    rule = DEFAULT_RULE if margin is None else replace(DEFAULT_RULE, margin=margin)
    groups, forced = _groups(runs, scanned is not None, force)
    results = []
    with Activity("comparing", log) as say:   # envelope runs and localization jobs: a spinner on a terminal
        for group in groups:
            if len(group) < 2:
                notes.append(_alone(group[0], groups, reference))
                continue
            ref = _pick_reference(group, reference) if scanned is None or any(
                r.backend == reference or r.name == reference for r in group) else None
            if ref is None:
                have = sorted({r.backend for r in group})
                notes.append(f"{len(group)} runs of model {group[0].manifest.get('model')} have no {reference} run: "
                             f"not compared ({', '.join(r.name for r in group)}); `-r {have[0]}` compares them "
                             f"against {have[0]} (backends there: {', '.join(have)})")
                continue
            cands = [r for r in group if r is not ref]
            group_forced = list(forced)
            group_notes = [] if ref.is_clean() else [f"the reference {ref.name} is not a clean run (fault, "
                                                     "perturbation or float64)"]
            last = left_range_at(ref)   # its parameters overflow: nothing computed from there is compared
            warning = range_note(ref, last) if last is not None else None
            if last is not None:
                ref, cands = cut(ref, last), [cut(r, last) for r in cands]
            if envelope_paths:
                members = [load_run(p) for p in envelope_paths]
                group_forced += check_comparable([ref] + members, force)
            else:
                avoid = {r.perturb_ulp for r in group if r.perturb_ulp is not None}
                members, env_notes = envelope_runs(ref, envelope_seeds(k, avoid), precision=fp64,
                                                   timeout=timeout, log=say, jobs=jobs)
                group_notes += env_notes
            if last is not None:
                members = [cut(m, last) for m in members]
            env = compute(ref, members, rule)
            loc = Localizer(ref.path.parent, timeout=timeout, log=say, parallel=jobs) if localize else None
            rs = ((lambda pair, extra, loc=loc: loc.resync(pair, resync_every, extra))
                  if loc is not None and resync_every > 0 else None)
            c = compare(ref, cands, env, members, rule, forced=group_forced, localize=loc, resync=rs, jobs=jobs,
                        judged=(lambda p, loc=loc: loc.release(p.b.name)) if loc is not None else None)
            if auto_stat and localize:   # framework-RNG dropout: no deterministic comparison; decided over seeds instead
                from .autostat import decide, needs_stat
                for p in c.pairs:
                    if needs_stat(p):
                        decide(p, timeout=timeout, log=say)
            if arbiter:   # which side of each BUG the exact computation supports
                from .arbiter import arbitrate_comparison
                c = arbitrate_comparison(c, arbiter, timeout=timeout, log=say)
            if loc is not None:
                loc.close()
            c.notes += group_notes
            c.range_warning = warning
            results.append(c)
    if not results:
        raise BadInput("nothing to compare: " + "; ".join(notes))
    code = max(c.exit_code for c in results)
    if len(results) == 1:
        c = results[0]
        c.notes += notes
        written = write_outputs(c, out_dir, per_step=steps_csv)
        doc = json.loads(written["json"].read_text())
        text = render(c, verbose)
    else:
        written, doc, text = _write_groups(results, out_dir, notes, steps_csv, verbose)
    from .arbiter import lead_text
    return CompareOutcome(code, written, json.dumps(doc), lead_text(results) + text)


def check_timeout(timeout: float | None) -> None:
    """A job limit of 0 s or less would kill every envelope, probe and replay job at its start; nan would never
    kill one, inf overflows the waits."""
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        raise BadInput(f"--timeout must be a number of seconds > 0, got {timeout}")


def compare_seeds(*, paths: tuple[Path, ...] | list[Path], reference: str, force: bool = False,
                  seeds: list[int] | None = None, at: list[int] | None = None, metrics: str = DEFAULT_METRICS,
                  alpha: float = 0.05, timeout: float | None = None, out: Path | None = None,
                  log: Callable[[str], None] = stderr_line) -> CompareOutcome:
    """Statistical mode (`compare --stat`): groups of seeds, a Welch t-test per metric and step; the
    seeds not yet trained are trained first. Raises BadInput or BackendFailed."""
    from .compare_output import write_outputs
    from .runs import load_run
    from .stats import check_stat_comparable, ensure_seeds, render_stat, stat_compare
    if not 0 < alpha < 1:
        raise BadInput(f"--alpha must be between 0 and 1, got {alpha}")
    check_timeout(timeout)
    folders, scanned, _ = _resolve(tuple(paths))
    runs = [load_run(p) for p in folders]
    out_dir = _out_dir(out, scanned, runs)
    forced = check_stat_comparable(runs, force)
    if seeds:
        runs = ensure_seeds(runs, seeds, None, timeout, log)
    c = stat_compare(runs, reference, [m.strip() for m in metrics.split(",") if m.strip()], at, alpha, forced)
    written = write_outputs(c, out_dir)
    return CompareOutcome(c.exit_code, written, written["json"].read_text(), render_stat(c))


def compare_folder(folder: Path, *, reference: str, k: int = 3, fp64: bool = True, localize: bool = True,
                   timeout: float | None = None, verbose: bool = False, resync_every: int = DEFAULT_RESYNC_EVERY,
                   arbiter: str | None = None, jobs: int = 1, log: Callable[[str], None] = stderr_line) -> int:
    """The verdict for `duipai all`: every comparable group of runs in folder/runs (or folder), the
    table on stdout, the files in folder (one subfolder per group when there are several). Returns
    the exit status (0 no BUG, 1 BUG, 2 bad input, 3 a backend job failed)."""
    folder = Path(folder)
    runs_dir = folder / "runs" if (folder / "runs").is_dir() else folder
    try:
        outcome = compare_runs(paths=(runs_dir,), reference=reference, k=k, fp64=fp64, localize=localize, out=folder,
                               timeout=timeout, verbose=verbose, resync_every=resync_every, arbiter=arbiter,
                               jobs=jobs, log=log)
    except BadInput as e:
        log(error_line(e))
        return EXIT_BAD_INPUT
    except BackendFailed as e:
        log(error_line(e))
        return EXIT_CRASH
    print(outcome.text, flush=True)
    print("\nwritten: " + ", ".join(str(p) for p in outcome.written.values()), flush=True)
    return outcome.code
