"""The arbiter's rule: which side of a BUG leaves the exact values first (pure NumPy on dicts of probe arrays).

Walking the probe keys in computation order (forward in the spec's layer order, loss, gradients in backward
order, per optimizer step the updates, buffers and optimizer state, then the inference-mode forward), the first
key where a side leaves the exact values is where that side disagrees with the exact computation.

Tolerance: a float32 framework is off the exact values by its rounding. The yardstick is the arbiter run in
float32 on the same inputs: a correct float32 implementation of the same formulas. Per key, a side leaves when
its RMS error against the exact values (over max|exact|, PyTorch Inductor's measure) exceeds MARGIN times that
float32 RMS error, and never below REL_FLOOR. Measured (bench/arbiter_tolerance.py, docs/backend-api.md):
clean backends stay far inside it; every catalogued fault exceeds it by orders of magnitude.

Running the arbiter backend and putting its answer into a comparison is harness/arbiter.py.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from harness.batch_rows import align
from harness.probes import running_mean_scale

MARGIN = 3.0          # x the arbiter's own float32 RMS error at the key (Inductor: 2 for fp32; the probes use 3)
REL_FLOOR = 1e-6      # keys a float32 computation gets (nearly) exact: ~8 float32 ULPs of the tensor's scale
REL_TOL = 1e-4        # without a float32 calibration probe: the probes' fixed float32 tolerance (harness.probes)
ABS_FLOOR = 1e-6      # scale floor for (nearly) all-zero tensors, as in the probe comparison
SIDES = ("candidate", "reference", "both", "neither")


# --------------------------------------------------------------------------- errors against the exact values
def _finite_pair(x: np.ndarray, exact: np.ndarray) -> bool:
    return x.shape == exact.shape and bool(np.isfinite(x).all())


def _relative(x: Any, exact: Any, size: Any, scale: np.ndarray | None = None) -> float:
    """size(x - exact) over max(max|exact|, ABS_FLOOR), or size((x - exact) / scale) with a per-element `scale`
    (a running mean's: harness.probes.running_mean_scale); inf for a shape mismatch or a non-finite x."""
    x, exact = np.asarray(x, np.float64), np.asarray(exact, np.float64)
    if not _finite_pair(x, exact):
        return float("inf")
    if not x.size:
        return 0.0
    if scale is not None and np.shape(scale) == x.shape:
        return float(size((x - exact) / scale))
    return float(size(x - exact)) / max(float(np.max(np.abs(exact))), ABS_FLOOR)


def rms_rel(x: Any, exact: Any, scale: np.ndarray | None = None) -> float:
    """RMS of x - exact, relative to the exact tensor's scale or to `scale` per element (inf: shape mismatch or
    non-finite x)."""
    return _relative(x, exact, lambda d: np.sqrt(np.mean(d ** 2)), scale)


def max_rel(x: Any, exact: Any, scale: np.ndarray | None = None) -> float:
    """max|x - exact|, relative to the exact tensor's scale or to `scale` per element (inf: shape mismatch or
    non-finite x)."""
    return _relative(x, exact, lambda d: np.max(np.abs(d)), scale)


# --------------------------------------------------------------------------- computation order
_STEP_KINDS = {"update": 0, "buffer": 1, "opt": 2}


def key_order(key: str, layers: list[str] | None = None) -> tuple:
    """Sort key of a probe key in computation order: forward (layer order), loss, gradients (backward
    order), then per optimizer step i update<i>, buffer<i>, opt<i> (layer order), inference forward last."""
    head, _, rest = key.partition("/")
    rank = {l: i for i, l in enumerate(layers or [])}
    n = len(rank)

    def layer_rank(name: str, backward: bool = False) -> int:
        for cand in (name, name.rsplit(".", 1)[0], name.split("/")[-1].rsplit(".", 1)[0]):
            if cand in rank:
                return n - 1 - rank[cand] if backward else rank[cand]
        return n
    if head == "forward":
        return (0, 0, 0, layer_rank(rest), key)
    if head == "loss":
        return (1, 0, 0, 0, key)
    if head == "grad":
        return (2, 0, 0, layer_rank(rest, backward=True), key)
    m = re.fullmatch(r"(update|buffer|opt)(\d+)", head)
    if m:
        return (3, int(m.group(2)), _STEP_KINDS[m.group(1)], layer_rank(rest), key)
    if head == "eval":
        return (4, 0, 0, layer_rank(rest), key)
    return (5, 0, 0, 0, key)


# --------------------------------------------------------------------------- the pure decision
@dataclass
class KeyErrors:
    key: str
    candidate: float          # RMS relative errors against the exact values
    reference: float
    candidate_tol: float      # the tolerances each side was held to
    reference_tol: float
    candidate_max: float      # max relative errors (for the reader)
    reference_max: float


@dataclass
class Arbitration:
    """The side that leaves the exact computation first: `key` and both sides' errors there. `compared` keys
    were judged; `unjudged` keys had non-finite exact values; `missing` keys lacked in a side."""
    side: str                                  # candidate | reference | both | neither
    key: str | None = None
    candidate_error: float = 0.0
    reference_error: float = 0.0
    candidate_tol: float = 0.0
    reference_tol: float = 0.0
    candidate_first: str | None = None         # each side's first key off the exact values
    reference_first: str | None = None
    candidate_keys: int = 0                    # how many keys each side leaves
    reference_keys: int = 0
    compared: int = 0
    worst: KeyErrors | None = None             # with side neither: the key closest to its tolerance
    unjudged: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    calibrated: bool = True                    # tolerance from the arbiter's float32 probes (else REL_TOL)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def tolerance(exact: Any, calib: Any | None, own32: Any | None = None, own64: Any | None = None,
              margin: float = MARGIN, floor: float = REL_FLOOR, scale: np.ndarray | None = None) -> float:
    """How far a float32 side may be off the exact values at one key: MARGIN x the larger of the arbiter's
    float32 RMS error (`calib`: a correct float32 computation of the same formulas) and the side's own float32
    vs float64 RMS error (`own32`, `own64`: its code path's rounding, PyTorch Inductor's yardstick), never below
    REL_FLOOR; REL_TOL when neither is available. `scale`: as rms_rel's."""
    parts = []
    if calib is not None:
        parts.append(rms_rel(calib, exact, scale))
    if own32 is not None and own64 is not None:
        parts.append(rms_rel(own32, own64, scale))
    parts = [x for x in parts if np.isfinite(x)]
    return max(floor, margin * max(parts)) if parts else REL_TOL


def arbitrate(candidate: dict[str, Any], reference: dict[str, Any], exact: dict[str, Any],
              calib: dict[str, Any] | None = None, *, candidate64: dict[str, Any] | None = None,
              reference64: dict[str, Any] | None = None, layers: list[str] | None = None,
              keys: list[str] | None = None, margin: float = MARGIN, floor: float = REL_FLOOR) -> Arbitration:
    """Which side leaves the exact values first, over the keys of `exact` (or `keys`), in computation order.

    A side leaves a key when its RMS error against the exact values exceeds its tolerance there (`tolerance`:
    from the arbiter's float32 probes `calib` and the side's own float64 probes `candidate64`/`reference64`,
    each optional; a shape mismatch or a non-finite value is an infinite error). Keys whose exact values are
    not finite cannot be judged and are listed, as are keys one side lacks."""
    if layers:   # each side's activation rows in the exact computation's order (harness.batch_rows)
        candidate, reference = align(candidate, exact, layers)[0], align(reference, exact, layers)[0]
        candidate64 = align(candidate64, exact, layers)[0] if candidate64 else candidate64
        reference64 = align(reference64, exact, layers)[0] if reference64 else reference64
    pool = list(keys) if keys is not None else list(exact)
    out = Arbitration("neither", calibrated=calib is not None)
    worst_ratio = -1.0
    c64, r64 = candidate64 or {}, reference64 or {}
    for k in sorted(pool, key=lambda k: key_order(k, layers)):
        if k not in exact:
            continue
        if k not in candidate or k not in reference:
            out.missing.append(k)
            continue
        ex = np.asarray(exact[k], np.float64)
        if not np.isfinite(ex).all():
            out.unjudged.append(k)
            continue
        cal = None if calib is None else calib.get(k)
        per = running_mean_scale(k, exact)   # a running mean: on its channels' spread, as in the probes
        tc = tolerance(ex, cal, candidate[k], c64.get(k), margin, floor, per)
        tr = tolerance(ex, cal, reference[k], r64.get(k), margin, floor, per)
        ke = KeyErrors(k, rms_rel(candidate[k], ex, per), rms_rel(reference[k], ex, per), tc, tr,
                       max_rel(candidate[k], ex, per), max_rel(reference[k], ex, per))
        out.compared += 1
        c_off, r_off = ke.candidate > tc, ke.reference > tr
        out.candidate_keys += c_off
        out.reference_keys += r_off
        if c_off and out.candidate_first is None:
            out.candidate_first = k
        if r_off and out.reference_first is None:
            out.reference_first = k
        if (c_off or r_off) and out.key is None:
            out.side = "both" if c_off and r_off else "candidate" if c_off else "reference"
            out.key, out.candidate_error, out.reference_error = k, ke.candidate, ke.reference
            out.candidate_tol, out.reference_tol = tc, tr
        ratio = max(ke.candidate / tc, ke.reference / tr)
        if ratio > worst_ratio:
            worst_ratio, out.worst = ratio, ke
    return out


# --------------------------------------------------------------------------- words
def _g(x: float) -> str:
    return "inf" if not np.isfinite(x) else f"{x:.2g}"


def statement(a: Arbitration | None, arbiter: str, ref: str, cand: str, replayed: int | None = None,
              reason: str | None = None) -> str:
    """One sentence for every output: 'arbiter (NAME float64): the exact computation supports X; Y
    disagrees at KEY (err e; X e')'; why it did not run, in capitals, when it did not."""
    head = f"arbiter ({arbiter} float64)"
    if a is None:
        return f"{head} NOT RUN: {reason}"
    at = "" if replayed is None else f" (replayed step {replayed}, from the reference's state)"
    if a.side == "reference":
        return (f"{head}: the exact computation supports {cand}; the reference {ref} disagrees with it at {a.key}{at} "
                f"(err {_g(a.reference_error)}, tolerance {_g(a.reference_tol)}; {cand} {_g(a.candidate_error)})")
    if a.side == "candidate":
        return (f"{head}: the exact computation supports the reference {ref}; {cand} disagrees with it at {a.key}{at} "
                f"(err {_g(a.candidate_error)}, tolerance {_g(a.candidate_tol)}; {ref} {_g(a.reference_error)})")
    if a.side == "both":
        return (f"{head}: both sides disagree with the exact computation at {a.key}{at} "
                f"({ref} err {_g(a.reference_error)}, {cand} err {_g(a.candidate_error)}; tolerances "
                f"{_g(a.reference_tol)}, {_g(a.candidate_tol)})")
    w = a.worst
    worst = (f"; closest: {w.key}, {ref} err {_g(w.reference)} (tolerance {_g(w.reference_tol)}), {cand} err "
             f"{_g(w.candidate)} (tolerance {_g(w.candidate_tol)})" if w else "")
    return (f"{head}: neither side disagrees with the exact computation in the {a.compared} probes compared"
            f"{worst}; the bug is beyond what one step's probes resolve")


__all__ = ["arbitrate", "Arbitration", "KeyErrors", "statement", "rms_rel", "max_rel", "tolerance", "key_order",
           "MARGIN", "REL_FLOOR", "REL_TOL", "ABS_FLOOR", "SIDES"]
