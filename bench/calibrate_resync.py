"""Calibration data for the shared-state step comparison (resync): how far a correct candidate's one step
from the reference's state is from the reference's float64 step, relative to the reference's own float32
error there.

    python bench/calibrate_resync.py RESULTS_DIR [--every 10] [--reference torch] [--out FILE.json]

For every candidate run in RESULTS_DIR (one configuration, no fault), the resync jobs (reference float32,
reference float64, candidate: harness.localize.Localizer.replay) probe one step at every `--every` steps;
per probe key: the candidate's RMS error against float64 over the tensor's scale (`cand`), the float32
reference's (`own`), and their ratio. The table printed per key kind: how many keys, the largest ratio,
its 99th percentile, and the largest `cand` where `own` is below one float32 ULP (where only the floor can
hold). These numbers choose harness.resync's MARGIN and FLOOR (docs/verdict.md)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.localize import Localizer  # noqa: E402
from harness.probe_jobs import checkpoints  # noqa: E402
from harness.probes import rms_rel, kind_of  # noqa: E402
from harness.runs import discover, load_run  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--reference", default="torch")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    runs = [load_run(p) for p in discover(Path(a.results))]
    runs = [r for r in runs if r.perturb_ulp is None and r.fault is None and r.options.dtype != "float64"]
    ref = next(r for r in runs if r.backend == a.reference)
    steps = int(ref.step[-1]) + 1
    at = list(range(0, steps, a.every))
    print(f"reference {ref.name}; {len(at)} points; checkpoints {sorted(checkpoints(ref))}", file=sys.stderr)
    loc = Localizer(ref.path.parent)
    rows = []
    for cand in runs:
        if cand is ref:
            continue
        rep = loc.replay(ref, cand, at)
        for t, pa, pb, p64, _ in rep["probes"]:
            if p64 is None:
                continue
            for k in pb:
                if k not in pa or k not in p64:
                    continue
                x, y, z = (np.asarray(v, np.float64) for v in (pa[k], pb[k], p64[k]))
                rows.append({"candidate": cand.backend, "step": t, "key": k, "kind": kind_of(k)[0],
                             "cand": rms_rel(x, z), "own": rms_rel(y, z)})
    kinds = sorted({r["kind"] for r in rows})
    print(f"{'kind':8} {'keys':>6} {'max ratio':>10} {'p99 ratio':>10} {'max cand':>10} {'max cand, own<1ulp':>18}")
    for kd in kinds:
        rs = [r for r in rows if r["kind"] == kd]
        ratio = np.array([r["cand"] / max(r["own"], 1e-30) for r in rs if r["own"] > 6e-8])
        tiny = [r["cand"] for r in rs if r["own"] <= 6e-8]
        print(f"{kd:8} {len(rs):6d} {ratio.max() if len(ratio) else float('nan'):10.3g} "
              f"{np.quantile(ratio, 0.99) if len(ratio) else float('nan'):10.3g} {max(r['cand'] for r in rs):10.3g} "
              f"{max(tiny) if tiny else float('nan'):18.3g}")
    worst = sorted(rows, key=lambda r: -r["cand"] / max(r["own"], 6e-8))[:10]
    for r in worst:
        print(f"  {r['candidate']:12} step {r['step']:4d} {r['key']:40} cand {r['cand']:.3g} own {r['own']:.3g}")
    if a.out:
        Path(a.out).write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
