"""`duipai all`: every installed backend on the default model and data; the skipped ones said loudly."""
from __future__ import annotations

import sys
from pathlib import Path

import click
import pandas as pd

from . import runner
from .runner import BackendFailed, BadInput, RunConfig

DEFAULT_BACKENDS = ("torch", "jax", "tensorflow", "keras-tensorflow", "keras-jax", "keras-torch")


@click.command("all")
@click.option("--model", "-m", default="cnn2d_2conv_2fc", show_default=True)
@click.option("--data", default="digits", show_default=True)
@click.option("--steps", type=int, default=300, show_default=True)
@click.option("--backends", default=",".join(DEFAULT_BACKENDS), show_default=True,
              help="Comma-separated backend configurations.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("results"), show_default=True)
def all_cmd(model: str, data: str, steps: int, backends: str, out: Path) -> None:
    """Run every installed backend on one model and data, each in its own process, and summarise."""
    from algorithms.optim import HParams
    hp = HParams(steps=steps, eval_every=min(50, steps), checkpoint_every=min(50, steps))
    info = runner.backend_info()
    done: dict[str, Path] = {}
    problems: list[str] = []
    for b in [x.strip() for x in backends.split(",") if x.strip()]:
        if b not in info:
            click.echo(f"duipai: error: unknown backend {b!r}; known: {', '.join(info)}", err=True)
            sys.exit(runner.EXIT_BAD_INPUT)
        if info[b]["missing"]:
            msg = f"SKIPPED {b}: package(s) not installed: {', '.join(info[b]['missing'])}"
            click.echo(msg, err=True)
            problems.append(msg)
            continue
        cfg = RunConfig(model=model, backend=b, hparams=hp, data=data)
        try:
            done[b] = runner.execute(cfg, out)
            click.echo(f"ran {b:<18} -> {done[b]}", err=True)
        except BadInput as e:
            click.echo(f"duipai: error: {e}", err=True)
            sys.exit(runner.EXIT_BAD_INPUT)
        except BackendFailed as e:
            msg = f"{'UNSUPPORTED' if e.unsupported else 'FAILED'} {b}: {e}"
            click.echo(msg, err=True)
            problems.append(msg)
    if not done:
        click.echo("duipai: error: no backend ran", err=True)
        sys.exit(runner.EXIT_CRASH)
    rows = []
    ref = next(iter(done.values()))
    ref_loss = pd.read_csv(ref / "steps.csv")["loss"].to_numpy()
    for b, folder in done.items():
        s = pd.read_csv(folder / "steps.csv")
        e = pd.read_csv(folder / "eval.csv")
        rows.append({"backend": b, "final_loss": s["loss"].iloc[-1], "eval_acc": e["eval_accuracy"].iloc[-1],
                     f"max|loss-{next(iter(done))}|": float(abs(s["loss"].to_numpy() - ref_loss).max()),
                     "median_step_ms": 1e3 * s["step_time_s"].median(), "folder": str(folder)})
    table = pd.DataFrame(rows)
    click.echo(table.to_string(index=False))
    click.echo(f"\nresults: {out.resolve()}")
    for p in problems:
        click.echo(p)
    sys.exit(runner.EXIT_CRASH if any(p.startswith("FAILED") for p in problems) else runner.EXIT_OK)
