"""What a backend process's start costs, with and without wrappers.worker.keep_to_own_framework.

Every run, probe and replay job is a process of its own (import isolation), so `make all` starts ~30 of them:
their start is a large part of its time. Keras' set_random_seed imports TensorFlow whatever Keras' backend,
TensorFlow loads Keras eagerly and Keras loads JAX and scikit-learn (with pandas and matplotlib);
keep_to_own_framework makes the frameworks a backend does not require unimportable in its process.

For every installed backend, side by side in one run (alternating, so that the machine's load hits both
alike): a fresh `python -c` sets the backend's environment as `python -m wrappers run` does, imports the
framework and builds the default model's Backend (whose construction seeds the framework), then prints what
it imported; timed from the process's start to its end, once with the block and once without.

    python bench/process_start.py [--repeats 3] [--name process_start]

Writes bench/results/<name>.md and .json with the load average before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SCRIPT = """
import json, sys
from algorithms.contract import RunOptions
from algorithms.optim import HParams
from algorithms.spec import load_model
from wrappers.__main__ import set_backend_env
from wrappers.registry import REGISTRY
from wrappers.worker import backend_class, imported_frameworks, keep_to_own_framework
entry = REGISTRY[sys.argv[1]]
opts = RunOptions(threads=1)
set_backend_env(entry, opts)
if sys.argv[2] == "block":
    keep_to_own_framework(entry)
cls = entry.load()
backend_class(cls, opts)(load_model("cnn2d_2conv_2fc"), HParams(), opts)
print(json.dumps(imported_frameworks()))
"""


def start(backend: str, mode: str) -> tuple[float, list[str]]:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", SCRIPT, backend, mode], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"{backend} ({mode}): exit {out.returncode}\n{out.stderr[-1500:]}")
    return wall, json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--name", default="process_start")
    args = ap.parse_args()
    info = json.loads(subprocess.run([sys.executable, "-m", "wrappers", "info"], cwd=ROOT, capture_output=True,
                                     text=True, check=True).stdout)
    backends = [b for b, i in info.items() if not i["missing"]]
    load_before = os.getloadavg()
    rows = []
    for b in backends:
        times = {"block": [], "all": []}
        imported = {}
        for _ in range(args.repeats):
            for mode in ("all", "block"):
                wall, imported[mode] = start(b, mode)
                times[mode].append(wall)
        med = {m: statistics.median(v) for m, v in times.items()}
        rows.append({"backend": b, "median_s_without": round(med["all"], 2), "median_s_with": round(med["block"], 2),
                     "saved_s": round(med["all"] - med["block"], 2), "ratio": round(med["block"] / med["all"], 2),
                     "imported_without": imported["all"], "imported_with": imported["block"],
                     "times": times})
        print(f"{b:<17} without {med['all']:5.2f} s  with {med['block']:5.2f} s  "
              f"imported without: {', '.join(imported['all'])}", file=sys.stderr)
    load_after = os.getloadavg()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit,
            "host": platform.node(), "cpus": os.cpu_count(), "load_before": load_before, "load_after": load_after,
            "repeats": args.repeats, "command": "python bench/process_start.py " + " ".join(sys.argv[1:])}
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [f"# A backend process's start, with and without keep_to_own_framework", "",
             f"`{meta['command']}` at {commit}, {meta['date']}, {meta['cpus']} CPUs, load average "
             f"{'/'.join(f'{x:.1f}' for x in load_before)} before, {'/'.join(f'{x:.1f}' for x in load_after)} after; "
             f"median of {args.repeats} starts each, alternating.", "",
             "| backend | without (s) | with (s) | saved (s) | with / without | imported without the block | with it |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['backend']} | {r['median_s_without']} | {r['median_s_with']} | {r['saved_s']} | {r['ratio']} | "
                     f"{', '.join(r['imported_without']) or '-'} | {', '.join(r['imported_with']) or '-'} |")
    (out / f"{args.name}.md").write_text("\n".join(lines) + "\n")
    print(f"written: {out / (args.name + '.md')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
