"""`duipai compare`: the verdict on runs of one configuration by several backends (harness/compare_runs.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from ..compare_runs import DEFAULT_METRICS, DEFAULT_RESYNC_EVERY, compare_runs, compare_seeds, parse_ints
from ..defaults import REFERENCE
from ..errors import EXIT_CRASH, BackendFailed, BadInput
from .common import SECONDS, fail, say

EPILOG = """\b
Verdicts: IDENTICAL (bitwise), DRIFT (inside the envelope, or outside it while every step from a
shared state agrees), BUG (first divergent step, series, factor over the envelope, or a resynced step
that disagrees; localized), DECLARED (a declared difference explains it, verified), INCONCLUSIVE (no
deterministic comparison: framework-RNG dropout, or no resync made). Exit 0: no BUG; 1: a BUG; 2: bad input; 3: a backend
failed. The rule is in docs/verdict.md.
\b
Examples:
  duipai compare results/                       every comparable group of runs in a results folder
  duipai compare results/A results/B results/C  these runs, against the reference backend
  duipai compare --stat --seeds 0,1,2,3,4 results/A results/B   Welch t-test over 5 seeds each
"""


@click.command("compare", epilog=EPILOG)
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path))
@click.option("--reference", "-r", default=REFERENCE, show_default=True,
              help="Reference: a backend name or a run folder name.")
@click.option("-k", "--k", "k", type=int, default=3, show_default=True,
              help="Envelope runs of the reference (--perturb-ulp 1..k), trained on demand and cached.")
@click.option("--envelope", "envelope_paths", multiple=True, type=click.Path(path_type=Path),
              help="Use these run folders as the envelope instead of training them (repeatable).")
@click.option("--no-fp64", is_flag=True, help="Leave the float64 run out of the envelope (1-ULP runs only).")
@click.option("--margin", type=float, default=None, help="Override the margin over the envelope (default 3).")
@click.option("--force", is_flag=True, help="Compare runs of different configurations anyway (said in every output).")
@click.option("--no-localize", is_flag=True,
              help="Do not run probe/replay jobs to localize a BUG (nor the shared-state step comparison).")
@click.option("--resync-every", "resync_every", type=int, default=DEFAULT_RESYNC_EVERY, show_default=True,
              help="Compare one step of every candidate from the reference's state every K steps "
                   "(its checkpoints, re-trained in between when finer; a run with fewer than 8 such steps "
                   "gets 8); 0: off.")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Folder for comparison.csv/.json (default: next to the runs).")
@click.option("--steps-csv/--no-steps-csv", "steps_csv", default=None,
              help="Write comparison-steps.csv (every per-step number; default: for runs up to 100,000 steps).")
@click.option("--json", "as_json", is_flag=True, help="Print comparison.json on stdout instead of the table.")
@click.option("-v", "--verbose", is_flag=True,
              help="List every pair without the reference, not one line when they agree.")
@click.option("--timeout", type=SECONDS, default=None, help="Kill a backend job (envelope, probe, replay) after this many s.")
@click.option("-j", "--jobs", type=int, default=1, show_default=True,
              help="Backend processes at once (envelope runs; resync and localization jobs of the candidates).")
@click.option("--arbiter", default=None, metavar="BACKEND",
              help="Probe this backend in float64 on every BUG: which side the exact computation supports.")
@click.option("--no-auto-stat", "no_auto_stat", is_flag=True,
              help="Leave framework-RNG dropout pairs INCONCLUSIVE instead of training seeds to decide them.")
@click.option("--stat", is_flag=True, help="Statistical mode: groups of seeds, Welch t-test per metric and step.")
@click.option("--seeds", default=None, help="--stat: train these data-order seeds for every group (e.g. 0,1,2,3,4).")
@click.option("--at", "at", default=None, help="--stat: steps to compare (default: the last evaluation).")
@click.option("--metrics", default=DEFAULT_METRICS, show_default=True, help="--stat: series compared.")
@click.option("--alpha", type=float, default=0.05, show_default=True, help="--stat: significance level (Bonferroni).")
def compare_cmd(paths: tuple[Path, ...], reference: str, k: int, envelope_paths: tuple[Path, ...], no_fp64: bool,
                margin: float | None, force: bool, no_localize: bool, out: Path | None, steps_csv: bool | None,
                as_json: bool, timeout: float | None, stat: bool, seeds: str | None, at: str | None,
                metrics: str, alpha: float, verbose: bool, resync_every: int, arbiter: str | None,
                jobs: int, no_auto_stat: bool) -> None:
    """Compare runs of one configuration: IDENTICAL / DRIFT / BUG / DECLARED / INCONCLUSIVE per
    candidate against the reference's calibrated 1-ULP envelope; a BUG is localized to a stage,
    layer and parameter. PATHS: run folders, or one results folder."""
    try:
        if jobs < 1:
            raise BadInput(f"--jobs must be >= 1, got {jobs}")
        if stat:
            if arbiter:
                raise BadInput("--arbiter judges the lock-step comparison's BUGs, not --stat")
            if k < 1:
                raise BadInput(f"-k must be >= 1, got {k}")
            outcome = compare_seeds(paths=paths, reference=reference, force=force, seeds=parse_ints(seeds, "--seeds"),
                                    at=parse_ints(at, "--at"), metrics=metrics, alpha=alpha, timeout=timeout, out=out,
                                    log=say)
        else:
            outcome = compare_runs(paths=paths, reference=reference, k=k, envelope_paths=envelope_paths,
                                   fp64=not no_fp64, margin=margin, force=force, localize=not no_localize, out=out,
                                   steps_csv=steps_csv, timeout=timeout, verbose=verbose,
                                   resync_every=resync_every, arbiter=arbiter, jobs=jobs,
                                   auto_stat=not no_auto_stat, log=say)
    except BadInput as e:
        fail(str(e))
    except BackendFailed as e:
        fail(str(e), EXIT_CRASH)
    if as_json:
        click.echo(outcome.json_text)
    else:
        click.echo(outcome.text)
        click.echo("\nwritten: " + ", ".join(str(p) for p in outcome.written.values()))
    sys.exit(outcome.code)
