"""The statistical decision, started automatically where no deterministic comparison exists.

With framework-RNG dropout (`--dropout native`, the declared difference `native_dropout_masks`) two runs
draw different masks: neither the curves nor one step from a shared state can be compared, and the
lock-step verdict can only be INCONCLUSIVE. Such a pair is decided the way `duipai compare --stat` decides
it: the reference's and the candidate's configurations trained on AUTO_SEEDS data-order seeds (the run's
own seed and the next ones; complete runs are reused), Welch's t-test per metric at the last evaluation
(harness/stats.py). The pair's verdict becomes that test's (BUG, DRIFT; INCONCLUSIVE only when another
declared difference could move the means), with the test's reason in a note; nothing else is touched.
"""
from __future__ import annotations

from typing import Any, Callable

from algorithms.differences import DIFFERENCES

from .errors import BackendFailed, BadInput
from .pair import BUG, INCONCLUSIVE, drop_stat_advice

AUTO_SEEDS = 5
AUTO_METRICS = ("eval_loss", "eval_accuracy", "loss")
AUTO_ALPHA = 0.05


def needs_stat(pair: Any) -> bool:
    """A pair with the reference, INCONCLUSIVE, whose candidate or reference draws its dropout masks from the
    framework's RNG."""
    if not pair.with_reference or pair.verdict != INCONCLUSIVE:
        return False
    ids = {d["id"] for d in pair.b.declared} | {d["id"] for d in pair.a.declared}
    return any(DIFFERENCES.get(i) is not None and DIFFERENCES[i].statistical for i in ids)


def decide(pair: Any, *, timeout: float | None = None, log: Callable[[str], None] = lambda s: None) -> None:
    """Train the seeds, run the t-tests, and set the pair's verdict (module docstring)."""
    from .stats import ensure_seeds, stat_compare
    ref, cand = pair.a, pair.b
    s0 = int(ref.manifest.get("hparams", {}).get("seed", 0))
    seeds = list(range(s0, s0 + AUTO_SEEDS))
    try:
        runs = ensure_seeds([ref, cand], seeds, None, timeout, log)
        sc = stat_compare(runs, ref.backend, list(AUTO_METRICS), None, AUTO_ALPHA)
    except (BackendFailed, BadInput) as e:
        pair.notes.append(f"the automatic statistical comparison failed ({str(e).splitlines()[0]}): INCONCLUSIVE stands")
        return
    mine = next((v for lab, v in sc.verdicts.items() if cand.name in v["runs"]), None)
    if mine is None:
        pair.notes.append("the automatic statistical comparison found no group of the candidate: INCONCLUSIVE stands")
        return
    was = pair.verdict
    pair.verdict = mine["verdict"]
    drop_stat_advice(pair)
    pair.stat = {"seeds": seeds, "metrics": list(AUTO_METRICS), "alpha": AUTO_ALPHA, "verdict": mine["verdict"],
                 "reason": mine["reason"], "tests": [t for t in sc.tests if cand.name in
                                                     sc.verdicts.get(t["group"], {}).get("runs", [])]}
    if pair.verdict == BUG:
        pair.localization = {"stage": None, "method": "statistical (framework-RNG dropout)", "layer": None,
                             "parameter": None, "probe": None, "summary": "statistical: " + mine["reason"],
                             "lines": [], "disagreeing_keys": []}
    pair.notes.append(f"framework-RNG dropout: decided statistically over {len(seeds)} data-order seeds per side "
                      f"(seeds {seeds[0]}..{seeds[-1]}, Welch's t-test on {', '.join(AUTO_METRICS)} at the last "
                      f"evaluation, alpha {AUTO_ALPHA} Bonferroni): {mine['verdict']}, {mine['reason']}"
                      f" (the lock-step verdict was {was})")


__all__ = ["needs_stat", "decide", "AUTO_SEEDS"]
