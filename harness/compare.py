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
Pairs without the reference (judged for the odd one out) are DIFFER when they leave the envelope.
The rule and the numbers behind it: harness/envelope.py, docs/verdict.md.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .files import atomic_write_text
from .envelope import DEFAULT_RULE, Rule, SeriesCheck, SeriesEnvelope, check_series
from .runs import SERIES, Run, declared_records, mismatches

IDENTICAL, DRIFT, BUG, DECLARED, INCONCLUSIVE = "IDENTICAL", "DRIFT", "BUG", "DECLARED", "INCONCLUSIVE"
DIFFER = "DIFFER"   # a pair without the reference that leaves the envelope (not localized; for the odd one out)
SERIES_ORDER = {s: i for i, s in enumerate(("batch_checksum",) + SERIES)}


@dataclass
class Pair:
    a: Run                          # the reference (or, for pairs without it, the first run)
    b: Run
    with_reference: bool
    checks: dict[str, SeriesCheck]
    checksum_step: int | None       # first step whose batch checksums differ
    steps: dict[str, Any]           # compared range and what was left out
    verdict: str = DRIFT
    first: dict[str, Any] | None = None
    saturated: dict[str, int] = field(default_factory=dict)
    declared: list[str] = field(default_factory=list)
    localization: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)
    resync: dict[str, Any] | None = None   # the shared-state step comparison (harness/resync.py)
    stat: dict[str, Any] | None = None     # the automatic statistical decision (harness/autostat.py)

    @property
    def diverged(self) -> bool:
        return self.first is not None

    def to_dict(self) -> dict[str, Any]:
        return {"reference": self.a.name, "candidate": self.b.name, "reference_backend": self.a.backend,
                "candidate_backend": self.b.backend, "with_reference": self.with_reference,
                "verdict": self.verdict, "first_divergence": self.first, "saturated": self.saturated,
                "declared_differences": self.declared, "checksum_first_difference_step": self.checksum_step,
                "steps": self.steps, "series": {s: c.to_dict() for s, c in self.checks.items()},
                "localization": self.localization, "resync": _resync_doc(self.resync), "stat": self.stat,
                "notes": self.notes}


def _align(grid: np.ndarray, ga: np.ndarray, gb: np.ndarray):
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
        ie, ia, ib = _align(e.grid, a.grid(s), b.grid(s))
        checks[s] = check_series(e, ie, a.values[s][ia], b.values[s][ib], rule, with_reference)
        if s in ("loss", "eval_loss"):
            key = "train" if s == "loss" else "eval"
            n_a, n_b = len(a.grid(s)), len(b.grid(s))
            steps[key] = {"compared": int(len(ie)), "first": int(e.grid[ie[0]]) if len(ie) else None,
                          "last": int(e.grid[ie[-1]]) if len(ie) else None, "a_points": n_a, "b_points": n_b}
    ie, ia, ib = _align(a.step, a.step, b.step)
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


def _diverging_series(p: Pair) -> list[str]:
    return [p.first["series"]] + list(p.first.get("also") or [])


def _not_moved(p: Pair, ids: list[str]) -> list[str]:
    """The diverging series that none of the declared differences `ids` can move (their `series`)."""
    recs = declared_records(p.a, p.b)
    can = {s for i in ids for s in (recs.get(i) or {}).get("series", ())}
    return [s for s in _diverging_series(p) if s not in can]


def _compared(loc: dict[str, Any]) -> str:
    """What the localization compared, for notes on a verdict that is not DECLARED."""
    rep = loc.get("replay") or {}
    return "step-0 probes" + (f" and the replay of steps {rep.get('at')}" if rep.get("at") else "")


def resolve(p: Pair, localized: bool) -> None:
    """Turn an excess into BUG, DECLARED or INCONCLUSIVE, using the localization when there is one.

    DECLARED only with evidence: the reference computing the formula of every difference the candidate
    declares (`declared_check`: emulation faults, the candidate's replica count) agrees with the candidate
    on every probe compared (step 0, and the replayed steps when they ran), some of those probes disagree
    with the plain reference (the difference is really there), and every diverging series is one the
    differences can move (their `series`). A difference without an emulation makes nothing DECLARED, except
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
        if chk.get("verified"):
            p.notes.append(f"declared difference(s) {', '.join(chk['emulated'])} do not explain probe "
                           f"{loc.get('probe') or loc['disagreeing_keys'][0]}: it disagrees with the reference "
                           f"computing their formula ({_change(chk)})")
        elif decl:
            p.notes.append(f"declared difference(s) {', '.join(decl)} do not explain probe "
                           f"{loc.get('probe') or (loc.get('disagreeing_keys') or ['?'])[0]}")
        return
    if sa.get("all"):   # every disagreeing probe is one an unverified difference may move
        if sa.get("statistical"):
            p.verdict = INCONCLUSIVE
            p.notes.append(f"every disagreeing probe ({len(sa['keys'])}) is one framework-RNG dropout masks may move "
                           f"({', '.join(sa['differences'])}); those they cannot move agree: lock-step comparison "
                           "cannot decide, compare seeds with --stat")
            return
        left = _not_moved(p, sa["differences"])
        if not left:
            p.verdict, p.declared = DECLARED, sa["differences"]
            p.notes.append(f"every disagreeing probe is one that declared difference(s) {', '.join(sa['differences'])} "
                           "name as theirs, and so is every diverging series (not verified: no emulation)")
        else:
            p.notes.append(f"declared difference(s) {', '.join(sa['differences'])} may move the disagreeing probes "
                           f"but not series {', '.join(left)} (not verified: no emulation)")
        return
    # every compared probe agrees (with the emulating reference, when there is one)
    if chk.get("verified") and chk.get("agree"):
        left = _not_moved(p, chk["emulated"])
        if chk.get("evidence") and not left and not chk.get("skipped"):
            p.verdict, p.declared = DECLARED, list(chk["emulated"])
            p.notes.append(f"{', '.join(chk['emulated'])} verified: the reference computing the declared formula "
                           f"({_change(chk)}) agrees with the candidate on every probe compared ({_compared(loc)}); "
                           f"{len(chk['evidence'])} of them disagree with the plain reference")
            return
        if not chk.get("evidence"):
            p.notes.append(f"declared difference(s) {', '.join(chk['emulated'])}: no probe compared ({_compared(loc)}) "
                           "disagrees with the plain reference either, so nothing shows the difference at work: not "
                           "DECLARED")
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
        p.notes.append(f"excess from step {p.first['step']} ({p.first['series']}, {_fmt_factor(p.first['factor'])}) "
                       f"that no one-step probe reproduces ({_compared(loc)} agree): a bifurcation of the trajectory, "
                       "or a bug too small for one step; decide with --stat")


def _resync_doc(rs: dict[str, Any] | None) -> dict[str, Any] | None:
    """comparison.json's resync section: the first disagreement's analysis reduced to its place."""
    if rs is None:
        return None
    out = {k: v for k, v in rs.items() if k != "first_disagreement"}
    fb = rs.get("first_disagreement")
    if fb:
        out["first_disagreement"] = {k: fb.get(k) for k in ("step", "stage", "layer", "parameter", "probe", "rel",
                                                            "disagreeing_keys")}
    return out


RESYNC_DRIFT = "trajectories diverged by accumulated rounding; every step agrees from a shared state"


def _resync_what(rs: dict[str, Any]) -> str:
    w = rs.get("worst") or {}
    seq = rs.get("sequential") or {}
    return (f"{rs['n']} resynced steps {rs['points'][0]}..{rs['points'][-1]}; worst {w.get('worst_key')} at step "
            f"{w.get('step')}, {_fmt_factor(w.get('worst_factor'))} its calibrated tolerance; sequential test "
            + (f"min p {seq['min_p']:.3g} >= {seq['threshold']:.3g}" if seq.get("min_p") is not None
               else "not run (fewer than 3 points)"))


def apply_resync(p: Pair, requested: bool) -> None:
    """The shared-state step comparison's part of the verdict, after the free-running one (`resolve`).

    BUG when a resynced step disagrees (localized from that step's probes) or the sequential test finds a
    bias, whatever the free-running curves say (a late or subtle bug inside the envelope). When every
    resynced step agrees: an INCONCLUSIVE pair (saturated envelope, an excess no probe reproduces) is DRIFT
    ("trajectories diverged by accumulated rounding"), or DECLARED when the candidate declares emulated
    differences and the plain reference disagrees with it at some resynced step while the emulating one
    agrees everywhere. Without the comparison (not requested, skipped, a failed job) nothing is upgraded:
    the note says what was not compared."""
    rs = p.resync
    if not p.with_reference:
        return
    if not requested or rs is None:
        if p.verdict in (DRIFT, INCONCLUSIVE):   # first: the last note stays the verdict's own reason
            p.notes.insert(0, "no shared-state step comparison (--no-localize or --resync-every 0): only the "
                              "free-running curves were compared")
        return
    if "skipped" in rs or "error" in rs:
        why = rs.get("skipped") or f"a resync job failed ({rs['error']})"
        p.notes.append(f"shared-state step comparison not made: {why}"
                       + ("; the free-running verdict stands" if p.verdict in (DRIFT, INCONCLUSIVE, DECLARED) else ""))
        return
    seq = rs["sequential"]
    was = p.verdict
    if not rs["agree"]:
        from .localize import describe
        fb = rs["first_disagreement"]
        t = fb["step"]
        worst = next(x for x in rs["per_point"] if x["step"] == t)
        against = rs.get("against")
        method = f"resync of step {t} from the reference's state" + (
            f", against the reference computing the declared formula ({_change({'change': against['change']})})"
            if against else "")
        if was != BUG or (p.localization or {}).get("stage") is None:
            summary, lines = describe(fb, method)
            keep = {k: (p.localization or {}).get(k) for k in ("declared_check", "replay") if (p.localization or {}).get(k)}
            p.localization = dict({k: v for k, v in fb.items() if k != "diffs"}, method=method, summary=summary,
                                  lines=lines, **keep)
        p.verdict = BUG
        drop_stat_advice(p)
        if p.first is None:
            p.first = {"step": t, "series": "resync", "factor": worst["worst_factor"], "reason": "resync",
                       "a_value": None, "b_value": None, "deviation": fb.get("rel"), "envelope": None, "also": [],
                       "probe": worst["worst_key"]}
        p.notes.append(f"resynced step {t} disagrees: one step from the reference's state computes something else "
                       f"({fb.get('probe') or worst['worst_key']}; worst {worst['worst_key']}, "
                       f"{_fmt_factor(worst['worst_factor'])} its calibrated tolerance; {rs['n']} resynced steps)"
                       + (f"; the free-running verdict was {was}" if was != BUG else "")
                       + (f"; declared difference(s) {', '.join(against['emulated'])} do not explain it" if against else ""))
        return
    if seq.get("bias") is not None:
        kd = seq["bias"]
        st = seq["kinds"][kd]
        from .resync import STAGE_OF_KIND
        p.verdict = BUG
        drop_stat_advice(p)
        line = (f"localized by the sequential test over {st['points']} resynced steps: a bias in the {kd} probes "
                f"(mean {st['mean_ulp']:+.3g} float32 ULP, t {st['t']:.3g}, p {st['p']:.3g} < {seq['threshold']:.3g}; "
                f"{st['positive']} of {st['positive'] + st['negative']} positive)")
        if was != BUG or (p.localization or {}).get("stage") is None:
            p.localization = {"stage": STAGE_OF_KIND.get(kd, kd), "method": "sequential test over resynced steps",
                              "layer": None, "parameter": None, "probe": kd, "summary": f"{STAGE_OF_KIND.get(kd, kd)}: "
                              f"bias in {kd} (p {st['p']:.2g})", "lines": [line], "disagreeing_keys": []}
        if p.first is None:
            p.first = {"series": "resync-sequential", "factor": None, "reason": "bias", "a_value": None,
                       "b_value": None, "deviation": None, "envelope": None, "also": [], "probe": kd}
        p.notes.append(f"every resynced step is inside its tolerance, but the signed differences of the {kd} probes "
                       f"keep one sign: p {st['p']:.3g} < {seq['threshold']:.3g} (Bonferroni over "
                       f"{seq['kinds_tested']} kinds): a bias rounding does not produce"
                       + (f"; the free-running verdict was {was}" if was != BUG else ""))
        return
    against = rs.get("against")
    if was == INCONCLUSIVE and against and rs.get("evidence") and not _not_moved_ids(p, against["emulated"]):
        p.verdict, p.declared = DECLARED, list(against["emulated"])
        drop_stat_advice(p)
        p.notes.append(f"{', '.join(against['emulated'])} verified on the shared-state steps: the reference computing "
                       f"the declared formula agrees with the candidate at every resynced step, the plain reference "
                       f"does not ({len(rs['evidence'])} probes); {_resync_what(rs)}")
    elif was == INCONCLUSIVE:
        p.verdict = DRIFT
        drop_stat_advice(p)
        p.notes.append(f"{RESYNC_DRIFT} ({rs['n']} resynced steps): {_resync_what(rs)}")
    elif was in (DRIFT, IDENTICAL, DECLARED):
        p.notes.append(f"every resynced step agrees: {_resync_what(rs)}")
    elif was == BUG:
        p.notes.append(f"the resynced steps agree ({_resync_what(rs)}), but the verdict above stands")


def drop_stat_advice(p: Pair) -> None:
    """The free-running verdict's INCONCLUSIVE reasons, kept as what the curves alone say, without their advice
    to use --stat (the shared-state comparison decided)."""
    for i, n in enumerate(p.notes):
        for tail in ("; compare seeds statistically (--stat)", "; decide with --stat", ", compare seeds with --stat"):
            if n.endswith(tail):
                p.notes[i] = "free-running curves alone: " + n[: -len(tail)]


def _not_moved_ids(p: Pair, ids: list[str]) -> list[str]:
    if p.first is None:
        return []
    return _not_moved(p, ids)


def _change(chk: dict[str, Any]) -> str:
    from .localize import change_text
    return change_text(chk.get("change"))


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

    @property
    def exit_code(self) -> int:
        return 1 if any(p.verdict == BUG for p in self.pairs if p.with_reference) else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": 1, "tool": "duipai compare", "mode": "lockstep",
            "forced": self.forced, "notes": self.notes,
            "reference": {"run": self.reference.name, "path": str(self.reference.path),
                          "backend": self.reference.backend},
            "runs": [{"run": r.name, "path": str(r.path), "backend": r.backend, "fault": r.fault,
                      "options": r.options, "perturb_ulp": r.perturb_ulp,
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
            all_pairs: bool = True, jobs: int = 1) -> Comparison:
    """Judge every candidate against the reference (localizing each excess when `localize` is given; the
    shared-state step comparison of every pair when `resync` is given, run first so that the localization
    reuses its replay; `resync(pair, extra)` gets the divergent steps of every pair as `extra`, so that the
    reference's resync jobs are the same for all), and, with >= 3 runs, every pair of candidates too (for
    the odd one out). The candidates' resync and localization jobs run `jobs` pairs at once (threads: the
    jobs are processes; a job two pairs share runs once, see Localizer._job)."""
    from .localize import divergent_steps
    pairs: list[Pair] = []
    index: dict[tuple[str, str], Pair] = {}
    checked = [check_pair(envelope, reference, c, rule, True) for c in candidates]
    extra = sorted({t for p in checked for t in divergent_steps(p)})

    def judge(p: Pair) -> Pair:
        if resync is not None:
            p.resync = ({"skipped": "a different batch (data): the steps are not the same computation"}
                        if p.first is not None and p.first["series"] == "batch_checksum" else resync(p, extra))
        if p.diverged and localize is not None:
            p.localization = localize(p)
        resolve(p, localize is not None)
        apply_resync(p, resync is not None)
        return p

    if jobs > 1 and len(checked) > 1 and (resync is not None or localize is not None):
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            judged = list(pool.map(judge, checked))
    else:
        judged = [judge(p) for p in checked]
    for p in judged:
        pairs.append(p)
        index[(reference.name, p.b.name)] = p
    runs = [reference] + candidates
    if all_pairs and len(runs) >= 3:
        for i, x in enumerate(candidates):
            for y in candidates[i + 1:]:
                p = check_pair(envelope, x, y, rule, False)
                p.declared = sorted(declared_of(p.a, p.b))
                if p.verdict == BUG:
                    p.verdict = DIFFER
                pairs.append(p)
                index[(x.name, y.name)] = p
    odd = odd_one_out(runs, index)
    return Comparison(reference, runs, envelope_runs, envelope, rule, pairs, odd, forced or [], [])


# --------------------------------------------------------------------------- checking the inputs
def check_comparable(runs: list[Run], force: bool) -> list[str]:
    """Refuse (BadInput naming the field and both values) runs that are not one configuration;
    with force, return the differences as notes to repeat in every output."""
    from .errors import BadInput
    forced = []
    ref = runs[0]
    for r in runs[1:]:
        for f, va, vb in mismatches(ref, r):
            msg = f"{f} differs: {ref.name} has {va}, {r.name} has {vb}"
            if not force:
                raise BadInput(msg + " (not the same configuration; --force compares anyway)")
            forced.append(msg)
    return forced


# --------------------------------------------------------------------------- output
def atomic_write(path: Path, text: str) -> None:
    atomic_write_text(path, text)


def _num(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "inf" if x > 0 else ("-inf" if x < 0 else "nan")
    if isinstance(x, (np.floating,)):
        return _num(float(x))
    if isinstance(x, np.integer):
        return int(x)
    return x


def jsonable(o: Any) -> Any:
    if isinstance(o, dict):
        return {str(k): jsonable(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [jsonable(v) for v in o]
    if isinstance(o, np.ndarray):
        return [jsonable(v) for v in o.tolist()]
    return _num(o)


CSV_FIELDS = ["reference", "candidate", "reference_backend", "candidate_backend", "with_reference", "verdict",
              "first_step", "first_series", "factor", "deviation", "envelope", "reference_value", "candidate_value",
              "reason", "also_diverging", "stage", "layer", "parameter", "probe", "localization_method",
              "declared_differences", "saturated", "max_factor_inside", "notes", "forced",
              "resync_points", "resync_agree", "resync_worst_key", "resync_worst_factor", "resync_sequential_p",
              "resync_sequential_bias"]


def pair_row(p: Pair, forced: list[str]) -> dict[str, Any]:
    f = p.first or {}
    loc = p.localization or {}
    inside = max((c.max_ratio for c in p.checks.values() if math.isfinite(c.max_ratio)), default=0.0)
    return {"reference": p.a.name, "candidate": p.b.name, "reference_backend": p.a.backend,
            "candidate_backend": p.b.backend, "with_reference": p.with_reference, "verdict": p.verdict,
            "first_step": f.get("step"), "first_series": f.get("series"), "factor": f.get("factor"),
            "deviation": f.get("deviation"), "envelope": f.get("envelope"), "reference_value": f.get("a_value"),
            "candidate_value": f.get("b_value"), "reason": f.get("reason"),
            "also_diverging": " ".join(f.get("also", [])), "stage": loc.get("stage"), "layer": loc.get("layer"),
            "parameter": loc.get("parameter"), "probe": loc.get("probe"), "localization_method": loc.get("method"),
            "declared_differences": " ".join(p.declared),
            "saturated": " ".join(f"{s}@{t}" for s, t in p.saturated.items()),
            "max_factor_inside": inside, "notes": " | ".join(p.notes), "forced": " | ".join(forced),
            **_resync_row(p.resync)}


def _resync_row(rs: dict[str, Any] | None) -> dict[str, Any]:
    """comparison.csv's resync columns (empty when it was not made)."""
    if not rs or "points" not in rs or "per_point" not in rs:
        return {}
    w, seq = rs.get("worst") or {}, rs.get("sequential") or {}
    return {"resync_points": rs["n"], "resync_agree": rs["agree"], "resync_worst_key": w.get("worst_key"),
            "resync_worst_factor": w.get("worst_factor"), "resync_sequential_p": seq.get("min_p"),
            "resync_sequential_bias": seq.get("bias")}


def to_csv(rows: list[dict[str, Any]], fields: list[str]) -> str:
    import csv
    import io
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if r.get(k) is None else (repr(r[k]) if isinstance(r[k], float) else r[k])) for k in fields})
    return buf.getvalue()


def steps_csv(c: Comparison) -> str:
    """Every per-step number: reference value, raw spread, envelope, and each candidate's value and factor."""
    import pandas as pd
    frames = []
    cand_pairs = [p for p in c.pairs if p.with_reference]
    for s in SERIES:
        e = c.envelope[s]
        df = pd.DataFrame({"series": s, "step": e.grid, "reference": e.ref, "spread": e.raw, "envelope": e.env})
        for p in cand_pairs:
            g = p.b.grid(s)
            idx = np.searchsorted(g, e.grid).clip(0, max(len(g) - 1, 0))
            ok = (g[idx] == e.grid) if len(g) else np.zeros(len(e.grid), bool)
            df[f"{p.b.name}:value"] = np.where(ok, p.b.values[s][idx] if len(g) else np.nan, np.nan)
            r = p.checks[s].ratios
            ie, _, _ = _align(e.grid, p.a.grid(s), g)
            col = np.full(len(e.grid), np.nan)
            if r is not None:
                col[ie] = r
            df[f"{p.b.name}:factor"] = col
        frames.append(df)
    return pd.concat(frames, ignore_index=True).to_csv(index=False, float_format=None)


STEPS_CSV_AUTO_LIMIT = 100_000   # per-step rows written by default up to this many steps


def write_outputs(c: Comparison | Any, out_dir: Path, *, per_step: bool | None = None) -> dict[str, Path]:
    """comparison.json, comparison.csv and (by default for runs up to STEPS_CSV_AUTO_LIMIT steps)
    comparison-steps.csv, each written atomically."""
    out_dir = Path(out_dir)
    paths = {"json": out_dir / "comparison.json", "csv": out_dir / "comparison.csv"}
    if isinstance(c, Comparison):
        if per_step is None:
            per_step = len(c.reference.step) <= STEPS_CSV_AUTO_LIMIT
            if not per_step:
                c.notes.append(f"comparison-steps.csv not written ({len(c.reference.step)} steps; --steps-csv writes it)")
        rows = [pair_row(p, c.forced) for p in c.pairs]
        atomic_write(paths["csv"], to_csv(rows, CSV_FIELDS))
        if per_step:
            paths["steps"] = out_dir / "comparison-steps.csv"
            atomic_write(paths["steps"], steps_csv(c))
    else:
        atomic_write(paths["csv"], c.csv())
    doc = jsonable(c.to_dict())
    doc["files"] = {k: str(v) for k, v in paths.items()}
    atomic_write(paths["json"], json.dumps(doc, indent=1) + "\n")
    return paths


# --------------------------------------------------------------------------- the terminal table
def _fmt_factor(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, str) or (isinstance(x, float) and not math.isfinite(x)):   # comparison.json writes "inf"
        return str(x) if isinstance(x, str) else "inf"
    return f"{x:.3g}x"


def labels(runs: list[Run]) -> dict[str, str]:
    """Short names for the table: the parts of each folder name (split at '__') that not every run
    shares, the backend first; the full name where that would be ambiguous."""
    parts = {r.name: r.name.split("__") for r in runs}
    common = set.intersection(*(set(p) for p in parts.values())) if runs else set()
    out = {}
    for r in runs:
        rest = [x for x in parts[r.name] if x not in common and x != r.backend]
        out[r.name] = " ".join([r.backend] + rest)
    if len(set(out.values())) < len(out):
        return {r.name: r.name for r in runs}
    return out


AGREE = (IDENTICAL, DRIFT)


def odd_one_out_line(odd: dict[str, Any] | None, reference: str,
                     label: Callable[[str], str]) -> tuple[bool, str] | None:
    """The odd one out in words: (whether it is the reference, the sentence). A reference that every
    other run disagrees with while they all agree points at the reference, not at the candidates its
    pairs call BUG: that sentence must lead every output."""
    if not odd:
        return None
    who = label(odd["run"])
    if odd["run"] == reference:
        return True, (f"The reference {who} is the odd one out: it disagrees with every other run, and they all "
                      "agree with each other; the bug is most likely in the reference.")
    return False, (f"odd one out: {who}: disagrees with every other run, and they all agree with each other; "
                   f"the bug is most likely in {who}.")


def _pair_words(a: str, b: str, verdict: str, first: dict[str, Any] | None) -> str:
    return f"{a} ~ {b}: {verdict}" + (f" from step {first['step']} ({first['series']}, {_fmt_factor(first['factor'])})"
                                      if first else "")


def other_pairs_lines(rows: list[tuple[str, str, str, dict[str, Any] | None, float]], margin: float,
                      verbose: bool = False, hint: str = "; -v lists them") -> list[str]:
    """The pairs without the reference, rows of (label a, label b, verdict, first divergence, max factor
    inside): one line when they all agree (the answer is the table above), each disagreeing pair
    listed, every pair with verbose."""
    if not rows:
        return []
    head = f"pairs without the reference (margin x{margin:g})"
    if verbose:
        return [head + ":"] + ["  " + _pair_words(*r[:4]) for r in rows]
    agree = [r for r in rows if r[2] in AGREE]
    by = {v: sum(r[2] == v for r in agree) for v in AGREE}
    counts = ", ".join(f"{n} {v}" for v, n in by.items() if n)
    said = counts if sum(n > 0 for n in by.values()) == 1 else f"{len(agree)} agree: {counts}"
    if len(agree) == len(rows):
        inside = f"max {max(r[4] for r in agree):.2g}x of the envelope, " if by[DRIFT] else ""
        return [f"pairs without the reference: all {said} ({inside}margin x{margin:g}{hint})"]
    rest = [r for r in rows if r[2] not in AGREE]
    return [f"{head}: " + (f"{said}; " if agree else "") + f"{len(rest)} do not:"] + [
        "  " + _pair_words(*r[:4]) for r in rest]


def _max_inside(p: Pair) -> float:
    return max((x.max_ratio for x in p.checks.values() if math.isfinite(x.max_ratio)), default=0.0)


def render(c: Comparison, verbose: bool = False) -> str:
    """The terminal table. The odd one out leads when it is the reference; the pairs without the
    reference follow the table as one line when they all agree (every pair with verbose)."""
    lines = []
    lab = labels(c.runs)
    odd = odd_one_out_line(c.odd, c.reference.name, lambda n: c.reference.backend if n == c.reference.name else lab[n])
    if odd and odd[0]:
        lines += [odd[1], ""]
    for f in c.forced:
        lines.append(f"FORCED: {f}")
    r = c.rule
    lines.append(f"reference: {c.reference.name} ({c.reference.backend})")
    kinds = ", ".join(f"--perturb-ulp {m.perturb_ulp}" + (" --dtype float64" if m.options.get("dtype") == "float64" else "")
                      for m in c.envelope_runs)
    lines.append(f"envelope:  {len(c.envelope_runs)} {c.reference.backend} runs ({kinds})")
    lines.append(f"rule:      exceed = |diff| > {r.margin:g} x max(spread, max over +-{r.window} steps; {r.ulps:g} float32 "
                 f"ULP; {r.abs_floor:g}); divergence = 2 consecutive exceedances or > {r.max_isolated} isolated")
    sat = {s: e.summary()["saturated_at_step"] for s, e in c.envelope.items() if e.saturated_at is not None}
    if sat:
        lines.append("saturated: " + ", ".join(f"{s} from step {t}" for s, t in sat.items()))
    rows = []
    for p in c.pairs:
        if not p.with_reference:
            continue
        f = p.first or {}
        loc = p.localization or {}
        where = ""
        if p.verdict in (BUG, DECLARED) and loc:
            where = loc.get("summary", "")
        elif p.verdict == DECLARED:
            where = ", ".join(p.declared)
        if p.verdict == DECLARED:
            where = (f"declared: {', '.join(p.declared)}; " + where).rstrip("; ")
        rows.append((lab[p.b.name], p.verdict, "-" if f.get("step") is None else str(f["step"]),
                     f.get("series", "-"), _fmt_factor(f.get("factor")) if p.first else f"max {_max_inside(p):.2g}x",
                     where))
    head = ("candidate", "verdict", "step", "series", "factor", "where")
    widths = [max(len(h), *(len(rw[i]) for rw in rows)) if rows else len(h) for i, h in enumerate(head)]
    widths[-1] = len(head[-1])
    lines.append("")
    lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip())
    for rw in rows:
        lines.append("  ".join(v.ljust(w) for v, w in zip(rw, widths)).rstrip())
    for p in c.pairs:
        if not p.with_reference:
            continue
        if p.first or p.notes:
            lines.append("")
            lines.append(f"{lab[p.b.name]}: {p.verdict}  ({p.b.name})")
        if p.first:
            f = p.first
            if f["series"] == "batch_checksum":
                lines.append(f"  step {f['step']}: batch checksum {f['b_value']} vs reference {f['a_value']}")
            elif f["series"] in ("resync", "resync-sequential"):
                lines.append("  the free-running curves stay inside the envelope; the shared-state step comparison "
                             "disagrees" + (f" at step {f['step']}" if f.get("step") is not None else " (a bias)"))
            else:
                lines.append(f"  step {f['step']} {f['series']}: {f['b_value']!r} vs reference {f['a_value']!r}, "
                             f"|diff| {f['deviation']:.3g} = {_fmt_factor(f['factor'])} the envelope {f['envelope']:.3g} "
                             f"({f['reason']})" + (f"; also diverging: {', '.join(f['also'])}" if f.get("also") else ""))
        for line in (p.localization or {}).get("lines", []):
            lines.append("  " + line)
        for n in p.notes:
            lines.append(f"  note: {n}")
    others = [(lab[p.a.name], lab[p.b.name], p.verdict, p.first, _max_inside(p))
              for p in c.pairs if not p.with_reference]
    if others:
        lines.append("")
        lines += other_pairs_lines(others, c.rule.margin * c.rule.pair_factor, verbose)
    if odd and not odd[0]:
        lines.append(odd[1])
    for n in c.notes:
        lines.append(f"note: {n}")
    for f in c.forced:
        lines.append(f"FORCED: {f}")
    return "\n".join(lines)


__all__ = ["compare", "check_pair", "Comparison", "Pair", "render", "write_outputs", "check_comparable",
           "odd_one_out_line", "other_pairs_lines",
           "IDENTICAL", "DRIFT", "BUG", "DECLARED", "INCONCLUSIVE", "DIFFER"]
