"""The shared-state step comparison's part of the verdict (harness/resync.py computes the comparison): a
resynced step that disagrees, or a bias the sequential test finds, is BUG; free-running curves that
leave the envelope while every resynced step agrees are DRIFT (or DECLARED, when the candidate's declared
formula is what agrees). Rule and numbers: docs/verdict.md."""
from __future__ import annotations

from typing import Any

from .pair import (BUG, DECLARED, DRIFT, IDENTICAL, INCONCLUSIVE, Pair, against_text, drop_stat_advice, fmt_factor,
                   formula_computed_by, not_moved_ids)
from .resync_text import resync_what
from .self_replay import also_not_reproduced

RESYNC_DRIFT = "trajectories diverged by accumulated rounding; every step agrees from a shared state"


# a restart from the exported state may differ from the continued step by the rounding of an optimizer-state
# conversion (a velocity from the canonical buffer: ~1e-7; measured 0.0 everywhere); state the checkpoint misses
# moves it by far more
RESTART_TOL = 1e-4


def restart_differs(loc: dict[str, Any] | None) -> bool:
    """Did the candidate's restart check (wrappers.base.Backend.restart_check) find its second probe step
    different after a reload of the state exported after the first?"""
    r = (loc or {}).get("restart") or {}
    return bool(r.get("checked")) and float(r.get("rel", 0.0)) > RESTART_TOL


def superseded_by_resync(loc: dict[str, Any] | None, rs: dict[str, Any]) -> str | None:
    """When a localization from the step-0 probes disagrees at their first step only on gradients, updates and
    optimizer state (BACKWARD_KINDS: every activation, the loss and the buffers agree; at the later steps on
    anything, the buffers too: those start from the candidate's own state), at steps the resync computed from the
    reference's own state (the gradients: step 0; update<i>/opt<i>: step i; the probes' later steps start
    from the candidate's own state after its first), and the resync agreed there: a short description of
    those keys; else None. The resync's steps are the better instrument: calibrated at each state, with the
    reference's own 1-ULP-nudged steps, where a ReLU kink flipped by rounding shows (harness/resync.py)."""
    from .probes import BACKWARD_KINDS, kind_of
    keys = (loc or {}).get("disagreeing_keys") or []
    if not keys or (loc or {}).get("missing_keys") or "resync" in str((loc or {}).get("method", "")):
        return None
    if restart_differs(loc) and any(kind_of(k)[1] >= 1 for k in keys):
        # the probes' later steps run after their first in one process; the resync's start from a loaded
        # checkpoint, and this backend does not step the same from one: no kink explains that
        return None
    kinds = [kind_of(k) for k in keys]
    # a flip at the first step moves its gradients and what follows from them; the probes' later steps start
    # from the candidate's own state after it, where anything (the running statistics too) follows from it
    if not all(kd in BACKWARD_KINDS or i >= 1 for kd, i in kinds):
        return None
    if not all(i in rs.get("points", ()) for i in range(0, max(i for _, i in kinds) + 1)):
        return None
    return f"{len(keys)} key(s) such as {keys[0]}, rel {(loc or {}).get('rel') or 0:.2g}"


def _drop_conclusion(p: Pair) -> None:
    """The note of a localization about to be replaced goes with it (it would contradict the new verdict)."""
    note = (p.localization or {}).get("note")
    if note in p.notes:
        p.notes.remove(note)


# the step's order: a disagreement's stage is the earliest that shows it (the inference path apart, last)
STAGE_RANK = {"forward": 0, "loss": 1, "backward": 2, "optimizer": 3, "eval": 4}


def upstream_of(stage: str, loc: dict[str, Any] | None) -> bool:
    """Is `stage` earlier in the step than the localization's? Only among the step's own stages: a data,
    reduction or other localization is a finding of its own and stays."""
    current = (loc or {}).get("stage")
    if current is None:
        return True
    return current in STAGE_RANK and STAGE_RANK.get(stage, 9) < STAGE_RANK[current]


def bias_localization(seq: dict[str, Any]) -> dict[str, Any]:
    """The place the sequential test gives a bias: the stage of its kind (the earliest biased one) and, from
    the per-key tests, the first biased key's layer or parameter."""
    from .probe_analysis import param_layer
    from .bias_test import ALONG_PARAMETER, STAGE_OF_KIND
    kd = seq["bias"]
    st = seq["kinds"][kd]
    first = (seq.get("where") or {}).get("first")
    name = first.split("/")[-1].removesuffix(ALONG_PARAMETER) if first and "/" in first else None
    parameter = name if name and "." in name else None
    layer = param_layer(name) if parameter else name
    stage = STAGE_OF_KIND.get(kd, kd)
    if seq.get("by_key"):   # one key (or a few) biased, its kind's median not: the per-key family found it
        kt = seq["where"]["keys"][first]
        line = (f"localized by the sequential test over {kt['points']} resynced steps: a bias in {first} (mean "
                f"{kt['mean_ulp']:+.3g} float32 ULP where rounding allows {kt['null_ulp']:.3g}, t {kt['t']:.3g}, p "
                f"{kt['p']:.3g} < {seq['where']['threshold']:.3g}, Bonferroni over {seq['per_key']['tested']} keys; "
                f"{kt['positive']} of {kt['positive'] + kt['negative']} positive); the median of the {kd} probes is "
                f"unbiased (p {st['p']:.3g}): the bias is in some of them only")
        if first.endswith(ALONG_PARAMETER):
            line += (f" ({ALONG_PARAMETER}: the update's deviation projected on its parameter, where a weight-decay "
                     "error moves it)")
        others = [k for k in seq["where"]["keys"] if k != first]
        if others:
            line += f"; biased too: {', '.join(others[:6])}" + (f" and {len(others) - 6} more" if len(others) > 6 else "")
        place = f"{parameter or layer}, " if layer else ""
        return {"stage": stage, "method": "sequential test over resynced steps", "layer": layer,
                "parameter": parameter, "probe": first, "summary": f"{stage}: {place}bias in {first} (p {kt['p']:.2g})",
                "lines": [line], "disagreeing_keys": []}
    line = (f"localized by the sequential test over {st['points']} resynced steps: a bias in the {kd} probes "
            f"(mean {st['mean_ulp']:+.3g} float32 ULP, t {st['t']:.3g}, p {st['p']:.3g} < {seq['threshold']:.3g}; "
            f"{st['positive']} of {st['positive'] + st['negative']} positive)"
            + (f", first in {first} (p {seq['where']['keys'][first]['p']:.2g} < {seq['where']['threshold']:.2g})"
               if first else ""))
    later = [k for k, v in seq["kinds"].items() if v["significant"] and k != kd]
    if later:
        line += f"; biased after it too: {', '.join(later)}"
    return {"stage": stage, "method": "sequential test over resynced steps", "layer": layer, "parameter": parameter,
            "probe": first or kd, "summary": f"{stage}: " + (f"{parameter or layer}, " if layer else "")
            + f"bias in {kd} (p {st['p']:.2g})", "lines": [line], "disagreeing_keys": []}


# a disagreeing step inherits an upstream bias only where the bias is there: its first key deviates at that step
# by at least this share of its mean deviation over the resynced steps
BIAS_PRESENT = 0.1


def bias_present_at(seq: dict[str, Any], fb: dict[str, Any]) -> bool:
    """Does the bias the sequential test found show at the first disagreeing resynced step itself? A bias that
    grows with training is absent at step 0: a conv layer's missing bias (zero at initialisation) leaves step 0's
    forward equal to rounding and its gradient missing, while the forward keys after it drift by 4e4 ULP later on.
    There the step's own disagreement (backward, conv1.bias) is the finding, not the later bias (forward, relu_1).
    Without the first key's deviation at that step (no per-key test, the key not probed): as before, inherited."""
    where = seq.get("where") or {}
    first = where.get("first")
    at = next((d for d in fb.get("diffs") or [] if d.get("key") == first), None) if first else None
    if at is None:
        return True
    return at["rel"] * 2.0 ** 23 >= BIAS_PRESENT * abs(where["keys"][first]["mean_ulp"])


def apply_resync(p: Pair, requested: bool) -> None:
    """The shared-state step comparison's part of the verdict, after the free-running one (`resolve`).

    BUG when a resynced step disagrees (localized from that step's probes) or the sequential test finds a
    bias, whatever the free-running curves say (a late or subtle bug inside the envelope). When every
    resynced step agrees: an INCONCLUSIVE pair (saturated envelope, an excess no probe reproduces) is DRIFT
    ("trajectories diverged by accumulated rounding"), or DECLARED when the candidate declares emulated
    differences and the plain reference disagrees with it at some resynced step while the emulating one
    agrees everywhere. A BUG localized by step-0 probes that the resynced steps find agreeing there (a kink,
    superseded_by_resync) goes with them, unless step 0 shows a difference besides its probes (the localization's
    `fallback`: a report slip, the evaluation off from the start), which then places the BUG. Without the
    comparison (not requested, skipped, a failed job) nothing is upgraded: the note says what was not compared."""
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
        if rs.get("reference_check") and p.verdict == DECLARED:   # its evidence is the reference's steps too
            p.verdict, p.evidence = INCONCLUSIVE, None
        p.notes.append(f"shared-state step comparison not made: {why}"
                       + ("; the free-running verdict stands" if p.verdict in (DRIFT, INCONCLUSIVE, DECLARED) else ""))
        return
    seq = rs["sequential"]
    was = p.verdict
    if not rs["agree"]:
        from .probe_analysis import describe
        fb = rs["first_disagreement"]
        t = fb["step"]
        worst = next(x for x in rs["per_point"] if x["step"] == t)
        against = rs.get("against")
        method = f"resync of step {t} from the reference's state" + (
            f", against {against_text(against)}" if against else "")
        if was != BUG or (p.localization or {}).get("stage") is None:
            summary, lines = describe(fb, method)
            summary += " (the reference's own step)" if rs.get("reference_side") and summary else ""
            keep = {k: (p.localization or {}).get(k) for k in ("declared_check", "replay") if (p.localization or {}).get(k)}
            p.localization = dict({k: v for k, v in fb.items() if k != "diffs"}, method=method, summary=summary,
                                  lines=lines, **keep)
        # a bias upstream of the disagreeing step's stage: that step inherits it
        loc = bias_localization(seq) if seq.get("bias") is not None else None
        if loc is not None and (p.localization or {}).get("stage") is not None \
                and upstream_of(loc["stage"], p.localization) and bias_present_at(seq, fb):
            loc["lines"].append(f"(resynced step {t} disagrees at {fb.get('probe')}, a later stage: "
                                f"{(p.localization or {}).get('summary')})")
            p.localization = dict(loc, **{k: v for k, v in (p.localization or {}).items()
                                          if k in ("declared_check", "replay")})
        p.verdict = BUG
        drop_stat_advice(p)
        # the earliest evidence of another computation: a resynced step that disagrees before the free-running
        # curves part (which a clean run's rounding can make them do too) is where the bug is seen first; and
        # wherever they part when the curves alone were no evidence (no probe reproduced their excess, or a
        # verified declared difference explains it): a bug that starts at step 100 is not seen at step 6
        parted = p.first if p.first is not None and p.first.get("step") is not None else None
        if p.first is None or (parted is not None and (t < parted["step"] or was != BUG)):
            p.first = {"step": t, "series": "resync", "factor": worst["worst_factor"], "reason": "resync",
                       "a_value": None, "b_value": None, "deviation": fb.get("rel"), "envelope": None, "also": [],
                       "probe": worst["worst_key"]}
            if parted is not None:   # said with the step: the curves do part, later
                p.first["parted"] = {k: parted.get(k) for k in ("step", "series", "factor")}
        p.notes.append(f"resynced step {t} disagrees: one step from the reference's state computes something else "
                       f"({fb.get('probe') or worst['worst_key']}; worst {worst['worst_key']}, "
                       f"{fmt_factor(worst['worst_factor'])} its calibrated tolerance; {rs['n']} resynced steps)"
                       + (f"; the free-running verdict was {was}" if was != BUG else "")
                       + (f"; the reference's own step is not its declared difference(s) {', '.join(against['emulated'])}"
                          if rs.get("reference_side") else
                          f"; declared difference(s) {', '.join(against['emulated'])} do not explain it" if against else "")
                       + also_not_reproduced(rs.get("self_replay") or {}))
        return
    if seq.get("bias") is not None:
        kd = seq["bias"]
        st = seq["kinds"][kd]
        p.verdict = BUG
        drop_stat_advice(p)
        loc = bias_localization(seq)
        if was != BUG or upstream_of(loc["stage"], p.localization):
            p.localization = loc
        if p.first is None:
            p.first = {"series": "resync-sequential", "factor": None, "reason": "bias", "a_value": None,
                       "b_value": None, "deviation": None, "envelope": None, "also": [], "probe": kd}
        if seq.get("by_key"):
            first = seq["where"]["first"]
            kt = seq["where"]["keys"][first]
            said = (f"the signed differences of {first} keep one sign: p {kt['p']:.3g} < {seq['where']['threshold']:.3g} "
                    f"(Bonferroni over {seq['per_key']['tested']} keys), {kt['mean_ulp']:+.3g} ULP where rounding "
                    f"allows {kt['null_ulp']:.3g}")
        else:
            said = (f"the signed differences of the {kd} probes keep one sign: p {st['p']:.3g} < "
                    f"{seq['threshold']:.3g} (Bonferroni over {seq['kinds_tested']} kinds)")
        p.notes.append(f"every resynced step is inside its tolerance, but {said}: a bias rounding does not produce"
                       + (f"; the free-running verdict was {was}" if was != BUG else ""))
        return
    superseded = superseded_by_resync(p.localization, rs)
    def differs(d: dict[str, Any]) -> bool:      # its training, or its evaluation of its own checkpoints
        return bool(d.get("differs") or d.get("eval_differs"))
    sr, of_reference = rs.get("self_replay") or {}, False
    if not differs(sr) and differs(rs.get("self_replay_reference") or {}):
        sr, of_reference = rs["self_replay_reference"], True
    if differs(sr):
        from .self_replay import describe, placed
        said = f"the reference {p.a.name}" if of_reference else "the candidate"
        line = describe(said if of_reference else p.b.name, sr)
        p.verdict = BUG
        drop_stat_advice(p)
        where = placed(sr, "the reference" if of_reference else "the candidate")
        if was != BUG or superseded or (p.localization or {}).get("stage") is None:
            _drop_conclusion(p)
            p.localization = {"stage": where["stage"], "layer": None, "parameter": None, "probe": None,
                              "method": "self-replay", "lines": [line], "series": where["series"],
                              "summary": where["summary"]}
        else:
            p.notes.append(line)
        p.notes.append(f"every resynced step agrees ({resync_what(rs)}), but {said} {where['why']}"
            + (f"; the free-running verdict was {was}" if was != BUG else ""))
        return
    if was == BUG and superseded:
        from .implied import optimizer_only
        updates_only = optimizer_only((p.localization or {}).get("disagreeing_keys") or [])
        # update0/opt0 keys only (optimizer_only): the step-0 probes' first step is the resync's step 0
        ill = updates_only and bool(((rs.get("implied") or {}).get(0) or {}).get("agree"))
        why = ("an update the resynced steps found to be what the candidate's own gradient implies (an "
               "ill-conditioned formula there)" if ill else "not reproduced from the reference's state" if updates_only
               else "a discontinuity (a kink flipped by rounding)")
        old = p.localization or {}
        fallback = old.get("fallback")   # what step 0 shows besides its probes (a report, the evaluation): a BUG
        p.notes.append("the step-0 probes disagreed only on " + ("updates and optimizer state" if updates_only else
                       "gradients and what follows from them") + f" ({superseded}), at steps the resync computed "
                       f"from the reference's own state, calibrated there, and found agreeing: {why}, not a "
                       "different computation" + (f"; but step 0 shows one besides its probes: {fallback['summary']}"
                                                  if fallback else "; decided by the resynced steps"))
        _drop_conclusion(p)
        gone = {k: old.get(k) for k in ("stage", "probe", "rel", "method", "summary", "note")}
        if fallback:   # the verdict stays BUG, placed there
            p.localization = dict(fallback, superseded=gone)
        else:
            p.localization = {"stage": None, "layer": None, "parameter": None, "probe": None, "method": "resync",
                              "summary": "no different computation: the step-0 probes' " + (
                                  "updates disagreed by an ill-conditioned formula the resynced steps check" if ill else
                                  "updates disagreed where the resynced steps agree" if updates_only else
                                  "gradients disagreed by a discontinuity the resynced steps do not show"), "lines": [],
                              "superseded": gone}
            was = p.verdict = INCONCLUSIVE
    if rs.get("rows_matched"):
        p.notes.append(f"the candidate holds the batch's samples in another row order at {len(rs['rows_matched'])} "
                       "resynced step(s): its activations were compared row by matched row (harness.batch_rows)")
    against = rs.get("against")
    if was == INCONCLUSIVE and against and rs.get("evidence") and not not_moved_ids(p, against["emulated"]):
        p.verdict, p.declared = DECLARED, list(against["emulated"])
        p.evidence = f"verified (every resynced step agrees with {formula_computed_by(against)})"
        drop_stat_advice(p)
        p.notes.append(f"{', '.join(against['emulated'])} verified on the shared-state steps: the reference computing "
                       f"the declared formula agrees with the candidate at every resynced step, the plain reference "
                       f"does not ({len(rs['evidence'])} probes); {resync_what(rs)}")
    elif was == INCONCLUSIVE:
        p.verdict = DRIFT
        drop_stat_advice(p)
        p.notes.append(f"{RESYNC_DRIFT} ({rs['n']} resynced steps): {resync_what(rs)}")
    elif was in (DRIFT, IDENTICAL, DECLARED):
        p.notes.append(f"every resynced step agrees: {resync_what(rs)}")
    elif was == BUG:
        p.notes.append(f"the resynced steps agree ({resync_what(rs)}), but the verdict above stands")


__all__ = ["apply_resync", "resync_what", "RESYNC_DRIFT", "restart_differs", "RESTART_TOL"]
