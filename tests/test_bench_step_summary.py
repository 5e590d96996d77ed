"""bench/bench_step.py's summary of the alternating pairs: the median over runs of each side, and beside it each
side's fastest run and the count of runs in the VM's slow mode (a process ~30 % slower from start to end, on
either side alike), so that a median one side's slow runs decided can be read as such."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_step as B  # noqa: E402


def _side(step_ms: float, whole_ms: float) -> dict:
    return {"per_step_s": step_ms / 1e3, "p10_s": step_ms / 1e3, "whole_loop_s": whole_ms / 1e3,
            "whole_loop_no_eval_s": whole_ms / 1e3, "first_loss": 2.0}


def test_a_median_decided_by_slow_runs_shows_beside_the_fastest_runs():
    harness = [1.40, 2.00, 1.95, 2.05, 1.45, 2.10, 1.42]      # four of seven in the slow mode
    hand = [1.35, 1.36, 1.90, 1.34, 1.37, 1.38, 1.92]         # two of seven
    runs = [{"repeat": i, "harness": _side(a, a * 1.1), "hand": _side(b, b * 1.05), "loadavg": 1.0}
            for i, (a, b) in enumerate(zip(harness, hand))]
    row = B.summarise("x", runs, None)
    assert round(row["ratio_per_step"], 3) == round(1.95 / 1.37, 3)      # the median over runs, as the target reads
    assert not row["ok"]
    assert round(row["ratio_fastest"], 4) == round(1.40 / 1.34, 4)
    assert round(row["ratio_fastest_whole_loop"], 4) == round(1.40 * 1.1 / (1.34 * 1.05), 4)
    assert row["slow_runs"] == {"harness": 4, "hand": 2}
    table = B.markdown([row], {"machine": {"nproc": 2, "platform": "p"}, "date": "d", "steps": 400, "repeats": 7,
                               "warmup": 10, "quick": False, "versions": {}})
    line = next(l for l in table.splitlines() if l.startswith("| x |"))
    assert "1.04 / 1.09" in line and "4 / 2 of 7" in line
    assert line.count("|") == table.splitlines()[6].count("|")          # as many cells as the header
