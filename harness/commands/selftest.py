"""`duipai selftest`: would the harness catch each catalogued bug, and call no drift a BUG?"""
from __future__ import annotations

import sys
from pathlib import Path

import click

from algorithms.faults import FAULTS
from algorithms.spec import model_names

from ..selftest import DRIFT_VARIANTS, REDUCED, SCENARIO_MODELS, registered_backends, run_selftest


@click.command("selftest")
@click.option("--reduced", is_flag=True,
              help=f"The CI version: the reference backend only, {REDUCED['steps']} steps, {len(REDUCED['faults'])} "
                   f"faults and {len(REDUCED['variants'])} variants.")
@click.option("--backends", default=None, help="Comma-separated backends (default: every registered one, or the reference when reduced).")
@click.option("--faults", default=None,
              help="Comma-separated faults of `duipai faults` to inject (default: all, or the reduced set); "
                   "'none' for no fault.")
@click.option("--variants", default=None,
              help="Comma-separated drift-only variants (dp2, dp4, threads2, eager, xla, float64, channels_last, "
                   "onednn_off; default: all, or the reduced set); 'none' for no variant.")
@click.option("--steps", type=int, default=None, help="Steps per run (default 300, or 40 when reduced).")
@click.option("--models", default=None,
              help="Comma-separated built-in models (or scenario models: " + ", ".join(SCENARIO_MODELS) + ") to "
                   "inject every fault into where it touches their layers (default: every built-in model and the "
                   "scenario models, or each fault's own model when reduced).")
@click.option("--out", type=click.Path(path_type=Path), default=Path("results"), show_default=True)
@click.option("-j", "--jobs", type=int, default=1, show_default=True)
@click.option("--timeout", type=click.FloatRange(min=1), default=900, show_default=True,
              help="Seconds each run or localization job may take (a loaded machine or the 32x32x3 models need more).")
def selftest_cmd(reduced: bool, backends: str | None, faults: str | None, variants: str | None, steps: int | None,
                 out: Path, jobs: int, models: str | None, timeout: float) -> None:
    """Inject every catalogued fault, run every drift-only variant and each backend's clean run of every
    model a fault ran on; print and write the detection matrix (<out>/selftest*/selftest.md). Exit 1 if a
    fault is missed or a clean run or variant is called a BUG.

    \b
    Would it catch my bug on my machine?
      duipai selftest --backends B --faults flatten_no_permute,maxpool_ceil --variants none -j 2"""
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
                          variants=names(variants, tuple(DRIFT_VARIANTS), "variant"), steps=steps, jobs=jobs,
                          timeout=timeout, models=names(models, tuple(model_names()) + SCENARIO_MODELS, "model")))
