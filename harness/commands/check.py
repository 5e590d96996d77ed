"""`duipai check` and `duipai baseline save|show`: rerun a matrix (the CI matrix by default) and compare
every run with its committed golden baseline (the work: harness/check.py)."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import NoReturn

import click

from .. import matrix as M
from ..baseline_set import BASELINES_DIR, load_set, rel_path, set_folder
from ..check import Saved, check_baselines, update_baselines
from ..errors import BadInput
from ..files import atomic_write_text
from .common import SECONDS, fail, options, say

COMMON = [
    click.option("--matrix", "matrix_file", default="ci", show_default=True,
                 help="Matrix name (harness/matrices/NAME.toml) or file."),
    click.option("--baselines", type=click.Path(path_type=Path), default=BASELINES_DIR, show_default=True,
                 help="Baselines root; the set is <baselines>/<matrix name>/."),
    click.option("--out", type=click.Path(path_type=Path), default=Path("results"), show_default=True,
                 help="Results root; the runs go to <out>/<matrix name>/runs/."),
    click.option("-j", "--jobs", type=int, default=1, show_default=True, help="Backend processes at once."),
    click.option("--reuse", is_flag=True, help="Reuse up-to-date runs (same run key) instead of rerunning them."),
]


common = options(COMMON)   # the options of check and baseline save


def _print_saved(saved: Saved) -> NoReturn:
    for line in saved.lines:
        click.echo(line)
    sys.exit(saved.code)


@click.command("check")
@common
@click.option("--update", is_flag=True, help="Rerun and regenerate the baselines; print what changed.")
@click.option("--mode", type=click.Choice(["auto", "bitwise", "envelope"]), default="auto", show_default=True,
              help="auto: bitwise when the fingerprint and versions match the baseline's, else envelope.")
@click.option("--fault", multiple=True, metavar="BACKEND:FAULT",
              help="Inject a catalogued bug into BACKEND's runs (a demonstration: the check must fail).")
@click.option("--junit", "junit_path", type=click.Path(path_type=Path), default=None, help="Write JUnit XML here.")
@click.option("--summary", "summary_path", type=click.Path(path_type=Path), default=None,
              help="Write the Markdown summary here (it is printed too).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of the summary.")
@click.option("--no-localize", is_flag=True, help="Do not run probe jobs to localize a regression.")
@click.option("--allow-drift", is_flag=True,
              help="Bitwise mode: a bit-level change that the envelope calls drift is reported in the summary but "
                   "passes (a gate for real regressions only); without it any changed bit fails.")
@click.option("--timeout", type=SECONDS, default=None, help="Kill a localization job after this many seconds.")
def check_cmd(matrix_file: str, baselines: Path, out: Path, jobs: int, reuse: bool, update: bool, mode: str,
              fault: tuple[str, ...], junit_path: Path | None, summary_path: Path | None, as_json: bool,
              no_localize: bool, timeout: float | None, allow_drift: bool) -> None:
    """Rerun a matrix (the CI matrix by default) and compare every run with its golden baseline.

    \b
    Exit 0: every run matches its baseline; 1: a numerical regression; 2: bad input (a missing,
    corrupt or stale baseline, a bad matrix: nothing is run); 3: a backend crashed or was killed.
    Writes <out>/<matrix>/check/{summary.md,junit.xml,check.json}.
    \b
    Examples:
      duipai check -j 2                          the CI matrix against results/baselines/ci/
      duipai check --junit report.xml            and JUnit XML for the CI server
      duipai check --fault B:flatten_no_permute     a demonstration (backend B): exit 1, the BUG localized
      duipai check --update                      rerun, rewrite the baselines, print what changed
    """
    if update:
        try:
            saved = update_baselines(matrix_file=matrix_file, baselines=baselines, out=out, jobs=jobs, reuse=reuse,
                                     fault=fault, log=say)
        except BadInput as e:
            fail(str(e))
        _print_saved(saved)
    try:
        c = check_baselines(matrix_file=matrix_file, baselines=baselines, out=out, jobs=jobs, reuse=reuse, mode=mode,
                            fault=fault, localize=not no_localize, timeout=timeout, allow_drift=allow_drift, log=say)
    except BadInput as e:
        fail(str(e))
    if summary_path:
        atomic_write_text(summary_path, c.markdown)
    if junit_path:
        atomic_write_text(junit_path, c.junit)
    if as_json:
        click.echo(json.dumps(c.doc, default=str))
    else:
        click.echo(c.markdown.rstrip())
        d = c.check_dir
        click.echo(f"\nwritten: {d / 'summary.md'}, {d / 'junit.xml'}, {d / 'check.json'}"
                   + "".join(f", {p}" for p in (summary_path, junit_path) if p))
    sys.exit(c.code)


@click.group("baseline")
def baseline_group() -> None:
    """Golden baselines of a matrix (results/baselines/<matrix>/): save, show."""


@baseline_group.command("save")
@common
def baseline_save(matrix_file: str, baselines: Path, out: Path, jobs: int, reuse: bool) -> None:
    """Run the matrix and store every run's curves (exact floats), configuration and platform
    fingerprint as its baseline; print what changed against the previous baselines."""
    try:
        saved = update_baselines(matrix_file=matrix_file, baselines=baselines, out=out, jobs=jobs, reuse=reuse, log=say)
    except BadInput as e:
        fail(str(e))
    _print_saved(saved)


@baseline_group.command("show")
@click.option("--matrix", "matrix_file", default="ci", show_default=True)
@click.option("--baselines", type=click.Path(path_type=Path), default=BASELINES_DIR, show_default=True)
def baseline_show(matrix_file: str, baselines: Path) -> None:
    """Validate a baseline set (every file's SHA-256) and list its runs and fingerprint."""
    name = Path(matrix_file).stem if Path(matrix_file).suffix else matrix_file
    try:
        m = M.load_matrix(matrix_file)
        name = m.name
    except BadInput:
        pass
    try:
        bs, _ = load_set(set_folder(baselines, name))
    except BadInput as e:
        fail(str(e))
    click.echo(f"{rel_path(bs.folder)}: matrix {bs.index['matrix']['name']}, saved {bs.index.get('created')}, "
               f"{len(bs.runs)} runs, every file's sha256 verified")
    click.echo("platform: " + json.dumps(bs.index.get("platform")))
    for n, b in bs.runs.items():
        v = ", ".join(f"{k} {x}" for k, x in b.fingerprint["run"].get("versions", {}).items())
        click.echo(f"  {n:<62} {b.doc.get('role', ''):<9} {v}")
    for n, msg in bs.unsupported.items():
        click.echo(f"  {n:<62} refused: {msg}")
