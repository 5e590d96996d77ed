"""`make all` as a build: cold, with nothing changed, and after touching one wrapper's source.

In a fresh `git clone` of this repository's HEAD (a temporary folder), with this checkout's virtual
environment (no install: make is told the install stamp is up to date, and a dry run checks that
no pip command would run), three things are measured:

  1. cold: `make all` from an empty results folder: the default matrix (six backend
     configurations, dp 1 and 2, torch's 1-ULP envelope), the comparison and the report.
                                                                    target <= 120 s on this 2-core VM
  2. no-op: `make all` again with nothing changed (three times): no run executed.  target <= 3 s
  3. touch: a comment line appended to a source file of one backend only (default: a file of
     wrappers/tensorflow/, the `sources` that key tensorflow's runs) and `make all` again: exactly
     that backend's runs are executed again, then the comparison and the report.

The clone's sources are the ones used: PYTHONPATH puts the clone first (before the editable install
of this checkout), the harness starts every backend process with cwd and PYTHONPATH at its own
project root, and the script checks, before measuring, that the harness and `python -m wrappers
info` (started exactly as the backend workers are) resolve to the clone. Executed runs are counted
from the `[i/n] <status> <run>` lines the matrix prints on stderr (one per backend process started)
and cross-checked with matrix.json.

    python bench/bench_make_all.py [--quick] [--touch-backend tensorflow] [--keep] [--venv PATH]

Writes bench/results/bench_make_all.md and .json (--quick: bench/results/quick/; a small
torch + jax matrix run with `duipai all --matrix`, not make's default matrix). The machine is shared:
the load average (1/5/15 min) is recorded before and after every phase, next to the times.
Exit 1 when the touch test re-executes other runs than the touched backend's, or a phase fails.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TARGET_COLD_S, TARGET_NOOP_S = 120.0, 3.0
LINE = re.compile(r"^\[(\d+)/(\d+)\]\s+(\S+)\s+(\S+) \(([\d.]+) s\)")
QUICK_MATRIX = """name = "bench-quick"
description = "bench_make_all --quick: torch and jax, dp 1 and 2, 20 steps, a 1-ULP envelope run"
models = ["cnn2d_2conv_2fc"]
backends = ["torch", "jax"]
devices = [1, 2]
steps = 20
envelope_k = 1
"""


def load() -> dict:
    la = os.getloadavg()
    up = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return {"loadavg": [round(x, 2) for x in la], "uptime": up}


def sh(cmd: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.venv = Path(args.venv).resolve()
        self.work = Path(tempfile.mkdtemp(prefix="duipai-bench-make-", dir=args.workdir))
        self.clone = self.work / "repo"
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join([str(self.clone), self.env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        self.env.pop("PYTHONHOME", None)
        self.stamp = self.venv / ".duipai-installed"
        self.matrix_name = "bench-quick" if args.quick else "default"
        self.results = self.clone / "results"
        self.folder = self.results / self.matrix_name
        self.via_make = not args.quick and args.jobs <= 1

    # ------------------------------------------------------------------ set-up
    def setup(self) -> dict:
        r = sh(["git", "clone", "-q", str(ROOT), str(self.clone)], cwd=self.work)
        if r.returncode:
            raise SystemExit(f"bench_make_all: git clone failed: {r.stderr}")
        commit = sh(["git", "rev-parse", "HEAD"], cwd=self.clone).stdout.strip()
        dirty = sh(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT).stdout.strip()
        if self.args.quick:
            (self.work / "bench-quick.toml").write_text(QUICK_MATRIX)
        # what would make do? nothing but `duipai all` (never a pip install into the shared venv)
        dry = sh(self.make_cmd(dry=True), cwd=self.clone, env=self.env) if self.via_make else None
        if dry and (dry.returncode or "pip" in dry.stdout or "duipai all" not in dry.stdout):
            raise SystemExit(f"bench_make_all: `make -n` would not just run duipai all:\n{dry.stdout}{dry.stderr}")
        # the clone's sources, in the harness and in a wrappers process started the way workers are
        probe = sh([str(self.venv / "bin" / "python"), "-c",
                    "import json, harness, algorithms; from harness import runner; "
                    "print(json.dumps({'harness': harness.__file__, 'algorithms': algorithms.__file__, "
                    "'project_root': str(runner.PROJECT_ROOT), "
                    "'sources': {k: v['sources'] for k, v in runner.backend_info().items()}, "
                    "'missing': {k: v['missing'] for k, v in runner.backend_info().items()}}))"],
                   cwd=self.clone, env=self.env)
        if probe.returncode:
            raise SystemExit(f"bench_make_all: probe failed: {probe.stderr}")
        info = json.loads(probe.stdout)
        paths = [info["harness"], info["algorithms"], info["project_root"]] + [s for v in info["sources"].values() for s in v]
        outside = [p for p in paths if not Path(p).resolve().is_relative_to(self.clone.resolve())]
        if outside:
            raise SystemExit(f"bench_make_all: not the clone's sources: {outside[:5]}")
        self.sources = info["sources"]
        empty = not self.folder.exists() and not (self.results / ".cache").exists()
        return {"clone": str(self.clone), "commit": commit, "uncommitted_changes_in_checkout_not_measured": bool(dirty),
                "venv": str(self.venv), "make_dry_run": dry.stdout.strip().splitlines() if dry else None,
                "sources_resolve_to_clone": True, "project_root": info["project_root"],
                "missing_backends": {k: v for k, v in info["missing"].items() if v},
                "results_empty_at_start": empty, "results_listing_at_start": sorted(p.name for p in self.results.iterdir())
                if self.results.exists() else []}

    def make_cmd(self, dry: bool = False) -> list[str]:
        jobs = ["-j", str(self.args.jobs)] if self.args.jobs > 1 else []
        if self.args.quick:
            return [str(self.venv / "bin" / "duipai"), "all", "--matrix", str(self.work / "bench-quick.toml"), *jobs]
        if jobs:   # what `make all` would run with -j N: its recipe, directly (make passes no arguments)
            return [str(self.venv / "bin" / "duipai"), "all", *jobs]
        # -o: the install stamp counts as up to date (the shared venv is used as it is)
        return ["make"] + (["-n"] if dry else []) + ["-o", str(self.stamp), "all", f"VENV={self.venv}"]

    # ------------------------------------------------------------------ one `make all`
    def once(self, label: str) -> dict:
        before = load()
        index = self.folder / "report" / "index.html"
        index_mtime = index.stat().st_mtime_ns if index.exists() else None
        ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        r = subprocess.run(self.make_cmd(), cwd=self.clone, env=self.env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)   # every process under make, waited for
        cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
        after = load()
        executed = []
        for line in r.stderr.splitlines():
            m = LINE.match(line.strip())
            if m:
                executed.append({"run": m.group(4), "status": m.group(3), "seconds": float(m.group(5))})
        try:
            entries = json.loads((self.folder / "matrix.json").read_text())["entries"]
        except (OSError, ValueError):
            entries = []
        statuses: dict[str, int] = {}
        for e in entries:
            statuses[e["status"]] = statuses.get(e["status"], 0) + 1
        summary = next((l for l in r.stderr.splitlines() if l.startswith("runs: ")), "")
        new_index = index.exists() and index.stat().st_mtime_ns != index_mtime
        code = r.returncode          # duipai's own exit status (make says "Error N" and exits 2)
        if self.via_make and code:
            m = re.search(r"\] Error (\d+)", r.stderr)
            code = int(m.group(1)) if m else 255
        res = {"label": label, "command": " ".join(self.make_cmd()), "exit_code": code, "wall_s": round(wall, 2),
               "cpu_s": round(cpu, 1),
               "executed": executed, "n_executed": len(executed),
               "n_ran": sum(e["status"] == "ran" for e in executed), "matrix_summary": summary,
               "matrix_json_status": statuses, "n_entries": len(entries),
               "report_rewritten": new_index, "nothing_changed_message": "nothing changed" in r.stdout,
               "load_before": before, "load_after": after,
               "entries": [{k: e[k] for k in ("name", "backend", "devices", "role", "status", "seconds", "message")}
                           for e in entries]}
        if code not in (0, 1):          # 1: a BUG verdict (the harness worked)
            res["stderr_tail"] = r.stderr.splitlines()[-30:]
            res["stdout_tail"] = r.stdout.splitlines()[-30:]
        print(f"bench_make_all: {label}: {wall:.1f} s ({cpu:.0f} CPU s), exit {code}, {len(executed)} run(s) executed "
              f"({summary.removeprefix('runs: ') or 'no matrix summary'}), report rewritten: {new_index}, "
              f"load {before['loadavg']} -> {after['loadavg']}", file=sys.stderr, flush=True)
        return res

    def touch_file(self, backend: str) -> Path:
        """A source file of `backend` and of no other backend (so only its runs are keyed by it)."""
        mine = set(self.sources[backend])
        others = set().union(*(set(v) for k, v in self.sources.items() if k != backend))
        only = sorted(mine - others)
        if not only:
            raise SystemExit(f"bench_make_all: {backend} has no source file of its own to touch")
        pref = [p for p in only if p.endswith("/backend.py")]
        return Path((pref or only)[0])

    # ------------------------------------------------------------------ the three measurements
    def run(self) -> dict:
        meta = self.setup()
        cold = self.once("cold")
        noops = [self.once(f"no-op {i + 1}") for i in range(self.args.noop_repeats)]
        backend = self.args.touch_backend or ("tensorflow" if not self.args.quick else "jax")
        f = self.touch_file(backend)
        with f.open("a") as fh:
            fh.write("# bench_make_all: touched\n")
        touch = self.once(f"touch {f.relative_to(self.clone)}")
        expected = sorted(e["name"] for e in cold["entries"] if e["backend"] == backend and e["status"] != "skipped")
        got = sorted(e["run"] for e in touch["executed"])
        touch.update({"backend": backend, "file": str(f.relative_to(self.clone)), "expected_runs": expected,
                      "executed_runs": got, "only_that_backend": got == expected and bool(expected)})
        checks = {
            "cold_ok": cold["exit_code"] in (0, 1) and cold["n_executed"] == cold["n_entries"] - cold["matrix_json_status"].get("skipped", 0),
            "cold_within_target": cold["wall_s"] <= TARGET_COLD_S,
            "noop_executes_nothing": all(n["n_executed"] == 0 and n["exit_code"] == cold["exit_code"] for n in noops),
            "noop_within_target": all(n["wall_s"] <= TARGET_NOOP_S for n in noops),
            "touch_reruns_only_that_backend": touch["only_that_backend"] and touch["report_rewritten"],
        }
        return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "quick": self.args.quick,
                "jobs": self.args.jobs,
                "machine": {"node": platform.node(), "platform": platform.platform(), "cpus": os.cpu_count(),
                            "nproc": len(os.sched_getaffinity(0)), "python": platform.python_version()},
                "setup": meta, "targets": {"cold_s": TARGET_COLD_S, "noop_s": TARGET_NOOP_S},
                "cold": cold, "noop": noops, "touch": touch, "checks": checks}

    def cleanup(self) -> None:
        if self.args.keep:
            print(f"bench_make_all: kept {self.work}", file=sys.stderr)
        else:
            shutil.rmtree(self.work, ignore_errors=True)


def markdown(r: dict) -> str:
    c, t, noops, ck = r["cold"], r["touch"], r["noop"], r["checks"]
    la = lambda p: "/".join(f"{x:.2f}" for x in p["loadavg"])  # noqa: E731
    ok = lambda b: "met" if b else "**MISSED**"  # noqa: E731
    m = r["machine"]
    lines = [
        "## make all: cold, no-op, one wrapper touched (bench_make_all"
        + (f" --jobs {r['jobs']}" if r.get("jobs", 1) > 1 else "") + ")", "",
        f"{r['date']}; {m['node']}, {m['nproc']} CPUs, {m['platform']}, Python {m['python']}; "
        f"clone of {r['setup']['commit'][:10]}; command `{c['command'].replace(str(ROOT) + '/', '')}`"
        + (" (quick: a small torch + jax matrix, not the default one)" if r["quick"] else "") + ".",
        "Load average (1/5/15 min) before -> after each phase: the machine is shared. CPU time: user + system "
        "of every process the phase started (load-independent; on an idle machine the wall time of a -j 1 "
        "phase approaches it).", "",
        "| phase | wall time | CPU time (all processes) | runs executed | report | exit | load before -> after |",
        "|---|---|---|---|---|---|---|",
        f"| cold, empty results folder | **{c['wall_s']:.1f} s** (target <= {r['targets']['cold_s']:.0f} s: "
        f"{ok(ck['cold_within_target'])}) | {c['cpu_s']:.0f} s | {c['n_executed']} ({c['matrix_summary'].removeprefix('runs: ')}) | "
        f"written | {c['exit_code']} | {la(c['load_before'])} -> {la(c['load_after'])} |",
    ]
    for n in noops:
        lines.append(f"| {n['label']}, nothing changed | **{n['wall_s']:.2f} s** (target <= {r['targets']['noop_s']:.0f} s: "
                     f"{ok(n['wall_s'] <= r['targets']['noop_s'])}) | {n['cpu_s']:.1f} s | {n['n_executed']} | "
                     f"{'rewritten' if n['report_rewritten'] else 'up to date'} | {n['exit_code']} | "
                     f"{la(n['load_before'])} -> {la(n['load_after'])} |")
    lines.append(f"| touch `{t['file']}` | **{t['wall_s']:.1f} s** | {t['cpu_s']:.0f} s | {t['n_executed']}: "
                 f"{', '.join('`' + x.split('__', 1)[1] + '`' for x in t['executed_runs']) or '-'} | "
                 f"{'rewritten' if t['report_rewritten'] else 'NOT rewritten'} | {t['exit_code']} | "
                 f"{la(t['load_before'])} -> {la(t['load_after'])} |")
    lines += ["", f"Touch test: {'only' if t['only_that_backend'] else '**NOT only**'} the {t['backend']} runs "
              f"re-executed (expected {len(t['expected_runs'])}: "
              f"{', '.join('`' + x.split('__', 1)[1] + '`' for x in t['expected_runs'])}), then the comparison "
              f"and the report.", "",
              f"No-op median: {statistics.median(n['wall_s'] for n in noops):.2f} s.", "",
              "Cold run, per run (seconds inside `make all`, in the order run):", "",
              "| run | status | s |", "|---|---|---|"]
    for e in c["executed"]:
        lines.append(f"| `{e['run'].split('__', 1)[1]}` | {e['status']} | {e['seconds']:.1f} |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: a small torch + jax matrix (results/quick/)")
    ap.add_argument("--touch-backend", default=None, help="backend whose own source is touched (default tensorflow; "
                    "--quick: jax)")
    ap.add_argument("--noop-repeats", type=int, default=3, help="how many no-change reruns (default 3)")
    ap.add_argument("--venv", default=str(ROOT / ".venv"), help="the installed venv to use (default: this checkout's)")
    ap.add_argument("--workdir", default=None, help="where the temporary clone goes (default: $TMPDIR)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary clone and its results")
    ap.add_argument("--jobs", type=int, default=1, help="N > 1: run make's recipe `duipai all -j N` directly "
                    "(what `make all` would do with -j N); results in bench_make_all-jN.md/.json")
    args = ap.parse_args(argv)
    out = HERE / "results" / ("quick" if args.quick else "")
    out.mkdir(parents=True, exist_ok=True)
    b = Bench(args)
    try:
        res = b.run()
    finally:
        b.cleanup()
    stem = "bench_make_all" + (f"-j{args.jobs}" if args.jobs > 1 else "")
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    (out / f"{stem}.md").write_text(md)
    print(md)
    ck = res["checks"]
    return 0 if ck["cold_ok"] and ck["noop_executes_nothing"] and ck["touch_reruns_only_that_backend"] else 1


if __name__ == "__main__":
    sys.exit(main())
