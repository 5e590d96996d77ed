"""The pair record the verdict rules fill in (harness/compare.py: the envelope and the localization;
harness/resync_verdict.py: the shared-state step comparison; harness/autostat.py: seeds), the verdict
names, and the small readings of a pair that several rules share."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .envelope import SeriesCheck
from .runs import EVAL_SERIES, SERIES, Run, declared_records

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
    evidence: str | None = None     # what makes a DECLARED verdict: "verified (...)" or "not verified (...)"
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
                "declared_differences": self.declared,
                "declared_evidence": self.evidence if self.verdict == DECLARED else None,
                "checksum_first_difference_step": self.checksum_step,
                "steps": self.steps, "series": {s: c.to_dict() for s, c in self.checks.items()},
                "localization": self.localization, "resync": resync_doc(self.resync), "stat": self.stat,
                "notes": self.notes}



def fmt_factor(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, str) or (isinstance(x, float) and not math.isfinite(x)):   # comparison.json writes "inf"
        return str(x) if isinstance(x, str) else "inf"
    return f"{x:.3g}x"


def resync_doc(rs: dict[str, Any] | None) -> dict[str, Any] | None:
    """comparison.json's resync section: the first disagreement's analysis reduced to its place."""
    if rs is None:
        return None
    out = {k: v for k, v in rs.items() if k != "first_disagreement"}
    fb = rs.get("first_disagreement")
    if fb:
        out["first_disagreement"] = {k: fb.get(k) for k in ("step", "stage", "layer", "parameter", "probe", "rel",
                                                            "disagreeing_keys")}
        if fb.get("training_set_aside"):   # the training keys a flip explained beside an evaluation that disagrees
            out["first_disagreement"]["training_set_aside"] = fb["training_set_aside"]
    return out


def diverging_series(p: Pair) -> list[str]:
    return [p.first["series"]] + list(p.first.get("also") or [])


# What each series' row of step 0 is computed from, as probe keys ("kind/" for that kind's key of any layer or
# parameter): both runs compute it from the same initial weights, buffers and first batch. The training row: the
# forward and backward of that batch, and for the update and parameter norms the first update; the evaluation row:
# the inference forward of the initial state, evaluated before any step. A declared difference none of whose probe
# keys is among these (a second update's lr, running buffers that training writes) acts only later: it cannot move
# that series at step 0, whatever it may move afterwards.
STEP0_KEYS = {"loss": ("loss", "forward/"), "accuracy": ("forward/",), "grad_norm": ("grad/", "forward/"),
              "update_norm": ("update0/", "opt0/", "grad/", "forward/"),
              "param_norm": ("update0/", "opt0/", "grad/", "forward/"),
              "eval_loss": ("eval/",), "eval_accuracy": ("eval/",)}
def probe_names(man: dict[str, Any]) -> list[str]:
    """What follows a probe key's kind for this run's model: its layers' and trainable parameters' names, from the
    spec its manifest records (algorithms.spec.build_model); the layers' alone where that spec does not build."""
    from algorithms.spec import SpecError, build_model
    decl = man.get("spec") or {}
    try:
        model = build_model(decl)
    except SpecError:
        return [l["name"] for l in decl.get("layers", [])]
    return [l.name for l in model.layers] + [q.name for q in model.trainable]


def step0_keys(series: str, names: list[str] = ()) -> list[str]:
    """The probe keys `series`' step-0 row comes from: each kind's key of every name in `names` (probe_names) and of
    a stand-in name (a pattern that names no layer matches it as it matches any)."""
    return [k if not k.endswith("/") else f"{k}{n}" for k in STEP0_KEYS[series]
            for n in (["x", *names] if k.endswith("/") else [""])]


def can_move(rec: dict[str, Any], series: str, step: int | None, names: list[str] = ()) -> bool:
    """Can a declared difference (`rec`, runs.declared_records) move `series` where it diverges (`step`)? One of its
    `series`, and at step 0 only through the probe keys that step computes from (step0_keys of the model's `names`)."""
    if series not in rec.get("series", ()):
        return False
    if step != 0 or series not in STEP0_KEYS:
        return True
    pattern = rec.get("probe_keys")
    return pattern is not None and any(pattern.search(k) for k in step0_keys(series, names))


def diverged_at(p: Pair, series: str) -> int | None:
    c = p.checks.get(series)
    return c.diverged_step if c is not None else None


def not_moved(p: Pair, ids: list[str]) -> list[str]:
    """The diverging series that none of the declared differences `ids` can move where they diverge (can_move)."""
    recs = declared_records(p.a, p.b)
    names = probe_names(p.a.manifest or {}) if any(diverged_at(p, s) == 0 for s in diverging_series(p)) else []
    return [s for s in diverging_series(p)
            if not any(can_move(recs.get(i) or {}, s, diverged_at(p, s), names) for i in ids)]


def eval_from_start(p: Pair, probes_said: str = "step-0 probes agree", training_moved: bool = False
                    ) -> dict[str, Any] | None:
    """Stage eval from the series alone: the evaluation diverges at step 0, where both runs evaluate the same initial
    state before any step (what training computes cannot enter), and no declared difference moves that (can_move).
    A training series off at step 0 that no declared difference moves either is a finding of its own, which this
    would hide: then None, unless `training_moved` (the step-0 probes disagreed: their disagreement is that
    finding). The localization, or None."""
    unexplained = set(not_moved(p, list(declared_records(p.a, p.b))))
    eval0 = [s for s in EVAL_SERIES if diverged_at(p, s) == 0]
    train0 = [s for s, c in p.checks.items() if s not in EVAL_SERIES and c.diverged_step == 0 and s in unexplained]
    if not eval0 or not set(eval0) <= unexplained or (train0 and not training_moved):
        return None
    train = [c.diverged_step for s, c in p.checks.items() if s not in EVAL_SERIES and c.diverged_step is not None]
    line = (f"localized by series: eval: {', '.join(eval0)} diverge from step 0, the same initial state evaluated "
            f"before any step; training {f'parts from step {min(train)}' if train else 'stays inside'}; {probes_said}")
    return {"stage": "eval", "method": "series", "step": 0, "layer": None, "parameter": None, "probe": None,
            "summary": "eval: evaluation path", "lines": [line], "disagreeing_keys": []}


def not_moved_ids(p: Pair, ids: list[str]) -> list[str]:
    if p.first is None:
        return []
    return not_moved(p, ids)


def drop_stat_advice(p: Pair) -> None:
    """The free-running verdict's INCONCLUSIVE reasons, kept as what the curves alone say, without their advice
    to use --stat (the shared-state comparison decided)."""
    for i, n in enumerate(p.notes):
        for tail in ("; compare seeds statistically (--stat)", "; decide with --stat", ", compare seeds with --stat"):
            if n.endswith(tail):
                p.notes[i] = "free-running curves alone: " + n[: -len(tail)]


def change_of(chk: dict[str, Any]) -> str:
    from .probe_analysis import change_text
    return change_text(chk.get("change"))


def formula_of(against: dict[str, Any]) -> str:
    """The formula one side of a shared-state comparison was computed with (`against`: its emulation), not who
    computed it nor how the step ran, so that two runs checked on different backends compare alike."""
    from .probe_analysis import change_text
    change = {k: v for k, v in (against.get("change") or {}).items() if k not in ("backend", "jit", "threads")}
    rc = against.get("reference_check")
    undone = f"its own {', '.join(rc['differences'])} undone" if rc else ""
    return ", ".join(x for x in (change_text(change) if change else "", undone) if x) or "no change"


def against_text(chk: dict[str, Any] | None) -> str:
    """What a candidate was compared against when not the plain reference (`chk`: a declared_check, or a resync's
    `against`), for notes: the reference computing the declared formula, or a stand-in undoing the reference's own."""
    rc = (chk or {}).get("reference_check")
    if rc:
        return (f"{(chk or {}).get('change', {}).get('backend')} computing the candidate's formulas from the reference's "
                f"states (the reference's own {', '.join(rc['differences'])} undone)")
    return f"the reference computing the declared formula ({change_of(chk or {})})"


def formula_computed_by(chk: dict[str, Any] | None) -> str:
    """Who computed a declared formula, for a DECLARED verdict's evidence: the reference, or the backend that
    computed it from the reference's states where the reference's own backend does not (harness/emulating.py)."""
    on = ((chk or {}).get("change") or {}).get("backend")
    rc = (chk or {}).get("reference_check")
    if rc:   # the reference's own differences undone by a stand-in
        return (f"{on} computing the candidate's formulas from the reference's states (the reference's own "
                f"{', '.join(rc['differences'])} undone; its own steps agree with that formula computed by "
                f"{rc['change'].get('backend')})")
    return "the reference computing the formula" + (f" (on {on}, from the reference's states)" if on else "")


__all__ = ["Pair", "IDENTICAL", "DRIFT", "BUG", "DECLARED", "INCONCLUSIVE", "DIFFER", "SERIES_ORDER", "fmt_factor",
           "resync_doc", "diverging_series", "not_moved", "can_move", "diverged_at", "STEP0_KEYS", "step0_keys", "probe_names", "not_moved_ids", "eval_from_start",
           "drop_stat_advice", "change_of", "formula_computed_by", "formula_of", "against_text"]
