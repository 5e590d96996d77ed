"""How the shared-state step comparison's agreement is said (harness/resync_verdict.py decides with it): the
resynced steps, the sequential test, the steps that agree by a discontinuity, a crossing or the optimizer's own
formula, and the self-replay, each with its evidence."""
from __future__ import annotations

from typing import Any

from .pair import fmt_factor


def resync_what(rs: dict[str, Any]) -> str:
    w = rs.get("worst") or {}
    seq = rs.get("sequential") or {}
    return (f"{rs['n']} resynced steps {rs['points'][0]}..{rs['points'][-1]}; worst {w.get('worst_key')} at step "
            f"{w.get('step')}, {fmt_factor(w.get('worst_factor'))} its calibrated tolerance; sequential test "
            + (f"min p {seq['min_p']:.3g} >= {seq['threshold']:.3g}" if seq.get("min_p") is not None
               else "not run (fewer than 3 points)") + _per_key_what(seq) + flips_what(rs) + _self_replay_what(rs))


def _per_key_what(seq: dict[str, Any]) -> str:
    """The per-key family of the sequential test (harness.bias_test.keywise_test), when it ran."""
    pk = seq.get("per_key") or {}
    if not pk.get("tested") or pk.get("min_p") is None:
        return ""
    return f"; per key min p {pk['min_p']:.3g} >= {pk['threshold']:.3g} ({pk['tested']} keys)"


def _self_replay_what(rs: dict[str, Any]) -> str:
    """Whether the candidate reproduced its own training from its checkpoint (harness.self_replay), when checked."""
    sr = rs.get("self_replay") or {}
    ref = rs.get("self_replay_reference") or {}
    if sr.get("checked") and not sr.get("differs"):
        exact = sr["exact_rows"]
        how = ("to the bit" if exact >= sr["rows"] else
               f"within rel {sr['max_rel']:.2g}, {exact} of them bit-equal and judged"
               + (f" (its backend does not reload a checkpoint bit for bit: its {sr['inexact_loads']} stretches are "
                  f"judged on their first step only)" if sr.get("inexact_loads") else
                  " (after a stretch's first step that is not bit-equal, state the checkpoint misses is not judged)"))
        return (f"; the candidate re-trained from each of its own checkpoints ({sr['stretches']} stretches, its state "
                f"reloaded after every step) reproduces its {sr['rows']} steps {how}"
                + (f" and evaluates them as its run did ({sr['eval_checked']} evaluations)" if sr.get("eval_checked")
                   else "")
                + (", and so does the reference" if ref.get("checked") and not ref.get("differs") else ""))
    if sr and not sr.get("checked"):
        return f"; self-replay not made ({sr.get('why')})"
    return ""


def flips_what(rs: dict[str, Any]) -> str:
    """The resynced steps that agree by a discontinuity (harness.resync.judge), said with their evidence."""
    dc = rs.get("discontinuities") or {}
    return _flipped_what(rs, dc) + _crossed_what(dc) + _implied_what(rs)


def _implied_what(rs: dict[str, Any]) -> str:
    """The resynced steps that agree by the optimizer's own formula (harness.implied), each key with its error."""
    by = {p["step"]: p["implied"] for p in rs.get("per_point") or () if p.get("implied")}
    if not by:
        return ""
    beside = {p["step"] for p in rs.get("per_point") or () if p.get("implied") and
              (p.get("discontinuity") or p.get("crossed"))}
    said = "; ".join(f"step {t}" + (" (beside the discontinuity or crossing above)" if t in beside else "") + ": "
                     + ", ".join(f"{k} {v['rel']:.2g} of its scale from it (the reference's own {v['own']:.2g} from "
                                 f"it on its gradient; allowed {v['tol']:.2g})" for k, v in got["keys"].items())
                     for t, got in by.items())
    return (f"; step(s) {', '.join(map(str, by))} agree by the optimizer's formula: the updates named here disagree "
            f"while their own parameter's gradient agrees within its tolerance, and each is what the reference "
            f"optimizer's float64 formula gives from the candidate's own gradient: {said}")


def _crossed_what(dc: dict[str, Any]) -> str:
    crossed = dc.get("crossed") or {}
    if not crossed:
        return ""
    said = "; ".join(f"step {t}: " + ", ".join(map(_crossing_what, cs)) for t, cs in crossed.items())
    return (f"; step(s) {', '.join(map(str, crossed))} agree by what the candidate's own activations or its own "
            f"float64 step show (only gradients and what follows from them disagree; every sample compared with the "
            f"float64 reference's): {said}")


def _crossing_what(c: dict[str, Any]) -> str:
    """One kink the candidate crossed, one saturated layer, or its own float64 step (harness.kinks), said with its
    evidence."""
    def keys(plain: str, other: str) -> str:   # the explained keys, each with its two errors: three, then a count
        return (", ".join(f"{k} {r32:.2g} of its scale off {plain}, {r:.2g} {other}"
                          for k, (r32, r) in list(c["keys"].items())[:3])
                + (f" and {len(c['keys']) - 3} more keys" if len(c["keys"]) > 3 else ""))
    if c["kind"] == "float64":
        return ("the candidate's own float64 step from the same state computes what the float64 reference does ("
                + keys("in float32", "in float64") + "): its kernels round differently, the function is the same")
    if c["kind"] == "recorded":
        return ("the candidate's own step compiled with its activations as outputs computes the reference's "
                "gradients (" + keys("in its plain step", "recorded")
                + "), each upstream of a kink with inputs within its rounding ("
                + "; ".join(f"{n['layer']}: {n['near']} of {n['of']}, float64 margin {n['margin_min']:.2g}, its "
                            f"rounding {n['rounding']:.2g}" for n in c["near"])
                + "): a kernel its plain step fuses across such a kink rounded one to the other side")
    if "allowance" in c:
        return (f"{c['layer']} ({c['kind']}) saturated: {c['carried_by']} of its {c['of']} outputs carry 99% of its "
                f"derivative, which rounding of the candidate's own outputs moves by up to {c['allowance']:.2g} of "
                f"itself")
    return (f"{c['layer']} ({c['kind']}, a kink crossed by {c['crossed']} of {c['of']} outputs, float64 margin "
            f"{c['margin_min']:.2g}" + (f"..{c['margin_max']:.2g}" if c["margin_max"] > c["margin_min"] else "") + ")")


def _flipped_what(rs: dict[str, Any], dc: dict[str, Any]) -> str:
    if not dc.get("flipped") or not dc.get("allowed"):
        return ""
    largest = ", ".join(f"{kd} {v:.2g}" for kd, v in sorted(dc["largest"].items()))
    return (f"; step(s) {', '.join(map(str, dc['flipped']))} agree by discontinuity (only gradients and what "
            f"follows from them disagree, {len(dc['keys'])} key(s) "
            f"such as {dc['keys'][0]}, each within {rs['margin']:g}x the largest jump of the reference's own steps: "
            f"{largest}; the reference's own steps jumped at {len(dc['reference_jumps'])} of {rs['n']} resynced steps)")


__all__ = ["resync_what", "flips_what"]
