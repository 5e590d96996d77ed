"""The verdict engine: runs of one configuration by several backends, aligned step by step, judged
against the reference backend's calibrated envelope (harness/envelope.py), BUGs localized
(harness/localize.py). Framework-free: it reads run folders and starts backends only through
runner.execute.

Verdicts per pair (reference, candidate):
  IDENTICAL     every series and every batch checksum bitwise equal
  DRIFT         inside the envelope everywhere
  BUG           a series leaves the envelope: first divergent step, series, factor over the envelope;
                localized (stage, layer, parameter)
  DECLARED      it leaves, and a declared difference (algorithms/differences.py) listed in either
                manifest explains the disagreeing probes: named
  INCONCLUSIVE  the envelope saturates (relative spread O(1)) before any excess, or the excess starts
                after step 0 and no one-step probe reproduces it: use --stat
Pairs without the reference (judged for the odd one out) are DIFFER when they leave the envelope, unless
their sides' shared-state comparisons with the reference decide them (through_reference).
The rule and the numbers behind it: harness/envelope.py, docs/verdict.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from algorithms.differences import DIFFERENCES

from .envelope import DEFAULT_RULE, Rule, SeriesCheck, SeriesEnvelope, check_series
from .pair import (BUG, DECLARED, DIFFER, DRIFT, IDENTICAL, INCONCLUSIVE, SERIES_ORDER, Pair, against_text,
                   fmt_factor, formula_computed_by, not_moved)
from .candidate_pairs import odd_one_out, pivot_pairs, resync_candidates, through_reference
from .resync_verdict import apply_resync
from .config_diff import differences
from .runs import SERIES, Run, declared_records


def align(grid: np.ndarray, ga: np.ndarray, gb: np.ndarray):
    """Indices into the envelope grid, a and b of the steps all three have."""
    if len(ga) == len(grid) == len(gb) and np.array_equal(ga, grid) and np.array_equal(gb, grid):
        i = np.arange(len(grid))
        return i, i, i
    common = np.intersect1d(np.intersect1d(grid, ga, assume_unique=True), gb, assume_unique=True)
    return (np.searchsorted(grid, common), np.searchsorted(ga, common), np.searchsorted(gb, common))


def check_pair(env: dict[str, SeriesEnvelope], a: Run, b: Run, rule: Rule = DEFAULT_RULE,
               with_reference: bool = True) -> Pair:
    checks: dict[str, SeriesCheck] = {}
    steps: dict[str, Any] = {}
    for s in SERIES:
        e = env[s]
        ie, ia, ib = align(e.grid, a.grid(s), b.grid(s))
        checks[s] = check_series(e, ie, a.values[s][ia], b.values[s][ib], rule, with_reference)
        if s in ("loss", "eval_loss"):
            key = "train" if s == "loss" else "eval"
            n_a, n_b = len(a.grid(s)), len(b.grid(s))
            steps[key] = {"compared": int(len(ie)), "first": int(e.grid[ie[0]]) if len(ie) else None,
                          "last": int(e.grid[ie[-1]]) if len(ie) else None, "a_points": n_a, "b_points": n_b}
    ie, ia, ib = align(a.step, a.step, b.step)
    diff = a.checksum[ia] != b.checksum[ib]
    cs = int(a.step[ia][np.argmax(diff)]) if diff.any() else None
    p = Pair(a, b, with_reference, checks, cs, steps)
    _judge(p)
    return p


def _judge(p: Pair) -> None:
    """IDENTICAL / DRIFT / INCONCLUSIVE, or the first divergence (resolved later to BUG or DECLARED)."""
    tr, ev = p.steps.get("train", {}), p.steps.get("eval", {})
    ranges_differ = tr.get("a_points") != tr.get("b_points") or ev.get("a_points") != ev.get("b_points")
    if ranges_differ:
        p.notes.append(f"step ranges differ: {p.a.name} has {tr.get('a_points')} steps, {p.b.name} {tr.get('b_points')}; "
                       f"compared the {tr.get('compared')} common steps {tr.get('first')}..{tr.get('last')}")
    cands = []
    if p.checksum_step is not None:
        i = int(np.searchsorted(p.a.step, p.checksum_step))
        j = int(np.searchsorted(p.b.step, p.checksum_step))
        cands.append({"step": p.checksum_step, "series": "batch_checksum", "factor": math.inf, "reason": "data",
                      "a_value": p.a.checksum[i].decode(), "b_value": p.b.checksum[j].decode(), "deviation": None,
                      "envelope": 0.0})
    for s, c in p.checks.items():
        if c.diverged_step is not None:
            cands.append({"step": c.diverged_step, "series": s, "factor": c.factor, "reason": c.reason,
                          "a_value": c.a_value, "b_value": c.b_value, "deviation": c.dev_at_divergence,
                          "envelope": c.env_at_divergence})
        if c.saturated_step is not None:
            p.saturated[s] = c.saturated_step
    if cands:
        p.first = min(cands, key=lambda d: (d["step"], SERIES_ORDER[d["series"]]))
        p.first["also"] = sorted({d["series"] for d in cands} - {p.first["series"]}, key=SERIES_ORDER.get)
        p.verdict = BUG
        return
    if p.checksum_step is None and not ranges_differ and all(c.identical for c in p.checks.values()):
        p.verdict = IDENTICAL
    elif p.saturated:
        s, t = min(p.saturated.items(), key=lambda kv: kv[1])
        p.verdict = INCONCLUSIVE
        p.notes.append(f"the envelope saturates at step {t} ({s}: relative spread O(1)) with no excess before it: "
                       "pointwise comparison has no power there; compare seeds statistically (--stat)")
    else:
        p.verdict = DRIFT


def declared_of(*runs: Run) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for r in runs:
        for d in r.declared:
            out.setdefault(d["id"], d)
    return out


def _compared(loc: dict[str, Any]) -> str:
    """What the localization compared, for a verdict's notes and a DECLARED verdict's evidence."""
    rep = loc.get("replay") or {}
    return "step-0 probes" + (f" and the replay of steps {rep.get('at')}" if rep.get("at") else "")


def resolve(p: Pair, localized: bool) -> None:
    """Turn an excess into BUG, DECLARED or INCONCLUSIVE, using the localization when there is one.

    DECLARED only with evidence: the reference computing the formula of every difference the candidate
    declares (`declared_check`: emulation faults, the candidate's replica count) agrees with the candidate
    on every probe compared (step 0, and the replayed steps when they ran), some of those probes disagree
    with the plain reference (the difference is really there), and every diverging series is one the
    differences can move where it diverges (pair.can_move: their `series`; at step 0 through what it computes). A difference without an emulation makes nothing DECLARED, except
    a record outside the catalogue that names exactly its probe keys and series (then 'not verified').
    Framework-RNG dropout (a `statistical` difference): when every disagreeing probe is one the masks may
    move, INCONCLUSIVE (decide with --stat). Never DECLARED: a different batch, --no-localize, a failed
    localization, no probe disagreement at all. INCONCLUSIVE: the excess starts after step 0, is finite,
    and neither the step-0 probes nor the replay of the divergent step from the reference's own state
    reproduce it (a bifurcation of the trajectory, or a bug too small for one step's probes)."""
    decl = declared_of(p.a, p.b)
    p.declared = sorted(decl)
    if p.verdict != BUG:
        return
    loc = p.localization or {}
    chk = loc.get("declared_check") or {}
    recs = declared_records(p.a, p.b)
    statistical = sorted(i for i, r in recs.items() if r["statistical"])
    if decl and loc.get("stage") == "data":
        p.notes.append(f"declared difference(s) {', '.join(decl)} cannot explain a different batch")
        return
    if not localized or loc.get("error"):
        why = ("not localized (--no-localize)" if not localized else f"localization failed ({loc['error']})")
        if statistical:
            p.verdict = INCONCLUSIVE
            p.notes.append(f"{why}, and the runs use framework-RNG dropout ({', '.join(statistical)}): no probe was "
                           "compared; decide with --stat")
        else:
            p.notes.append(f"{why}: no probe was compared, the excess alone makes this a BUG"
                           + (f"; declared difference(s) {', '.join(decl)} not checked" if decl else ""))
        return
    sa = loc.get("set_aside") or {}
    if loc.get("stage") is not None and not sa.get("all"):
        note = None
        # a probe that disagrees, or (stage report: every probe agrees) what the localization found instead
        probe = loc.get("probe") or (loc.get("disagreeing_keys") or [None])[0]
        what = f"probe {probe}" if probe else (loc.get("summary") or f"stage {loc.get('stage')}")
        if loc.get("reference_side"):
            rc = chk.get("reference_check") or {}
            note = (f"the reference's own step is not its declared difference(s) {', '.join(rc.get('differences', []))}: "
                    f"{what} disagrees with that formula computed by {(rc.get('change') or {}).get('backend')} "
                    "from the same state")
        elif chk.get("verified"):
            note = (f"declared difference(s) {', '.join(chk['emulated'])} do not explain {what}: "
                    + (f"it disagrees with {against_text(chk)}" if probe else
                       f"the step agrees with {against_text(chk)}, what is reported of it does not"))
        elif decl:
            note = f"declared difference(s) {', '.join(decl)} do not explain {what}"
        if note:   # the localization's own conclusion: withdrawn with it when the resync supersedes it
            p.notes.append(note)
            loc["note"] = note
        return
    if sa.get("all"):   # every disagreeing probe is one an unverified difference may move
        if sa.get("statistical"):
            p.verdict = INCONCLUSIVE
            p.notes.append(f"every disagreeing probe ({len(sa['keys'])}) is one framework-RNG dropout masks may move "
                           f"({', '.join(sa['differences'])}); those they cannot move agree: lock-step comparison "
                           "cannot decide, compare seeds with --stat")
            return
        left = not_moved(p, sa["differences"])
        catalogued = sorted(i for i in sa["differences"] if i in DIFFERENCES)
        if not left and catalogued:    # catalogued, with a formula, yet not verified: no evidence, no DECLARED
            p.verdict = INCONCLUSIVE
            p.notes.append(f"every disagreeing probe is one that declared difference(s) {', '.join(catalogued)} may "
                           f"move, but they were not verified ({chk.get('skipped') or 'not emulated'}): not DECLARED "
                           "without that evidence; a reference that computes their formula decides")
        elif not left:
            p.verdict, p.declared = DECLARED, sa["differences"]
            p.evidence = "not verified (no emulation; its probes and series only)"
            p.notes.append(f"every disagreeing probe is one that declared difference(s) {', '.join(sa['differences'])} "
                           "name as theirs, and so is every diverging series (not verified: no emulation)")
        else:
            p.notes.append(f"declared difference(s) {', '.join(sa['differences'])} may move the disagreeing probes "
                           f"but not series {', '.join(left)} (not verified: no emulation)")
        return
    # every compared probe agrees (with the emulating reference, when there is one)
    if chk.get("verified") and chk.get("agree"):
        left = not_moved(p, chk["emulated"])
        own = chk.get("reference_check")   # the reference's own differences undone: its steps checked too
        if chk.get("evidence") and not left and not chk.get("skipped") and (not own or own.get("agree") is True):
            p.verdict, p.declared = DECLARED, list(chk["emulated"])
            p.evidence = f"verified ({_compared(loc)} agree with {formula_computed_by(chk)})"
            p.notes.append(f"{', '.join(chk['emulated'])} verified: {against_text(chk)} agrees with the candidate on "
                           f"every probe compared ({_compared(loc)}); "
                           f"{len(chk['evidence'])} of them disagree with the plain reference")
            return
        if not chk.get("evidence"):
            p.notes.append(f"declared difference(s) {', '.join(chk['emulated'])}: no probe compared ({_compared(loc)}) "
                           "disagrees with the plain reference either, so nothing there shows the difference at "
                           "work: not DECLARED by those probes (the shared-state steps may still show it)")
        elif left:
            p.notes.append(f"declared difference(s) {', '.join(chk['emulated'])} agree with the candidate's probes but "
                           f"cannot move series {', '.join(left)}: not DECLARED")
        else:
            p.notes.append(f"declared difference(s) {', '.join(chk['skipped_differences'])} not verified "
                           f"({chk['skipped']}): not DECLARED")
    elif decl:
        p.notes.append(f"declared difference(s) {', '.join(decl)} not verified ({chk.get('skipped') or 'no emulation'})")
    if p.first["step"] == 0:
        p.notes.append(f"the step-0 values already differ beyond the envelope although the probes compared "
                       f"({_compared(loc)}) agree within their tolerance; loss, gradients, updates and the inference "
                       "output of one step from the same state are what was compared")
    elif p.first["reason"] == "non-finite":
        p.notes.append("one run is not finite where the other is")
    elif statistical:
        p.verdict = INCONCLUSIVE
        p.notes.append(f"framework-RNG dropout ({', '.join(statistical)}): lock-step comparison cannot decide; "
                       "compare seeds with --stat")
    else:
        p.verdict = INCONCLUSIVE
        p.notes.append(f"excess from step {p.first['step']} ({p.first['series']}, {fmt_factor(p.first['factor'])}) "
                       f"that no one-step probe reproduces ({_compared(loc)} agree): a bifurcation of the trajectory, "
                       "or a bug too small for one step; decide with --stat")


@dataclass
class Comparison:
    reference: Run
    runs: list[Run]
    envelope_runs: list[Run]
    envelope: dict[str, SeriesEnvelope]
    rule: Rule
    pairs: list[Pair]
    odd: dict[str, Any] | None
    forced: list[str]
    notes: list[str]
    range_warning: str | None = None   # the reference overflowed: compared up to that step (harness.finite_range)

    @property
    def exit_code(self) -> int:
        return 1 if any(p.verdict == BUG for p in self.pairs if p.with_reference) else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": 1, "tool": "duipai compare", "mode": "lockstep",
            "forced": self.forced, "notes": self.notes, "compared_to_step": self.reference.compared_to,
            "range_warning": self.range_warning,
            "reference": {"run": self.reference.name, "path": str(self.reference.path),
                          "backend": self.reference.backend},
            "runs": [{"run": r.name, "path": str(r.path), "backend": r.backend, "fault": r.fault,
                      "options": r.options.to_dict(), "perturb_ulp": r.perturb_ulp,
                      "declared_differences": [d.get("id") for d in r.declared]} for r in self.runs],
            "rule": self.rule.to_dict(),
            "envelope": {"runs": [str(r.path) for r in self.envelope_runs],
                         "perturb_ulp_seeds": [r.perturb_ulp for r in self.envelope_runs],
                         "series": {s: e.summary() for s, e in self.envelope.items()}},
            "pairs": [p.to_dict() for p in self.pairs],
            "odd_one_out": self.odd,
            "verdicts": {p.b.name: p.verdict for p in self.pairs if p.with_reference},
            "exit_code": self.exit_code,
        }


def compare(reference: Run, candidates: list[Run], envelope: dict[str, SeriesEnvelope], envelope_runs: list[Run],
            rule: Rule = DEFAULT_RULE, *, forced: list[str] | None = None,
            localize: Callable[[Pair], dict[str, Any] | None] | None = None,
            resync: Callable[[Pair, list[int]], dict[str, Any] | None] | None = None,
            all_pairs: bool = True, jobs: int = 1, judged: Callable[[Pair], None] | None = None) -> Comparison:
    """Judge every candidate against the reference (localizing each excess when `localize` is given; the
    shared-state step comparison of every pair when `resync` is given, run first so that the localization
    reuses its replay; `resync(pair, extra)` gets the divergent steps of every pair as `extra`, so that the
    reference's resync jobs are the same for all), and, with >= 3 runs, every pair of candidates too (for
    the odd one out). The candidates' resync and localization jobs run `jobs` pairs at once (threads: the
    jobs are processes; a job two pairs share runs once, see Localizer._job); `judged(pair)` is called as each
    candidate's pair is decided (the localization cache may then drop its jobs)."""
    from .localize import divergent_steps
    pairs: list[Pair] = []
    index: dict[tuple[str, str], Pair] = {}
    checked = [check_pair(envelope, reference, c, rule, True) for c in candidates]
    extra = sorted({t for p in checked for t in divergent_steps(p)})

    def judge(p: Pair) -> Pair:
        if p.b.manifest.get("fault_inert"):   # said first: the verdict is of a run that is not the bug it names
            p.notes.append(f"--fault {p.b.fault} does not apply to this run: {p.b.manifest['fault_inert']}")
        if resync is not None:
            p.resync = ({"skipped": "a different batch (data): the steps are not the same computation"}
                        if p.first is not None and p.first["series"] == "batch_checksum" else resync(p, extra))
        if p.diverged and localize is not None:
            p.localization = localize(p)
        resolve(p, localize is not None)
        apply_resync(p, resync is not None)
        if judged is not None:
            judged(p)
        return p

    if jobs > 1 and len(checked) > 1 and (resync is not None or localize is not None):
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            with_reference = list(pool.map(judge, checked))
    else:
        with_reference = [judge(p) for p in checked]
    for p in with_reference:
        pairs.append(p)
        index[(reference.name, p.b.name)] = p
    runs = [reference] + candidates
    unplaced: dict[str, str] = {}
    if all_pairs and len(runs) >= 3:
        for i, x in enumerate(candidates):
            for y in candidates[i + 1:]:
                p = check_pair(envelope, x, y, rule, False)
                p.declared = sorted(declared_of(p.a, p.b))
                if p.verdict == BUG:
                    p.verdict = DIFFER
                through_reference(p, index[(reference.name, x.name)], index[(reference.name, y.name)])
                pairs.append(p)
                index[(x.name, y.name)] = p
        if resync is not None:   # two or more BUG: do they compute one thing (the reference or their shared code)?
            unplaced = resync_candidates(*pivot_pairs(with_reference, pairs[len(with_reference):]), resync,
                                         jobs)
    odd = odd_one_out(runs, index, unplaced)
    return Comparison(reference, runs, envelope_runs, envelope, rule, pairs, odd, forced or [], [])


# --------------------------------------------------------------------------- checking the inputs
def check_comparable(runs: list[Run], force: bool) -> list[str]:
    """Refuse (BadInput naming the field and both values) runs that are not one configuration;
    with force, return the differences as notes to repeat in every output."""
    from .errors import BadInput
    forced = []
    ref = runs[0]
    for r in runs[1:]:
        for f, va, vb, words in differences(ref.manifest, r.manifest):
            msg = f"{f} differs: {ref.name} has {va}, {r.name} has {vb} ({words})"
            if not force:
                raise BadInput(msg + " (not the same configuration; --force compares anyway)")
            forced.append(msg)
    return forced


__all__ = ["compare", "check_pair", "align", "resolve", "declared_of", "odd_one_out", "check_comparable", "Comparison",
           "Pair", "IDENTICAL", "DRIFT", "BUG", "DECLARED", "INCONCLUSIVE", "DIFFER"]
