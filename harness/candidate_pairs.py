"""The pairs without the reference: two candidates judged against each other (margin x pair_factor), decided
through their shared-state comparisons with the reference when their own curves part, and the odd one out
(the run that disagrees with every other while they all agree). Framework-free."""
from __future__ import annotations

from typing import Any, Callable

from .pair import BUG, DECLARED, DIFFER, DRIFT, IDENTICAL, INCONCLUSIVE, Pair, change_of
from .runs import Run

PLAIN = "the reference"


def computes(q: Pair) -> set[str] | None:
    """The steps a candidate computes from the reference's states, as its shared-state comparison found them:
    the plain reference's step (DRIFT or IDENTICAL with every resynced step agreeing); the reference computing
    its declared formula (verified against it: DECLARED with evidence, or DRIFT/IDENTICAL whose resynced steps
    the plain reference disagrees with somewhere: the formula is at work there); both, when it agrees with the
    emulating and the plain reference at every resynced step (the formula moves no step of this run). None: a
    BUG, an unverified declaration, no shared-state comparison."""
    rs = q.resync or {}
    if rs.get("agree") is not True or not rs.get("n"):
        return None
    against = rs.get("against")
    if not against:
        return {PLAIN} if q.verdict in (DRIFT, IDENTICAL) else None
    formula = f"{PLAIN} computing {change_of(against)}"
    if q.verdict == DECLARED and (q.evidence or "").startswith("verified"):
        return {formula}
    if q.verdict in (DRIFT, IDENTICAL):
        return {formula} if rs.get("evidence") else {formula, PLAIN}
    return None


def through_reference(p: Pair, px: Pair, py: Pair) -> None:
    """A pair without the reference has no shared-state comparison of its own; its sides' comparisons with the
    reference decide it when its own curves part (INCONCLUSIVE or DIFFER). Two candidates that each compute one
    and the same step at every resynced step (`computes`) compute the same step as each other: the parting is
    accumulated rounding, DRIFT. Two that each compute a different one, each verified at every resynced step
    (one the plain reference's, the other the reference computing its declared formula, or two formulas), and
    the formula at work (the plain reference disagrees with its side somewhere): they differ as their
    declarations say, DECLARED, with that evidence. Nothing else is inferred: a BUG, an unverified DECLARED, a
    side without the shared-state comparison leave the pair as it is."""
    sx, sy = computes(px), computes(py)
    if p.verdict not in (INCONCLUSIVE, DIFFER) or sx is None or sy is None:
        return
    n = f"{px.resync['n']} and {py.resync['n']} steps from its state"
    if sx & sy:
        step = PLAIN if PLAIN in sx & sy else sorted(sx & sy)[0]
        p.notes.append(f"was {p.verdict}: both runs agree with {step} at every resynced step ({n}), so they compute "
                       "the same step; their curves part by accumulated rounding")
        p.verdict = DRIFT
        return
    p.notes.append(f"was {p.verdict}: {p.a.name} agrees with {' and '.join(sorted(sx))} and {p.b.name} with "
                   f"{' and '.join(sorted(sy))} at every resynced step ({n}), and those differ there: the runs "
                   f"differ as their declared difference(s) {', '.join(p.declared)} say they must")
    p.verdict = DECLARED
    p.evidence = "verified through the reference (each run agrees with its formula at every resynced step)"


def odd_one_out(runs: list[Run], pairs: dict[tuple[str, str], Pair]) -> dict[str, Any] | None:
    """The run that disagrees with every other while all the others agree with each other."""
    if len(runs) < 3:
        return None

    def state(x: Run, y: Run) -> str | None:
        p = pairs.get((x.name, y.name)) or pairs.get((y.name, x.name))
        if p is None:
            return None
        if p.verdict in (IDENTICAL, DRIFT):
            return "agree"
        return "disagree" if p.verdict in (BUG, DIFFER) else None

    for x in runs:
        others = [r for r in runs if r is not x]
        if all(state(x, y) == "disagree" for y in others) and all(
                state(y, z) == "agree" for i, y in enumerate(others) for z in others[i + 1:]):
            return {"run": x.name, "backend": x.backend,
                    "statement": f"{x.name} ({x.backend}) disagrees with all {len(others)} others, which agree "
                                 f"with each other"}
    return None


def suspect_reference(with_reference: list[Pair], candidate_pairs: list[Pair]) -> list[Pair]:
    """The pairs of candidates to compare from a shared state of their own: when every candidate is BUG against
    the reference, the reference itself may be the one that computes something else, and on a chaotic model the
    candidates' own curves part past the envelope's saturation whatever they compute (INCONCLUSIVE or DIFFER,
    and nothing to decide them through the reference). Only pairs in which neither run declares a difference:
    a run whose declared formula the other lacks is expected to differ, and the emulation of one side's
    formula on the other would apply it twice."""
    if len(with_reference) < 2 or not all(p.verdict == BUG for p in with_reference):
        return []
    return [p for p in candidate_pairs if p.verdict in (INCONCLUSIVE, DIFFER) and not p.a.declared
            and not p.b.declared]


def decide_by_resync(p: Pair, rs: dict[str, Any] | None) -> None:
    """A pair of candidates compared from the states of its first run (harness/localize.py resync, that run in
    the reference's role): every resynced step agreeing makes it DRIFT, one that disagrees DIFFER; a comparison
    that could not run leaves it as it is, said."""
    p.resync = rs
    rs = rs or {}
    who = p.a.name
    if rs.get("agree") is True and rs.get("n"):
        p.notes.append(f"was {p.verdict}: every step agrees from {who}'s state ({rs['n']} resynced steps): "
                       "their curves part by accumulated rounding")
        p.verdict = DRIFT
    elif rs.get("agree") is False:
        bad = rs.get("first_disagreement") or {}
        p.notes.append(f"was {p.verdict}: one step from {who}'s state computes something else"
                       + (f" at step {bad['step']}" if bad.get("step") is not None else "")
                       + (f" ({rs['n']} resynced steps)" if rs.get("n") else ""))
        p.verdict = DIFFER
    else:
        p.notes.append(f"no shared-state comparison from {who}'s state "
                       f"({rs.get('skipped') or rs.get('error') or 'none ran'})")


def resync_candidates(pairs: list[Pair], resync: Callable[[Pair, list[int]], dict[str, Any] | None],
                      jobs: int = 1) -> None:
    """decide_by_resync for each pair, `jobs` at a time (the jobs are processes)."""
    from .localize import divergent_steps

    def one(p: Pair) -> None:
        decide_by_resync(p, resync(p, divergent_steps(p)))
    if jobs > 1 and len(pairs) > 1:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            list(pool.map(one, pairs))
    else:
        for p in pairs:
            one(p)


__all__ = ["PLAIN", "computes", "through_reference", "odd_one_out", "suspect_reference", "decide_by_resync",
           "resync_candidates"]
