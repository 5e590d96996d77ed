"""bench/hand_loops/_common.py's timing: an evaluation between two steps counts in the whole loop's wall time
and in eval_s, never in a step's time (bench_step.py's per-step ratio reads the steps, its whole-loop ratio the
wall)."""
import json
import time

from bench.hand_loops._common import EVAL_EVERY, Timer, evaluates_after, report


def test_evaluation_is_timed_apart_from_the_steps(monkeypatch, capsys):
    clock = iter([0.0, 1.0, 2.0, 2.5, 3.0, 4.0, 4.25, 5.0, 5.5])
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    t = Timer()
    t.stamp()                    # 0.0: before step 0
    t.stamp()                    # 1.0: after step 0
    t.stamp()                    # 2.0: after step 1
    with t.evaluating():         # 2.5 .. 3.0: an evaluation before step 2
        pass
    t.stamp()                    # 4.0: after step 2 (which took 2.0 - 0.5 of evaluation = 1.5)
    with t.evaluating():         # 4.25 .. 5.0: the evaluation after the last step
        pass
    report("x", t, warmup=1, losses=[1.0, 2.0, 3.0], evals=[(0.5, 0.25)])
    out = json.loads(capsys.readouterr().out)
    assert out["step_times_s"] == [1.0, 1.5]
    assert out["wall_s"] == 5.0 - 1.0            # to the end of the last evaluation
    assert out["eval_s"] == 0.5 + 0.75
    assert out["evals"] == [[0.5, 0.25]]


def test_the_harness_evaluation_cadence():
    every = EVAL_EVERY
    assert [d for d in range(1, 2 * every + 3) if evaluates_after(d, 2 * every + 2)] == [every, 2 * every, 2 * every + 2]
