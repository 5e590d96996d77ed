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
    """Per kind: the worst RMS-relative error against float64, and the worst ratio to the reference's own; the
    keys the candidate's declared differences may move are left out (another formula on purpose)."""
    out: dict[str, dict] = {}
    keys = set(cand.undeclared_keys())
    cand = cand.arrays
    for k, z in ref64.items():
        if k not in keys or k not in ref or np.shape(cand[k]) != np.shape(z):
            continue
        kind = "continuous" if probes.kind_of(k)[0] in probes.CONTINUOUS_KINDS else "derivative"
        x, y, z = (np.asarray(v, np.float64) for v in (cand[k], ref[k], z))
        rel, own = probes._rms_rel(x, z), probes._rms_rel(y, z)
        w = out.setdefault(kind, {"rel": 0.0, "rel_key": None, "ratio": 0.0, "ratio_key": None})
        if rel > w["rel"]:
            w.update(rel=rel, rel_key=k)
        if own > 0 and rel / own > w["ratio"]:
            w.update(ratio=rel / own, ratio_key=k)
    return out


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
        ref = probes.run_cases(REFERENCE, model, CASE, a.out, probe_steps=1, data=data)["sgd"].arrays
        ref64 = probes.run_cases(REFERENCE, model, CASE, a.out, probe_steps=1, data=data, dtype="float64")["sgd"].arrays
        for b in backends:
            caps = info[b].get("capabilities", ())
            runs = [("dp1", {}, None)] + [(v, kw, None) for v, kw in VARIANTS.items() if v in caps]
            runs += [(f, {}, f) for f in FAULTS if f in info[b].get("faults", ()) and load_model(model).has("gelu")]
            for label, kw, fault in runs:
                try:
                    cand = probes.run_cases(b, model, CASE, a.out, probe_steps=1, data=data, fault=fault, **kw)["sgd"]
                except Exception as e:   # one failed configuration is a row, not the end of the table
                    rows.append({"model": model, "backend": b, "run": label, "error": str(e).splitlines()[0]})
                    continue
                rows.append({"model": model, "backend": b, "run": label, "fault": fault, **worst(cand, ref, ref64)})
                print(f"{model} {b} {label}: {rows[-1].get('continuous')}", file=sys.stderr, flush=True)
    clean = [r for r in rows if not r.get("fault") and "continuous" in r]
    top = max(clean, key=lambda r: r["continuous"]["rel"])
    top_ratio = max(clean, key=lambda r: r["continuous"]["ratio"])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    head = (f"# Continuous probes against float64 at step 0 ({datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, "
            f"{platform.machine()}, {os.cpu_count()} cores, load {'%.1f %.1f %.1f' % os.getloadavg()}, commit {commit})")
    lines = [head, "", f"`python bench/forward_floor.py {' '.join(sys.argv[1:])}`, {time.time() - t0:.0f} s. RMS-relative error "
             f"against {REFERENCE}'s float64 probes; ratio: over {REFERENCE}'s own float32 error on the same key. "
             f"CONTINUOUS_TOL = {probes.CONTINUOUS_TOL:g}, REL_TOL = {probes.REL_TOL:g}.", "",
             f"**Clean, worst continuous key: {top['continuous']['rel']:.2g}** ({top['model']} {top['backend']} {top['run']}, "
             f"{top['continuous']['rel_key']}); worst ratio to the reference's own error {top_ratio['continuous']['ratio']:.2g} "
             f"({top_ratio['model']} {top_ratio['backend']} {top_ratio['run']}, {top_ratio['continuous']['ratio_key']}).", "",
             "| model | backend | run | continuous worst rel | key | ratio to own | derivative worst rel | key |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['backend']} | {r['run']} | failed: {r['error'][:80]} | | | | |")
            continue
        c, d = r.get("continuous", {}), r.get("derivative", {})
        lines.append(f"| {r['model']} | {r['backend']} | {r['run']} | {c.get('rel', 0):.2e} | {c.get('rel_key')} | "
                     f"{c.get('ratio', 0):.2f} | {d.get('rel', 0):.2e} | {d.get('rel_key')} |")
    text = "\n".join(lines) + "\n"
    dest = Path(__file__).resolve().parent / "results"
    (dest / "forward_floor.md").write_text(text)
    (dest / "forward_floor.json").write_text(json.dumps(rows, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
