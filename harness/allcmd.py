"""`duipai matrix` and `duipai all`: make-style matrix runs, then the comparison of what ran."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from . import matrix as M
from . import runner
from .runner import BadInput


def _say_problems(entries: list[M.Entry]) -> None:
    for e in entries:
        if e.status in ("skipped", "unsupported", "failed"):
            tag = {"skipped": "SKIPPED", "unsupported": "UNSUPPORTED", "failed": "FAILED"}[e.status]
            click.echo(f"{tag:<11} {e.name}: {e.message}" + (f" (log: {e.log})" if e.log else ""), err=True)


def run_and_summarise(matrix: str, out: Path, jobs: int, force: bool) -> tuple[M.Matrix, list[M.Entry]]:
    try:
        m = M.load_matrix(matrix)
    except BadInput as e:
        click.echo(f"duipai: error: {e}", err=True)
        sys.exit(runner.EXIT_BAD_INPUT)
    try:
        entries = M.run_matrix(m, out, jobs, force=force)
    except BadInput as e:
        click.echo(f"duipai: error: {e}", err=True)
        sys.exit(runner.EXIT_BAD_INPUT)
    counts = {s: sum(e.status == s for e in entries) for s in ("ran", "cached", "failed", "unsupported", "skipped")}
    click.echo("runs: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n), err=True)
    _say_problems(entries)
    return m, entries


MATRIX_OPTS = [
    click.option("--out", type=click.Path(path_type=Path), default=Path("results"), show_default=True,
                 help="Results root; the matrix writes into <out>/<matrix name>/."),
    click.option("-j", "--jobs", type=int, default=1, show_default=True, help="Backend processes at once."),
    click.option("--force", is_flag=True, help="Rerun even the runs that are up to date."),
]


def matrix_options(f):
    for o in reversed(MATRIX_OPTS):
        f = o(f)
    return f


@click.command("matrix")
@click.argument("matrix_file", default="default")
@matrix_options
def matrix_cmd(matrix_file: str, out: Path, jobs: int, force: bool) -> None:
    """Run a matrix file (TOML; a built-in name or a path). Up-to-date runs are reused."""
    m, entries = run_and_summarise(matrix_file, out, jobs, force)
    click.echo(f"results: {(out / m.name).resolve()}")
    sys.exit(runner.EXIT_CRASH if any(e.status == "failed" for e in entries) else runner.EXIT_OK)


@click.command("all")
@click.option("--matrix", "matrix_file", default="default", show_default=True, help="Matrix name or file.")
@matrix_options
@click.option("-v", "--verbose", is_flag=True,
              help="List every pair without the reference, not one line when they agree.")
def all_cmd(matrix_file: str, out: Path, jobs: int, force: bool, verbose: bool) -> None:
    """The main job: run the default matrix (every installed backend, the reference's ULP envelope),
    compare every run with the reference, and write the report."""
    m, entries = run_and_summarise(matrix_file, out, jobs, force)
    folder = out / m.name
    code = runner.EXIT_CRASH if any(e.status == "failed" for e in entries) else runner.EXIT_OK
    from .comparecmd import compare_folder
    from .report import build, markdown
    index = folder / "report" / "index.html"
    fresh = [e for e in entries if e.status == "ran" or (e.status == "unsupported" and not e.cached)]
    if not fresh and not force and (folder / "comparison.json").exists() and index.exists():
        # nothing changed since the last comparison: its verdicts stand (make-style)
        prev = json.loads((folder / "comparison.json").read_text())
        click.echo(markdown(folder, verbose).rstrip())
        click.echo("(nothing changed: comparison and report are up to date)")
        code = max(code, int(prev.get("exit_code", 0)))
    else:
        code = max(code, compare_folder(folder, reference=m.reference, k=m.envelope_k, fp64=m.envelope_fp64,
                                         verbose=verbose))
        index = build(folder, verbose=verbose)
    click.echo(f"report:  {index.resolve()}")
    click.echo(f"results: {folder.resolve()}")
    sys.exit(code)


@click.command("report")
@click.argument("folder", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("-v", "--verbose", is_flag=True, help="summary.md lists every pair without the reference.")
def report_cmd(folder: Path, verbose: bool) -> None:
    """Regenerate FOLDER/report/index.html and summary.md from existing results (no training)."""
    from .report import build, find_comparisons
    if not find_comparisons(folder):
        click.echo(f"duipai: error: {folder}: no comparison.json; run `duipai compare {folder}` first", err=True)
        sys.exit(runner.EXIT_BAD_INPUT)
    click.echo(str(build(folder, verbose=verbose).resolve()))


@click.command("selftest")
@click.option("--reduced", is_flag=True, help="The CI version: torch only, 40 steps, 9 faults and 3 variants.")
@click.option("--backends", default=None, help="Comma-separated backends (default: all six, or torch when reduced).")
@click.option("--faults", default=None,
              help="Comma-separated faults of `duipai faults` to inject (default: all, or the reduced set); "
                   "'none' for no fault.")
@click.option("--variants", default=None,
              help="Comma-separated drift-only variants (dp2, dp4, threads2, eager, xla, float64, channels_last, "
                   "onednn_off; default: all, or the reduced set); 'none' for no variant.")
@click.option("--steps", type=int, default=None, help="Steps per run (default 300, or 40 when reduced).")
@click.option("--out", type=click.Path(path_type=Path), default=Path("results"), show_default=True)
@click.option("-j", "--jobs", type=int, default=1, show_default=True)
def selftest_cmd(reduced: bool, backends: str | None, faults: str | None, variants: str | None, steps: int | None,
                 out: Path, jobs: int) -> None:
    """Inject every catalogued fault and run every drift-only variant; print and write the detection
    matrix (<out>/selftest*/selftest.md). Exit 1 if a fault is missed or a variant is called a BUG.

    \b
    Would it catch my bug on my machine?
      duipai selftest --backends jax --faults flatten_no_permute,maxpool_ceil --variants none -j 2"""
    from .selftest import DRIFT_VARIANTS, registered_backends, run_selftest
    from algorithms.faults import FAULTS

    def names(text: str | None, known, what: str) -> tuple[str, ...] | None:
        if text is None:
            return None
        got = tuple(x.strip() for x in text.split(",") if x.strip())
        if got == ("none",):
            return ()
        bad = [x for x in got if x not in known]
        if bad or not got:
            raise click.BadParameter(f"unknown {what} {', '.join(map(repr, bad)) or repr(text)}; known: {', '.join(known)}",
                                     param_hint=f"--{what}s")
        return got
    sys.exit(run_selftest(out, reduced=reduced, backends=names(backends, registered_backends(), "backend"),
                          faults=names(faults, tuple(FAULTS), "fault"),
                          variants=names(variants, tuple(DRIFT_VARIANTS), "variant"), steps=steps, jobs=jobs))
