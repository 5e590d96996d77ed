"""How far clean float32 backends' continuous probes (activations, loss, running statistics, evaluation) land
from the reference's float64 step-0 probes: the numbers behind harness.probes.CONTINUOUS_TOL.

A value that is a continuous function of the parameters and the batch moves by rounding under rounding; a
derivative (gradient, update, optimizer state) can jump where rounding flips a ReLU kink or a max-pool tie, so
it keeps REL_TOL's room. Per model x backend configuration (dp 1, and every drift-only variant the backend
declares): the worst RMS-relative error against float64 of each kind, and the worst ratio to the reference's
own float32 error on the same key; then the faults that change a continuous value by little (gelu_tanh_approx)
on every backend that implements them, to show they sit above the floor.

    python bench/forward_floor.py [--models a b] [--backends x y] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from algorithms.optim import HParams  # noqa: E402
from algorithms.params import load_npz  # noqa: E402
from algorithms.spec import load_model  # noqa: E402
from harness import probes  # noqa: E402
from harness.defaults import REFERENCE  # noqa: E402
from harness.runner import backend_info, installed_backends  # noqa: E402

MODELS = ("cnn2d_2conv_2fc", "cnn2d_3conv_3fc", "cnn2d_hard", "resnet_tiny", "mobilenet_tiny", "convnext_tiny")
VARIANTS = {"xla": {"extra": {"xla": True}}, "channels_last": {"extra": {"channels_last": True}},
            "onednn": {"extra": {"onednn": "off"}}, "eager": {"jit": False}}
FAULTS = ("gelu_tanh_approx",)
CASE = {"sgd": HParams(optimizer="sgd", lr=0.1, steps=1, batch_size=64, eval_every=1, checkpoint_every=1)}


def data_for(model: str) -> str:
    return "digits32" if load_model(model).input_shape[0] == 32 else "digits"


def worst(cand: probes.ProbeResult, ref: dict, ref64: dict) -> dict[str, dict]:
    """Per kind (continuous, derivative), as harness.probes.compare judges a key (its scale, the exactly-zero rule,
    the loss's logits allowance): the worst error, the worst ratio to the reference's own error and the worst
    factor of the key's tolerance; the keys the candidate's declared differences may move are left out
    (another formula on purpose)."""
    keys = [k for k in cand.undeclared_keys() if k in ref and k in ref64]
    out: dict[str, dict] = {}
    for d in probes.compare(cand.arrays, ref, keys=keys, ref64=ref64, logits_key=None):
        kind = "continuous" if d.kind in probes.CONTINUOUS_KINDS else "derivative"
        w = out.setdefault(kind, {"rel": 0.0, "rel_key": None, "ratio": 0.0, "ratio_key": None, "factor": 0.0,
                                  "factor_key": None})
        for what, v in (("rel", d.rel), ("ratio", d.rel / d.own if d.own > 0 else 0.0), ("factor", d.rel / d.tol)):
            if np.isfinite(v) and v > w[what]:
                w.update({what: float(v), f"{what}_key": d.key})
    return out


def cached(backend: str, model: str, out: Path, variant: str, **kw) -> probes.ProbeResult:
    """One probe job per (backend, model, variant): its own folder, reused when it is there."""
    folder_root = out / variant
    label = f"probe__{model}__{backend}__{kw.get('fault') or 'clean'}__{kw.get('dtype', 'float32')}"
    folder = folder_root / label
    if (folder / "probe-0.npz").is_file():
        return probes.ProbeResult(load_npz(folder / "probe-0.npz"),
                                  json.loads((folder / "probe-0.json").read_text())["declared_differences"])
    return probes.run_cases(backend, model, CASE, folder_root, probe_steps=1, **kw)["sgd"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--backends", nargs="+", default=None, help="default: every installed backend")
    ap.add_argument("--out", type=Path, default=Path("/tmp/duipai-forward-floor"))
    a = ap.parse_args()
    info = backend_info()
    backends = a.backends or installed_backends()
    t0, rows = time.time(), []
    for model in a.models:
        data = data_for(model)
        ref = cached(REFERENCE, model, a.out, "dp1", data=data).arrays
        ref64 = cached(REFERENCE, model, a.out, "dp1", data=data, dtype="float64").arrays
        for b in backends:
            caps = info[b].get("capabilities", ())
            runs = [("dp1", {}, None)] + [(v, kw, None) for v, kw in VARIANTS.items() if v in caps]
            runs += [(f, {}, f) for f in FAULTS if f in info[b].get("faults", ()) and load_model(model).has("gelu")]
            for label, kw, fault in runs:
                try:
                    cand = cached(b, model, a.out, label, data=data, fault=fault, **kw)
                except Exception as e:   # one failed configuration is a row, not the end of the table
                    rows.append({"model": model, "backend": b, "run": label, "error": str(e).splitlines()[0]})
                    continue
                rows.append({"model": model, "backend": b, "run": label, "fault": fault, **worst(cand, ref, ref64)})
                print(f"{model} {b} {label}: {rows[-1].get('continuous')}", file=sys.stderr, flush=True)
    clean = [r for r in rows if not r.get("fault") and "continuous" in r]
    top = {w: max(clean, key=lambda r: r["continuous"][w]) for w in ("rel", "ratio", "factor")}
    faulty = [r for r in rows if r.get("fault") and "continuous" in r]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    head = (f"# Continuous probes against float64 at step 0 ({datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, "
            f"{platform.machine()}, {os.cpu_count()} cores, load {'%.1f %.1f %.1f' % os.getloadavg()}, commit {commit})")

    def where(r: dict, w: str) -> str:
        return f"{r['model']} {r['backend']} {r['run']}, {r['continuous'][w + '_key']}"

    lines = [head, "", f"`python bench/forward_floor.py {' '.join(sys.argv[1:])}`, {time.time() - t0:.0f} s. Each key judged as "
             f"harness.probes.compare judges it against {REFERENCE}'s float32 and float64 step-0 probes (RMS over the "
             f"key's scale; a value zero in exact arithmetic at its kind's scale): rel, its ratio to {REFERENCE}'s own "
             f"float32 error, its factor of the key's tolerance (max(floor, 3 x own)). Continuous: forward, loss, buffer, "
             f"eval (floor CONTINUOUS_TOL = {probes.CONTINUOUS_TOL:g}); derivative: grad, update, opt (REL_TOL = "
             f"{probes.REL_TOL:g}). Keys a declared difference may move are left out.", "",
             f"**Clean ({len(clean)} model x backend configurations), continuous keys: worst "
             f"{top['factor']['continuous']['factor']:.2g}x the tolerance** ({where(top['factor'], 'factor')}); worst rel "
             f"{top['rel']['continuous']['rel']:.2g} ({where(top['rel'], 'rel')}); worst ratio to the reference's own error "
             f"{top['ratio']['continuous']['ratio']:.2g} ({where(top['ratio'], 'ratio')})."]
    if faulty:
        lo = min(faulty, key=lambda r: r["continuous"]["factor"])
        lines += ["", f"**Faults, continuous keys: at least {lo['continuous']['factor']:.2g}x the tolerance** "
                      f"({where(lo, 'factor')}, rel {lo['continuous']['rel']:.2g})."]
    lines += ["", "| model | backend | run | continuous worst rel | key | x own | x tolerance | derivative worst rel | key | x tolerance |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['backend']} | {r['run']} | failed: {r['error'][:80]} | | | | | | |")
            continue
        c, d = r.get("continuous", {}), r.get("derivative", {})
        lines.append(f"| {r['model']} | {r['backend']} | {r['run']} | {c.get('rel', 0):.2e} | {c.get('rel_key')} | "
                     f"{c.get('ratio', 0):.2f} | {c.get('factor', 0):.3f} | {d.get('rel', 0):.2e} | {d.get('rel_key')} | "
                     f"{d.get('factor', 0):.3f} |")
    text = "\n".join(lines) + "\n"
    dest = Path(__file__).resolve().parent / "results"
    (dest / "forward_floor.md").write_text(text)
    (dest / "forward_floor.json").write_text(json.dumps(rows, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
