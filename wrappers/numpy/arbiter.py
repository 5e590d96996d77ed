"""Which side of a disagreement the exact computation supports, from step-0 (or replay) probes.

For the arbiter of `duipai compare` (not wired in here): given the probes of a candidate and of the
reference for one case, and the numpy float64 probes of the same case, walk the keys in computation order
(forward, loss, gradients, updates, buffers, optimizer state, inference) and at the first key where either
side is off the exact values by more than the tolerance, say which side that is. Pure NumPy on dicts of
arrays: the harness can call it on probe files without importing a framework.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

ORDER = ("forward", "loss", "grad", "update", "buffer", "opt", "eval")
REL_TOL = 1e-4        # a float32 framework against the exact float64 values (the probes' float32 tolerance)
ABS_FLOOR = 1e-6      # scale floor for (nearly) all-zero tensors, as in the probe comparison


@dataclass(frozen=True)
class Arbitration:
    side: str                 # "candidate" | "reference" | "both" | "neither"
    key: str | None           # the first probe key where a side leaves the exact values
    candidate_error: float    # relative errors against the exact values at that key
    reference_error: float


def _order(key: str) -> tuple[int, int]:
    head = key.split("/", 1)[0]
    m = re.fullmatch(r"([a-z]+?)(\d*)", head)
    kind, step = (m.group(1), int(m.group(2) or 0)) if m else (head, 0)
    return (ORDER.index(kind) if kind in ORDER else len(ORDER), step)


def relative_error(x: np.ndarray, exact: np.ndarray) -> float:
    """max |x - exact| / max(max |exact|, ABS_FLOOR); inf for a shape mismatch or a non-finite value."""
    x, exact = np.asarray(x, np.float64), np.asarray(exact, np.float64)
    if x.shape != exact.shape or not np.isfinite(x).all():
        return float("inf")
    if not x.size:
        return 0.0
    return float(np.max(np.abs(x - exact))) / max(float(np.max(np.abs(exact))), ABS_FLOOR)


def arbitrate(candidate: dict[str, np.ndarray], reference: dict[str, np.ndarray], exact: dict[str, np.ndarray],
              rel_tol: float = REL_TOL, keys: list[str] | None = None) -> Arbitration:
    """The side that leaves the exact computation first (keys common to all three, in computation order)."""
    common = keys if keys is not None else [k for k in exact if k in candidate and k in reference]
    for k in sorted(common, key=lambda k: (_order(k), k)):
        ec, er = relative_error(candidate[k], exact[k]), relative_error(reference[k], exact[k])
        if ec > rel_tol or er > rel_tol:
            side = "both" if ec > rel_tol and er > rel_tol else "candidate" if ec > rel_tol else "reference"
            return Arbitration(side, k, ec, er)
    return Arbitration("neither", None, 0.0, 0.0)
