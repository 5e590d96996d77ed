"""`duipai matrix` and `duipai all`: make-style matrix runs, then the comparison of what ran."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from .. import matrix as M
from ..compare_runs import compare_folder
from ..errors import EXIT_CRASH, EXIT_OK, BadInput
from .common import fail, options, say


def _say_problems(entries: list[M.Entry]) -> None:
    for e in entries:
        if e.status in ("skipped", "unsupported", "failed"):
            tag = {"skipped": "SKIPPED", "unsupported": "UNSUPPORTED", "failed": "FAILED"}[e.status]
            say(f"{tag:<11} {e.name}: {e.message}" + (f" (log: {e.log})" if e.log else ""))


def run_and_summarise(matrix: str, out: Path, jobs: int, force: bool,
                      compares: bool = False) -> tuple[M.Matrix, list[M.Entry]]:
    """Load and run a matrix (bad input: exit 2); one line of counts and every problem on stderr. `compares`:
    the runs are compared with the reference's envelope afterwards, so a matrix without one is refused first."""
    try:
        m = M.load_matrix(matrix)
        if compares and m.envelope_k < 1:   # (duipai check's bitwise mode needs none)
            raise BadInput(f"matrix {m.source}: field 'envelope_k' must be >= 1 for `duipai all`, which compares every "
                           f"run with the reference's envelope, got {m.envelope_k}")
        entries = M.run_matrix(m, out, jobs, force=force)
    except BadInput as e:
        fail(str(e))
    counts = {s: sum(e.status == s for e in entries) for s in ("ran", "cached", "failed", "unsupported", "skipped")}
    say("runs: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n))
    _say_problems(entries)
    return m, entries


MATRIX_OPTS = [
    click.option("--out", type=click.Path(path_type=Path), default=Path("results"), show_default=True,
                 help="Results root; the matrix writes into <out>/<matrix name>/."),
    click.option("-j", "--jobs", type=int, default=1, show_default=True, help="Backend processes at once."),
    click.option("--force", is_flag=True, help="Rerun even the runs that are up to date."),
]


matrix_options = options(MATRIX_OPTS)   # the options of a matrix run


def _crash_code(entries: list[M.Entry]) -> int:
    return EXIT_CRASH if any(e.status == "failed" for e in entries) else EXIT_OK


@click.command("matrix")
@click.argument("matrix_file", default="default")
@matrix_options
def matrix_cmd(matrix_file: str, out: Path, jobs: int, force: bool) -> None:
    """Run a matrix file (TOML; a built-in name or a path). Up-to-date runs are reused."""
    m, entries = run_and_summarise(matrix_file, out, jobs, force)
    click.echo(f"results: {(out / m.name).resolve()}")
    sys.exit(_crash_code(entries))


@click.command("all")
@click.option("--matrix", "matrix_file", default="default", show_default=True, help="Matrix name or file.")
@matrix_options
@click.option("-v", "--verbose", is_flag=True,
              help="List every pair without the reference, not one line when they agree.")
def all_cmd(matrix_file: str, out: Path, jobs: int, force: bool, verbose: bool) -> None:
    """The main job: run the default matrix (every installed backend, the reference's ULP envelope),
    compare every run with the reference, and write the report."""
    from ..report import build, markdown   # pandas and matplotlib: only when a report is made
    m, entries = run_and_summarise(matrix_file, out, jobs, force, compares=True)
    folder = out / m.name
    code = _crash_code(entries)
    index = folder / "report" / "index.html"
    fresh = [e for e in entries if e.status == "ran" or (e.status == "unsupported" and not e.cached)]
    if not fresh and not force and (folder / "comparison.json").exists() and index.exists():
        # nothing changed since the last comparison: its verdicts stand (make-style)
        prev = json.loads((folder / "comparison.json").read_text())
        click.echo(markdown(folder, verbose).rstrip())
        click.echo("(nothing changed: comparison and report are up to date)")
        code = max(code, int(prev.get("exit_code", 0)))
    else:
        arbiter, why_not = M.arbiter_of(m)
        if why_not:
            say(f"WARNING: {why_not}")
        code = max(code, compare_folder(folder, reference=m.reference, k=m.envelope_k, fp64=m.envelope_fp64,
                                         verbose=verbose, arbiter=arbiter, jobs=jobs, log=say))
        index = build(folder, verbose=verbose)
    click.echo(f"report:  {index.resolve()}")
    click.echo(f"results: {folder.resolve()}")
    sys.exit(code)
