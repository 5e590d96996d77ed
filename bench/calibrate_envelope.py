"""Measure the numbers behind the envelope rule (harness/envelope.py, docs/verdict.md).

For each model and optimizer (300 steps, torch): the reference; 1-ULP runs --perturb-ulp 1..8; the
float64 run the envelope adds (--dtype float64 --perturb-ulp 1); and held-out drift-only runs that
must never be called a bug: the 1-ULP runs not in the envelope, --dtype float64, --threads 2. Plus
fault runs that must be caught. The envelope is rotated over several choices of 3 of the 8 seeds
(every held-out run is judged against every envelope it is not part of), and each rule variant
reports: pointwise excesses among drift runs (split by onset: step 0 / later), and the faults'
first-divergence factors.

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
from harness.envelope import DEFAULT_RULE, check_series, compute, ulp32  # noqa: E402
from algorithms.contract import RunConfig  # noqa: E402
from harness.runs import SERIES, load_run  # noqa: E402

FAULTS = {"momentum": ["lr_scale_1.001", "grad_double", "label_smoothing"],
          "adam": ["lr_scale_1.001", "grad_double", "adam_eps_hat"]}
ROTATIONS = [(1, 2, 3), (4, 5, 6), (6, 7, 8), (1, 4, 7), (2, 5, 8), (3, 6, 8)]
RULES = {
    "chosen: W=5 ulps=8 iso=4": DEFAULT_RULE,
    "W=2 ulps=4 iso=2": replace(DEFAULT_RULE, window=2, ulps=4.0, max_isolated=2),
    "W=0 ulps=4 iso=2": replace(DEFAULT_RULE, window=0, ulps=4.0, max_isolated=2),
    "W=5 ulps=4 iso=4": replace(DEFAULT_RULE, ulps=4.0),
    "W=2 ulps=8 iso=4": replace(DEFAULT_RULE, window=2),
}


def run(cfg: RunConfig, root: Path):
    prep = runner.prepare(cfg, root)
    folder = root / cfg.default_name(prep.model.name)
    if not (folder / "manifest.json").exists():
        t = time.time()
        runner.execute(cfg, root, folder.name, prepared=prep)
        print(f"  trained {folder.name} ({time.time() - t:.1f} s)", file=sys.stderr)
    return load_run(folder)


def first_divergence(env, ref, cand, rule):
    first = None
    for s in SERIES:
        e = env[s]
        c = check_series(e, np.arange(len(e.grid)), cand.values[s], ref.values[s], rule)
        if c.diverged_step is not None and (first is None or c.diverged_step < first[0]):
            first = (c.diverged_step, s, c.factor, c.reason)
    return first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/verdict-cal"))
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--models", nargs="+", default=["cnn2d_2conv_2fc", "cnn2d_3conv_3fc", "cnn2d_hard"])
    ap.add_argument("--optimizers", nargs="+", default=["momentum", "adam"])
    ap.add_argument("--json", type=Path, default=None, help="write every measured number here")
    a = ap.parse_args()
    configs = []
    for model in a.models:
        for opt in a.optimizers:
            hp = HParams(steps=a.steps, optimizer=opt, lr=0.05 if opt == "momentum" else 1e-3,
                         eval_every=min(50, a.steps), checkpoint_every=min(50, a.steps))
            base = dict(model=model, backend="torch", hparams=hp)
            runs = {"ref": run(RunConfig(**base), a.out)}
            runs.update({f"ulp{k}": run(RunConfig(**base, perturb_ulp=k), a.out) for k in range(1, 9)})
            runs["float64"] = run(RunConfig(**base, dtype="float64"), a.out)
            runs["threads2"] = run(RunConfig(**base, threads=2), a.out)
            runs["f64member"] = run(RunConfig(**base, dtype="float64", perturb_ulp=1), a.out)
            faults = {f: run(RunConfig(**base, fault=f), a.out) for f in FAULTS[opt]}
            configs.append((model, opt, runs, faults))
    report: dict = {"steps": a.steps, "rotations": ROTATIONS, "rules": {}, "early_ulps": {}}
    # how far float64 / threads2 / 1-ULP runs are from the reference over the first 10 steps, in float32 ULPs
    print("deviation from the reference over steps 0-9, in float32 ULPs of the value (max over the series' points)")
    for model, opt, runs, _ in configs:
        ref = runs["ref"]
        for name in ("ulp4", "float64", "threads2"):
            u = {s: float(np.nanmax(np.abs(runs[name].values[s][:10] - ref.values[s][:10]) / ulp32(ref.values[s][:10])))
                 for s in ("loss", "grad_norm", "update_norm", "param_norm")}
            report["early_ulps"][f"{model}/{opt}/{name}"] = u
            print(f"  {model:<16} {opt:<8} {name:<9} " + "  ".join(f"{s} {v:5.1f}" for s, v in u.items()))
    for rname, rule in RULES.items():
        for precision in (True, False):
            drift_n, excess, faults_hit, fault_factors = 0, [], 0, []
            for model, opt, runs, faults in configs:
                ref = runs["ref"]
                for rot in ROTATIONS:
                    members = [runs[f"ulp{k}"] for k in rot] + ([runs["f64member"]] if precision else [])
                    env = compute(ref, members, rule)
                    held = [f"ulp{k}" for k in range(1, 9) if k not in rot] + ["float64", "threads2"]
                    for h in held:
                        drift_n += 1
                        v = first_divergence(env, ref, runs[h], rule)
                        if v:
                            excess.append({"model": model, "optimizer": opt, "envelope": rot, "run": h,
                                           "step": v[0], "series": v[1], "factor": v[2], "reason": v[3]})
                    if rot == ROTATIONS[0]:
                        for f, fr in faults.items():
                            v = first_divergence(env, ref, fr, rule)
                            if v:
                                faults_hit += 1
                                fault_factors.append({"model": model, "optimizer": opt, "fault": f, "step": v[0],
                                                      "series": v[1], "factor": v[2]})
            n_faults = sum(len(f) for *_, f in configs)
            at0 = [e for e in excess if e["step"] == 0]
            key = f"{rname}{'' if precision else ' (1-ULP runs only)'}"
            report["rules"][key] = {"drift_runs_judged": drift_n, "excess": excess, "faults_caught": faults_hit,
                                    "faults": n_faults, "fault_first_divergence": fault_factors}
            fmin = min((f["factor"] for f in fault_factors), default=float("nan"))
            f0 = sum(f["step"] == 0 for f in fault_factors)
            print(f"\n{key}: drift-only runs with an excess {len(excess)}/{drift_n} (onset at step 0: {len(at0)}; "
                  f"later: {len(excess) - len(at0)}, earliest at step "
                  f"{min((e['step'] for e in excess if e['step'] > 0), default='-')}); "
                  f"faults caught {faults_hit}/{n_faults} (at step 0: {f0}), smallest factor {fmin:.3g}")
            for e in excess[:40]:
                print(f"    {e['model']:<16} {e['optimizer']:<8} env {e['envelope']} {e['run']:<9} step {e['step']:>3} "
                      f"{e['series']:<12} x{e['factor']:.3g} ({e['reason']})")
    if a.json:
        a.json.write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
