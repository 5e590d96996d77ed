"""Step time of data-parallel runs (--devices 1, 2, 4) per backend, as ratios to dp=1.

For each backend that takes `--devices N` the harness trains cnn2d_2conv_2fc (momentum, S steps)
with N = 1, 2, 4 replicas, each run in its own process(es) through `runner.execute`; the device
counts are interleaved (1, 2, 4, 1, 2, 4, ... for R repeats) so that a drift of the machine's load
falls on every N alike. A backend that refuses data parallelism (UNSUPPORTED, exit 3) is recorded
as refused with its message, and not asked again.

Figures, each leaving out the first W=10 steps (tracing / compilation / first call):

  median   median over steps of steps.csv `step_time_s` (rank 0's / the one process's train_step,
           so it holds the gradient all-reduce and the wait for the slowest replica), then the
           median over the R runs; ratio = median(dp=N) / median(dp=1), per backend.
  p10      the same with each run's 10th percentile (on a loaded machine the median measures the
           load, the fast steps the step).
  wall     the whole process (launch, rendezvous, compilation, S steps, checkpoints): manifest wall_s.

On a 2-core machine N replicas share 2 cores: these ratios measure the overhead of the
data-parallel machinery (sharding, all-reduce, extra processes / logical devices), not a speed-up.

    python bench/bench_dp.py [--backends torch jax ...] [--steps 200] [--repeats 2] [--quick]

Writes bench/results/bench_dp.md and bench_dp.json (with --quick: bench/results/quick/).
"""
from __future__ import annotations

import argparse
import csv
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))
from algorithms.optim import HParams  # noqa: E402
from bench_step import machine, quantiles, versions  # noqa: E402
from harness import runner  # noqa: E402
from algorithms.contract import RunConfig  # noqa: E402
from harness.errors import BackendFailed, BadInput  # noqa: E402

RESULTS = HERE / "results"
DP_BACKENDS = ["torch", "tensorflow", "jax", "keras-jax", "keras-tensorflow"]
DEVICES = (1, 2, 4)
MODEL = "cnn2d_2conv_2fc"
WARMUP = 10


def git_state() -> dict:
    """The commit and the wrapper / harness files changed in the working tree (numbers are of those files)."""
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], capture_output=True, text=True, cwd=ROOT, timeout=10).stdout.rstrip()
        except (OSError, subprocess.SubprocessError):
            return ""
    dirty = [l[3:] for l in git("status", "--porcelain", "--untracked-files=no", "--", "wrappers", "algorithms",
                                 "harness").splitlines()]
    return {"commit": git("rev-parse", "--short", "HEAD").strip(), "dirty": dirty}


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def loadavg() -> list[float] | None:
    try:
        import os
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def run_one(backend: str, devices: int, steps: int, warmup: int, root: Path, name: str, timeout: float) -> dict:
    load = loadavg()
    t0 = time.time()
    folder = runner.execute(RunConfig(model=MODEL, backend=backend, devices=devices,
                                      hparams=HParams(steps=steps, optimizer="momentum", lr=0.05)),
                            root, name=name, timeout=timeout)
    took = time.time() - t0
    with open(folder / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    st = [float(r["step_time_s"]) for r in rows]
    man = json.loads((folder / "manifest.json").read_text())
    par = man.get("parallel", {})
    rec = {"devices": devices, "median_s": statistics.median(st[warmup:]), **quantiles(st[warmup:]),
           "train_wall_s": man.get("train_wall_s"), "wall_s": man.get("wall_s"), "process_wall_s": took,
           "last_loss": float(rows[-1]["loss"]), "loadavg_before": load,
           "layout": {"strategy": par.get("strategy"), "processes": par.get("processes"),
                      "launcher": par.get("launcher"), "hosts": par.get("hosts"),
                      "gradient_reduction": par.get("gradient_reduction"), "comm": par.get("backend"),
                      "devices": man.get("devices", [])}}
    shutil.rmtree(folder, ignore_errors=True)   # the throwaway run goes at once (root/.cache stays)
    return rec


def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarise(backend: str, runs: list[dict], refused: dict[int, str], failed: dict[int, str]) -> dict:
    row: dict = {"backend": backend, "per_devices": {}}
    for n in DEVICES:
        rs = [r for r in runs if r["devices"] == n]
        d: dict = {"runs": len(rs)}
        if n in refused:
            d["refused"] = refused[n]
        if n in failed:
            d["failed"] = failed[n]
        if rs:
            d.update({"median_s": med([r["median_s"] for r in rs]), "p10_s": med([r["p10_s"] for r in rs]),
                      "wall_s": med([r["wall_s"] for r in rs]), "layout": rs[0]["layout"],
                      "per_run_median_s": [r["median_s"] for r in rs]})
        row["per_devices"][n] = d
    base = row["per_devices"][1]
    for n in DEVICES[1:]:
        d = row["per_devices"][n]
        if base.get("median_s") and d.get("median_s"):
            d["ratio_median"] = d["median_s"] / base["median_s"]
            d["ratio_p10"] = d["p10_s"] / base["p10_s"]
            d["ratio_wall"] = d["wall_s"] / base["wall_s"]
            # the same ratio within each repeat (runs of one round, close in time): how much the load moved it
            by_rep = {(r["repeat"], r["devices"]): r for r in runs}
            d["per_repeat_ratio_median"] = [by_rep[(i, n)]["median_s"] / by_rep[(i, 1)]["median_s"]
                                            for i in sorted({r["repeat"] for r in runs})
                                            if (i, n) in by_rep and (i, 1) in by_rep]
    return row


def layout_text(lay: dict | None) -> str:
    if not lay:
        return "-"
    procs = lay.get("processes") or 1
    s = f"{lay.get('strategy')}, {procs} process{'es' if procs != 1 else ''}"
    if lay.get("launcher"):
        s += f" ({lay['launcher']}"
        s += f", {lay['comm']})" if lay.get("comm") else ")"
    s += f", {len(lay.get('devices') or [])} device(s)"
    return s


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.3f}"


def markdown(rows: list[dict], meta: dict) -> str:
    m = meta["machine"]
    la, lb = meta["loadavg_start"], meta["loadavg_end"]
    lines = ["## Data-parallel step time: dp=N against dp=1 (cnn2d_2conv_2fc)", "",
             f"{meta['date']}; {m['nproc']} CPUs (`nproc`), {m['platform']}; load average (1/5/15 min) "
             f"{' / '.join(f'{x:.2f}' for x in la) if la else '?'} at start, "
             f"{' / '.join(f'{x:.2f}' for x in lb) if lb else '?'} at end; {meta['duration_s']:.0f} s in all. "
             f"{meta['steps']} steps, momentum (lr 0.05), batch 64, one thread per process; device counts "
             f"interleaved 1, 2, 4 x {meta['repeats']} repeats per backend; first {meta['warmup']} steps left out."
             f"{' **Quick smoke run.**' if meta['quick'] else ''}", "",
             f"Command: `{meta['command']}`; commit {meta['git']['commit']}"
             + (f", working tree changes in {', '.join(meta['git']['dirty'])}" if meta['git']['dirty'] else "") + ".", "",
             "**On this 2-core machine the N replicas share two cores: the ratios measure the overhead of "
             "data parallelism (sharding, gradient all-reduce, extra processes or logical devices), not a "
             "speed-up.**", "",
             "| backend | dp=1 median (ms) | dp=2 median (ms) | dp=4 median (ms) | dp=2 / dp=1 | dp=4 / dp=1 | "
             "ratio per repeat | p10: dp=2 / dp=1 | p10: dp=4 / dp=1 | process wall: dp=2 / dp=1 | "
             "dp=4 / dp=1 |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    notes, layouts = [], []

    def rat(d: dict, k: str) -> str:
        if d.get("refused"):
            return "refused"
        if d.get("failed"):
            return "failed"
        return f"{d[k]:.2f}" if k in d else "-"

    def per_rep(pd_: dict) -> str:
        parts = [f"dp={n}: " + (", ".join(f"{x:.2f}" for x in pd_[n].get("per_repeat_ratio_median", [])) or "-")
                 for n in DEVICES[1:]]
        return "; ".join(parts)

    for r in rows:
        pd_ = r["per_devices"]
        if r.get("skipped"):
            lines.append(f"| {r['backend']} | skipped | | | | | | | | | |")
            notes.append(f"- **{r['backend']}** skipped: {r['skipped']}")
            continue
        cells = [ms(pd_[n].get("median_s")) if not (pd_[n].get("refused") or pd_[n].get("failed"))
                 else ("refused" if pd_[n].get("refused") else "failed") for n in DEVICES]
        lines.append(f"| {r['backend']} | {' | '.join(cells)} | {rat(pd_[2], 'ratio_median')} | "
                     f"{rat(pd_[4], 'ratio_median')} | {per_rep(pd_)} | {rat(pd_[2], 'ratio_p10')} | {rat(pd_[4], 'ratio_p10')} | "
                     f"{rat(pd_[2], 'ratio_wall')} | {rat(pd_[4], 'ratio_wall')} |")
        for n in DEVICES:
            if pd_[n].get("refused"):
                notes.append(f"- **{r['backend']}** dp={n} refused (UNSUPPORTED): {pd_[n]['refused']}")
            if pd_[n].get("failed"):
                notes.append(f"- **{r['backend']}** dp={n} failed: {pd_[n]['failed']}")
            if pd_[n].get("layout") and n > 1:
                layouts.append(f"- {r['backend']} dp={n}: {layout_text(pd_[n]['layout'])}")
    lines += ["", "Median: median over steps of steps.csv `step_time_s` (the train_step as timed in rank 0 / the "
              "one process: it holds the all-reduce and the wait for the slowest replica), then the median over the "
              "repeats; per repeat: the ratio of medians within each round of 1, 2, 4 (its spread shows what the "
              "load does to the figure). p10: the 10th percentile instead (the load-robust figure on a busy machine). Process wall: "
              "manifest `wall_s`, the whole run including launch, rendezvous and compilation."]
    if layouts:
        lines += ["", "Process layout (from the manifest's `parallel` and `devices`):", "", *layouts]
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", nargs="+", default=DP_BACKENDS, metavar="B", help=f"default: {' '.join(DP_BACKENDS)}")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 200; --quick 40)")
    ap.add_argument("--repeats", type=int, default=None, help="rounds of 1, 2, 4 per backend (default 2; --quick 1)")
    ap.add_argument("--warmup", type=int, default=WARMUP, help="first steps left out")
    ap.add_argument("--quick", action="store_true", help="fast smoke run: 40 steps, 1 repeat, results/quick/")
    ap.add_argument("--timeout", type=float, default=600.0, help="per run, seconds")
    ap.add_argument("--results", type=Path, default=None, help="output folder (default bench/results[/quick])")
    args = ap.parse_args(argv)
    steps = args.steps or (40 if args.quick else 200)
    repeats = args.repeats or (1 if args.quick else 2)
    out_dir = args.results or (RESULTS / "quick" if args.quick else RESULTS)
    if steps <= args.warmup + 1:
        ap.error(f"--steps must exceed --warmup ({args.warmup}) + 1")
    started = time.time()
    meta = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(),
            "versions": versions(), "git": git_state(), "uptime_start": uptime(), "loadavg_start": loadavg(),
            "steps": steps, "repeats": repeats, "warmup": args.warmup, "quick": args.quick, "model": MODEL,
            "devices": list(DEVICES),
            "command": " ".join(["python bench/bench_dp.py", *(argv if argv is not None else sys.argv[1:])])}
    info = runner.backend_info()
    skipped: dict[str, str] = {}
    for b in args.backends:
        if b not in info:
            ap.error(f"unknown backend {b!r}; known: {', '.join(info)}")
        if info[b]["missing"]:
            skipped[b] = f"not installed ({', '.join(info[b]['missing'])})"
    runs: dict[str, list[dict]] = {b: [] for b in args.backends}
    refused: dict[str, dict[int, str]] = {b: {} for b in args.backends}
    failed: dict[str, dict[int, str]] = {b: {} for b in args.backends}
    with tempfile.TemporaryDirectory(prefix="duipai-bench-dp-") as tmp:
        root = Path(tmp)
        for r in range(repeats):
            for b in args.backends:
                if b in skipped:
                    continue
                if r > 0 and all(n in refused[b] for n in DEVICES[1:]):
                    continue            # nothing to compare dp=1 with
                for n in DEVICES:
                    if n in refused[b] or n in failed[b]:
                        continue
                    try:
                        rec = run_one(b, n, steps, args.warmup, root, f"{b}-dp{n}-r{r}", args.timeout)
                    except BackendFailed as e:
                        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                        (refused if e.unsupported else failed)[b][n] = msg
                        print(f"bench_dp: {b} dp={n} {'refused' if e.unsupported else 'failed'}: {msg}",
                              file=sys.stderr, flush=True)
                        continue
                    except BadInput as e:
                        failed[b][n] = str(e)
                        print(f"bench_dp: {b} dp={n}: bad input: {e}", file=sys.stderr, flush=True)
                        continue
                    rec["repeat"] = r
                    runs[b].append(rec)
                    print(f"  {b:<17} dp={n} repeat {r + 1}/{repeats}: median {ms(rec['median_s'])} ms, "
                          f"p10 {ms(rec['p10_s'])} ms, wall {rec['wall_s']:.1f} s (load {rec['loadavg_before']})",
                          file=sys.stderr, flush=True)
    rows = []
    for b in args.backends:
        if b in skipped:
            rows.append({"backend": b, "skipped": skipped[b], "per_devices": {}})
        else:
            rows.append(summarise(b, runs[b], refused[b], failed[b]))
    meta.update({"uptime_end": uptime(), "loadavg_end": loadavg(), "duration_s": time.time() - started})
    text = markdown(rows, meta)
    print(text)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_dp.md").write_text(text)
    (out_dir / "bench_dp.json").write_text(json.dumps({**meta, "rows": rows, "runs": runs}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
