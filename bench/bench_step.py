"""Step time of the harness against a minimal hand-written loop, per backend, measured side by side.

For each backend the harness run (`runner.execute`, its own worker process) and the hand loop of
the same framework (bench/hand_loops/*.py, its own process) train the default model
cnn2d_2conv_2fc (or `--model resnet_tiny`, 32x32x3, with the hand-written ResNets
bench/hand_loops/resnet_*.py) on the same data, batch order and initial weights for S steps; the two alternate,
R pairs per backend (the first of each pair alternates too), so that the noise of a shared machine
falls on both sides. Absolute times on such a machine mean little; the target is the ratio.

Figures, each leaving out the first W=10 steps (tracing / compilation / first call) on both sides:

  per-step    median over steps of one run's step time, then the median over the R runs.
              harness: steps.csv `step_time_s` (the backend's train_step: input conversion, the
              step, the statistics, the sync); hand loop: one loop iteration (batch, step, log).
  p10         the same with the 10th percentile of each run's step times instead of the median:
              on a loaded machine the scheduler stretches a share of the steps, the median then
              measures the load, the fast steps still measure the step (the ratio to read there).
  whole-loop  the training loop's wall time per step: harness worker.json `train_wall_s` less the
              first W steps' step_time_s, over S - W (so it includes the harness's batch gather,
              dropout masks, checksum, CSV rows, checkpoints and evaluations every 50 steps);
              hand loop: wall time of steps W..S over S - W, with its own evaluations of the test
              set every 50 steps (the same work: the evaluation is the user's, not the harness's).
  ratio       harness / hand (target <= 1.10 per step, <= 1.15 whole-loop).

    python bench/bench_step.py [--backends torch jax ...] [--steps 400] [--repeats 3] [--quick]

Then, per backend, bench/step_breakdown.py runs the harness's train_step and the hand-written step
interleaved in blocks inside one process (the most load-robust figure; --interleaved-rounds 0 skips it).

Writes bench/results/bench_step.md and bench_step.json (with --quick: bench/results/quick/; another model:
bench_step-<model>.md/.json). The interleaved comparison has its variants for the default model only.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from algorithms.optim import HParams  # noqa: E402
from harness import runner  # noqa: E402
from algorithms.contract import RunConfig  # noqa: E402
from harness.errors import BackendFailed, BadInput  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
ALL_BACKENDS = ["torch", "jax", "tensorflow", "keras-tensorflow", "keras-jax", "keras-torch"]
TARGET = 1.10        # per step (median, p10, interleaved): harness / hand
TARGET_LOOP = 1.15   # whole loop
WARMUP = 10
SLOW = 1.2           # a run whose median step exceeds its side's fastest run's by this factor is counted slow
DEFAULT_MODEL = "cnn2d_2conv_2fc"
HAND_SCRIPT_PREFIX = {DEFAULT_MODEL: "", "resnet_tiny": "resnet_"}   # bench/hand_loops/<prefix><framework>.py


def hand_command(backend: str, steps: int, warmup: int, model: str = DEFAULT_MODEL) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    prefix = HAND_SCRIPT_PREFIX[model]
    if backend.startswith("keras-"):
        script, env["KERAS_BACKEND"] = f"{prefix}keras.py", backend.split("-", 1)[1]
    else:
        script = f"{prefix}{backend}.py"
    # -P: the script's folder (bench/hand_loops, holding torch.py, jax.py, ...) never goes on sys.path
    return [sys.executable, "-P", str(HERE / "hand_loops" / script), "--steps", str(steps),
            "--warmup", str(warmup)], env


def run_hand(backend: str, steps: int, warmup: int, timeout: float, model: str = DEFAULT_MODEL) -> dict:
    cmd, env = hand_command(backend, steps, warmup, model)
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    if r.returncode != 0:
        tail = "\n".join("    " + l for l in r.stderr.strip().splitlines()[-6:])
        raise RuntimeError(f"hand loop {backend} exited with code {r.returncode}\n{tail}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return {"per_step_s": out["median_step_s"], **quantiles(out["step_times_s"]),
            "whole_loop_s": out["wall_s"] / out["steps"], "process_wall_s": time.time() - t0,
            "whole_loop_no_eval_s": (out["wall_s"] - out.get("eval_s", 0.0)) / out["steps"],
            "first_loss": out.get("first_loss"), "last_loss": out.get("last_loss")}


def run_harness(backend: str, steps: int, warmup: int, root: Path, name: str, timeout: float,
                model: str = DEFAULT_MODEL) -> dict:
    t0 = time.time()
    folder = runner.execute(RunConfig(backend=backend, model=model, hparams=HParams(steps=steps)), root, name=name,
                            timeout=timeout)
    with open(folder / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    st = [float(r["step_time_s"]) for r in rows]
    worker = json.loads((folder / "worker.json").read_text())
    wall = float(worker["train_wall_s"])
    periodic = worker.get("train_eval_checkpoint_s")
    return {"per_step_s": statistics.median(st[warmup:]), **quantiles(st[warmup:]),
            "whole_loop_s": (wall - sum(st[:warmup])) / (steps - warmup),
            # the same less the evaluations and checkpoints every 50 steps (the hand loops' less their evaluations)
            "whole_loop_no_eval_s": None if periodic is None else (wall - periodic - sum(st[:warmup])) / (steps - warmup),
            "train_wall_per_step_s": wall / steps, "process_wall_s": time.time() - t0,
            "first_loss": float(rows[0]["loss"]), "last_loss": float(rows[-1]["loss"])}


def run_interleaved(backend: str, rounds: int, block: int, timeout: float) -> dict:
    """bench/step_breakdown.py, variants `harness` (Backend.train_step) and `hand` only: the two steps
    interleaved in blocks inside one process, so the load of the machine falls on both alike."""
    with tempfile.TemporaryDirectory(prefix="duipai-interleaved-") as tmp:
        out = Path(tmp) / "res.json"
        r = subprocess.run([sys.executable, str(HERE / "step_breakdown.py"), "-b", backend, "--rounds", str(rounds),
                            "--block", str(block), "--variants", "harness", "--json", str(out)],
                           capture_output=True, text=True, cwd=ROOT, timeout=timeout)
        if r.returncode != 0 or not out.exists():
            tail = "\n".join("    " + l for l in r.stderr.strip().splitlines()[-6:])
            raise RuntimeError(f"interleaved {backend} exited with code {r.returncode}\n{tail}")
        res = json.loads(out.read_text())
    v = {x["variant"]: x for x in res["variants"]}
    return {"rounds": rounds, "block": block, "harness_p10_s": v["harness"]["p10_us"] / 1e6,
            "hand_p10_s": v["hand"]["p10_us"] / 1e6, "harness_median_s": v["harness"]["median_us"] / 1e6,
            "hand_median_s": v["hand"]["median_us"] / 1e6, "ratio_p10": v["harness"]["p10_ratio_to_hand"],
            "ratio_median": v["harness"]["ratio_to_hand"]}


def quantiles(times: list[float]) -> dict[str, float]:
    """Low quantiles of one run's step times: on a shared machine a step is either left alone or
    stretched by the scheduler, so the fast steps show the cost and the median shows the load."""
    a = sorted(times)
    return {f"p{q}_s": a[min(len(a) - 1, int(q / 100 * len(a)))] for q in (5, 10, 25)}


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("numpy", "torch", "jax", "jaxlib", "optax", "tensorflow-cpu", "tensorflow", "keras"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def machine() -> dict:
    try:
        nproc = int(subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip())
    except (OSError, ValueError):
        nproc = os.cpu_count()
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"nproc": nproc, "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "machine": platform.machine(), "processor": platform.processor(), "node": platform.node(),
            "loadavg_at_start": load}


def med(vals: list[float]) -> float | None:
    return statistics.median(vals) if vals else None


def summarise(b: str, runs: list[dict], skipped: str | None, inter: dict | None = None) -> dict:
    h = [r["harness"] for r in runs if "harness" in r]
    l = [r["hand"] for r in runs if "hand" in r]
    row: dict = {"backend": b, "repeats": len(runs)}
    if skipped:
        row["skipped"] = skipped
    for side, xs in (("harness", h), ("hand", l)):
        if xs:
            row[f"{side}_per_step_s"] = med([x["per_step_s"] for x in xs])
            row[f"{side}_p10_s"] = med([x["p10_s"] for x in xs])
            row[f"{side}_whole_loop_s"] = med([x["whole_loop_s"] for x in xs])
    no_eval = [x["whole_loop_no_eval_s"] for x in h if x.get("whole_loop_no_eval_s") is not None]
    hand_no_eval = [x["whole_loop_no_eval_s"] for x in l if x.get("whole_loop_no_eval_s") is not None]
    if no_eval and hand_no_eval:
        row["ratio_whole_loop_no_eval"] = med(no_eval) / med(hand_no_eval)
    if h and l:
        row["ratio_per_step"] = row["harness_per_step_s"] / row["hand_per_step_s"]
        row["ratio_p10"] = row["harness_p10_s"] / row["hand_p10_s"]
        row["ratio_whole_loop"] = row["harness_whole_loop_s"] / row["hand_whole_loop_s"]
        both = [r for r in runs if "harness" in r and "hand" in r]
        row["pair_ratios_per_step"] = [r["harness"]["per_step_s"] / r["hand"]["per_step_s"] for r in both]
        row["pair_ratios_p10"] = [r["harness"]["p10_s"] / r["hand"]["p10_s"] for r in both]
        row["ok"] = row["ratio_per_step"] <= TARGET
        row["ok_p10"] = row["ratio_p10"] <= TARGET
        row["ok_whole_loop"] = row["ratio_whole_loop"] <= TARGET_LOOP
        row["loadavg"] = med([r["loadavg"] for r in runs if "loadavg" in r])
        # the same computation timed on both sides: the first step's loss (same weights, same batch) agrees
        firsts = [(r["harness"].get("first_loss"), r["hand"].get("first_loss")) for r in both]
        row["first_loss_rel_diff"] = max((abs(a - c) / abs(c) for a, c in firsts if a is not None and c), default=None)
        # the VM runs a share of processes ~30 % slower throughout (either side, at the same rate): the fastest run
        # of each side, and how many runs of each were in that slow mode, for reading a median that one of them hit
        row["ratio_fastest"] = min(x["per_step_s"] for x in h) / min(x["per_step_s"] for x in l)
        row["ratio_fastest_whole_loop"] = min(x["whole_loop_s"] for x in h) / min(x["whole_loop_s"] for x in l)
        row["slow_runs"] = {side: sum(x["per_step_s"] > SLOW * min(y["per_step_s"] for y in xs) for x in xs)
                            for side, xs in (("harness", h), ("hand", l))}
    if inter:
        row["interleaved"] = inter
    return row


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.3f}"


def ratio_s(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}"


def mark(ratio: float, target: float = TARGET) -> str:
    return f"{ratio:.2f} ok" if ratio <= target else f"**{ratio:.2f} MISS**"


def markdown(rows: list[dict], meta: dict) -> str:
    m = meta["machine"]
    load = m.get("loadavg_at_start")
    end = meta.get("loadavg_at_end")
    load_s = (f", load average {load[0]:.1f} at start" if load else "") + (f", {end[0]:.1f} at the end" if end else "")
    lines = [f"## Harness step time vs a hand-written loop ({meta.get('model', DEFAULT_MODEL)})", "",
             f"{meta['date']}; {m['nproc']} CPUs (`nproc`){load_s}, {m['platform']}; "
             f"{meta['steps']} steps x {meta['repeats']} alternating harness/hand pairs per backend, each run "
             f"its own process, first {meta['warmup']} steps left out; one thread pinned on both sides."
             f"{' **Quick smoke run.**' if meta['quick'] else ''}",
             "", "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()), "",
             "| backend | harness median (ms) | hand median (ms) | ratio, median | harness p10 (ms) | "
             "hand p10 (ms) | ratio, p10 | interleaved ratio, p10 (median) | harness whole-loop (ms) | "
             "hand whole-loop (ms) | ratio, whole-loop | whole-loop ratio without evaluations (and the "
             "harness's checkpoints) | fastest run of each side: ratio, median / whole-loop | slow runs, harness / hand | "
             "p10 ratio per pair | load average (1 min) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    notes = []

    def load_of(r: dict) -> str:
        """The machine's load during this backend's pairs (median of the 1-minute load average after each
        pair) and during its interleaved comparison."""
        i = r.get("interleaved") or {}
        pairs = "-" if r.get("loadavg") is None else f"{r['loadavg']:.1f}"
        return pairs + (f" (interleaved {i['loadavg']:.1f})" if i.get("loadavg") is not None else "")

    def inter(r: dict) -> str:
        i = r.get("interleaved")
        return "-" if not i else f"{mark(i['ratio_p10'])} ({i['ratio_median']:.2f})"
    for r in rows:
        if "ratio_per_step" in r:
            lines.append(f"| {r['backend']} | {ms(r['harness_per_step_s'])} | {ms(r['hand_per_step_s'])} | "
                         f"{mark(r['ratio_per_step'])} | {ms(r['harness_p10_s'])} | {ms(r['hand_p10_s'])} | "
                         f"{mark(r['ratio_p10'])} | {inter(r)} | {ms(r['harness_whole_loop_s'])} | "
                         f"{ms(r['hand_whole_loop_s'])} | {mark(r['ratio_whole_loop'], TARGET_LOOP)} | "
                         f"{ratio_s(r.get('ratio_whole_loop_no_eval'))} | "
                         f"{ratio_s(r.get('ratio_fastest'))} / {ratio_s(r.get('ratio_fastest_whole_loop'))} | "
                         f"{r['slow_runs']['harness']} / {r['slow_runs']['hand']} of {r['repeats']} | "
                         f"{', '.join(f'{p:.2f}' for p in r['pair_ratios_p10'])} | {load_of(r)} |")
        elif "harness_per_step_s" in r or "hand_per_step_s" in r:
            lines.append(f"| {r['backend']} | {ms(r.get('harness_per_step_s'))} | {ms(r.get('hand_per_step_s'))} | - | "
                         f"{ms(r.get('harness_p10_s'))} | {ms(r.get('hand_p10_s'))} | - | {inter(r)} | "
                         f"{ms(r.get('harness_whole_loop_s'))} | {ms(r.get('hand_whole_loop_s'))} | - | - | - | - | | {load_of(r)} |")
        else:
            lines.append(f"| {r['backend']} | skipped | | | | | | | | | | | | | | |")
        if r.get("skipped"):
            notes.append(f"- **{r['backend']}** skipped: {r['skipped']}")
    lines += ["", f"Target: ratio <= {TARGET} per step (median; on a loaded machine read the p10 and the "
              f"interleaved ratio), <= {TARGET_LOOP} whole-loop. Per-step figures are one run's step times (harness: steps.csv "
              "`step_time_s`, i.e. `Backend.train_step`; hand loop: one loop iteration with its batch and logged "
              "loss), summarised per run (median; p10 = 10th percentile), then the median over the runs. "
              "On a shared, loaded machine a step is either left alone or stretched by the scheduler: the median "
              "then measures the load and the p10 measures the step, so the p10 ratio is the one to read there. "
              "Whole-loop: the training loop's wall time per step (harness: worker.json `train_wall_s`, which also "
              "holds the batch gather, CSV rows and the checkpoints and evaluations every 50 steps), "
              "less the warm-up steps on both sides; the hand loops evaluate the test set at the same cadence "
              "(the same work; they save no checkpoints). The next column leaves the evaluations out of both loops "
              "and the checkpoints out of the harness's (worker.json `train_eval_checkpoint_s`), for "
              "information: the target is on the whole loop. Fastest run: each side's fastest run (by its median step; "
              "by its whole loop), for information: on this VM a share of processes, harness and hand-written alike, "
              f"runs ~30 % slower from start to end; 'slow runs' counts those over {SLOW}x their side's fastest. "
              "When half the runs of one side are slow the median over runs measures that, not the harness. Interleaved: bench/step_breakdown.py, the harness's "
              "`Backend.train_step` and the hand-written step (for Keras: what `fit` runs per step) alternating "
              f"in blocks of {meta.get('interleaved_block', 20)} steps for {meta.get('interleaved_rounds', 0)} "
              "rounds inside one process: both see the same load, the most robust figure on a busy machine."]
    diffs = {r["backend"]: r.get("first_loss_rel_diff") for r in rows if r.get("first_loss_rel_diff") is not None}
    if diffs:
        lines += ["", "The same computation on both sides: the first step's loss, harness against hand-written loop, "
                  "relative difference " + ", ".join(f"{b} {d:.1e}" for b, d in diffs.items()) + "."]
    if notes:
        lines += ["", *notes]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", nargs="+", default=ALL_BACKENDS, metavar="B",
                    help=f"default: {' '.join(ALL_BACKENDS)}")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 400; --quick 60)")
    ap.add_argument("--repeats", type=int, default=None, help="harness/hand pairs per backend (default 3; --quick 1)")
    ap.add_argument("--warmup", type=int, default=WARMUP, help="first steps left out on both sides")
    ap.add_argument("--quick", action="store_true", help="fast smoke run: 60 steps, 1 pair, results/quick/")
    ap.add_argument("--timeout", type=float, default=600.0, help="per run, seconds")
    ap.add_argument("--results", type=Path, default=None, help="output folder (default bench/results[/quick])")
    ap.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(HAND_SCRIPT_PREFIX),
                    help="the model both sides train (a hand-written loop exists for these)")
    ap.add_argument("--interleaved-rounds", type=int, default=None,
                    help="rounds of the in-process interleaved comparison (default 10; --quick 4; 0: skip it)")
    args = ap.parse_args(argv)
    steps = args.steps or (60 if args.quick else 400)
    repeats = args.repeats or (1 if args.quick else 3)
    out_dir = args.results or (RESULTS / "quick" if args.quick else RESULTS)
    rounds = args.interleaved_rounds if args.interleaved_rounds is not None else (4 if args.quick else 10)
    if args.model != DEFAULT_MODEL:
        rounds = 0      # bench/step_breakdown.py's variants are written for the default model
    if steps <= args.warmup + 1:
        ap.error(f"--steps must exceed --warmup ({args.warmup}) + 1")
    unknown = [b for b in args.backends if b not in ALL_BACKENDS]
    if unknown:
        ap.error(f"unknown backend(s) {', '.join(unknown)}; known: {', '.join(ALL_BACKENDS)}")

    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
            "versions": versions(), "steps": steps, "repeats": repeats, "warmup": args.warmup,
            "quick": args.quick, "model": args.model, "target_ratio": TARGET, "target_ratio_whole_loop": TARGET_LOOP,
            "interleaved_rounds": rounds, "interleaved_block": 20,
            "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])}
    installed = set(runner.installed_backends())
    skipped: dict[str, str] = {}
    for b in args.backends:
        if b not in installed:
            skipped[b] = "framework not installed"
    runs: dict[str, list[dict]] = {b: [] for b in args.backends}
    with tempfile.TemporaryDirectory(prefix="duipai-bench-step-") as tmp:
        root = Path(tmp)
        for r in range(repeats):
            for b in args.backends:
                if b in skipped:
                    continue
                rec: dict = {"repeat": r}
                sides = ("harness", "hand") if r % 2 == 0 else ("hand", "harness")
                for side in sides:
                    try:
                        if side == "harness":
                            rec[side] = run_harness(b, steps, args.warmup, root, f"{b}-r{r}", args.timeout, args.model)
                            # the throwaway result folder goes at once (the .cache of prepared data stays)
                            shutil.rmtree(root / f"{b}-r{r}", ignore_errors=True)
                        else:
                            rec[side] = run_hand(b, steps, args.warmup, args.timeout, args.model)
                    except (BackendFailed, BadInput, RuntimeError, subprocess.TimeoutExpired,
                            json.JSONDecodeError, IndexError) as e:
                        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                        skipped[b] = f"{side} does not run: {msg}"
                        print(f"bench_step: skipping {b}: {side} does not run: {e}", file=sys.stderr)
                        break
                if b in skipped:
                    continue
                rec["loadavg"] = os.getloadavg()[0]
                runs[b].append(rec)
                h, l = rec["harness"], rec["hand"]
                print(f"  {b:<17} pair {r + 1}/{repeats}: median harness {ms(h['per_step_s'])} / hand "
                      f"{ms(l['per_step_s'])} ms = {h['per_step_s'] / l['per_step_s']:.2f}; p10 harness "
                      f"{ms(h['p10_s'])} / hand {ms(l['p10_s'])} ms = {h['p10_s'] / l['p10_s']:.2f}",
                      file=sys.stderr, flush=True)
    inter: dict[str, dict] = {}
    for b in args.backends:
        if rounds <= 0 or not runs[b]:
            continue
        try:
            inter[b] = run_interleaved(b, rounds, 20, args.timeout)
            inter[b]["loadavg"] = os.getloadavg()[0]
            i = inter[b]
            print(f"  {b:<17} interleaved: p10 harness {ms(i['harness_p10_s'])} / hand {ms(i['hand_p10_s'])} ms = "
                  f"{i['ratio_p10']:.2f} (median {i['ratio_median']:.2f})", file=sys.stderr, flush=True)
        except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError, KeyError) as e:
            print(f"bench_step: interleaved {b} failed: {e}", file=sys.stderr)
    rows = [summarise(b, runs[b], skipped.get(b), inter.get(b)) for b in args.backends]
    meta["loadavg_at_end"] = os.getloadavg()
    text = markdown(rows, meta)
    print(text)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "bench_step" if args.model == DEFAULT_MODEL else f"bench_step-{args.model}"
    (out_dir / f"{stem}.md").write_text(text)
    (out_dir / f"{stem}.json").write_text(json.dumps({**meta, "rows": rows, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
