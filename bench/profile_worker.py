"""Where the harness's time goes: the worker loop (wrappers/worker.py run_train) taken apart, per step.

Runs one backend in its own process with the environment the harness gives it (`python -m wrappers`'s
set_backend_env), on the job the harness would write, and times every piece of the per-step loop separately:
batch gather, dropout masks, Backend.train_step, the row's formatting (its step, epoch, lr and batch
checksum formatted before the loop, as there), the progress line, and the periodic checkpoint and evaluation. Then it
profiles train_step itself with cProfile and prints the functions where its time goes.

    python bench/profile_worker.py -b torch [--steps 300] [--top 25]

A diagnostic for when bench_step.py shows a ratio over target; it writes nothing under results/.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

WARMUP = 10


def make_job(backend: str, steps: int, root: Path) -> Path:
    """The job file runner.execute would write (train mode, default model and hyper-parameters)."""
    from algorithms.contract import INIT_PARAMS_FILE, JOB_FILE, ORDER_FILE, Job, RunConfig
    from algorithms.optim import HParams
    from algorithms.params import save_npz
    from harness import runner
    cfg = RunConfig(backend=backend, hparams=HParams(steps=steps))
    prep = runner.prepare(cfg, root)
    out = root / "out"
    out.mkdir(parents=True, exist_ok=True)
    np.save(root / ORDER_FILE, prep.order)
    save_npz(root / INIT_PARAMS_FILE, prep.params)
    job = Job(mode="train", backend=backend, model=prep.model.to_dict(), model_source=str(prep.model.source),
              hparams=cfg.hparams, data=str(prep.dataset_path), order=str(root / ORDER_FILE),
              params=str(root / INIT_PARAMS_FILE), out=str(out), options=cfg.options)
    path = root / JOB_FILE
    job.write(path)
    return path


def child(job_path: str, top: int) -> None:
    """In the backend's process: the worker loop, piece by piece."""
    from algorithms.contract import Job
    from wrappers.__main__ import set_backend_env
    from wrappers.registry import REGISTRY
    job = Job.read(job_path)
    entry = REGISTRY[job.backend]
    set_backend_env(entry, job.options)
    from algorithms.contract import state_arrays
    from algorithms.params import load_npz, save_npz
    from wrappers import worker as W

    backend = W.build_backend(job, entry.load())
    backend.name = entry.name
    model, hp, opts = backend.model, backend.hp, backend.opts
    arrays = load_npz(job.data)
    x_tr, y_tr, x_te, y_te = arrays["x_train"], arrays["y_train"], arrays["x_test"], arrays["y_test"]
    order = np.load(job.order)
    backend.load_params(load_npz(job.params))
    out_dir = Path(job.out)
    t: dict[str, list[float]] = {k: [] for k in ("gather", "masks", "train_step", "fmt+row", "progress", "iteration")}
    periodic: dict[str, list[float]] = {"checkpoint": [], "evaluate": []}
    heads, tails = W.fixed_columns(backend, x_tr, y_tr, order)
    rows: list[str] = []
    dropout = opts.dropout == "harness" and any(l.kind == "dropout" for l in model.layers)   # as run_train
    last_progress = -W.PROGRESS_EVERY_S
    sink = open(os.devnull, "w")
    pc = time.perf_counter
    half = hp.steps // 2
    prof = cProfile.Profile()
    with open(out_dir / "steps.csv", "w") as fs:
        for step in range(hp.steps):
            profiling = step >= half
            t_it = pc()
            a = pc(); idx = order[step]; x, y = x_tr[idx], y_tr[idx]; b = pc(); t["gather"].append(b - a)
            a = pc(); masks = W.masks_for(model, hp.seed, step, hp.batch_size, opts.dropout) if dropout else {}; b = pc()
            t["masks"].append(b - a)
            if profiling:
                prof.enable()
            a = pc(); st = backend.train_step(step, x, y, masks); b = pc()
            if profiling:
                prof.disable()
            t["train_step"].append(b - a)
            a = pc()   # as run_train: step, epoch, lr and checksum were formatted before the loop
            row = (heads[step], st.loss, st.accuracy, st.grad_norm, st.update_norm, st.param_norm, tails[step], 0.0)
            rows.append(",".join(map(W.fmt, row)) + "\n")
            b = pc(); t["fmt+row"].append(b - a)
            a = pc()
            if a - last_progress >= W.PROGRESS_EVERY_S:   # as run_train
                last_progress = a
                W.progress(sink, step=step + 1, of=hp.steps, loss=float(st.loss))
            b = pc()
            t["progress"].append(b - a)
            t["iteration"].append(pc() - t_it)
            done = step + 1
            if done % hp.checkpoint_every == 0:   # as run_train
                a = pc()
                save_npz(out_dir / f"ckpt_{done}.npz", state_arrays(backend.export_params(), backend.export_opt_state()))
                periodic["checkpoint"].append(pc() - a)
            if done % hp.eval_every == 0:
                a = pc(); fs.writelines(rows); rows.clear(); fs.flush(); backend.evaluate(x_te, y_te)
                periodic["evaluate"].append(pc() - a)
    res = {"backend": job.backend, "steps": hp.steps,
           "p10_us": {k: float(np.percentile(v[WARMUP:], 10)) * 1e6 for k, v in t.items()},
           "median_us": {k: statistics.median(v[WARMUP:]) * 1e6 for k, v in t.items()},
           "mean_us": {k: float(np.mean(v[WARMUP:])) * 1e6 for k, v in t.items()},
           "periodic_ms_per_call": {k: (statistics.median(v) * 1e3 if v else None) for k, v in periodic.items()},
           "periodic_us_per_step": {k: sum(v) / hp.steps * 1e6 for k, v in periodic.items()}}
    s = io.StringIO()
    ps = pstats.Stats(prof, stream=s)
    ps.sort_stats("tottime").print_stats(top)
    res["profile_steps"] = hp.steps - half
    res["train_step_s"] = t["train_step"]
    res["cprofile_tottime"] = s.getvalue()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(top)
    res["cprofile_cumulative"] = s.getvalue()
    print("@@RESULT@@" + json.dumps(res))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-b", "--backend", default="torch")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--top", type=int, default=25, help="cProfile rows")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, help="also write the result here")
    args = ap.parse_args()
    if args.child:
        child(args.child, args.top)
        return 0
    with tempfile.TemporaryDirectory(prefix="duipai-profile-") as tmp:
        job = make_job(args.backend, args.steps, Path(tmp))
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONHASHSEED="0")
        r = subprocess.run([sys.executable, __file__, "--child", str(job), "--top", str(args.top)],
                           capture_output=True, text=True, env=env, cwd=ROOT)
    line = next((l for l in r.stdout.splitlines() if l.startswith("@@RESULT@@")), None)
    if r.returncode != 0 or line is None:
        print(r.stderr[-3000:], file=sys.stderr)
        return 1
    res = json.loads(line[len("@@RESULT@@"):])
    print(f"# {res['backend']}: worker loop per step, {res['steps']} steps (first {WARMUP} left out)\n")
    print(f"{'piece':<12} {'p10 us':>10} {'median us':>10} {'mean us':>10}")
    for k, v in res["median_us"].items():
        print(f"{k:<12} {res['p10_us'][k]:>10.1f} {v:>10.1f} {res['mean_us'][k]:>10.1f}")
    for k, v in res["periodic_ms_per_call"].items():
        print(f"{k:<12} {v if v is None else round(v, 3)} ms per call, "
              f"{res['periodic_us_per_step'][k]:.1f} us per step averaged")
    print(f"\n# cProfile of train_step over the last {res['profile_steps']} steps (tottime)\n")
    print(res["cprofile_tottime"])
    print("\n# (cumulative)\n")
    print(res["cprofile_cumulative"])
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
