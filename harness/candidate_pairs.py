"""The pairs without the reference: two candidates judged against each other (margin x pair_factor), decided
through their shared-state comparisons with the reference when their own curves part, and the odd one out
(the run that disagrees with every other while they all agree). Framework-free."""
from __future__ import annotations

import copy
from typing import Any, Callable

from .pair import BUG, DECLARED, DIFFER, DRIFT, IDENTICAL, INCONCLUSIVE, Pair, change_of, drop_stat_advice, formula_of
from .runs import Run

PLAIN = "the reference"


def computes(q: Pair, who: str = PLAIN) -> set[str] | None:
    """The steps a run computes from `who`'s states (the reference's, or a pivot candidate's), as its
    shared-state comparison with `who` found them: `who`'s own step (DRIFT or IDENTICAL with every resynced step
    agreeing); `who` computing the run's declared formula (verified against it: DECLARED with evidence, or
    DRIFT/IDENTICAL whose resynced steps plain `who` disagrees with somewhere: the formula is at work there);
    both, when it agrees with the emulating and plain `who` at every resynced step (the formula moves no step
    of this run). None: a BUG, an unverified declaration, no shared-state comparison."""
    rs = q.resync or {}
    if rs.get("agree") is not True or not rs.get("n"):
        return None
    against = rs.get("against")
    if not against:
        return {who} if q.verdict in (DRIFT, IDENTICAL) else None
    formula = f"{who} computing {formula_of(against)}"
    if q.verdict == DECLARED and (q.evidence or "").startswith("verified"):
        return {formula}
    if q.verdict in (DRIFT, IDENTICAL):
        return {formula} if rs.get("evidence") else {formula, who}
    return None


def departs(q: Pair) -> str | None:
    """Where a run's shared-state comparison with the plain reference (or pivot) found another step (BUG, or
    DIFFER from a pivot), when by at least twice its calibrated tolerance (so that a run agreeing with it
    within its tolerance cannot agree with this one): a short description, else None."""
    rs = q.resync or {}
    if q.verdict not in (BUG, DIFFER) or rs.get("agree") is not False or rs.get("against"):
        return None
    w = rs.get("worst") or {}
    if not w.get("worst_factor") or w["worst_factor"] < 2:
        return None
    return f"{w.get('worst_key')} at step {w.get('step')}, {w['worst_factor']:.3g}x its calibrated tolerance"


def through_reference(p: Pair, px: Pair, py: Pair, who: str = PLAIN) -> None:
    """A pair without the reference has no shared-state comparison of its own; its sides' comparisons with the
    reference (`px`, `py`; or with a pivot candidate, named `who`: resync_candidates) decide it when its own
    curves part (INCONCLUSIVE or DIFFER). Two candidates that each compute one
    and the same step at every resynced step (`computes`) compute the same step as each other: the parting is
    accumulated rounding, DRIFT. Two that each compute a different one, each verified at every resynced step
    (one the plain reference's, the other the reference computing its declared formula, or two formulas), and
    the formula at work (the plain reference disagrees with its side somewhere): they differ as their
    declarations say, DECLARED, with that evidence. An INCONCLUSIVE pair of which one side computes the
    reference's step and the other, a BUG, departs from it by at least twice its tolerance (`departs`): DIFFER
    (so that a buggy candidate on a chaotic model is the odd one out). Nothing else is inferred: a BUG, an
    unverified DECLARED, a side without the shared-state comparison leave the pair as it is."""
    sx, sy = computes(px, who), computes(py, who)
    if p.verdict == INCONCLUSIVE:
        for (a, sa), (b, qb) in (((p.a, sx), (p.b, py)), ((p.b, sy), (p.a, px))):
            gap = departs(qb)
            if sa is not None and who in sa and gap is not None:
                p.notes.append(f"was INCONCLUSIVE: {a.name} agrees with {who} at every resynced step and "
                               f"{b.name} does not ({gap}): they compute different steps")
                p.verdict = DIFFER
                return
    if p.verdict not in (INCONCLUSIVE, DIFFER) or sx is None or sy is None:
        return
    n = f"{px.resync['n']} and {py.resync['n']} steps from its state"
    if sx & sy:
        step = who if who in sx & sy else sorted(sx & sy)[0]
        p.notes.append(f"was {p.verdict}: both runs agree with {step} at every resynced step ({n}), so they compute "
                       "the same step; their curves part by accumulated rounding")
        p.verdict = DRIFT
        return
    p.notes.append(f"was {p.verdict}: {p.a.name} agrees with {' and '.join(sorted(sx))} and {p.b.name} with "
                   f"{' and '.join(sorted(sy))} at every resynced step ({n}), and those differ there: the runs "
                   f"differ as their declared difference(s) {', '.join(p.declared)} say they must")
    p.verdict = DECLARED
    p.evidence = f"verified through {who} (each run agrees with its formula at every resynced step)"


def odd_one_out(runs: list[Run], pairs: dict[tuple[str, str], Pair],
                unplaced: dict[str, str] | None = None) -> dict[str, Any] | None:
    """The run that disagrees with every other while all the others agree with each other; or the odd group:
    the runs split in two groups, each agreeing within itself, every pair across them disagreeing, and one
    group spanning fewer backends than the other, which spans at least two (a bug in a backend's code shows in
    all its runs: a reference and its own dp 2 run against every other backend). Agreeing: DRIFT, IDENTICAL,
    or DECLARED with evidence (the same computation up to what the runs declare); disagreeing: BUG or DIFFER.
    "runs" lists the odd run(s); "run" is the odd run itself, or for a group the reference when it is in it
    (else its first run).
    Not when the larger side's runs all carry one injected --fault that the smaller side's do not: their
    agreement is the shared fault's, not evidence against the smaller side (a self-test's faulted runs
    against their clean reference).
    `unplaced` (run -> why, from resync_candidates): runs left out of the split, named in "unplaced"."""
    unplaced = {n: w for n, w in (unplaced or {}).items() if any(r.name == n for r in runs)}
    runs = [r for r in runs if r.name not in unplaced]
    if len(runs) < 3:
        return None

    def state(x: Run, y: Run) -> str | None:
        p = pairs.get((x.name, y.name)) or pairs.get((y.name, x.name))
        if p is None:
            return None
        if p.verdict in (IDENTICAL, DRIFT) or (
                p.verdict == DECLARED and (getattr(p, "evidence", None) or "").startswith("verified")):
            return "agree"   # a verified DECLARED pair computes the same up to what its runs declare
        return "disagree" if p.verdict in (BUG, DIFFER) else None

    group = [runs[0]] + [r for r in runs[1:] if state(runs[0], r) == "agree"]
    rest = [r for r in runs if r not in group]
    # sized by backends, not runs: a bug in one backend's code is in all its runs, so two runs of one backend
    # agreeing is no evidence against a third backend; the larger side must hold two backends or more
    width = {id(g): len({r.backend for r in g}) for g in (group, rest)}
    small, big = sorted((group, rest), key=lambda g: width[id(g)])
    if not small or width[id(small)] == width[id(big)] or width[id(big)] < 2:
        return None
    within = all(state(x, y) == "agree" for g in (small, big) for i, x in enumerate(g) for y in g[i + 1:])
    if not within or not all(state(x, y) == "disagree" for x in small for y in big):
        return None
    shared = {r.fault for r in big}
    if len(shared) == 1 and None not in shared and not shared & {r.fault for r in small}:
        return None   # the larger side agrees because it shares one injected fault (a self-test): no evidence
    aside = (f"; left aside: {', '.join(f'{n} ({w})' for n, w in unplaced.items())}" if unplaced else "")
    if len(small) == 1:
        x = small[0]
        return {"run": x.name, "runs": [x.name], "backend": x.backend, "unplaced": unplaced,
                "statement": f"{x.name} ({x.backend}) disagrees with all {len(big)} others, which agree with each "
                             f"other" + aside}
    backends = sorted({r.backend for r in small})
    lead = runs[0] if runs[0] in small else small[0]
    return {"run": lead.name, "runs": [r.name for r in small], "backend": backends[0] if len(backends) == 1 else None,
            "unplaced": unplaced,
            "statement": f"{', '.join(r.name for r in small)} ({', '.join(backends)}) agree with each other and "
                         f"disagree with all {len(big)} others, which agree with each other" + aside}


def pivot_pairs(with_reference: list[Pair], candidate_pairs: list[Pair]) -> tuple[list[Pair], list[Pair], str | None]:
    """The pairs of BUG candidates to compare from a shared state of their own. Two or more candidates BUG against
    the reference: either they compute one thing (the reference's backend is the one that computes something else,
    a bug in its code showing in all its runs; or a bug in code the BUG runs share, e.g. one backend's dp 1 and
    dp 2 runs, or every backend of one library), or each a thing of its own. Their own curves cannot tell: the
    envelope measures the reference's computation, which none of them computes, and on a chaotic model they part
    past its saturation whatever they compute (INCONCLUSIVE or DIFFER, nothing to decide them through the
    reference). The first BUG candidate that declares no difference is the pivot: returned are its pairs with every
    other BUG candidate, to compare from its states (computing a candidate's declared formula where the candidate
    declares one, as the reference does), the other undecided pairs among them, to decide through it
    (`through_reference`), and the pivot's name: linear in the candidates. Not when a BUG candidate carries a
    --fault (a self-test: the faults say where the bugs are)."""
    if any(p.b.fault for p in with_reference if p.verdict == BUG):
        return [], [], None
    bugs = [p.b for p in with_reference if p.verdict == BUG]
    plain = [r for r in bugs if not r.declared]
    names = {r.name for r in bugs}
    among = [p for p in candidate_pairs if {p.a.name, p.b.name} <= names]
    if len(bugs) < 2 or not plain or not any(p.verdict in (INCONCLUSIVE, DIFFER) for p in among):
        return [], [], None
    pivot = plain[0].name
    star = [p for p in among if pivot in (p.a.name, p.b.name)]
    return star, [p for p in among if p not in star and p.verdict in (INCONCLUSIVE, DIFFER)], pivot


def decide_by_resync(p: Pair, rs: dict[str, Any] | None, pivot: str) -> None:
    """A pair of candidates compared from the pivot's states (harness/localize.py resync, the pivot in the
    reference's role, computing the other run's declared formula where it declares one): every resynced step
    agreeing makes it DRIFT, or DECLARED when the formula is at work (plain pivot disagrees with the other run
    somewhere: the resync's evidence); one that disagrees DIFFER (a pair whose curves stayed inside the envelope
    too: one step from a shared state is the sharper comparison); a comparison that could not run leaves it as
    it is, said."""
    p.resync = rs
    rs = rs or {}
    against = rs.get("against")
    if rs.get("agree") is False or (rs.get("agree") is True and rs.get("n")):
        drop_stat_advice(p)      # decided: the saturated curves' advice to use --stat no longer stands
    if rs.get("agree") is True and rs.get("n"):
        if against and rs.get("evidence"):
            p.notes.append(f"was {p.verdict}: every step agrees from {pivot}'s state with {pivot} computing "
                           f"{change_of(against)} ({rs['n']} resynced steps), and plain {pivot} disagrees "
                           f"({len(rs['evidence'])} probes): they differ as declared")
            p.verdict = DECLARED
            p.evidence = f"verified (every resynced step agrees with {pivot} computing the formula)"
        elif p.verdict not in (DRIFT, IDENTICAL):
            p.notes.append(f"was {p.verdict}: every step agrees from {pivot}'s state ({rs['n']} resynced steps): "
                           "their curves part by accumulated rounding")
            p.verdict = DRIFT
    elif rs.get("agree") is False:
        bad = rs.get("first_disagreement") or {}
        p.notes.append(f"was {p.verdict}: one step from {pivot}'s state computes something else"
                       + (f" at step {bad['step']}" if bad.get("step") is not None else "")
                       + (f" ({rs['n']} resynced steps)" if rs.get("n") else ""))
        p.verdict = DIFFER
    else:
        p.notes.append(f"no shared-state comparison from {pivot}'s state "
                       f"({rs.get('skipped') or rs.get('error') or 'none ran'})")


def resync_candidates(star: list[Pair], rest: list[Pair], pivot: str | None,
                      resync: Callable[[Pair, list[int]], dict[str, Any] | None], jobs: int = 1) -> dict[str, str]:
    """decide_by_resync for each pair with the pivot (the pivot in the reference's role; `jobs` at a time: the
    jobs are processes), then through_reference, the pivot in the reference's place, for the rest. Returns the runs that could not be placed: a candidate
    whose declared formula the pivot's backend cannot compute (run -> why), for odd_one_out to leave aside."""
    from .localize import divergent_steps
    if not star or pivot is None:
        return {}

    def one(p: Pair) -> None:
        view = p
        if p.a.name != pivot:   # the pivot first: it plays the reference
            view = copy.copy(p)
            view.a, view.b, view.notes = p.b, p.a, []
        decide_by_resync(p, resync(view, divergent_steps(p)), pivot)
    if jobs > 1 and len(star) > 1:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            list(pool.map(one, star))
    else:
        for p in star:
            one(p)
    by_run = {(p.b.name if p.a.name == pivot else p.a.name): p for p in star}
    for p in rest:
        if p.a.name in by_run and p.b.name in by_run:
            through_reference(p, by_run[p.a.name], by_run[p.b.name], pivot)
    unplaced = {}
    for name, p in by_run.items():
        other = p.b if p.b.name == name else p.a
        rs = p.resync or {}
        if (rs.get("skipped") or rs.get("error")) and other.declared:   # e.g. a formula only the reference computes
            ids = ", ".join(sorted({d.get("id", "?") for d in other.declared}))
            who = (p.a if p.a.name == pivot else p.b).backend
            unplaced[name] = f"its declared {ids} not computed from the {who} run's states (see its pair's notes)"
    return unplaced


__all__ = ["PLAIN", "computes", "departs", "through_reference", "odd_one_out", "pivot_pairs",
           "decide_by_resync", "resync_candidates"]
