"""The arbiter: which side of a BUG the exact computation supports, run and reported.

With two framework backends a BUG says only that they disagree; the odd-one-out vote needs three, and three
frameworks may share a kernel library or a convention. The arbiter is a backend named by the user (`duipai
compare --arbiter NAME`) or the matrix (`arbiter = "NAME"`), never by this module, that implements the
spec's formulas in float64. For every pair judged BUG it is probed on the same configuration (model, data,
hyper-parameters, the reference's initial weights; no fault) at step 0, and, when the bug was localized by
replay, from the reference's own states at the replayed steps; harness/arbitration.py (pure) says which side
leaves the exact values first. This module chooses the arbiter's options, runs its jobs through the
Localizer's public `probe0` and `replay` (runner.execute in child processes) and writes its section into the
comparison.
"""
from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from .arbitration import MARGIN, REL_FLOOR, REL_TOL, arbitrate, statement
from .compare import Comparison
from .compare_output import labels
from .pair import BUG, Pair
from .probe_analysis import spec_layers
from .errors import BackendFailed, BadInput

# options of the compared runs that change how, not what, is computed: the arbiter runs without those it
# cannot honour, and says so; any other option it cannot honour stops it (capability -> option)
LAYOUT_EXTRAS = {"channels_last": "channels_last", "xla": "xla", "onednn": "onednn", "hosts": "hosts",
                 "platform": None}
SEMANTIC_EXTRAS = {"sync_bn": "sync_bn"}


# --------------------------------------------------------------------------- running the arbiter backend
def check_arbiter(name: str) -> None:
    """BadInput unless `name` is a registered, installed backend that computes in float64."""
    from .runner import backend_info
    info = backend_info()
    if name not in info:
        raise BadInput(f"--arbiter {name}: unknown backend; known: {', '.join(info)}")
    if info[name]["missing"]:
        raise BadInput(f"--arbiter {name}: not installed ({', '.join(info[name]['missing'])})")
    if "float64" not in info[name].get("capabilities", []):
        raise BadInput(f"--arbiter {name}: it does not declare float64; the exact computation needs it")


def arbiter_options(ref_options: dict[str, Any], capabilities: set[str] | frozenset[str]
                    ) -> tuple[dict[str, Any] | None, list[str], str | None]:
    """The arbiter's options for the reference's configuration: (options or None, what it does not honour,
    why it cannot run). No fault, float64; layout and compiler switches it lacks are dropped (said); an option
    that changes the computation and that it cannot honour stops it."""
    o = dict(ref_options)
    o.update(fault=None, dtype="float64")
    adjusted: list[str] = []
    if o.get("devices", 1) > 1 and "data_parallel" not in capabilities:
        return None, adjusted, f"--devices {o['devices']}: no data_parallel capability"
    if o.get("dropout", "harness") != "harness":
        return None, adjusted, (f"--dropout {o['dropout']}: framework-RNG masks, which an exact computation "
                                "cannot share")
    extra = {}
    for k, v in (o.get("extra") or {}).items():
        if k == "port" or v in (None, False):
            continue
        if k in SEMANTIC_EXTRAS and SEMANTIC_EXTRAS[k] not in capabilities:
            return None, adjusted, f"{k}={v}: no {SEMANTIC_EXTRAS[k]} capability (it changes what is computed)"
        if k in SEMANTIC_EXTRAS or LAYOUT_EXTRAS.get(k, "-") in capabilities:
            extra[k] = v
        else:
            adjusted.append(f"{k}={v} (not honoured: it changes how the compared runs compute, not what)")
    o["extra"] = extra
    if not o.get("jit", True) and "eager" not in capabilities:
        adjusted.append("jit=False (not honoured: the arbiter has one execution mode)")
        o["jit"] = True
    if o.get("threads", 1) != 1 and "threads" not in capabilities:
        adjusted.append(f"threads={o['threads']} (not honoured: one thread)")
        o["threads"] = 1
    return o, adjusted, None


def variant(run, backend: str | None = None, **options: Any):
    """A Run standing for `run` computed by another backend and/or with other options, for the Localizer's jobs:
    the same manifest (data, weights, hashes) with the backend and options replaced; no folder of its own (its
    jobs live under .localize). With another backend: no fault and no declared differences."""
    from .runs import Run
    man = copy.deepcopy(run.manifest)
    if backend is not None and backend != run.backend:
        man.update(backend=backend, fault=None, declared_differences=[])
        options = {"fault": None, **options}
    before = man.get("options") or {}
    tag = "__".join(f"{k}-{v}" for k, v in sorted(options.items())
                    if k not in ("extra", "fault") and before.get(k) != v) or "same"
    man["options"] = dict(before, **options)
    if "config" in man:    # what config_of regenerates the variant's jobs from
        man["config"] = dict(man["config"], backend=man["backend"], **options)
    return Run(run.path.parent / f"{run.name}__{backend or run.backend}__{tag}", man, run.step, run.values,
               run.checksum, run.eval_step)


def _own64(loc, run) -> tuple[dict[str, Any] | None, str | None]:
    """A side's step-0 probes in float64 (its own rounding, for its tolerance), or None and why not."""
    if run.options.dtype == "float64":
        return None, None
    try:
        return loc.probe0(run, dtype="float64"), None
    except BackendFailed as e:
        return None, f"{run.backend} float64 probe unavailable ({str(e).splitlines()[0]})"


def _without(d: dict[str, Any], drop: set[str]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k not in drop}


def _replayed(loc, ref, cand, exact_run, calib_run, at: list[int]) -> list[tuple]:
    """Per replayed step: (step, candidate, reference, exact, calibration, candidate64, reference64) probes (the
    optional ones None), all from the reference's own state at that step (the Localizer's replay jobs; those
    of the localization are reused)."""
    def optional(run) -> dict[int, Any]:
        try:
            return {t: p for t, p, *_ in loc.replay(ref, run, at)["probes"]}
        except BackendFailed:
            return {}
    c_rep = {t: (p, p64) for t, p, _, p64, *_ in loc.replay(ref, cand, at)["probes"]}
    e_rep = {t: (p, pb) for t, p, pb, *_ in loc.replay(ref, exact_run, at)["probes"]}
    k_rep = optional(calib_run)
    c64 = optional(variant(cand, dtype="float64")) if cand.options.dtype != "float64" else {}
    return [(t, c_rep[t][0], e_rep[t][1], e_rep[t][0], k_rep.get(t), c64.get(t), c_rep[t][1])
            for t in at if t in c_rep and t in e_rep]


def arbitrate_pair(pair: Pair, arbiter: str, loc, *, capabilities: set[str],
                   log: Callable[[str], None]) -> dict[str, Any]:
    """The arbiter's section of one BUG pair: step-0 probes of the arbiter (float64 exact, float32 calibration)
    against the pair's two sides, then the replayed steps when the localization replayed. Keys that a declared
    difference may move are set aside (the arbiter computes the reference formula)."""
    from .runs import movable_keys
    ref, cand = pair.a, pair.b
    lab = labels([ref, cand])
    ref_l, cand_l = lab[ref.name], lab[cand.name]
    sec: dict[str, Any] = {"backend": arbiter, "dtype": "float64", "ran": False, "reason": None, "adjusted": [],
                           "side": None, "supports": None, "disagrees": None, "key": None, "step": None,
                           "candidate_error": None, "reference_error": None, "candidate_tol": None,
                           "reference_tol": None, "set_aside": [],
                           "results": []}
    sec.update(candidate_label=cand_l, reference_label=ref_l)
    loc_res = pair.localization or {}
    log(f"arbiter: {arbiter} float64 on {cand_l} vs the reference {ref_l}")

    def not_run(why: str) -> dict[str, Any]:
        sec["reason"] = why
        sec["statement"] = statement(None, arbiter, ref_l, cand_l, reason=f"for {cand_l}: {why}")
        return sec
    own = [who for who, run in ((cand_l, cand), (ref_l, ref)) if run.backend == arbiter]
    if own:   # a bug in that backend's code is in the arbiter too: it would side with it
        sec["own_backend"] = True
        return not_run(f"the arbiter runs {own[0]}'s backend, so a bug in that code is in the arbiter too: not an "
                       "independent judge of this pair")
    if loc_res.get("stage") == "data":
        return not_run("the runs were fed different batches (localized: data); probes feed both sides the same batch "
                       "and cannot say whose data order is wrong")
    opts, adjusted, why = arbiter_options(ref.options.to_dict(), capabilities)
    sec["adjusted"] = adjusted
    if opts is None:
        return not_run(f"it cannot run the reference's configuration: {why}")
    exact_run = variant(ref, arbiter, **dict(opts, dtype="float64"))
    calib_run = variant(ref, arbiter, **dict(opts, dtype="float32"))
    layers = spec_layers(ref.manifest)
    try:
        exact = loc.probe0(exact_run)
        cp, rp = loc.probe0(cand), loc.probe0(ref)
    except BackendFailed as e:
        return not_run(f"a probe job failed: {str(e).splitlines()[0]}")
    try:
        calib = loc.probe0(calib_run)
    except BackendFailed as e:
        calib = None
        sec["adjusted"].append(f"no float32 calibration ({str(e).splitlines()[0]}): fixed tolerance {REL_TOL:g}")
    (c64, why_c), (r64, why_r) = _own64(loc, cand), _own64(loc, ref)
    sec["adjusted"] += [w + ": its tolerance from the arbiter's float32 rounding only" for w in (why_c, why_r) if w]
    aside = set(movable_keys(ref, cand, list(exact)))
    sec["set_aside"] = sorted(aside)
    sec["ran"] = True
    a = arbitrate(_without(cp, aside), _without(rp, aside), exact, calib, candidate64=c64, reference64=r64,
                  layers=layers)
    t = 0
    sec["results"].append(dict(a.to_dict(), step=0))
    rep = loc_res.get("replay") or {}
    if a.side == "neither" and rep.get("at") and not rep.get("error"):
        # step 0 says nothing: the replayed steps, from the reference's own states there
        try:
            for t_, c, r, ex, cal, c64_, r64_ in _replayed(loc, ref, cand, exact_run, calib_run, sorted(rep["at"])):
                a, t = arbitrate(_without(c, aside), _without(r, aside), ex, cal, candidate64=c64_,
                                 reference64=r64_, layers=layers), t_
                sec["results"].append(dict(a.to_dict(), step=t_))
                if a.side != "neither":
                    break
        except BackendFailed as e:
            sec["adjusted"].append(f"replayed steps not arbitrated: {str(e).splitlines()[0]}")
    sec.update(side=a.side, key=a.key, step=t, candidate_error=a.candidate_error, reference_error=a.reference_error,
               candidate_tol=a.candidate_tol, reference_tol=a.reference_tol)
    sec["supports"] = {"candidate": cand.name, "reference": ref.name}.get(
        {"reference": "candidate", "candidate": "reference"}.get(a.side, ""))
    sec["disagrees"] = {"candidate": cand.name, "reference": ref.name, "both": "both"}.get(a.side)
    sec["statement"] = statement(a, arbiter, ref_l, cand_l, t if len(sec["results"]) > 1 else None)
    return sec


@dataclass
class ArbitratedComparison(Comparison):
    """A Comparison with the arbiter's section per BUG pair (comparison.json `pairs[i].arbiter`, and
    `arbiter` at the top: the backend and the lead sentences)."""
    arbiter: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        secs = self.arbiter.get("pairs", {})
        for p in d["pairs"]:
            if p.get("with_reference") and p["candidate"] in secs:
                p["arbiter"] = secs[p["candidate"]]
        d["arbiter"] = {k: v for k, v in self.arbiter.items() if k != "pairs"}
        return d


def lead_lines(arb: dict[str, Any]) -> list[str]:
    """What leads every output: the arbiter naming the reference, and an arbiter that did not run (but for a
    pair with its own backend, which it never judges: said in that pair's notes). Several
    pairs in which the exact computation supports the candidate against the reference are one line (each
    pair's own sentence stays in its notes)."""
    secs = list(arb.get("pairs", {}).values())
    against = [s for s in secs if s.get("side") == "reference"]
    if len(against) >= 2 and all(s.get("candidate_label") for s in against):
        keys = Counter(s.get("key") for s in against)
        key, n = keys.most_common(1)[0]
        at = next(s for s in against if s.get("key") == key)
        names = [s["candidate_label"] for s in against]
        shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
        head = [f"arbiter ({arb.get('backend')} float64): the exact computation supports all {len(against)} "
                f"candidates it was asked about ({shown}); the reference {at['reference_label']} disagrees with it "
                f"at {key} (err {at['reference_error']:.2g}, tolerance {at['reference_tol']:.2g}"
                + (f"; that key in {n} of them" if n < len(against) else "") + "): the bug is most likely in the "
                "reference (each pair's notes have its numbers)"]
    else:
        head = [s["statement"] for s in against]
    return (head + [s["statement"] for s in secs if s.get("side") == "both"]
            + [s["statement"] for s in secs if not s.get("ran") and not s.get("own_backend")])


def arbitrate_comparison(c: Comparison, arbiter: str, *, timeout: float | None = None,
                         log: Callable[[str], None] = lambda m: None) -> ArbitratedComparison:
    """Run the arbiter on every BUG pair with the reference; its sentence goes into the pair's notes, its
    section into comparison.json, and `lead_lines` into the head of the outputs."""
    from .localize import Localizer
    from .runner import backend_info
    check_arbiter(arbiter)
    caps = set(backend_info()[arbiter].get("capabilities", []))
    loc = Localizer(c.reference.path.parent, timeout=timeout, log=log)
    pairs: dict[str, Any] = {}
    for p in c.pairs:
        if not p.with_reference or p.verdict != BUG:
            continue
        sec = arbitrate_pair(p, arbiter, loc, capabilities=caps, log=log)
        for a in sec["adjusted"]:
            p.notes.append(f"arbiter ({arbiter}): {a}")
        p.notes.insert(0, sec["statement"])
        pairs[p.b.name] = sec
    loc.close()
    arb = {"backend": arbiter, "dtype": "float64", "margin": MARGIN, "rel_floor": REL_FLOOR, "pairs": pairs}
    arb["lead"] = lead_lines(arb)
    return ArbitratedComparison(**{f.name: getattr(c, f.name) for f in fields(c)}, arbiter=arb)


def lead_text(comparisons: list[Any]) -> str:
    """The arbiter's leading lines of several comparisons as a block ending in a blank line ('' for none)."""
    lines = [x for c in comparisons for x in (getattr(c, "arbiter", None) or {}).get("lead", [])]
    return "\n".join(lines) + "\n\n" if lines else ""


__all__ = ["arbitrate_comparison", "arbitrate_pair", "ArbitratedComparison", "check_arbiter", "arbiter_options",
           "variant", "lead_lines", "lead_text"]
