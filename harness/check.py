"""`duipai check` and `duipai baseline save` as library functions: rerun a matrix (the CI matrix by
default) and compare every run with its golden baseline (harness/baseline_set.py), judged by
harness/check_judge.py and reported by harness/check_report.py.

Exit: 0 every run matches; 1 a numerical regression; 2 bad input (a missing, corrupt or stale
baseline, a bad matrix, a backend not installed; nothing is run); 3 a backend crashed or was
killed (the rest of the matrix still runs and is reported).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from . import matrix as M
from .baseline_file import BaselineError, baseline_doc
from .baseline_set import INDEX, BaselineSet, load_set, matrix_definition, rel_path, set_changes, set_folder, write_set
from .check_judge import ERROR, FAIL, UNJUDGED, Judge, Result
from .check_report import EXIT_NAMES, junit, markdown
from .errors import EXIT_BAD_INPUT, EXIT_BUG, EXIT_CRASH, EXIT_OK, BadInput
from .files import atomic_write_text
from .fingerprint import platform_fingerprint
from .runner import backend_info


def parse_faults(specs: tuple[str, ...], m: M.Matrix) -> dict[str, str]:
    """--fault BACKEND:FAULT arguments as {backend: fault}; BadInput naming the bad one."""
    from algorithms.faults import FAULTS, perturbation
    out: dict[str, str] = {}
    for s in specs:
        b, sep, f = s.partition(":")
        if not sep or not b or not f:
            raise BadInput(f"--fault {s!r}: expected BACKEND:FAULT (e.g. BACKEND:flatten_no_permute, a name of `duipai backends`)")
        if b not in m.backends:
            raise BadInput(f"--fault {s!r}: backend {b!r} is not in matrix {m.name} ({', '.join(m.backends)})")
        if f not in FAULTS and perturbation(f) is None:
            raise BadInput(f"--fault {s!r}: unknown fault {f!r}; see `duipai faults`")
        if b in out:
            raise BadInput(f"--fault: two faults for backend {b!r}")
        out[b] = f
    return out


def check_installed(m: M.Matrix) -> None:
    """Every backend of the matrix is installed (a check needs them all), or BadInput."""
    info = backend_info()
    for b in dict.fromkeys([m.reference] + m.backends):
        if info[b]["missing"]:
            raise BadInput(f"backend {b!r} of matrix {m.name} is not installed (missing {', '.join(info[b]['missing'])}): "
                           "a check needs every backend its baselines hold")


def entries_for(m: M.Matrix, faults: dict[str, str]) -> tuple[list[M.Entry], dict[str, tuple[str, str | None]]]:
    """The matrix's entries, faults injected into the 'run' entries of their backends; for each entry
    name: (baseline name, injected fault)."""
    from algorithms.spec import load_model
    out, names = [], {}
    for e in M.expand(m):
        f = faults.get(e.cfg.backend) if e.role == "run" else None
        base = e.name
        if f:
            cfg = replace(e.cfg, fault=f)
            e = M.Entry(cfg, cfg.default_name(load_model(cfg.model).name), e.role)
        out.append(e)
        names[e.name] = (base, f)
    return out, names


def check_set_matches(m: M.Matrix, bs: BaselineSet, names: dict[str, tuple[str, str | None]]) -> None:
    """The baselines must be of this matrix: the same definition, one baseline per run."""
    idx = INDEX
    old = (bs.index.get("matrix") or {}).get("definition") or {}
    new = json.loads(json.dumps(matrix_definition(m)))
    if old != new:
        ch = [f"{k} {json.dumps(old.get(k))} -> {json.dumps(new.get(k))}" for k in sorted(set(old) | set(new))
              if old.get(k) != new.get(k)]
        raise BaselineError(f"{bs.folder / idx}: the baselines are of another definition of matrix {m.name} "
                               f"({'; '.join(ch)}); regenerate them with `duipai check --update`")
    want = {b for b, _ in names.values()}
    have = set(bs.runs) | set(bs.unsupported)
    missing = sorted(want - have)
    if missing:
        raise BaselineError(f"{bs.folder / (missing[0] + '.json')}: missing: no baseline for run {missing[0]}"
                               + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                               + "; regenerate with `duipai check --update`")
    extra = sorted(have - want)
    if extra:
        raise BaselineError(f"{bs.folder / (extra[0] + '.json')}: baseline of run {extra[0]}, which matrix "
                               f"{m.name} does not have; regenerate with `duipai check --update`")


def exit_code(results: list[Result]) -> int:
    """The worst outcome wins: a crash (3) over bad input (2) over a regression (1)."""
    st = {r.status for r in results}
    if ERROR in st:
        return EXIT_CRASH
    if UNJUDGED in st:
        return EXIT_BAD_INPUT
    if FAIL in st:
        return EXIT_BUG
    return EXIT_OK


def run_check_matrix(m: M.Matrix, entries: list[M.Entry], out: Path, jobs: int, reuse: bool,
                     log: Callable[[str], None]) -> Path:
    """Run the entries into <out>/<matrix>/ (rerun unless reuse) and record their status; the folder."""
    folder = out / m.name
    M.run_entries(entries, folder, out, jobs, force=not reuse, timeout=m.timeout_s, log=log)
    M.write_status(folder, m, entries)
    return folder


@dataclass
class Saved:
    """What `baseline save` / `check --update` did: its exit status and the lines for stdout."""
    code: int
    lines: list[str]


def save_baselines(m: M.Matrix, entries: list[M.Entry], folder: Path, log: Callable[[str], None]) -> Saved:
    """Write the set from the runs just made; say what changed. Nothing is written if a run failed."""
    failed = [e for e in entries if e.status in ("failed", "skipped")]
    if failed:
        for e in failed:
            log(f"FAILED {e.name}: {e.message}" + (f" (log: {e.log})" if e.log else ""))
        log(f"duipai: error: {len(failed)} run(s) failed: baselines in {rel_path(folder)} left as they were")
        return Saved(EXIT_CRASH, [])
    old, errors = None, []
    try:
        old, errors = load_set(folder, strict=False)
    except BaselineError as e:
        if (folder / INDEX).exists():
            errors = [e]
    platform_fp = platform_fingerprint()
    docs = {e.name: baseline_doc(Path(e.folder), role=e.role, key=e.key, matrix=m.name, platform_fp=platform_fp)
            for e in entries if e.status in ("ran", "cached")}
    unsupported = {e.name: e.message for e in entries if e.status == "unsupported"}
    changes = set_changes(old, errors, docs, platform_fp)
    write_set(folder, m, docs, unsupported, platform_fp)
    head = f"baselines: {rel_path(folder)} ({len(docs)} runs" + (f", {len(unsupported)} refusals" if unsupported
                                                                   else "") + ")"
    return Saved(EXIT_OK, [head] + [f"  {line}" for line in changes])


def load_check_matrix(matrix_file: str, fault: tuple[str, ...] = ()) -> tuple[M.Matrix, dict[str, str]]:
    """The matrix, its --fault injections, every backend installed; or BadInput."""
    m = M.load_matrix(matrix_file)
    faults = parse_faults(fault, m)
    check_installed(m)
    return m, faults


def update_baselines(*, matrix_file: str, baselines: Path, out: Path, jobs: int = 1, reuse: bool = False,
                     fault: tuple[str, ...] = (), log: Callable[[str], None]) -> Saved:
    """Rerun the matrix and replace its baseline set (`check --update`, `baseline save`). BadInput first."""
    m, faults = load_check_matrix(matrix_file, fault)
    if faults:
        raise BadInput("--update with --fault would save a faulty baseline")
    entries, _ = entries_for(m, faults)
    folder = set_folder(baselines, m.name)
    run_check_matrix(m, entries, out, jobs, reuse, log)
    return save_baselines(m, entries, folder, log)


@dataclass
class CheckOutcome:
    """A finished check: the exit status, every run's result, and what was written."""
    code: int
    results: list[Result]
    markdown: str
    junit: str
    doc: dict[str, Any]
    check_dir: Path


def check_baselines(*, matrix_file: str, baselines: Path, out: Path, jobs: int = 1, reuse: bool = False,
                    mode: str = "auto", fault: tuple[str, ...] = (), localize: bool = True,
                    timeout: float | None = None, allow_drift: bool = False,
                    log: Callable[[str], None]) -> CheckOutcome:
    """Rerun the matrix, judge every run against its baseline, localize the failures and write
    <out>/<matrix>/check/{summary.md,junit.xml,check.json}. Raises BadInput before anything runs
    (a bad matrix or --fault, a missing, corrupt or stale baseline, a backend not installed)."""
    t0 = time.time()
    m, faults = load_check_matrix(matrix_file, fault)
    entries, names = entries_for(m, faults)
    bs, _ = load_set(set_folder(baselines, m.name))
    check_set_matches(m, bs, names)
    out_folder = run_check_matrix(m, entries, out, jobs, reuse, log)
    results = [Result(e, *names[e.name]) for e in entries]
    judge = Judge(m, bs, results, out_folder / "runs", mode, localize, timeout, log)
    judge.allow_drift = allow_drift
    for r in results:
        judge.judge(r)
    for r in results:
        if r.status == FAIL and r.pair is not None and r.pair.first is not None:
            judge.localize(r)
    code = exit_code(results)
    wall = time.time() - t0
    md = markdown(m, bs, results, code, wall, faults)
    doc = {"schema": 1, "tool": "duipai check", "matrix": m.name, "baselines": str(bs.folder), "exit_code": code,
           "result": EXIT_NAMES[code], "wall_s": round(wall, 2), "injected": faults,
           "platform": judge.platform, "runs": [r.to_dict() for r in results]}
    xml = junit(m, results, wall)
    check_dir = out_folder / "check"
    atomic_write_text(check_dir / "summary.md", md)
    atomic_write_text(check_dir / "junit.xml", xml)
    atomic_write_text(check_dir / "check.json", json.dumps(doc, indent=1, default=str) + "\n")
    return CheckOutcome(code, results, md, xml, doc, check_dir)
