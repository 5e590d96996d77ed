"""An optimizer step judged by what its own gradient implies: the candidate's update (and new optimizer
state) at a resynced step against the reference optimizer's float64 formula applied to the candidate's
own gradient, from the reference's state there (algorithms.optim.declared_update). Framework-free.

Why: some updates are ill-conditioned functions of the gradient. Adam's first step is g / (|g| + eps):
where a gradient element is within rounding of zero, the sign of a rounding error decides the sign of a
full-size update; coupled weight decay that nearly cancels a gradient (a BatchNorm gamma at 1) leaves an
update whose relative rounding is the cancellation's. Compared with the reference's update, such a step
disagrees while every gradient agrees; the optimizer is nonetheless right when its update is what its
gradient implies, and the difference is the gradient's rounding, carried through an ill-conditioned map.

The check, per disagreeing key (an `update0/` or `opt0/` probe of the resynced step; the gradients must
agree): the candidate's RMS error against the formula on its own gradient, over the scale of the
reference's implied value, is at most the largest of FLOOR, MARGIN x the float32 reference's own error
against the formula on its gradient, and the forward-error bound of evaluating the formula in float32:
eight roundings of the sum of the magnitudes of its terms (the formula on absolute values: it is large
where terms cancel, only there), plus half a ULP of the parameter the update is stored into.
A wrong learning rate, momentum, beta, eps or weight decay, a state loaded wrongly, a different rule:
the update is not what the gradient implies, and the step disagrees as before.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from algorithms.contract import split_state
from algorithms.faults import EMULATIONS, FAULTS, parts
from algorithms.optim import (DECLARED_FORMULAS, STATE_ROLES, HParams, State, declared_update,
                              load_flat_state, reference_init)
from algorithms.params import load_npz

from .probes import ABS_FLOOR, EPS32, kind_of, rms

# float32 roundings one element of an update may carry, each at most half a ULP (EPS32 / 2, round to nearest)
# of the largest magnitude in the formula: the weight decay's product and sum, the momentum's product and sum
# (and the rescale of a Keras velocity), Nesterov's second pair, the rate's product; Adam's moments, square
# root, eps and division. Eight roundings of EPS32 / 2 each: the bound is IMPLIED_ULPS x EPS32 x the formula
# on absolute values
IMPLIED_ULPS = 4.0
# and the new parameter, stored in float32: half a ULP of it (the update probe is new - old in float64)
STORE_ULPS = 0.5


def optimizer_only(keys: list[str]) -> bool:
    """Are these disagreeing keys the resynced step's optimizer outputs only (update0/, opt0/), no gradient?"""
    return bool(keys) and all(kind_of(k) in (("update", 0), ("opt", 0)) for k in keys)


def optimizer_rest(res: dict[str, Any]) -> list[str]:
    """The disagreeing keys of the resynced step's own update and optimizer state (update0/, opt0/) whose
    parameter's gradient agrees: a kink flipped upstream does not move them (its moves come through a
    gradient), an ill-conditioned formula may (this module's check). Adam on mobilenet_tiny (2026-12-03): a flip
    moves the stem's gradients while a BatchNorm gamma's first update, its gradient agreeing, is off by the
    formula's own conditioning; each explanation alone left the step unexplained, a false BUG."""
    keys = res["disagreeing_keys"]
    off = {k.rsplit("/", 1)[-1] for k in keys if kind_of(k)[0] == "grad"}
    return [k for k in keys if kind_of(k) in (("update", 0), ("opt", 0)) and k.rsplit("/", 1)[-1] not in off]


def formulas_of(fault: str | None) -> frozenset[str] | None:
    """The declared optimizer formulas an emulation fault (a '+'-joined list) makes the reference compute;
    None when it carries an optimizer fault declared_update cannot compute (then nothing is re-derived)."""
    known = {**FAULTS, **EMULATIONS}
    opt = {n for n in parts(fault) if n in known and known[n].stage == "optimizer"}
    return None if opt - set(DECLARED_FORMULAS) else frozenset(opt)


def state_of(h: HParams, flat: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], State]:
    """(parameters, optimizer state) from a resync state file (`param/<name>`, `opt/<role>/<name>`, `opt/step`);
    an empty optimizer state (before the first step) is the reference's initial one."""
    params, opt = split_state(flat)
    params = {n: np.asarray(v, np.float64) for n, v in params.items()}
    st = reference_init(h, params)
    load_flat_state(st, opt)
    return params, st


def _step(h: HParams, t: int, params: dict[str, np.ndarray], grads: dict[str, np.ndarray], st: State,
          formulas: frozenset[str]) -> dict[str, np.ndarray]:
    """The probes of step t the formula gives: `update0/<name>` and `opt0/<role>/<name>`."""
    new, ns = declared_update(h, t, params, grads, st, formulas)
    out = {f"update0/{n}": new[n] - params[n] for n in new}
    for role in STATE_ROLES:
        out.update({f"opt0/{role}/{n}": v for n, v in ns.get(role, {}).items()})
    return out


def _magnitudes(h: HParams, t: int, params: dict[str, np.ndarray], grads: dict[str, np.ndarray], st: State,
                formulas: frozenset[str]) -> dict[str, np.ndarray]:
    """The formula on absolute values: every term adds, so this is the sum of the terms' magnitudes."""
    ab = {role: {n: np.abs(v) for n, v in st[role].items()} for role in STATE_ROLES if role in st}
    return {k: np.abs(v) for k, v in _step(h, t, {n: np.abs(v) for n, v in params.items()},
                                            {n: np.abs(v) for n, v in grads.items()}, dict(st, **ab),
                                            formulas).items()}


class ImpliedStep:
    """The check for one pair's resync: hyper-parameters, the reference's state file per resynced step, the
    declared formulas the reference computed. `__call__(t, cand, ref, keys)`: per key, the candidate's and
    the reference's error against the formula on their own gradients, the tolerance, and `agree`."""

    def __init__(self, h: HParams, states: dict[str, str], formulas: frozenset[str], *, margin: float, floor: float):
        self.h, self.states, self.formulas, self.margin, self.floor = h, states, formulas, margin, floor

    def __call__(self, t: int, cand: dict[str, np.ndarray], ref: dict[str, np.ndarray],
                 keys: list[str]) -> dict[str, Any] | None:
        path = self.states.get(str(t))
        if not optimizer_only(keys) or path is None or not Path(path).exists():
            return None
        params, st = state_of(self.h, load_npz(Path(path)))
        names = sorted({k.rsplit("/", 1)[-1] for k in keys})
        if any(n not in params or f"grad/{n}" not in cand or f"grad/{n}" not in ref for n in names) \
                or any(k.endswith("/step") or k.count("/") > 2 for k in keys):
            return None   # a step count, or a key of no trainable parameter: not the formula's to explain
        sub = {n: params[n] for n in names}
        sst = {r: ({n: v[n] for n in names} if isinstance(v, dict) else v) for r, v in st.items()}
        grads = {w: {n: np.asarray(p[f"grad/{n}"], np.float64) for n in names} for w, p in (("cand", cand), ("ref", ref))}
        implied = {w: _step(self.h, t, sub, g, sst, self.formulas) for w, g in grads.items()}
        mags = _magnitudes(self.h, t, sub, grads["ref"], sst, self.formulas)
        per_key, agree = {}, True
        for k in keys:
            if k not in implied["ref"] or k not in cand or k not in ref:
                return None
            want_b, want_a = implied["cand"][k], implied["ref"][k]
            xb, xa = np.asarray(cand[k], np.float64), np.asarray(ref[k], np.float64)
            if xb.shape != want_b.shape or xa.shape != want_a.shape:
                return None
            scale = max(float(np.max(np.abs(want_a))) if want_a.size else 0.0, ABS_FLOOR)
            bound = IMPLIED_ULPS * EPS32 * mags[k]
            if k.startswith("update0/"):
                bound = bound + STORE_ULPS * EPS32 * np.abs(sub[k.rsplit("/", 1)[-1]])
            err_b, err_a = rms(xb - want_b) / scale, rms(xa - want_a) / scale
            rounding = rms(bound) / scale
            if err_a > max(self.floor, rounding):
                return None   # the reference itself is not what its gradient implies: no formula to judge by
            tol = max(self.floor, self.margin * err_a, rounding)
            per_key[k] = {"rel": err_b, "own": err_a, "tol": tol, "rounding": rounding,
                          "ok": bool(err_b <= tol)}
            agree &= err_b <= tol
        return {"agree": bool(agree), "keys": per_key, "formulas": sorted(self.formulas)}


__all__ = ["ImpliedStep", "formulas_of", "optimizer_only", "optimizer_rest", "state_of", "IMPLIED_ULPS"]
