"""`duipai compare`: the verdict on runs of one configuration by several backends."""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import click

from . import runner
from .runner import BackendFailed, BadInput

EPILOG = """\b
Verdicts: IDENTICAL (bitwise), DRIFT (inside the envelope), BUG (first divergent step, series,
factor over the envelope, localized), DECLARED (a declared difference explains it), INCONCLUSIVE
(the envelope saturates first: use --stat). Exit 0: no BUG; 1: a BUG; 2: bad input; 3: a backend
failed. The rule is in docs/verdict.md.
\b
Examples:
  duipai compare results/                       every comparable group of runs in a results folder
  duipai compare results/A results/B results/C  these runs, reference torch
  duipai compare --stat --seeds 0,1,2,3,4 results/A results/B   Welch t-test over 5 seeds each
"""


def _fail(msg: str, code: int = runner.EXIT_BAD_INPUT) -> None:
    click.echo(f"duipai: error: {msg}", err=True)
    sys.exit(code)


def _ints(text: str | None, what: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BadInput(f"{what}: expected comma-separated integers, got {text!r}") from None


def _resolve(paths: tuple[Path, ...]) -> tuple[list[Path], Path | None, list[str]]:
    """Run folders from the arguments; a single non-run folder is a results folder to scan."""
    from .runs import discover, is_run_folder
    notes: list[str] = []
    if not paths:
        raise BadInput("give run folders, or one results folder")
    if len(paths) == 1 and paths[0].is_dir() and not is_run_folder(paths[0]):
        found = discover(paths[0])
        if not found:
            raise BadInput(f"{paths[0]}: no complete run folders in it")
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


def _out_dir(out: Path | None, scanned_root: Path | None, runs) -> Path:
    if out is not None:
        return out
    if scanned_root is not None:
        return scanned_root
    parents = {r.path.resolve().parent for r in runs}
    return parents.pop() if len(parents) == 1 else runs[0].path.resolve().parent


@click.command("compare", epilog=EPILOG)
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path))
@click.option("--reference", "-r", default="torch", show_default=True,
              help="Reference: a backend name or a run folder name.")
@click.option("-k", "--k", "k", type=int, default=3, show_default=True,
              help="Envelope runs of the reference (--perturb-ulp 1..k), trained on demand and cached.")
@click.option("--envelope", "envelope_paths", multiple=True, type=click.Path(path_type=Path),
              help="Use these run folders as the envelope instead of training them (repeatable).")
@click.option("--no-fp64", is_flag=True, help="Leave the float64 run out of the envelope (1-ULP runs only).")
@click.option("--margin", type=float, default=None, help="Override the margin over the envelope (default 3).")
@click.option("--force", is_flag=True, help="Compare runs of different configurations anyway (said in every output).")
@click.option("--no-localize", is_flag=True, help="Do not run probe/replay jobs to localize a BUG.")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Folder for comparison.csv/.json (default: next to the runs).")
@click.option("--steps-csv/--no-steps-csv", "steps_csv", default=None,
              help="Write comparison-steps.csv (every per-step number; default: for runs up to 100,000 steps).")
@click.option("--json", "as_json", is_flag=True, help="Print comparison.json on stdout instead of the table.")
@click.option("-v", "--verbose", is_flag=True,
              help="List every pair without the reference, not one line when they agree.")
@click.option("--timeout", type=float, default=None, help="Kill a backend job (envelope, probe, replay) after this many s.")
@click.option("--stat", is_flag=True, help="Statistical mode: groups of seeds, Welch t-test per metric and step.")
@click.option("--seeds", default=None, help="--stat: train these data-order seeds for every group (e.g. 0,1,2,3,4).")
@click.option("--at", "at", default=None, help="--stat: steps to compare (default: the last evaluation).")
@click.option("--metrics", default="eval_loss,eval_accuracy,loss", show_default=True, help="--stat: series compared.")
@click.option("--alpha", type=float, default=0.05, show_default=True, help="--stat: significance level (Bonferroni).")
def compare_cmd(paths: tuple[Path, ...], reference: str, k: int, envelope_paths: tuple[Path, ...], no_fp64: bool,
                margin: float | None, force: bool, no_localize: bool, out: Path | None, steps_csv: bool | None,
                as_json: bool, timeout: float | None, stat: bool, seeds: str | None, at: str | None,
                metrics: str, alpha: float, verbose: bool) -> None:
    """Compare runs of one configuration: IDENTICAL / DRIFT / BUG / DECLARED / INCONCLUSIVE per
    candidate against the reference's calibrated 1-ULP envelope; a BUG is localized to a stage,
    layer and parameter. PATHS: run folders, or one results folder."""
    try:
        code = _main(paths, reference, k, envelope_paths, no_fp64, margin, force, no_localize, out, steps_csv, as_json,
                     timeout, stat, seeds, at, metrics, alpha, verbose)
    except BadInput as e:
        _fail(str(e))
    except BackendFailed as e:
        _fail(str(e), runner.EXIT_CRASH)
    sys.exit(code)


def _log(msg: str) -> None:
    click.echo(msg, err=True)


def _main(paths, reference, k, envelope_paths, no_fp64, margin, force, no_localize, out, steps_csv, as_json, timeout,
          stat, seeds, at, metrics, alpha, verbose: bool = False) -> int:
    from .compare import check_comparable, compare, render, write_outputs
    from .envelope import DEFAULT_RULE, compute, envelope_runs, envelope_seeds
    from .localize import Localizer
    from .progress import Activity
    from .runs import load_run
    if k < 1:
        raise BadInput(f"-k must be >= 1, got {k}")
    folders, scanned, notes = _resolve(paths)
    runs = [load_run(p) for p in folders]
    out_dir = _out_dir(out, scanned, runs)
    if stat:
        return _stat(runs, reference, force, seeds, at, metrics, alpha, timeout, out_dir, as_json)
    if scanned is not None:   # a results folder: envelope runs are members, not candidates
        perturbed = [r for r in runs if r.perturb_ulp is not None]
        runs = [r for r in runs if r.perturb_ulp is None]
        if perturbed:
            notes.append(f"{len(perturbed)} --perturb-ulp run(s) in {scanned} are envelope runs, not candidates")
    rule = DEFAULT_RULE if margin is None else replace(DEFAULT_RULE, margin=margin)
    groups, forced = _groups(runs, scanned is not None, force)
    results = []
    with Activity("comparing", _log) as say:   # envelope runs and localization jobs: a spinner on a terminal
        for group in groups:
            if len(group) < 2:
                notes.append(f"{group[0].name}: no other run of its configuration, not compared")
                continue
            ref = _pick_reference(group, reference) if scanned is None or any(
                r.backend == reference or r.name == reference for r in group) else None
            if ref is None:
                notes.append(f"{len(group)} runs of model {group[0].manifest.get('model')} have no {reference} run: "
                             f"not compared ({', '.join(r.name for r in group)})")
                continue
            cands = [r for r in group if r is not ref]
            group_forced = list(forced)
            group_notes = [] if ref.is_clean() else [f"the reference {ref.name} is not a clean run (fault, "
                                                     "perturbation or float64)"]
            if envelope_paths:
                members = [load_run(p) for p in envelope_paths]
                group_forced += check_comparable([ref] + members, force)
            else:
                avoid = {r.perturb_ulp for r in group if r.perturb_ulp is not None}
                members, env_notes = envelope_runs(ref, envelope_seeds(k, avoid), precision=not no_fp64,
                                                   timeout=timeout, log=say)
                group_notes += env_notes
            env = compute(ref, members, rule)
            loc = None if no_localize else Localizer(ref.path.parent, timeout=timeout, log=say)
            c = compare(ref, cands, env, members, rule, forced=group_forced, localize=loc)
            c.notes += group_notes
            results.append(c)
    if not results:
        raise BadInput("nothing to compare: " + "; ".join(notes))
    code = max(c.exit_code for c in results)
    if len(results) == 1:
        c = results[0]
        c.notes += notes
        paths_written = write_outputs(c, out_dir, per_step=steps_csv)
        doc = json.loads(paths_written["json"].read_text())
        text = render(c, verbose)
    else:
        paths_written, doc, text = _write_groups(results, out_dir, notes, steps_csv, verbose)
    if as_json:
        click.echo(json.dumps(doc))
    else:
        click.echo(text)
        click.echo("\nwritten: " + ", ".join(str(p) for p in paths_written.values()))
    return code


def _write_groups(results, out_dir: Path, notes: list[str], steps_csv: bool | None, verbose: bool = False):
    """Several comparable groups in one results folder: each group's files in a folder of its own,
    out_dir/<reference run>/ (every comparison.json is one comparison, as the report reads them)."""
    from .compare import render, write_outputs
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


def compare_folder(folder: Path, reference: str = "torch", *, k: int = 3, fp64: bool = True, localize: bool = True,
                   timeout: float | None = None, verbose: bool = False) -> int:
    """The verdict for `duipai all`: every comparable group of runs in folder/runs (or folder), the
    table on stdout, the files in folder (one subfolder per group when there are several). Returns
    the exit status (0 no BUG, 1 BUG, 2 bad input, 3 a backend job failed)."""
    folder = Path(folder)
    runs_dir = folder / "runs" if (folder / "runs").is_dir() else folder
    try:
        return _main((runs_dir,), reference, k, (), not fp64, None, False, not localize, folder, None, False, timeout,
                     False, None, None, "eval_loss,eval_accuracy,loss", 0.05, verbose)
    except BadInput as e:
        click.echo(f"duipai: error: {e}", err=True)
        return runner.EXIT_BAD_INPUT
    except BackendFailed as e:
        click.echo(f"duipai: error: {e}", err=True)
        return runner.EXIT_CRASH


def _stat(runs, reference, force, seeds, at, metrics, alpha, timeout, out_dir, as_json) -> int:
    from .compare import write_outputs
    from .stats import check_stat_comparable, ensure_seeds, render_stat, stat_compare
    forced = check_stat_comparable(runs, force)
    seed_list = _ints(seeds, "--seeds")
    if seed_list:
        runs = ensure_seeds(runs, seed_list, None, timeout, _log)
    c = stat_compare(runs, reference, [m.strip() for m in metrics.split(",") if m.strip()], _ints(at, "--at"),
                     alpha, forced)
    paths = write_outputs(c, out_dir)
    if as_json:
        click.echo(paths["json"].read_text())
    else:
        click.echo(render_stat(c))
        click.echo("\nwritten: " + ", ".join(str(p) for p in paths.values()))
    return c.exit_code


__all__ = ["compare_cmd", "compare_folder"]
