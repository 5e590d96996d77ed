"""`duipai report`: the HTML report and summary.md of existing results (no training)."""
from __future__ import annotations

from pathlib import Path

import click

from .common import fail


@click.command("report")
@click.argument("folder", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("-v", "--verbose", is_flag=True, help="summary.md lists every pair without the reference.")
def report_cmd(folder: Path, verbose: bool) -> None:
    """Regenerate FOLDER/report/index.html and summary.md from existing results (no training)."""
    from ..errors import BadInput
    from ..report import build, find_comparisons   # pandas and matplotlib: only here
    if not find_comparisons(folder):
        fail(f"{folder}: no comparison.json; run `duipai compare {folder}` first")
    try:
        click.echo(str(build(folder, verbose=verbose).resolve()))
    except BadInput as e:
        fail(str(e))
