"""How far clean float32 backends land from the exact (float64) step-0 probes, per probe key, and how far
faulty ones do: the numbers behind the arbiter's tolerance (harness/arbitration.py).

For every model and standard optimizer case: each installed backend in float32 and (where it can) float64,
the arbiter backend in float64 (the exact values) and float32 (a correct float32 implementation of the same
formulas), and the reference backend with a few catalogued faults. Per key: every side's RMS relative error
against the exact values over the tolerance harness.arbitration.tolerance gives it. Probe keys a backend's declared
differences may move are left out (they compute another formula on purpose). Probe folders are reused.

    python bench/arbiter_tolerance.py --arbiter NAME [--models a,b] [--backends x,y] [--faults f,g] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from algorithms.params import load_npz  # noqa: E402
from harness.arbitration import max_rel, rms_rel, tolerance  # noqa: E402
from harness.defaults import REFERENCE  # noqa: E402
from harness.probes import ProbeResult, run_cases, standard_cases  # noqa: E402
from harness.runner import backend_info  # noqa: E402

FAULTS = "flatten_no_permute,symmetric_same_padding,label_smoothing,grad_double,lr_scale_1.001,missing_bias"


def probes(backend: str, model: str, out: Path, dtype: str, fault: str | None = None) -> dict[str, ProbeResult]:
    folder = out / f"probe__{model}__{backend}__{fault or 'clean'}__{dtype}"
    cases = standard_cases()
    if (folder / "worker.json").is_file():
        return {n: ProbeResult(load_npz(folder / f"probe-{i}.npz"),
                               json.loads((folder / f"probe-{i}.json").read_text())["declared_differences"])
                for i, n in enumerate(cases)}
    return run_cases(backend, model, cases, out, dtype=dtype, fault=fault)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arbiter", required=True)
    ap.add_argument("--models", default="cnn2d_2conv_2fc,cnn2d_hard,cnn2d_3conv_3fc")
    ap.add_argument("--backends", default=None)
    ap.add_argument("--faults", default=FAULTS)
    ap.add_argument("--out", default="bench/results/arbiter_tolerance")
    a = ap.parse_args()
    info = backend_info()
    backends = a.backends.split(",") if a.backends else [b for b, i in info.items() if not i["missing"]]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in a.models.split(","):
        exact = probes(a.arbiter, model, out, "float64")
        calib = probes(a.arbiter, model, out, "float32")
        sides = [(b, None) for b in backends] + [(REFERENCE, f) for f in a.faults.split(",") if f]
        for b, fault in sides:
            try:
                got = probes(b, model, out, "float32", fault)
                own = probes(b, model, out, "float64", fault) if "float64" in info[b]["capabilities"] else None
            except Exception as e:   # noqa: BLE001  a refusal is a line, not the end of the measurement
                print(f"{model} {b} {fault or 'clean'}: {str(e).splitlines()[0]}", flush=True)
                continue
            mine = []
            for case, res in got.items():
                ex, cal = exact[case].arrays, calib[case].arrays
                o64 = own[case].arrays if own else {}
                for k in res.undeclared_keys():
                    if k not in ex or k not in cal:
                        continue
                    x = res.arrays[k]
                    t_cal = tolerance(ex[k], cal[k])
                    t_own = tolerance(ex[k], cal[k], x, o64.get(k))
                    e = rms_rel(x, ex[k])
                    mine.append({"model": model, "backend": b, "fault": fault, "case": case, "key": k, "rms": e,
                                 "max": max_rel(x, ex[k]), "calib_rms": rms_rel(cal[k], ex[k]),
                                 "own_rms": rms_rel(x, o64[k]) if k in o64 else None,
                                 "tol_calib": t_cal, "tol_own": t_own})
            rows += mine
            for rule in ("tol_calib", "tol_own"):
                if fault is None:
                    w = max(mine, key=lambda r: r["rms"] / r[rule])
                    print(f"{model} {b} clean, {rule}: worst err/tol {w['rms'] / w[rule]:.3g} ({w['case']} {w['key']}: "
                          f"err {w['rms']:.3g}, tol {w[rule]:.3g})", flush=True)
                else:   # the fault's strongest key per case: how far over the tolerance the fault is seen
                    by_case = {}
                    for r in mine:
                        q = r["rms"] / r[rule]
                        if q > by_case.get(r["case"], (0, ""))[0]:
                            by_case[r["case"]] = (q, r["key"])
                    w = min(by_case.items(), key=lambda kv: kv[1][0])
                    print(f"{model} {b} {fault}, {rule}: smallest over cases of the largest err/tol "
                          f"{w[1][0]:.3g} ({w[0]} {w[1][1]})", flush=True)
    (out / "errors.json").write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
