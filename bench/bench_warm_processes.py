"""Warm backend processes against a process per job, side by side: `duipai all` on a matrix, alternating.

    python bench/bench_warm_processes.py [--matrix default] [--matrix residual] [--repeats 1] [-j 2]

Each repeat runs `duipai all --matrix M -j J` twice into empty folders: once with DUIPAI_FRESH_PROCESSES=1
(a process per job, as before harness/worker_pool.py), once with the harness's warm processes; which goes
first alternates. Recorded: wall time, CPU time of every process (user + system, load-independent), jobs
that ran in a warm process, and whether the two give the same results bit for bit (every value column of
steps.csv and eval.csv, every .npz array of the runs and their probe and replay jobs; the step times and
the folders' random suffixes aside). Writes bench/results/bench_warm_processes.{md,json} (or --results-name).
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from algorithms.params import load_npz  # noqa: E402

TIME_COLUMNS = {"step_time_s"}


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def duipai_all(matrix: str, jobs: int, out: Path, fresh: bool) -> dict:
    env = {**os.environ, "DUIPAI_FRESH_PROCESSES": "1" if fresh else "0"}
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.time()
    r = subprocess.run([sys.executable, "-m", "harness.cli", "all", "--matrix", matrix, "-j", str(jobs),
                        "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True)
    wall, after = time.time() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise SystemExit(f"duipai all --matrix {matrix} exited {r.returncode}:\n{r.stderr[-2000:]}")
    manifests = [json.loads(p.read_text()) for p in out.rglob("manifest.json")]
    warm = sum(1 for m in manifests if (m.get("process") or {}).get("jobs_before", 0) > 0)
    return {"wall_s": round(wall, 1), "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1),
            "jobs": len(manifests), "jobs_in_a_warm_process": warm}


def digest(folder: Path) -> str:
    """What a run or job folder computed, as one hash: every CSV's value columns and every .npz array, by
    file name (manifests, logs and step times aside)."""
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.suffix == ".csv":
            rows = list(csv.reader(open(p)))
            keep = [i for i, c in enumerate(rows[0]) if c not in TIME_COLUMNS] if rows else []
            h.update(p.name.encode() + repr([[r[i] for i in keep if i < len(r)] for r in rows]).encode())
        elif p.suffix == ".npz":
            arrays = load_npz(p)
            for k in sorted(arrays):
                h.update(f"{p.relative_to(folder)}:{k}:{arrays[k].dtype}:{arrays[k].shape}".encode())
                h.update(np.ascontiguousarray(arrays[k]).tobytes())
    return h.hexdigest()


def differences(a: Path, b: Path) -> list[str]:
    """Runs (by name) whose values differ, and the probe and replay jobs (.localize; their folder names hash
    absolute paths) that one tree has and the other has not, compared as multisets of digests."""
    def runs(root: Path) -> dict[str, str]:
        return {d.name: digest(d) for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")}

    def jobs(root: Path) -> list[str]:
        return sorted(digest(d) for d in (root / ".localize").glob("*") if d.is_dir())
    ra, rb = runs(a), runs(b)
    bad = sorted(k for k in set(ra) | set(rb) if ra.get(k) != rb.get(k))
    ja, jb = jobs(a), jobs(b)
    if ja != jb:
        bad.append(f".localize: {len(ja)} and {len(jb)} jobs, {len(set(ja) ^ set(jb))} digests on one side only")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--matrix", action="append", help="matrix name or file (repeatable; default: default)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("-j", "--jobs", type=int, default=2)
    ap.add_argument("--results-name", default="bench_warm_processes")
    a = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    rows = []
    for matrix in a.matrix or ["default"]:
        for rep in range(a.repeats):
            with tempfile.TemporaryDirectory(prefix="duipai-warm-") as tmp:
                got = {}
                for fresh in ([True, False] if rep % 2 == 0 else [False, True]):
                    kind = "fresh" if fresh else "warm"
                    l0 = load()
                    got[kind] = duipai_all(matrix, a.jobs, Path(tmp) / kind, fresh) | {"load_before": l0, "load_after": load()}
                    print(f"{matrix} #{rep} {kind}: {got[kind]}", flush=True)
                name = Path(matrix).stem
                differ = differences(Path(tmp) / "fresh" / name / "runs", Path(tmp) / "warm" / name / "runs")
                rows.append({"matrix": matrix, "repeat": rep, **{f"{k}_{f}": v for k in got for f, v in got[k].items()},
                             "wall_ratio": round(got["warm"]["wall_s"] / got["fresh"]["wall_s"], 2),
                             "cpu_ratio": round(got["warm"]["cpu_s"] / got["fresh"]["cpu_s"], 2),
                             "files_that_differ": differ})
                print(f"  differ: {differ or 'none'}", flush=True)
    doc = {"when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit,
           "host": f"{platform.node()}, {os.cpu_count()} CPUs, {platform.platform()}", "jobs": a.jobs, "rows": rows}
    res = ROOT / "bench" / "results"
    (res / f"{a.results_name}.json").write_text(json.dumps(doc, indent=2))
    lines = ["# Warm backend processes against a process per job (`python bench/bench_warm_processes.py`)", "",
             f"finished {doc['when']}, commit {commit}, {doc['host']}; `duipai all --matrix M -j {a.jobs}`, the two alternating.", "",
             "| matrix | # | fresh wall s | warm wall s | wall ratio | fresh CPU s | warm CPU s | CPU ratio | jobs | in a warm process | load before (fresh / warm) | values differ |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['matrix']} | {r['repeat']} | {r['fresh_wall_s']} | {r['warm_wall_s']} | **{r['wall_ratio']}** | "
                     f"{r['fresh_cpu_s']} | {r['warm_cpu_s']} | **{r['cpu_ratio']}** | {r['warm_jobs']} | "
                     f"{r['warm_jobs_in_a_warm_process']} | {r['fresh_load_before']} / {r['warm_load_before']} | "
                     f"{', '.join(r['files_that_differ']) or 'none'} |")
    (res / f"{a.results_name}.md").write_text("\n".join(lines) + "\n")
    return 1 if any(r["files_that_differ"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
