"""Does a clean backend's replayed training step report what its probe of the same state computes?

The shared-state comparison's replay jobs run one training step of their backend from every state they
probe and record what that step reports (algorithms.contract.Replay.report_steps); where nothing else
localizes a pair, a report that its probe does not compute is stage `report` (harness/reported.py). On a clean
backend that must never happen. This script trains a short clean run of every installed backend
configuration (dp 1 and 2, and dp 2 with --sync-bn where the model has BatchNorm and the backend declares it)
on each model, replays its steps from the torch reference's states (a checkpoint's step and a re-trained
one), and reports, per run, the largest relative distance of each reported series from its recomputation,
against the tolerance harness.reported applies. Every mismatch is a false alarm waiting for a diverging pair.

    python bench/report_rows.py [--models M ...] [--backends B ...] [--steps 6] [--out DIR]
        -> bench/results/report_rows.{md,json}; exit 1 when any run's report is off
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from algorithms.contract import RunConfig  # noqa: E402
from algorithms.optim import HParams  # noqa: E402
from algorithms.spec import load_model  # noqa: E402
from harness import reported, runner  # noqa: E402
from harness.errors import BackendFailed  # noqa: E402
from harness.localize import Localizer  # noqa: E402
from harness.probe_analysis import spec_layers  # noqa: E402
from harness.resync import parameters_at  # noqa: E402
from harness.runs import load_run  # noqa: E402

MODELS = ("cnn2d_hard", "resnet_tiny", "mobilenet_tiny", "convnext_tiny")
GRAPH_DATA = "digits32"


class _AllDiverge:
    """A pair as harness.reported.localize reads it, every reported series diverging (nothing filtered out)."""

    class _Check:
        diverged_step = 0

    def __init__(self, ref, cand):
        self.a, self.b = ref, cand
        self.checks = {s: self._Check() for s in reported.REPORTED}


def configurations(model: str, backends: list[str], info: dict) -> list[tuple[str, int, bool]]:
    has_bn = any(l.kind == "batchnorm2d" for l in load_model(model).layers)
    out = []
    for b in backends:
        can = set(info[b].get("capabilities") or info[b].get("can") or [])
        out.append((b, 1, False))
        if "data_parallel" in can:
            out.append((b, 2, False))
            if has_bn and "sync_bn" in can:
                out.append((b, 2, True))
    return out


def distances(loc: Localizer, rep: dict, who: str, layers: list[str], ref) -> list[dict]:
    """Per replayed point: each series' relative distance of `who`'s report from its probe's recomputation."""
    rows = {int(r[0]): dict(zip(reported.REPORTED, r[1:])) for r in rep["reported"][who]}
    labels = reported.batch_labels(ref, loc.root)
    out = []
    for t, cand_probe, compared, _p64, plain in rep["probes"]:
        probe = cand_probe if who == "candidate" else (compared if plain is None else plain)
        if int(t) not in rows:
            continue
        computed = reported.recomputed(probe, parameters_at(rep, int(t)), layers[-1], labels[int(t)])
        n = sum(int(v.size) for k, v in probe.items() if k.startswith("update0/"))
        off = reported.mismatches(ref, computed, n, int(t), rows[int(t)], reported.loss_floor(probe, layers[-1]))
        out.append({"step": int(t), "off": [m["series"] for m in off],
                    "rel": {s: abs(rows[int(t)][s] - c) / max(abs(c), 1e-12) for s, c in computed.items()}})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--backends", nargs="+", default=None)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", type=Path, default=Path("/tmp/duipai-report-rows"))
    ap.add_argument("--results-name", default="report_rows")
    a = ap.parse_args(argv)
    info = runner.backend_info()
    backends = a.backends or [b for b in runner.installed_backends() if b != "torch"] + ["torch"]
    t0, load0 = time.time(), os.getloadavg()[0]
    out = a.out.resolve()
    rows = []
    for model in a.models:
        data = GRAPH_DATA if model not in ("cnn2d_hard", "cnn2d_2conv_2fc", "cnn2d_3conv_3fc") else "digits"
        hp = HParams(steps=a.steps, optimizer="adamw", lr=0.002, weight_decay=0.01, schedule="step",
                     step_size=max(2, a.steps // 2), checkpoint_every=max(2, a.steps // 2), eval_every=a.steps)
        folder = out / model
        ref = load_run(runner.execute(RunConfig(backend="torch", model=model, data=data, hparams=hp), folder))
        loc = Localizer(folder, log=lambda m: None)
        layers = spec_layers(ref.manifest)
        at = [hp.checkpoint_every, hp.checkpoint_every + 1]   # a checkpoint's step, and one re-trained from it
        for backend, devices, sync_bn in configurations(model, backends, info):
            name = f"{backend}{' dp2' if devices == 2 else ''}{' sync-bn' if sync_bn else ''}"
            try:
                cand = load_run(runner.execute(RunConfig(backend=backend, model=model, data=data, hparams=hp,
                                                         devices=devices,
                                                         extra={"sync_bn": True} if sync_bn else {}), folder))
                rep = loc.replay(ref, cand, at)
            except BackendFailed as e:
                rows.append({"model": model, "run": name, "error": str(e).splitlines()[0]})
                print(f"{model} {name}: FAILED {str(e).splitlines()[0]}", flush=True)
                continue
            got = distances(loc, rep, "candidate", layers, ref)
            found = loc.report_at(_AllDiverge(ref, cand), rep, layers[-1])
            rows.append({"model": model, "run": name, "points": got, "localized": (found or {}).get("summary")})
            worst = {s: max(p["rel"].get(s, 0.0) for p in got) for s in reported.REPORTED} if got else {}
            print(f"{model} {name}: {'OFF ' + str(found['summary']) if found else 'ok'} "
                  + " ".join(f"{s} {v:.1e}" for s, v in worst.items()), flush=True)
        ref_points = distances(loc, rep, "reference", layers, ref)
        rows.append({"model": model, "run": "torch (the reference's own job)", "points": ref_points, "localized": None})
    bad = [r for r in rows if r.get("error") or r.get("localized") or any(p["off"] for p in r.get("points", []))]
    meta = {"when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "load": f"{load0:.1f} -> {os.getloadavg()[0]:.1f}", "seconds": round(time.time() - t0),
            "command": "python bench/report_rows.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    results = ROOT / "bench" / "results"
    (results / f"{a.results_name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [f"# Replayed reports of clean runs against their probes ({meta['when']}, {meta['machine']}, load "
             f"{meta['load']})", "", f"`{meta['command'].strip()}`: {len(rows)} runs, {len(bad)} off, "
             f"{meta['seconds']} s. Per run, the largest relative distance of each reported series from its "
             f"recomputation over the replayed points (harness.reported's tolerance: loss 1e-3, norms the larger "
             f"of 1e-3 and 8 float32 epsilons x sqrt(n); accuracy one sample).", "",
             "| model | run | " + " | ".join(reported.REPORTED) + " | off |", "|---|---|" + "---:|" * 5 + "---|"]
    for r in rows:
        pts = r.get("points") or []
        worst = [max((p["rel"].get(s, 0.0) for p in pts), default=float("nan")) for s in reported.REPORTED]
        off = r.get("error") or r.get("localized") or ", ".join(sorted({s for p in pts for s in p["off"]})) or "-"
        lines.append(f"| {r['model']} | {r['run']} | " + " | ".join(f"{w:.1e}" for w in worst) + f" | {off} |")
    (results / f"{a.results_name}.md").write_text("\n".join(lines) + "\n")
    print(f"{len(rows)} runs, {len(bad)} off; bench/results/{a.results_name}.md", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
