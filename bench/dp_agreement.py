"""300-step agreement of data-parallel runs (--devices 2, 4) with the same backend's dp=1 run,
against that backend's own 1-ULP envelope.

For each backend that takes `--devices N` and each model without BatchNorm or dropout
(cnn2d_2conv_2fc, cnn2d_3conv_3fc): the dp=1 reference run, dp=2 and dp=4 runs, and K dp=1 runs
whose initial weights are moved by one ULP (`--perturb-ulp 1..K`, K=2), all momentum (lr 0.05),
batch 64. Per run, d = max over steps of |loss(run) - loss(dp=1)|.

Envelope rule (the one of bench/agreement.py): envelope = max over the K ULP runs of their d;
ratio = d(dp=N) / envelope; PASS when d(dp=N) <= 3 x envelope (issue 4's acceptance line).

For a model with BatchNorm (cnn2d_hard, which also has dropout, same harness masks at every N):
the dp=2 run is compared the same way, with the `declared_differences` its manifest records. When
it declares one that the dp=1 run does not (per-replica BatchNorm statistics: mean/var over B/N
samples instead of B, other mathematics) the row is DECLARED, not judged; otherwise it is judged
by the rule above and, since the model is chaotic enough (one ULP grows to ~0.2) to hide a
systematic difference over 300 steps, also over steps 0..10 against the envelope of those steps
(floored at one float32 ULP of the first loss). Where the backend has `--sync-bn`, a dp=2
synchronized-BatchNorm run is added (global-batch statistics again).

Runs are cached by content key (harness.matrix.run_key: spec, data, weights, order, hyper-parameters,
options, backend versions and wrapper sources) under --cache (default /tmp/duipai-dp-agreement),
so a rerun only trains what changed; refusals (UNSUPPORTED) are cached by key too.

    python bench/dp_agreement.py [--backends torch tensorflow jax ...] [--models ...] [--steps 300] [--k 2] [--quick]

Writes bench/results/dp_agreement.md and dp_agreement.json (with --quick: bench/results/quick/).
With --backends, rows of other backends already in the JSON are kept (so keras backends can be
added later alone).
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

import numpy as np
import pandas as pd

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))
from algorithms.optim import HParams  # noqa: E402
from algorithms.spec import load_model  # noqa: E402
from harness import runner  # noqa: E402
from harness.matrix import run_key, up_to_date  # noqa: E402
from algorithms.contract import RunConfig  # noqa: E402
from harness.errors import BackendFailed, BadInput  # noqa: E402
from bench_dp import DP_BACKENDS, git_state, loadavg, uptime  # noqa: E402  (one copy of the run-context helpers)

RESULTS = HERE / "results"
CLEAN_MODELS = ["cnn2d_2conv_2fc", "cnn2d_3conv_3fc"]
BN_MODEL = "cnn2d_hard"
TARGET = 3.0
EARLY = 10        # steps 0..EARLY: before chaotic growth, where a declared difference stands out


class Runs:
    """Train (or reuse) runs under cache/runs/<name>, keyed by content; refusals remembered by key."""

    def __init__(self, cache: Path, timeout: float) -> None:
        self.cache, self.timeout = cache, timeout
        self.runs = cache / "runs"
        self.runs.mkdir(parents=True, exist_ok=True)
        self.refusals_file = cache / "refusals.json"
        try:
            self.refusals = json.loads(self.refusals_file.read_text())
        except (OSError, json.JSONDecodeError):
            self.refusals = {}
        self.trained = self.reused = 0

    def get(self, cfg: RunConfig) -> dict:
        """{'folder', 'loss', 'manifest'} or {'refused': msg} or {'failed': msg}."""
        try:
            prep = runner.prepare(cfg, self.cache)
        except BadInput as e:
            return {"failed": f"bad input: {e}"}
        key = run_key(cfg, prep)
        name = cfg.default_name(prep.model.name)
        folder = self.runs / name
        if key in self.refusals:
            return {"refused": self.refusals[key], "cached": True}
        if up_to_date(folder, key):
            self.reused += 1
            cached = True
        else:
            t0 = time.time()
            print(f"  training {name} (load {loadavg()})", file=sys.stderr, flush=True)
            try:
                runner.execute(cfg, self.runs, name, timeout=self.timeout, prepared=prep,
                               manifest_extra={"run_key": key})
            except BackendFailed as e:
                msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                if e.unsupported:
                    self.refusals[key] = msg
                    self.refusals_file.write_text(json.dumps(self.refusals, indent=2))
                    print(f"  refused: {msg}", file=sys.stderr, flush=True)
                    return {"refused": msg}
                print(f"  FAILED: {msg}", file=sys.stderr, flush=True)
                return {"failed": msg}
            self.trained += 1
            cached = False
            print(f"    done in {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
        man = json.loads((folder / "manifest.json").read_text())
        return {"folder": str(folder), "loss": pd.read_csv(folder / "steps.csv")["loss"], "manifest": man,
                "cached": cached}


def diff(a: pd.Series, b: pd.Series) -> tuple[float, int]:
    d = (a - b).abs()
    return float(d.max()), int(d.idxmax())


def has_bn_or_dropout(model: str) -> bool:
    return any(l.kind in ("batchnorm2d", "dropout") for l in load_model(model).layers)


def measure_backend_model(runs: Runs, backend: str, model: str, steps: int, k: int, devices: list[int],
                          sync_bn: bool) -> list[dict]:
    hp = HParams(steps=steps, optimizer="momentum", lr=0.05)
    base = {"model": model, "backend": backend, "steps": steps}
    ref = runs.get(RunConfig(model=model, backend=backend, hparams=hp))
    if "loss" not in ref:
        return [{**base, "devices": 1, "error": ref.get("refused") or ref.get("failed")}]
    ulps, early = [], []
    for s in range(1, k + 1):
        u = runs.get(RunConfig(model=model, backend=backend, hparams=hp, perturb_ulp=s))
        if "loss" not in u:
            return [{**base, "devices": 1, "error": f"perturb-ulp {s}: {u.get('refused') or u.get('failed')}"}]
        ulps.append(diff(u["loss"], ref["loss"]))
        early.append(diff(u["loss"].iloc[:EARLY + 1], ref["loss"].iloc[:EARLY + 1])[0])
    env, env_early = max(d for d, _ in ulps), max(early)
    common = {**base, **{f"ulp{s}": d for s, (d, _) in enumerate(ulps, 1)},
              **{f"ulp{s}_at_step": t for s, (_, t) in enumerate(ulps, 1)}, "envelope": env,
              "envelope_early": env_early}
    rows = []
    variants = [(n, False) for n in devices] + ([(2, True)] if sync_bn else [])
    for n, sbn in variants:
        cfg = RunConfig(model=model, backend=backend, hparams=hp, devices=n, extra={"sync_bn": True} if sbn else {})
        r = runs.get(cfg)
        row = {**common, "devices": n, "sync_bn": sbn}
        if "loss" not in r:
            row["refused" if "refused" in r else "error"] = r.get("refused") or r.get("failed")
            rows.append(row)
            continue
        d, at = diff(r["loss"], ref["loss"])
        man = r["manifest"]
        declared = [x["id"] for x in man.get("declared_differences", [])]
        par = man.get("parallel", {})
        row.update({"max_abs_loss_diff": d, "at_step": at,
                    "early_max_abs_loss_diff": diff(r["loss"].iloc[:EARLY + 1], ref["loss"].iloc[:EARLY + 1])[0],
                    "ratio": d / env if env else float("inf"),
                    "declared": declared, "strategy": par.get("strategy"), "processes": par.get("processes"),
                    "batchnorm_statistics": par.get("batchnorm_statistics") or par.get("batchnorm"),
                    "final_loss_dp1": float(ref["loss"].iloc[-1]), "final_loss": float(r["loss"].iloc[-1]),
                    # growth of the difference: where the two trajectories part
                    "diff_at": {t: float(abs(r["loss"].iloc[t] - ref["loss"].iloc[t]))
                                for t in (0, 10, 50, 100, 200, steps - 1) if t < steps}})
        # only the differences data parallelism adds count here: those the dp=1 run declares too
        # (e.g. running_var_biased on keras-*) are differences from the reference math, not from dp=1
        ref_declared = {x["id"] for x in ref["manifest"].get("declared_differences", [])}
        row["declared_dp"] = [x for x in declared if x not in ref_declared]
        # early window floor: one float32 ULP of the first loss (an envelope of exactly 0 over 11 steps
        # must not turn a last-bit difference into a failure)
        row["early_floor"] = float(np.spacing(np.float32(ref["loss"].iloc[0])))
        if row["declared_dp"]:
            row["verdict"] = "DECLARED: " + ", ".join(row["declared_dp"])
        elif d > TARGET * env:
            row["verdict"] = "FAIL"
        elif has_bn_or_dropout(model) and row["early_max_abs_loss_diff"] > TARGET * max(env_early, row["early_floor"]):
            # a chaotic model hides a systematic difference in 300 steps; its first steps do not
            row["verdict"] = f"FAIL (steps 0..{EARLY}: undeclared difference)"
        else:
            row["verdict"] = "PASS"
        rows.append(row)
    return rows


def ratio_ulp1(r: dict) -> str:
    """d against the first ULP run alone (the acceptance line's 'two dp=1 runs' read literally)."""
    u = r.get("ulp1")
    return f"{r['max_abs_loss_diff'] / u:.2f}" if u else "-"


def g(v) -> str:
    return "-" if v is None or (isinstance(v, float) and v != v) else f"{v:.3g}"


def markdown(rows: list[dict], meta: dict) -> str:
    la, lb = meta["loadavg_start"], meta["loadavg_end"]
    fl = lambda x: " / ".join(f"{v:.2f}" for v in x) if x else "?"  # noqa: E731
    lines = ["## Data-parallel agreement: dp=N against dp=1 vs the 1-ULP envelope", "",
             f"{meta['date']}, {meta['node']}, {meta['platform']}, {meta['nproc']} CPUs; load average (1/5/15 min) "
             f"{fl(la)} at start, {fl(lb)} at end; {meta['duration_s']:.0f} s ({meta['trained']} runs trained, "
             f"{meta['reused']} reused from the cache). {meta['steps']} steps, momentum (lr 0.05), batch 64, K={meta['k']}."
             f"{' **Quick smoke run.**' if meta['quick'] else ''}", "",
             f"Command: `{meta['command']}`; commit {meta['git']['commit']}"
             + (f", working tree changes in {', '.join(meta['git']['dirty'])}" if meta['git']['dirty'] else "") + ".", "",
             "d = max over steps of |loss(run) - loss(same backend, dp=1)|. Envelope (rule of bench/agreement.py): "
             f"the largest d of the K dp=1 runs whose initial weights moved by one ULP (`--perturb-ulp 1..{meta['k']}`). "
             f"Ratio = d(dp=N) / envelope; PASS when <= {TARGET:g}. `d / ulp1 alone`: against the first ULP run only "
             "(the acceptance line read literally, one pair of dp=1 runs), for information.", "",
             "### Models without BatchNorm or dropout", "",
             "| model | backend | N | d(dp=N) | at step | ulp1 | ulp2 | envelope | ratio | d / ulp1 alone | verdict |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    bn_lines = ["", f"### {BN_MODEL} (BatchNorm + dropout): the difference declared where it applies", "",
                "Verdict: DECLARED when the dp=N run's manifest declares a difference that the dp=1 run does not "
                "(per-replica BatchNorm statistics); otherwise judged like the models above, and in addition over "
                f"steps 0..{EARLY} against the envelope of those steps (at least one float32 ULP of the first loss).", "",
                f"The whole-run d is of the order of the envelope (the model is chaotic: one ULP grows to ~0.2-0.3), "
                f"so the per-replica statistics show where trajectories have not yet parted: steps 0..{EARLY} "
                f"(d and envelope over those steps only; step 0 is the first forward pass, before any update).", "",
                f"| backend | N | sync-BN | d at step 0 | d, steps 0..{EARLY} | envelope, steps 0..{EARLY} | d(dp=N), "
                f"{meta['steps']} steps | envelope | ratio | manifest declared_differences | BatchNorm statistics (manifest) | verdict |",
                "|---|---:|---|---:|---:|---:|---:|---:|---:|---|---|---|"]
    notes = []
    for r in rows:
        bn = r["model"] != "-" and (r["model"] == BN_MODEL or has_bn_or_dropout(r["model"]))
        if "error" in r or "refused" in r:
            why = r.get("refused") or r.get("error")
            tag = "refused" if "refused" in r else "error"
            if bn:
                bn_lines.append(f"| {r['backend']} | {r['devices']} | {'yes' if r.get('sync_bn') else 'no'} | {tag} "
                                f"| | | | | | | | {tag} |")
            else:
                lines.append(f"| {r['model']} | {r['backend']} | {r['devices']} | {tag} | | | | | | | {tag} |")
            notes.append(f"- {r['model']} / {r['backend']} dp={r['devices']}{' sync-BN' if r.get('sync_bn') else ''}: "
                         f"{tag}: {why}")
            continue
        if bn:
            bn_lines.append(f"| {r['backend']} | {r['devices']} | {'yes' if r.get('sync_bn') else 'no'} | "
                            f"{g(r['diff_at'].get(0, r['diff_at'].get('0')))} | {g(r['early_max_abs_loss_diff'])} | {g(r['envelope_early'])} | "
                            f"{g(r['max_abs_loss_diff'])} | {g(r['envelope'])} | {r['ratio']:.2f} | "
                            f"{', '.join(r['declared']) or '(none)'} | {r.get('batchnorm_statistics') or '-'} | "
                            f"{'**' + r['verdict'] + '**' if r['verdict'].startswith('FAIL') else r['verdict']} |")
        else:
            v = f"**{r['verdict']}**" if r["verdict"].startswith("FAIL") else r["verdict"]
            lines.append(f"| {r['model']} | {r['backend']} | {r['devices']} | {g(r['max_abs_loss_diff'])} | "
                         f"{r['at_step']} | {g(r.get('ulp1'))} | {g(r.get('ulp2'))} | {g(r['envelope'])} | "
                         f"{r['ratio']:.2f} | {ratio_ulp1(r)} | {v} |")
    if not any(r["model"] == BN_MODEL or has_bn_or_dropout(r["model"]) for r in rows if r.get("model") != "-"):
        bn_lines = []
    text = "\n".join(lines + bn_lines)
    if notes:
        text += "\n\n" + "\n".join(notes)
    return text + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", nargs="+", default=DP_BACKENDS, metavar="B", help=f"default: {' '.join(DP_BACKENDS)}")
    ap.add_argument("--models", nargs="+", default=None,
                    help=f"default: {' '.join(CLEAN_MODELS)} {BN_MODEL} (--quick: {CLEAN_MODELS[0]})")
    ap.add_argument("--steps", type=int, default=None, help="default 300 (--quick 60)")
    ap.add_argument("--k", type=int, default=2, help="ULP-perturbed dp=1 runs per backend and model")
    ap.add_argument("--devices", type=int, nargs="+", default=[2, 4], help="N compared with dp=1 (BatchNorm model: 2)")
    ap.add_argument("--no-sync-bn", action="store_true", help=f"skip the dp=2 --sync-bn run of {BN_MODEL}")
    ap.add_argument("--quick", action="store_true", help="smoke run: 60 steps, cnn2d_2conv_2fc, results/quick/")
    ap.add_argument("--cache", type=Path, default=Path(tempfile_dir()) / "duipai-dp-agreement",
                    help="run cache (default /tmp/duipai-dp-agreement)")
    ap.add_argument("--timeout", type=float, default=900.0, help="per run, seconds")
    ap.add_argument("--results", type=Path, default=None, help="output folder (default bench/results[/quick])")
    ap.add_argument("--render-only", action="store_true",
                    help="rewrite the Markdown from the JSON of the last run (no training, no cache)")
    args = ap.parse_args(argv)
    if args.render_only:
        out_dir = args.results or (RESULTS / "quick" if args.quick else RESULTS)
        old = json.loads((out_dir / "dp_agreement.json").read_text())
        text = markdown(old["rows"], old)
        if old.get("kept_rows_from"):
            k = old["kept_rows_from"]
            text += (f"\nRows of {', '.join(k['backends'])} kept from the run of {k['date']} "
                     f"(`{k['command']}`, load average {k['loadavg_start']} at its start).\n")
        (out_dir / "dp_agreement.md").write_text(text)
        print(text)
        return 0
    steps = args.steps or (60 if args.quick else 300)
    models = args.models or ([CLEAN_MODELS[0]] if args.quick else CLEAN_MODELS + [BN_MODEL])
    out_dir = args.results or (RESULTS / "quick" if args.quick else RESULTS)
    info = runner.backend_info()
    unknown = [b for b in args.backends if b not in info]
    if unknown:
        ap.error(f"unknown backend(s) {', '.join(unknown)}; known: {', '.join(info)}")
    started = time.time()
    meta = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "node": platform.node(),
            "platform": platform.platform(), "nproc": os.cpu_count(), "git": git_state(), "uptime_start": uptime(),
            "loadavg_start": loadavg(), "steps": steps, "k": args.k, "quick": args.quick, "models": models,
            "backends": args.backends, "envelope_rule": "max over the K ULP runs of max_t |loss_ulp - loss_dp1|",
            "target_ratio": TARGET,
            "command": " ".join(["python bench/dp_agreement.py", *(argv if argv is not None else sys.argv[1:])])}
    runs = Runs(args.cache, args.timeout)
    rows: list[dict] = []
    for b in args.backends:
        if info[b]["missing"]:
            rows.append({"model": "-", "backend": b, "devices": "-", "error": f"not installed ({', '.join(info[b]['missing'])})"})
            continue
        for m in models:
            bn = has_bn_or_dropout(m)
            print(f"dp_agreement: {b} / {m}", file=sys.stderr, flush=True)
            rows += measure_backend_model(runs, b, m, steps, args.k, [2] if bn else args.devices,
                                          sync_bn=bn and not args.no_sync_bn)
    meta.update({"uptime_end": uptime(), "loadavg_end": loadavg(), "duration_s": time.time() - started,
                 "trained": runs.trained, "reused": runs.reused, "cache": str(args.cache)})
    out_dir.mkdir(parents=True, exist_ok=True)
    js = out_dir / "dp_agreement.json"
    kept: list[dict] = []
    if js.exists():   # keep other backends' rows from an earlier run with the same steps
        try:
            old = json.loads(js.read_text())
            if old.get("steps") == steps:
                kept = [r for r in old.get("rows", []) if r.get("backend") not in args.backends]
                if kept:
                    meta["kept_rows_from"] = {"date": old.get("date"), "command": old.get("command"),
                                              "loadavg_start": old.get("loadavg_start"),
                                              "backends": sorted({r['backend'] for r in kept})}
        except (OSError, json.JSONDecodeError):
            pass
    all_rows = kept + rows
    text = markdown(all_rows, meta)
    if kept:
        k = meta["kept_rows_from"]
        text += (f"\nRows of {', '.join(k['backends'])} kept from the run of {k['date']} "
                 f"(`{k['command']}`, load average {k['loadavg_start']} at its start).\n")
    print(text)
    (out_dir / "dp_agreement.md").write_text(text)
    js.write_text(json.dumps({**meta, "rows": all_rows}, indent=2, default=str))
    bad = [r for r in rows if str(r.get("verdict", "")).startswith("FAIL")]
    if bad:   # reported in the table; the exit status stays 0 so that run_all keeps the table (as agreement.py)
        print(f"dp_agreement: {len(bad)} row(s) FAIL or UNDECLARED", file=sys.stderr)
    return 0


def tempfile_dir() -> str:
    import tempfile
    return tempfile.gettempdir()


if __name__ == "__main__":
    sys.exit(main())
