"""How far a clean run's self-replay rows are from the run's own, per series: the data behind
harness/self_replay.py's RELOAD_TOL (the update and parameter norms of an inexact load's first row) and its
rule that only what the run reports carries state when those norms stay the run's.

    python bench/self_replay_rows.py /tmp/fa27 /tmp/fa27b ...

walks each folder for the self-replay jobs the comparisons left (`.localize/replay__<run>__...__self-...`),
reads each job's replayed rows and the run's steps.csv, and prints, per (load exact?, first row of a
stretch?, series), the number of rows, the largest relative difference, its 99th percentile and the share
that is bit-equal."""
from __future__ import annotations

import argparse
import csv
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

SERIES = ("loss", "accuracy", "grad_norm", "update_norm", "param_norm")   # a replayed row after its step


def rows_of(job: Path) -> tuple[bool, list[tuple[bool, str, float]]] | None:
    """(the load was exact, [(first row of its stretch, series, relative difference)]) of one self-replay job."""
    worker = job / "worker.json"
    run = job.parent.parent / job.name.split("__self-")[0].removeprefix("replay__").rsplit("__", 1)[0] / "steps.csv"
    if not worker.is_file() or not run.is_file():
        return None
    w = json.loads(worker.read_text())
    own = {int(r["step"]): r for r in csv.DictReader(run.open())}
    out, prev = [], None
    for row in w.get("replayed") or []:
        step = int(row[0])
        first, prev = prev is None or step != prev + 1, step
        for s, b in zip(SERIES, row[1:6]):
            a = float(own[step][s])
            out.append((first, s, abs(a - b) / max(abs(a), abs(b), 1e-30) if a != b else 0.0))
    return bool(w.get("reload_exact", True)), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path)
    a = ap.parse_args()
    stats: dict[tuple[bool, bool, str], list[float]] = defaultdict(list)
    jobs = 0
    for folder in a.folders:
        for job in sorted(folder.glob("**/.localize/replay__*__self-*")):
            got = rows_of(job)
            if got is None:
                continue
            jobs += 1
            exact, rows = got
            for first, s, rel in rows:
                stats[(exact, first, s)].append(rel)
    print(f"{jobs} self-replay jobs")
    print("| load | row | series | rows | max rel | p99 rel | bit-equal |\n|---|---|---|---:|---:|---:|---:|")
    for (exact, first, s), v in sorted(stats.items()):
        x = np.asarray(v)
        print(f"| {'exact' if exact else 'inexact'} | {'first' if first else 'later'} | {s} | {len(x)} | "
              f"{x.max():.3g} | {np.quantile(x, 0.99):.3g} | {np.mean(x == 0):.3f} |")


if __name__ == "__main__":
    main()
