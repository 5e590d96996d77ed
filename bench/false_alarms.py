"""The false-alarm matrix: clean runs far from the self-test's own configurations, judged by `duipai compare`.

A verdict is a promise: on a clean run (no fault anywhere) it must never be BUG, a DECLARED must name a
verified difference, and INCONCLUSIVE is a failure to decide. This script trains clean runs over a covering
subset of models x optimizers x schedules (each model x optimizer pair with three of the four schedules, so
every model x schedule and optimizer x schedule pair is covered too: 45 configurations), in every backend
configuration, at dp 1 and 2 (and dp 2 with --sync-bn where the model has BatchNorm and the backend declares
it), plus the drift-only variants (threads 2, eager, XLA, float64, channels_last, oneDNN off; where declared)
on every fifth configuration; compares every configuration's runs with the torch dp=1 reference and its
envelope, and counts the verdicts.

    python bench/false_alarms.py [--steps 300] [--configs 0-44|all] [--backends B ...] [-j 2] [--out DIR]
    python bench/false_alarms.py --quick          # 4 configurations, 60 steps: a smoke run
    python bench/false_alarms.py --models resnet_tiny mobilenet_tiny convnext_tiny --results-name false_alarms-graph

Runs are cached by content key under --out (default /tmp/duipai-false-alarms): a rerun after a harness-only
change recompares without retraining. Writes bench/results/false_alarms.{md,json} (--quick: bench/results/quick/).
Exit 1 when any clean pair is BUG.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import time
from collections import Counter
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from algorithms.spec import load_model  # noqa: E402
from harness import matrix as M  # noqa: E402
from harness import runner  # noqa: E402
from harness.compare_runs import compare_folder  # noqa: E402

HERE = Path(__file__).resolve().parent
MODELS = ("cnn2d_2conv_2fc", "cnn2d_3conv_3fc", "cnn2d_hard")
OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam", "adamw")
SCHEDULES = ("constant", "step", "cosine", "warmup")
# the optimizer's own settings: the learning rates people use, weight decay where it is part of the method
OPT_HPARAMS = {"sgd": {"lr": 0.05}, "momentum": {"lr": 0.05}, "nesterov": {"lr": 0.05, "weight_decay": 5e-4},
               "adam": {"lr": 1e-3}, "adamw": {"lr": 1e-3, "weight_decay": 1e-2}}
VARIANTS = {"threads2": ({"threads": 2}, "threads"), "eager": ({"jit": False}, "eager"),
            "xla": ({"extra": {"xla": True}}, "xla"), "float64": ({"dtype": "float64"}, "float64"),
            "channels_last": ({"extra": {"channels_last": True}}, "channels_last"),
            "onednn_off": ({"extra": {"onednn": "off"}}, "onednn")}


def configurations(models: tuple[str, ...] = MODELS) -> list[dict]:
    """The covering subset: every model x optimizer pair, each with three schedules (the one left out rotates).
    Ordered round-robin: the first 15 cover every model x optimizer pair once, the first 30 twice, so that a
    run stopped early (or --configs 0-14) is still spread over the whole space."""
    out = []
    for (i, model), (j, opt) in itertools.product(enumerate(models), enumerate(OPTIMIZERS)):
        skip = SCHEDULES[(i + j) % len(SCHEDULES)]
        kept = [s for s in SCHEDULES if s != skip]
        kept = kept[(i + 2 * j) % 3:] + kept[:(i + 2 * j) % 3]   # every round meets every schedule
        for rnd, sched in enumerate(kept):
            out.append({"id": f"{model}__{opt}__{sched}", "model": model, "optimizer": opt, "schedule": sched,
                        "round": rnd})
    return sorted(out, key=lambda c: (c["round"], OPTIMIZERS.index(c["optimizer"]), models.index(c["model"])))


def entries_for(conf: dict, backends: list[str], steps: int, with_variants: bool,
                default_lr: bool = False) -> list[M.Entry]:
    """The runs of one configuration; with `default_lr`, at the command's default learning rate (what a user
    gets who names only the optimizer: 0.05 for Adam too, a chaotic regime) instead of OPT_HPARAMS's."""
    info = runner.backend_info()
    own = {k: v for k, v in OPT_HPARAMS[conf["optimizer"]].items() if not (default_lr and k == "lr")}
    m = M.Matrix(name=conf["id"], models=[conf["model"]], backends=backends, devices=[1, 2],
                 optimizers=[conf["optimizer"]], steps=steps,
                 hparams={"schedule": conf["schedule"], "step_size": max(steps // 3, 1), **own})
    entries = M.expand(m)
    base = [e for e in entries if e.role == "run" and e.cfg.devices == 1]
    extra: list[tuple[runner.RunConfig, str]] = []
    if load_model(conf["model"]).has("batchnorm2d"):
        for e in base:
            if "sync_bn" in info[e.cfg.backend].get("capabilities", ()):
                extra.append((replace(e.cfg, devices=2, extra={"sync_bn": True}), "run"))
    if with_variants:
        for e in base:
            for over, cap in VARIANTS.values():
                if cap in info[e.cfg.backend].get("capabilities", ()):
                    extra.append((replace(e.cfg, **over), "variant"))
    seen = {e.name for e in entries}
    for cfg, role in extra:
        name = cfg.default_name(load_model(cfg.model).name)
        if name not in seen:
            seen.add(name)
            entries.append(M.Entry(cfg, name, role))
    return entries


def verdicts(folder: Path) -> list[dict]:
    rows = []
    for c in sorted(folder.rglob("comparison.json")):
        if "runs" in c.relative_to(folder).parts[:-1]:
            continue
        doc = json.loads(c.read_text())
        for p in doc.get("pairs", []):
            if p.get("with_reference"):
                rows.append({"candidate": p["candidate"], "backend": p.get("candidate_backend"), "verdict": p["verdict"],
                             "declared": p.get("declared_differences") or [], "notes": p.get("notes") or [],
                             "first": p.get("first_divergence"), "localization": p.get("localization") or {}})
    return rows


def render(rows: list[dict], meta: dict) -> str:
    counts = Counter(r["verdict"] for r in rows)
    lines = [f"# False-alarm matrix ({meta['when']}, {meta['machine']}, load {meta['load']}, commit {meta['commit']})", "",
             f"`{meta['command']}`: {meta['configs']} configurations, {meta['steps']} steps, {len(rows)} clean pairs "
             f"with the reference, {meta['seconds']:.0f} s.", "",
             "| verdict | pairs |", "|---|---|"]
    lines += [f"| {v} | {n} |" for v, n in sorted(counts.items())]
    by = Counter((r["backend"], r["verdict"]) for r in rows)
    backends = sorted({r["backend"] for r in rows})
    kinds = sorted(counts)
    lines += ["", "| backend | " + " | ".join(kinds) + " |", "|---|" + "---|" * len(kinds)]
    lines += [f"| {b} | " + " | ".join(str(by[(b, k)]) for k in kinds) + " |" for b in backends]
    odd = [r for r in rows if r["verdict"] not in ("DRIFT", "IDENTICAL")]
    if odd:
        lines += ["", "## Every pair that is not DRIFT", "", "| config / candidate | verdict | first | where | declared | note |",
                  "|---|---|---|---|---|---|"]
        for r in odd:
            f = r["first"] or {}
            loc = r["localization"]
            where = " / ".join(str(x) for x in (loc.get("stage"), loc.get("layer") or loc.get("parameter")) if x)
            lines.append(f"| {r['config']} / {r['candidate']} | {r['verdict']} | {f.get('series', '')} @ {f.get('step', '')} | "
                         f"{where} | {', '.join(r['declared'])} | {'; '.join(r['notes'])[:300]} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--configs", default="all", help="'all', or a range/list of indices (0-44, 3,7,9)")
    ap.add_argument("--backends", nargs="+", default=None, help="default: every installed backend")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("/tmp/duipai-false-alarms"))
    ap.add_argument("--models", nargs="+", default=list(MODELS),
                    help="the models of the covering subset (default: the three straight-line models; the graph "
                         "models resnet_tiny, mobilenet_tiny, convnext_tiny train on digits32)")
    ap.add_argument("--results-name", default="false_alarms",
                    help="bench/results/<name>.{md,json} (a run over other models keeps the main table)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--optimizers", nargs="+", default=None, choices=OPTIMIZERS,
                    help="only the configurations of these optimizers (after --configs)")
    ap.add_argument("--default-lr", action="store_true",
                    help="every optimizer at the command's default learning rate (0.05), not the usual one of "
                         "OPT_HPARAMS: where Adam saturates layers and the curves are chaotic from the first steps")
    ap.add_argument("--compare-only", action="store_true",
                    help="train nothing: judge the complete runs already in each configuration's folder under --out "
                         "(after a change of the harness, when a wrapper's source also changed in a way that moves no "
                         "number, so that the run keys no longer match; the table says so)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run before it is stopped (default 900)")
    ap.add_argument("--only", nargs="+", default=None, metavar="RUN",
                    help="train only these runs (their names in the configuration's folder, e.g. the ones that timed "
                         "out), keep the others as they are, then judge the whole folder")
    a = ap.parse_args()
    models = tuple(a.models)
    confs = configurations(models)
    if a.quick:
        confs, a.steps = [confs[i] for i in (0, 6, 12, 44)], 60
    elif a.configs != "all":
        idx: list[int] = []
        for part in a.configs.split(","):
            lo, _, hi = part.partition("-")
            idx += list(range(int(lo), int(hi or lo) + 1))
        confs = [confs[i] for i in idx]
    if a.optimizers:
        confs = [c for c in confs if c["optimizer"] in a.optimizers]
    backends = a.backends or runner.installed_backends()
    out = a.out.resolve()
    t0 = time.time()
    rows = []
    text = ""
    for n, conf in enumerate(confs):
        folder = out / conf["id"]
        if a.compare_only:
            if not (folder / "runs").is_dir():
                print(f"[{n + 1}/{len(confs)}] {conf['id']}: no runs in {folder} (--compare-only), skipped",
                      file=sys.stderr, flush=True)
                continue
            print(f"[{n + 1}/{len(confs)}] {conf['id']}: judging the runs in {folder} (--compare-only)",
                  file=sys.stderr, flush=True)
        else:
            entries = entries_for(conf, backends, a.steps, with_variants=configurations(models).index(conf) % 5 == 0,
                                  default_lr=a.default_lr)
            if a.only:
                unknown = sorted(set(a.only) - {e.name for e in entries})
                if unknown:
                    print(f"--only: no run {', '.join(unknown)} in configuration {conf['id']}", file=sys.stderr)
                    return 2
                entries = [e for e in entries if e.name in a.only]
            print(f"[{n + 1}/{len(confs)}] {conf['id']}: {len(entries)} runs", file=sys.stderr, flush=True)
            entries = M.run_entries(entries, folder, out, a.jobs, timeout=a.timeout, log=lambda s: None)
            if not a.only:   # the status file lists the whole configuration
                M.write_status(folder, type("S", (), {"name": conf["id"], "source": "bench/false_alarms.py"})(), entries)
            failed = [e for e in entries if e.status == "failed"]
            for e in failed:
                print(f"  FAILED {e.name}: {e.message.splitlines()[0] if e.message else ''}", file=sys.stderr)
        t1 = time.time()
        compare_folder(folder, reference="torch", k=3, jobs=a.jobs, log=lambda s: None)
        got = verdicts(folder)
        for r in got:
            rows.append({"config": conf["id"], **r})
        print(f"  {dict(Counter(r['verdict'] for r in got))} (compare {time.time() - t1:.0f} s)", file=sys.stderr, flush=True)
        text = write(rows, a, confs, n + 1, t0)   # after every configuration: a stopped run keeps its table
    print(text)
    return 1 if any(r["verdict"] == "BUG" for r in rows) else 0


def write(rows: list[dict], a: argparse.Namespace, confs: list[dict], done: int, t0: float) -> str:
    import subprocess
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    meta = {"when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores", "load": "%.1f %.1f %.1f" % os.getloadavg(),
            "commit": commit, "command": "python bench/false_alarms.py " + " ".join(sys.argv[1:]),
            "configs": f"{done} of {len(confs)}" if done < len(confs) else len(confs), "steps": a.steps,
            "seconds": time.time() - t0}
    text = render(rows, meta)
    dest = HERE / "results" / ("quick" if a.quick else "")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / f"{a.results_name}.md").write_text(text)
    (dest / f"{a.results_name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    return text


if __name__ == "__main__":
    sys.exit(main())
