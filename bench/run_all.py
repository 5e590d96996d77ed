"""Run every benchmark of bench/ and collect their Markdown into bench/results/SUMMARY.md.

    python bench/run_all.py [--quick] [--only bench_step agreement bench_make_all ...]

Each benchmark runs in its own process (`make bench` runs this). A benchmark that is absent is
listed as absent; one that fails is listed with the tail of its error output, and the others
still run. `--quick` is passed to the benchmarks that accept it (and the summary is then written
to bench/results/quick/SUMMARY.md, next to the quick results).
"""
from __future__ import annotations

import argparse
import collections
import platform
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
# (script, what it measures); run in this order
BENCHMARKS = [
    ("bench_step", "harness step time against hand-written loops"),
    ("bench_compare", "comparison benchmark"),
    ("agreement", "300-step loss agreement with torch vs the 1-ULP envelope"),
    ("bench_make_all", "`make all` cold / nothing changed / one wrapper touched, in a fresh clone"),
    ("bench_warm_processes", "`duipai all` with warm backend processes against a process per job, bitwise equal"),
    ("bench_dp", "data-parallel step time, dp=2 and dp=4 as ratios to dp=1"),
    ("dp_agreement", "300-step loss agreement of dp=2, 4 with dp=1 vs the 1-ULP envelope"),
]


def accepts(script: Path, flag: str) -> bool:
    r = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, cwd=ROOT)
    return r.returncode == 0 and flag in r.stdout


def run_one(name: str, quick: bool, results: Path) -> tuple[str, str]:
    """(status line, Markdown section) for one benchmark."""
    script = HERE / f"{name}.py"
    if not script.exists():
        return f"{name}: absent", ""
    cmd = [sys.executable, str(script)]
    if quick:
        if accepts(script, "--quick"):
            cmd.append("--quick")
        else:
            return f"{name}: skipped (no --quick mode)", ""
    started = time.time()
    print(f"run_all: {' '.join(Path(c).name if i < 2 else c for i, c in enumerate(cmd))}", file=sys.stderr, flush=True)
    # stdout is kept (a benchmark's table); stderr (its progress) is passed through and its tail kept
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    tail: collections.deque[str] = collections.deque(maxlen=15)

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            tail.append(line.rstrip("\n"))
            sys.stderr.write(line)
            sys.stderr.flush()
    t = threading.Thread(target=pump, daemon=True)
    t.start()
    assert proc.stdout is not None
    stdout = proc.stdout.read()
    proc.wait()
    t.join()
    took = time.time() - started
    if proc.returncode != 0:
        return (f"{name}: FAILED (exit {proc.returncode}, {took:.0f} s)",
                f"## {name}: failed\n\nexit code {proc.returncode} after {took:.0f} s:\n\n```\n" + "\n".join(tail)
                + "\n```\n")
    md = results / f"{name}.md"
    if md.exists() and md.stat().st_mtime >= started - 1:
        text = md.read_text()
    else:                       # a benchmark that wrote its table elsewhere: what it printed
        text = stdout
    return f"{name}: ok ({took:.0f} s)", text.strip() + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fast smoke run of the benchmarks that have one")
    ap.add_argument("--only", nargs="+", metavar="NAME", choices=[n for n, _ in BENCHMARKS],
                    help="run only these benchmarks")
    args = ap.parse_args()
    results = RESULTS / "quick" if args.quick else RESULTS
    results.mkdir(parents=True, exist_ok=True)
    status, sections = [], []
    for name, what in BENCHMARKS:
        if args.only and name not in args.only:
            continue
        line, text = run_one(name, args.quick, results)
        status.append(f"- {line} — {what}")
        if text:
            sections.append(text)
        print(f"run_all: {line}", file=sys.stderr, flush=True)
    head = (f"# duipai benchmarks{' (quick smoke run)' if args.quick else ''}\n\n"
            f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, {platform.platform()}, "
            f"Python {platform.python_version()}\n\n" + "\n".join(status) + "\n")
    summary = head + "\n" + "\n".join(sections)
    (results / "SUMMARY.md").write_text(summary)
    print(summary)
    return 0 if not any("FAILED" in s for s in status) else 1


if __name__ == "__main__":
    sys.exit(main())
