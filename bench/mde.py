"""Minimum detectable effect: how small a hyper-parameter error `duipai compare` still calls BUG.

For each built-in straight-line model and each knob — learning rate x (1 + e), momentum + e, weight decay + e,
BatchNorm eps x (1 + e) (models with BatchNorm) — a candidate backend is trained with the perturbation
(`duipai run --fault <knob>_<rel|abs>_<e>`, a bug every wrapper applies the same way) for e = 1e-1, 1e-2, ...
down to 1e-8, and compared with the clean torch reference and its envelope twice: by the envelope rule alone
(`--resync-every 0`, the rule before the shared-state comparison) and by the default rule (resync every 25
steps and the sequential test). The table gives per model and knob the smallest e each rule calls BUG, and
the step at which it did. A knob's sweep stops after two e in a row that neither rule calls BUG.

    python bench/mde.py [--backend jax] [--steps 300] [--models M ...] [-j 2] [--out DIR]

Writes bench/results/mde.{md,json}. Runs are cached under --out (default /tmp/duipai-mde).
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from algorithms.faults import perturbation_name  # noqa: E402
from algorithms.optim import HParams  # noqa: E402
from algorithms.spec import load_model  # noqa: E402
from harness import runner  # noqa: E402
from harness.compare_runs import DEFAULT_RESYNC_EVERY, compare_runs  # noqa: E402
from harness.envelope import envelope_runs, envelope_seeds  # noqa: E402
from harness.runs import load_run  # noqa: E402

HERE = Path(__file__).resolve().parent
MODELS = ("cnn2d_2conv_2fc", "cnn2d_3conv_3fc", "cnn2d_hard")
# knob -> (perturbation target, mode, what the model needs)
KNOBS = {"lr x (1+e)": ("lr", "rel", None), "momentum + e": ("momentum", "abs", None),
         "weight decay + e": ("weight_decay", "abs", None), "BatchNorm eps x (1+e)": ("bn_eps", "rel", "batchnorm2d")}
EXPONENTS = range(1, 9)


def train(cfg: runner.RunConfig, out: Path) -> Path:
    name = cfg.default_name(load_model(cfg.model).name)
    if (out / name / "manifest.json").is_file():
        return out / name
    return runner.execute(cfg, out, name)


def verdict(ref: Path, cand: Path, members: list[Path], resync_every: int, jobs: int) -> dict:
    o = compare_runs(paths=[ref, cand], reference="torch", envelope_paths=members, resync_every=resync_every,
                     out=cand / f"cmp-resync{resync_every}", jobs=jobs, log=lambda s: None)
    pair = next(p for p in json.loads(o.json_text)["pairs"] if p.get("with_reference"))
    first = pair.get("first_divergence") or {}
    return {"verdict": pair["verdict"], "step": first.get("step"), "series": first.get("series")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="jax")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("-j", "--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("/tmp/duipai-mde"))
    ap.add_argument("--knobs", nargs="+", default=None, choices=[k.split()[0] for k in KNOBS],
                    help="only these knobs (by their first word: lr momentum weight BatchNorm); the other rows "
                         "of bench/results/mde.json are kept, with the commit and load they were measured at")
    a = ap.parse_args()
    out = a.out.resolve()
    t0 = time.time()
    commit = _commit()
    rows = []
    for model in a.models:
        hp = HParams(optimizer="momentum", lr=0.05, steps=a.steps, eval_every=50, checkpoint_every=50)
        folder = out / model
        ref = load_run(train(runner.RunConfig(model=model, backend="torch", hparams=hp), folder))
        members, _ = envelope_runs(ref, envelope_seeds(3, set()), jobs=a.jobs)
        member_paths = [m.path for m in members]
        for knob, (target, mode, needs) in KNOBS.items():
            if (needs and not load_model(model).has(needs)) or (a.knobs and knob.split()[0] not in a.knobs):
                continue
            quiet = 0
            for x in EXPONENTS:
                e = 10.0 ** -x
                if target == "momentum" and hp.momentum + e >= 1.0:
                    continue   # momentum 0.9 + 0.1 is no momentum SGD (HParams refuses it)
                fault = perturbation_name(target, mode, e)
                cand = train(runner.RunConfig(model=model, backend=a.backend, hparams=hp, fault=fault), folder)
                old = verdict(ref.path, cand, member_paths, 0, a.jobs)
                new = verdict(ref.path, cand, member_paths, DEFAULT_RESYNC_EVERY, a.jobs)
                rows.append({"model": model, "knob": knob, "e": e, "fault": fault, "envelope": old, "resync": new,
                             "commit": commit, "load": "%.1f" % os.getloadavg()[0]})
                print(f"{model} {knob} e={e:.0e}: envelope {old['verdict']} @ {old['step']}, "
                      f"resync {new['verdict']} @ {new['step']}", file=sys.stderr, flush=True)
                quiet = quiet + 1 if old["verdict"] != "BUG" and new["verdict"] != "BUG" else 0
                if quiet == 2:
                    break
            write(rows, a, t0)
    print(write(rows, a, t0))
    return 0


def smallest(rows: list[dict], rule: str) -> str:
    """The smallest e called BUG, with the step, when every larger e tried was BUG too."""
    best = None
    for r in sorted(rows, key=lambda r: -r["e"]):
        if r[rule]["verdict"] != "BUG":
            break
        best = r
    if best is None:
        return "not detected at 1e-1" if rows else "-"
    return f"{best['e']:.0e} (step {best[rule]['step']})"


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()


def kept_rows(rows: list[dict]) -> list[dict]:
    """The rows of the last bench/results/mde.json for the (model, knob) pairs not measured in this run."""
    old = HERE / "results" / "mde.json"
    if not old.is_file():
        return []
    doc = json.loads(old.read_text())
    done = {(r["model"], r["knob"]) for r in rows}
    return [dict(r, commit=r.get("commit", doc["meta"]["commit"]), load=r.get("load", doc["meta"]["load"].split()[0]))
            for r in doc["rows"] if (r["model"], r["knob"]) not in done]


def write(rows: list[dict], a: argparse.Namespace, t0: float) -> str:
    commit = _commit()
    if a.knobs:
        rows = kept_rows(rows) + rows
    meta = {"when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores", "load": "%.1f %.1f %.1f" % os.getloadavg(),
            "commit": commit, "command": "python bench/mde.py " + " ".join(sys.argv[1:]), "seconds": time.time() - t0,
            "backend": a.backend, "steps": a.steps}
    lines = [f"# Minimum detectable effect ({meta['when']}, {meta['machine']}, load {meta['load']}, commit {commit})", "",
             f"`{meta['command']}`: candidate {a.backend} with the perturbation vs the clean torch reference, "
             f"momentum SGD lr 0.05, {a.steps} steps, {meta['seconds']:.0f} s. The smallest e (powers of 10) called BUG:",
             "", "| model | knob | envelope rule alone (`--resync-every 0`) | default rule (resync every "
             f"{DEFAULT_RESYNC_EVERY} + sequential test) |", "|---|---|---|---|"]
    for model in dict.fromkeys(r["model"] for r in rows):
        for knob in dict.fromkeys(r["knob"] for r in rows if r["model"] == model):
            sub = [r for r in rows if r["model"] == model and r["knob"] == knob]
            lines.append(f"| {model} | {knob} | {smallest(sub, 'envelope')} | {smallest(sub, 'resync')} |")
    lines += ["", "Every run: `e`, the verdict and first step of each rule, the commit and the load (1 min) it ran at.", "",
              "| model | knob | e | envelope | resync | commit | load |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['knob']} | {r['e']:.0e} | {r['envelope']['verdict']} @ {r['envelope']['step']} | "
              f"{r['resync']['verdict']} @ {r['resync']['step']} | {r.get('commit', commit)} | {r.get('load', '')} |"
              for r in rows]
    text = "\n".join(lines) + "\n"
    dest = HERE / "results"
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "mde.md").write_text(text)
    (dest / "mde.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    return text


if __name__ == "__main__":
    sys.exit(main())
