"""Speed of the verdict engine on synthetic runs (comparison only: no training, no localization jobs).

  A. six 1,000-step runs (a reference and five candidates, all 15 pairs judged) against a 4-run
     envelope: reading, envelope, verdicts, table, comparison.csv/.json/-steps.csv.   target < 2 s
  B. two 1,000,000-step runs: reading both CSVs and judging the pair against an envelope of three
     1,000,000-step runs (read too), table and comparison.csv/.json.                    target < 5 s
     (comparison-steps.csv is not written by default beyond 100,000 steps: 8 million rows here.)

    python bench/bench_compare.py [--out /tmp/verdict-bench] [--keep]
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from harness.compare import compare  # noqa: E402
from harness.compare_output import render, write_outputs  # noqa: E402
from harness.envelope import compute  # noqa: E402
from harness.runs import load_run  # noqa: E402


def synthetic_run(folder: Path, n: int, rng: np.random.Generator, rel: float, *, perturb: int | None = None,
                  backend: str = "torch", shift: float = 0.0) -> Path:
    """A run folder with smooth float32 curves, moved by a random relative amount ~rel (drift)."""
    if (folder / "manifest.json").exists():    # kept from an earlier --keep run
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    t = np.arange(n, dtype=np.float64)
    noise = lambda: 1 + rel * (1 + t / 100) * rng.standard_normal(n)  # noqa: E731
    f32 = lambda x: x.astype(np.float32).astype(np.float64)  # noqa: E731
    steps = pd.DataFrame({
        "step": t.astype(np.int64), "epoch": (t // 22).astype(np.int64),
        "loss": f32((2.3 * np.exp(-t / 300) + 0.05) * noise() * (1 + shift)),
        "accuracy": np.round((1 - 0.9 * np.exp(-t / 200)) * 64) / 64,
        "grad_norm": f32((5 * np.exp(-t / 400) + 0.5 + 0.2 * np.sin(t)) * noise()),
        "update_norm": f32((0.4 * np.exp(-t / 600) + 0.05) * noise()),
        "param_norm": f32((15 + 1e-5 * t) * noise()),
        "lr": np.full(n, 0.05),
        "batch_checksum": [f"{i:012x}" for i in range(n)] if n <= 100_000 else
        pd.Series(np.arange(n)).map("{:012x}".format),
        "step_time_s": np.full(n, 0.001)})
    steps.to_csv(folder / "steps.csv", index=False)
    es = np.unique(np.r_[np.arange(0, n, max(n // 20, 1)), n])
    ev = pd.DataFrame({"step": es, "eval_loss": f32((2.3 * np.exp(-es / 300) + 0.06) * (1 + rel * rng.standard_normal(len(es)))),
                       "eval_accuracy": np.round((1 - 0.9 * np.exp(-es / 200)) * 359) / 359})
    ev.to_csv(folder / "eval.csv", index=False)
    man = {"schema": 1, "status": "complete", "kind": "train", "run": folder.name, "backend": backend,
           "model": "bench", "spec_hash": "s", "data_hash": "d", "order_hash": "o", "base_weights_hash": "w",
           "hparams_hash": "h", "hparams": {"steps": n, "batch_size": 64, "seed": 0},
           "data": {"source": "digits", "n_test": 359}, "init": {"perturb_ulp_seed": perturb},
           "options": {"dtype": "float32"}, "fault": None, "declared_differences": [],
           "spec": {"layers": []}}
    (folder / "manifest.json").write_text(json.dumps(man))
    return folder


def make_set(root: Path, n: int, candidates: list[tuple[str, float]], k: int) -> tuple[Path, list[Path], list[Path]]:
    rng = np.random.default_rng(0)
    ref = synthetic_run(root / "ref", n, rng, 0.0)
    env = [synthetic_run(root / f"ref__ulp{i}", n, rng, 1e-6, perturb=i) for i in range(1, k + 1)]
    cands = [synthetic_run(root / name, n, rng, 1e-6, backend=name.split("_")[0], shift=shift)
             for name, shift in candidates]
    return ref, env, cands


def judge(ref: Path, env: list[Path], cands: list[Path], out: Path, per_step: bool) -> dict[str, float]:
    t = {}
    c0 = time.process_time()
    t0 = time.perf_counter()
    r = load_run(ref)
    cs = [load_run(c) for c in cands]
    t["read runs"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    members = [load_run(e) for e in env]
    t["read envelope runs"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    e = compute(r, members)
    t["envelope"] = time.perf_counter() - t2
    t3 = time.perf_counter()
    c = compare(r, cs, e, members)
    t["verdicts"] = time.perf_counter() - t3
    t4 = time.perf_counter()
    render(c)
    write_outputs(c, out, per_step=False)
    t["table + csv/json"] = time.perf_counter() - t4
    t["total"] = time.perf_counter() - t0
    t["total CPU time"] = time.process_time() - c0
    if per_step:
        t5 = time.perf_counter()
        write_outputs(c, out, per_step=True)
        t["with comparison-steps.csv"] = time.perf_counter() - t5
    t["verdicts:"] = ", ".join(f"{p.b.name}={p.verdict}" + (f" (step {p.first['step']} {p.first['series']})"
                                                            if p.first else "") for p in c.pairs if p.with_reference)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/verdict-bench"))
    ap.add_argument("--keep", action="store_true", help="keep the synthetic runs (and reuse kept ones)")
    a = ap.parse_args()
    print("A: six 1,000-step runs (15 pairs), envelope of 4 runs")
    ref, env, cands = make_set(a.out / "A", 1000, [("jax", 0.0), ("tensorflow", 0.0), ("keras-jax", 0.0),
                                                    ("keras-torch", 0.0), ("buggy_torch", 1e-3)], 4)
    ta = judge(ref, env, cands, a.out / "A", per_step=True)
    for k, v in ta.items():
        print(f"  {k:<28} {v if isinstance(v, str) else f'{v:.3f} s'}")
    cmd = [sys.executable, "-m", "harness.cli", "compare", str(ref), *map(str, cands),
           *[x for e in env for x in ("--envelope", str(e))], "--no-localize", "--out", str(a.out / "A-cli")]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    print(f"  {'duipai compare (process)':<28} {time.perf_counter() - t0:.3f} s, exit {r.returncode}")
    print("B: two 1,000,000-step runs, envelope of 3 runs of 1,000,000 steps")
    t0 = time.perf_counter()
    ref, env, cands = make_set(a.out / "B", 1_000_000, [("jax", 0.0)], 3)
    print(f"  (generating the CSVs: {time.perf_counter() - t0:.1f} s, not counted)")
    tb = judge(ref, env, cands, a.out / "B", per_step=False)
    for k, v in tb.items():
        print(f"  {k:<28} {v if isinstance(v, str) else f'{v:.3f} s'}")
    pair = tb["read runs"] + tb["verdicts"] + tb["table + csv/json"]
    print(f"  {'the two CSVs: read + judge + write':<28} {pair:.3f} s   (target < 5 s)")
    print(f"\nA total {ta['total']:.3f} s (target < 2 s); B total with the envelope {tb['total']:.3f} s")
    print("load average (1, 5, 15 min):", " ".join(f"{x:.2f}" for x in __import__("os").getloadavg()),
          f"on {__import__('os').cpu_count()} CPUs")
    if not a.keep:
        shutil.rmtree(a.out, ignore_errors=True)


if __name__ == "__main__":
    main()
