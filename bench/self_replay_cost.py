"""What the self-replay's per-step reload costs: the self-replay job of each run given, with and without
`Replay.reload_each_step`, alternating, twice each, every job in a fresh folder (no cache), side by side in one
run (this machine is shared: compare the two columns, not the absolute times).

    python bench/self_replay_cost.py RUN_FOLDER [RUN_FOLDER ...]
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import harness.probe_jobs as jobs  # noqa: E402
from harness.localize import Localizer  # noqa: E402
from harness.runs import load_run  # noqa: E402

REPLAY = jobs.Replay


def timed(run, reload: bool, work: Path) -> tuple[float, dict]:
    """Seconds of one self-replay (its job included), and what it found."""
    jobs.Replay = REPLAY if reload else (lambda *a, **k: REPLAY(*a, **dict(k, reload_each_step=False)))
    try:
        loc = Localizer(Path(tempfile.mkdtemp(dir=work)), log=lambda m: None)
        t = time.perf_counter()
        got = loc.self_replay(run)
        return time.perf_counter() - t, got
    finally:
        jobs.Replay = REPLAY


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="duipai-srcost-") as work:
        for path in paths:
            run = load_run(path)
            for _ in range(2):
                for reload in (False, True):
                    dt, got = timed(run, reload, Path(work))
                    print(f"{run.name}  reload_each_step={reload!s:5s} {dt:6.1f} s  rows {got.get('rows')}  "
                          f"bit-equal {got.get('exact_rows')}  differs {got.get('differs')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
