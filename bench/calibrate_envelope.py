"""Measure the numbers behind the envelope rule (harness/envelope.py, docs/verdict.md).

For each model and optimizer: the torch reference, K envelope runs (--perturb-ulp 1..K), held-out
drift-only runs that must never be called a bug (--perturb-ulp K+1.., --dtype float64, --threads 2),
and fault runs that must be caught. For each rule variant, prints per run the largest factor over
the envelope (|dev| / E) before saturation, and whether the verdict rule would call it divergent.

    python bench/calibrate_envelope.py [--out /tmp/verdict-cal] [--steps 300] [--models ...]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from algorithms.optim import HParams  # noqa: E402
from harness import runner  # noqa: E402
from harness.envelope import DEFAULT_RULE, Rule, check_series, compute, ulp32  # noqa: E402
from harness.runner import RunConfig  # noqa: E402
from harness.runs import SERIES, load_run  # noqa: E402

FAULTS = {"momentum": ["lr_scale_1.001", "grad_double", "label_smoothing"],
          "adam": ["lr_scale_1.001", "grad_double", "adam_eps_hat"]}


def run(cfg: RunConfig, root: Path):
    prep = runner.prepare(cfg, root)
    folder = root / cfg.default_name(prep.model.name)
    if not (folder / "manifest.json").exists():
        t = time.time()
        runner.execute(cfg, root, folder.name, prepared=prep)
        print(f"  trained {folder.name} ({time.time() - t:.1f} s)", file=sys.stderr)
    return load_run(folder)


def verdict(env, ref, cand, rule):
    """(first divergent step, series, factor), max factor before saturation, saturation steps."""
    first, worst, sat = None, (0.0, None, None), {}
    for s in SERIES:
        e = env[s]
        c = check_series(e, np.arange(len(e.grid)), cand.values[s], ref.values[s], rule)
        if c.saturated_step is not None:
            sat[s] = c.saturated_step
        if c.diverged_step is not None and (first is None or c.diverged_step < first[0]):
            first = (c.diverged_step, s, c.factor)
        # the largest factor among valid (pre-saturation) points
        valid = np.arange(len(e.grid)) < (e.saturated_at if e.saturated_at is not None else len(e.grid))
        r = np.where(valid & np.isfinite(c.ratios), c.ratios, 0.0)
        # quantum-sized accuracy deviations never count
        dq = np.abs(cand.values[s] - ref.values[s]) <= e.quantum * (1 + 1e-9)
        r = np.where(dq & (e.quantum > 0), 0.0, r)
        i = int(np.argmax(r))
        if r[i] > worst[0]:
            worst = (float(r[i]), s, int(e.grid[i]))
    return first, worst, sat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/verdict-cal"))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--models", nargs="+", default=["cnn2d_2conv_2fc", "cnn2d_3conv_3fc", "cnn2d_hard"])
    ap.add_argument("--optimizers", nargs="+", default=["momentum", "adam"])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--held-out", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None, help="write every measured number here")
    a = ap.parse_args()
    rules = {"rule": DEFAULT_RULE, "W=0": replace(DEFAULT_RULE, window=0),
             "W=1": replace(DEFAULT_RULE, window=1), "ulps=4": replace(DEFAULT_RULE, ulps=4.0),
             "ulps=16": replace(DEFAULT_RULE, ulps=16.0), "iso=0": replace(DEFAULT_RULE, max_isolated=0)}
    report = []
    for model in a.models:
        for opt in a.optimizers:
            hp = HParams(steps=a.steps, optimizer=opt, lr=0.05 if opt == "momentum" else 1e-3,
                         eval_every=min(50, a.steps), checkpoint_every=min(50, a.steps))
            base = dict(model=model, backend="torch", hparams=hp)
            ref = run(RunConfig(**base), a.out)
            members = [run(RunConfig(**base, perturb_ulp=k), a.out) for k in range(1, a.k + 1)]
            drift = {f"ulp{k}": run(RunConfig(**base, perturb_ulp=k), a.out)
                     for k in range(a.k + 1, a.k + 1 + a.held_out)}
            drift["float64"] = run(RunConfig(**base, dtype="float64"), a.out)
            drift["threads2"] = run(RunConfig(**base, threads=2), a.out)
            faults = {f: run(RunConfig(**base, fault=f), a.out) for f in FAULTS[opt]}
            for rname, rule in rules.items():
                env = compute(ref, members, rule)
                zero = {s: int(np.sum(env[s].raw == 0)) for s in SERIES}
                for kind, group in (("drift", drift), ("fault", faults)):
                    for name, cand in group.items():
                        first, worst, sat = verdict(env, ref, cand, rule)
                        row = {"model": model, "optimizer": opt, "rule": rname, "kind": kind, "run": name,
                               "diverged": first, "max_factor": worst, "saturated": sat,
                               "zero_spread_points": zero}
                        report.append(row)
                        flag = ("OK " if (first is None) == (kind == "drift") else "XX ")
                        fs = f"diverged at {first[0]} in {first[1]} x{first[2]:.3g}" if first else "inside"
                        print(f"{flag}{model:<16} {opt:<8} {rname:<12} {kind:<5} {name:<16} {fs:<40} "
                              f"max x{worst[0]:.3g} ({worst[1]} @ {worst[2]})  sat {sat or '-'}")
            env = compute(ref, members, DEFAULT_RULE)
            # deviations in float32 ULPs of the reference value over the first 10 steps, where the
            # 1-ULP members are still nearly bitwise equal: what the floor must cover
            ulps = {}
            for name, cand in drift.items():
                ulps[name] = {s: float(np.nanmax(np.abs(cand.values[s][:10] - ref.values[s][:10])
                                                 / ulp32(ref.values[s][:10]))) for s in SERIES if s != "lr"}
                print(f"   {name:<10} max ULPs of deviation, steps 0-9: "
                      + ", ".join(f"{s} {v:.1f}" for s, v in ulps[name].items()))
            report.append({"model": model, "optimizer": opt, "early_ulps": ulps})
            print(f"   zero-spread points of the K={a.k} envelope: "
                  + ", ".join(f"{s} {int(np.sum(env[s].raw == 0))}/{len(env[s].raw)}" for s in SERIES))
            print("   relative spread (max over steps): "
                  + ", ".join(f"{s} {env[s].summary()['max_relative_spread']:.2g}" for s in SERIES))
    if a.json:
        a.json.write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
