"""What a comparison writes and prints: comparison.json, comparison.csv, comparison-steps.csv (atomically,
next to the runs or in --out) and the terminal table with its notes. Reads harness/compare.py's records."""
from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .compare import Comparison, align
from .files import atomic_write_text
from .pair import BUG, DECLARED, DIFFER, DRIFT, IDENTICAL, INCONCLUSIVE, Pair, fmt_factor, formula_of
from .runs import SERIES, Run

NO_SIDE = ("", [], False, None)   # side_of of a run without a pair with the reference

# --------------------------------------------------------------------------- output
def _num(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "inf" if x > 0 else ("-inf" if x < 0 else "nan")
    if isinstance(x, (np.floating, np.integer)):
        return _num(float(x) if isinstance(x, np.floating) else int(x))
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
            ie, _, _ = align(e.grid, p.a.grid(s), g)
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
        if per_step is None and not (per_step := len(c.reference.step) <= STEPS_CSV_AUTO_LIMIT):
            c.notes.append(f"comparison-steps.csv not written ({len(c.reference.step)} steps; --steps-csv writes it)")
        rows = [pair_row(p, c.forced) for p in c.pairs]
        atomic_write_text(paths["csv"], to_csv(rows, CSV_FIELDS))
        if per_step:
            paths["steps"] = out_dir / "comparison-steps.csv"
            atomic_write_text(paths["steps"], steps_csv(c))
    else:
        atomic_write_text(paths["csv"], c.csv())
    doc = jsonable(c.to_dict())
    doc["files"] = {k: str(v) for k, v in paths.items()}
    atomic_write_text(paths["json"], json.dumps(doc, indent=1) + "\n")
    return paths


# --------------------------------------------------------------------------- the terminal table
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
    group = odd.get("runs") or [odd["run"]]
    if len(group) > 1:   # the odd group: a backend's bug shows in every run of it
        names = [label(n) for n in group]
        where = f"the {odd['backend']} backend they share" if odd.get("backend") else "what they share"
        said = (f"{', '.join(names[:-1])} and {names[-1]} are the odd group: they agree with each other and disagree "
                f"with every other run, and those all agree with each other; the bug is most likely in {where}"
                + _aside(odd, label))
        if reference in group:
            return True, f"The reference {said}."
        return False, f"odd group: {said.replace(' are the odd group:', ':', 1)}."
    if odd["run"] == reference:
        return True, (f"The reference {who} is the odd one out: it disagrees with every other run, and they all "
                      f"agree with each other; the bug is most likely in the reference{_aside(odd, label)}.")
    return False, (f"odd one out: {who}: disagrees with every other run, and they all agree with each other; "
                   f"the bug is most likely in {who}{_aside(odd, label)}.")


def _aside(odd: dict[str, Any], label: Callable[[str], str]) -> str:
    """The runs the split leaves aside (harness.candidate_pairs.resync_candidates: not placed), said."""
    left = odd.get("unplaced") or {}
    return ("" if not left else " (left aside, not placed in either group: "
            + "; ".join(f"{label(n)}: {w}" for n, w in left.items()) + ")")


def _pair_words(a: str, b: str, verdict: str, first: dict[str, Any] | None) -> str:
    return f"{a} ~ {b}: {verdict}" + (f" from step {first['step']} ({first['series']}, {fmt_factor(first['factor'])})"
                                      if first else "")


def declared_where(declared: list[str], evidence: str | None) -> str:
    """A DECLARED row's place: what it declares and what makes it DECLARED (terminal, summary.md, report)."""
    return f"declared: {', '.join(declared)}; {evidence or 'not verified'}"


def parted_text(f: dict[str, Any]) -> str:
    """Where the free-running curves part, said beside a BUG the shared-state step comparison found at step
    f['step']: later than it, or before it by rounding (no one-step comparison there found another computation)."""
    parted = f.get("parted")
    if not parted:
        return "; the free-running curves stay inside the envelope"
    later = f.get("step") is None or parted["step"] > f["step"]
    return (f"; the free-running curves part {'later' if later else 'before it'}, from step {parted['step']} "
            f"({parted['series']}, {fmt_factor(parted['factor'])} the envelope"
            + ("" if later else ": no one-step comparison there finds another computation") + ")")


def inside_factor(verdict: str, parted: bool, max_ratio: float) -> float | None:
    """The factor of the envelope a pair without the reference stayed within; None for a DRIFT pair whose curves
    parted past the envelope or its saturation (DRIFT through the reference: no factor to give)."""
    return None if verdict == DRIFT and parted else max_ratio


def side_of(verdict: str, declared: list[str], evidence: str | None, resync: dict[str, Any] | None) -> tuple:
    """What a run computes, as its comparison with the reference found it: (verdict, declared differences,
    verified: it agrees with the reference or is DECLARED with evidence, the formula the reference computed for
    its shared-state comparison, not who computed it, or None). The terminal and the report build these."""
    verified = verdict in AGREE or (verdict == DECLARED and (evidence or "").startswith("verified"))
    against = (resync or {}).get("against")
    return verdict, list(declared or []), verified, formula_of(against) if against else None


def bug_against_agreeing(sides: dict[str, tuple], a: str, b: str) -> bool:
    """One run is BUG against the reference and the other agrees with it (or is verified DECLARED): their pair
    must differ, and says nothing the two verdicts do not (`sides`: run -> side_of)."""
    (va, _, oka, _), (vb, _, okb, _) = sides.get(a, NO_SIDE), sides.get(b, NO_SIDE)
    return (va == BUG and okb) or (vb == BUG and oka)


def declared_apart(sides: dict[str, tuple], a: str, b: str, verdict: str | None = None) -> str | None:
    """Why two runs that differ are expected to: each agrees with the reference or is DECLARED against it with
    evidence (or the pair itself is DECLARED: `verdict`, harness.compare.through_reference), and they do not
    compute the same thing: other declared differences, or the same names checked against other formulas
    (`sides`: run -> side_of). None when nothing explains their difference."""
    (va, da, oka, fa), (vb, db, okb, fb) = sides.get(a, NO_SIDE), sides.get(b, NO_SIDE)
    if not (oka and okb) or DECLARED not in (va, vb, verdict) or (set(da) == set(db) and fa == fb):
        return None
    if set(da) != set(db):
        return "; ".join(f"{n} declares {', '.join(d)}" for n, d in ((a, da), (b, db)) if d)
    def said(n: str, d: list[str], f: str | None) -> str:   # other_pairs_lines reads d after " declares "/" own "
        return (f"{n} computes the formulas without the reference's own {', '.join(d)}" if f and "undone" in f
                else f"{n} declares {', '.join(d)} (the reference with {(f or 'its own formula').replace(', ', ' + ')})")
    # the same names, verified against two formulas (e.g. where the running statistics come from)
    return "; ".join(said(n, d, f) for n, d, f in ((a, da, fa), (b, db, fb)) if d)


def other_pairs_lines(rows: list[tuple], margin: float, verbose: bool = False,
                      hint: str = "; -v lists them", odd_group: set[str] | frozenset[str] = frozenset(),
                      some_apart: bool = False, sides: dict[str, tuple] | None = None) -> list[str]:
    """The pairs without the reference, rows of (label a, label b, verdict, first divergence, max factor inside[,
    why they differ as expected: declared_apart[, compared from a shared state of its own]]): one line when all
    agree (the table above is the answer), one for those the verified declarations explain, one for the DIFFER
    pairs across the odd group (`odd_group`: its runs' labels), one for those of a BUG run with a run agreeing with
    the reference (`sides`: run -> side_of), one for the pairs of two BUG runs nothing decided (the envelope is the
    reference's computation; one a pivot compared is listed), each other disagreeing pair listed; all with verbose."""
    if not rows:
        return []
    head = f"pairs without the reference (margin x{margin:g})"
    if verbose:
        return [head + ":"] + ["  " + _pair_words(*r[:4]) + (f" (expected: {r[5]})" if r[5:] and r[5] else "")
                               for r in rows]
    across = [r for r in rows if r[2] == DIFFER and len({r[0], r[1]} & set(odd_group)) == 1]
    if across:
        rest = other_pairs_lines([r for r in rows if r not in across], margin, verbose, hint, some_apart=True,
                                 sides=sides)
        return rest + [f"pairs without the reference: the {len(across)} across the odd group DIFFER, as it says{hint}"]
    sides = sides or {}
    implied = [r for r in rows if r[2] == DIFFER and bug_against_agreeing(sides, r[0], r[1])]
    both_bug = [r for r in rows if r[2] in (DIFFER, INCONCLUSIVE) and not (r[6:] and r[6])
                and all(sides.get(n, NO_SIDE)[0] == BUG for n in r[:2])]
    if implied or both_bug:
        t = sorted({r[3]["step"] for r in both_bug if (r[3] or {}).get("step") is not None}) or [None]
        when = "" if t[0] is None else f" from step {t[0]}" + (f" to {t[-1]}" if t[-1] != t[0] else "")
        kinds = " or ".join(v for v in (DIFFER, INCONCLUSIVE) if v in {r[2] for r in both_bug})
        rest = [r for r in rows if r not in implied + both_bug]
        return other_pairs_lines(rest, margin, verbose, hint, some_apart=True) + [
            f"pairs without the reference: the {len(implied)} of a BUG run with a run that agrees with the reference "
            f"DIFFER, as the verdicts above say{hint}"] * bool(implied) + [
            f"pairs without the reference: {len(both_bug)} of two BUG runs {kinds}{when}; the envelope measures the "
            f"reference's computation, which neither computes, so this does not tell whether they compute the same "
            f"thing (their localizations above do){hint}"] * bool(both_bug)
    declared = [r for r in rows if r[2] not in AGREE and r[5:] and r[5]]
    rows = [r for r in rows if r not in declared]
    if len(declared) <= 3:
        said_why = "; ".join(f"{r[0]} ~ {r[1]} ({r[5]})" for r in declared)
    else:   # many: by what the pairs' runs declare (-v lists each)
        why = Counter(", ".join(sorted({d for part in r[5].split("; ")
                                        for d in part.split(" declares " if " declares " in part else " own ")[1]
                                        .split(" (")[0].split(", ")}))
                      for r in declared)
        said_why = "; ".join(f"{n} by {w}" for w, n in why.most_common()) + hint
    expected = ([f"pairs without the reference: {len(declared)} differ as their verified declared differences "
                 f"say they must: {said_why}"] if declared else [])
    if not rows:
        return expected
    agree = [r for r in rows if r[2] in AGREE]
    by = {v: sum(r[2] == v for r in agree) for v in AGREE}
    counts = ", ".join(f"{n} {v}" for v, n in by.items() if n)
    said = counts if sum(n > 0 for n in by.values()) == 1 else f"{len(agree)} agree: {counts}"
    if len(agree) == len(rows):
        # a pair past the envelope (or its saturation) found DRIFT through the reference has no factor to give
        within = [r[4] for r in agree if r[2] == DRIFT and r[4] is not None]
        past = sum(r[2] == DRIFT and r[4] is None for r in agree)
        inside = ((f"max {max(within):.2g}x of the envelope, " if within else "")
                  + (f"{past} past it, each decided by the shared-state step comparison; " if past else ""))
        return [f"pairs without the reference: {'the other ' if declared or some_apart else 'all '}{said} "
                f"({inside}margin x{margin:g}{hint})"] + expected
    rest = [r for r in rows if r[2] not in AGREE]
    return [f"{head}: " + (f"{said}; " if agree else "") + f"{len(rest)} do not:"] + [
        "  " + _pair_words(*r[:4]) for r in rest] + expected


def _max_inside(p: Pair) -> float:
    return max((x.max_ratio for x in p.checks.values() if math.isfinite(x.max_ratio)), default=0.0)


def render(c: Comparison, verbose: bool = False) -> str:
    """The terminal table. The odd one out leads when it is the reference; the notes of each BUG and
    INCONCLUSIVE pair follow the table (of every pair with verbose); then the pairs without the reference,
    as one line when they all agree (every pair with verbose)."""
    lines, lab = [], labels(c.runs)
    if c.range_warning:   # the reference overflowed: what is compared at all, said first
        lines += [f"WARNING: {c.range_warning}", ""]
    odd = odd_one_out_line(c.odd, c.reference.name, lambda n: c.reference.backend if n == c.reference.name else lab[n])
    if odd and odd[0]:
        lines += [odd[1], ""]
    for f in c.forced:
        lines.append(f"FORCED: {f}")
    r = c.rule
    lines.append(f"reference: {c.reference.name} ({c.reference.backend})")
    kinds = ", ".join(f"--perturb-ulp {m.perturb_ulp}" + (" --dtype float64" if m.options.dtype == "float64" else "")
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
        if p.verdict == DECLARED:    # its evidence, not the localization's "not localized" (nothing disagrees)
            where = declared_where(p.declared, p.evidence)
        rows.append((lab[p.b.name], p.verdict, "-" if f.get("step") is None else str(f["step"]),
                     f.get("series", "-"), fmt_factor(f.get("factor")) if p.first else f"max {_max_inside(p):.2g}x",
                     where))
    head = ("candidate", "verdict", "step", "series", "factor", "where")
    widths = [max(len(h), *(len(rw[i]) for rw in rows)) if rows else len(h) for i, h in enumerate(head)]
    widths[-1] = len(head[-1])
    lines.append("")
    lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip())
    for rw in rows:
        lines.append("  ".join(v.ljust(w) for v, w in zip(rw, widths)).rstrip())
    for p in c.pairs:
        # the explanation of each verdict to act on (BUG, INCONCLUSIVE); the agreeing pairs' notes with verbose
        # (the table says their answer; comparison.json, summary.md and the report keep the notes)
        if not p.with_reference or (p.verdict in AGREE + (DECLARED,) and not verbose):
            continue
        if p.first or p.notes:
            lines.append("")
            lines.append(f"{lab[p.b.name]}: {p.verdict}  ({p.b.name})")
        if p.first:
            f = p.first
            if f["series"] == "batch_checksum":
                lines.append(f"  step {f['step']}: batch checksum {f['b_value']} vs reference {f['a_value']}")
            elif f["series"] in ("resync", "resync-sequential"):
                lines.append("  the shared-state step comparison disagrees" +
                             (f" at step {f['step']}" if f.get("step") is not None else " (a bias)") + parted_text(f))
            else:
                lines.append(f"  step {f['step']} {f['series']}: {f['b_value']!r} vs reference {f['a_value']!r}, "
                             f"|diff| {f['deviation']:.3g} = {fmt_factor(f['factor'])} the envelope {f['envelope']:.3g} "
                             f"({f['reason']})" + (f"; also diverging: {', '.join(f['also'])}" if f.get("also") else ""))
        for line in (p.localization or {}).get("lines", []):
            lines.append("  " + line)
        for n in p.notes:
            lines.append(f"  note: {n}")
    sides = {lab[p.b.name]: side_of(p.verdict, p.declared, p.evidence, p.resync) for p in c.pairs if p.with_reference}
    others = [(lab[p.a.name], lab[p.b.name], p.verdict, p.first,
               inside_factor(p.verdict, bool(p.first or p.saturated), _max_inside(p)),
               declared_apart(sides, lab[p.a.name], lab[p.b.name], p.verdict),
               (p.resync or {}).get("agree") is not None) for p in c.pairs if not p.with_reference]
    if odd and not odd[0]:   # a candidate (or a group of them): named before the pairs that show it
        lines += ["", odd[1]]
    if others:
        lines.append("")
        odd_runs = (c.odd or {}).get("runs") or []
        group = {lab[n] for n in odd_runs if n in lab} if len(odd_runs) > 1 else set()
        lines += other_pairs_lines(others, c.rule.margin * c.rule.pair_factor, verbose,
                                   hint="; -v lists them, with every pair's notes", odd_group=group, sides=sides)
    for n in c.notes:
        lines.append(f"note: {n}")
    lines += [f"FORCED: {f}" for f in c.forced]
    return "\n".join(lines)


__all__ = ["write_outputs", "render", "labels", "odd_one_out_line", "other_pairs_lines", "declared_apart", "side_of",
           "bug_against_agreeing", "declared_where", "inside_factor", "to_csv", "jsonable", "pair_row", "steps_csv"]
