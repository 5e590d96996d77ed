"""`duipai models`, `duipai backends`, `duipai faults`: what there is to run."""
from __future__ import annotations

import json

import click

from algorithms.faults import FAULTS
from algorithms.spec import BASE_LAYER_KINDS

from ..runner import backend_info
from .common import fail

@click.command()
@click.option("--show", default=None, help="Print one model's layers, shapes and parameters.")
def models(show: str | None) -> None:
    """List the built-in models, or show one."""
    from algorithms.spec import SpecError, load_model, model_names, summary
    if show:
        try:
            click.echo(summary(load_model(show)))
        except SpecError as e:
            fail(str(e))
        return
    for n in model_names():
        m = load_model(n)
        click.echo(f"{n:<20} {m.description}")


@click.command()
@click.option("--json", "as_json", is_flag=True)
def backends(as_json: bool) -> None:
    """The backend configurations, whether their frameworks are installed, and what each declares it can do
    (capabilities and the catalogued faults its wrapper implements)."""
    info = backend_info()
    if as_json:
        click.echo(json.dumps(info))
        return
    for n, i in info.items():
        state = "installed" if not i["missing"] else f"MISSING {', '.join(i['missing'])}"
        click.echo(f"{n:<18} {state:<28} {i['description']}")
        click.echo(f"{'':<18} can: {', '.join(i['capabilities']) or '-'}; faults: {len(i['faults'])}"
                   + (f"; as a reference computes: {', '.join(i['emulations'])}" if i.get("emulations") else ""))
        kinds = set(i.get("layer_kinds", ()))
        beyond = sorted(kinds - BASE_LAYER_KINDS)
        click.echo(f"{'':<18} lowers: the straight-line kinds" + (f" + {', '.join(beyond)}" if beyond else
                                                                 " only (no graph models)"))


@click.command()
def faults() -> None:
    """The catalogue of injectable bugs (`--fault NAME`)."""
    for f in FAULTS.values():
        click.echo(f"{f.name:<24} [{f.stage}] {f.practice}")
