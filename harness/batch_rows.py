"""The candidate's batch rows matched to the reference's before activations are compared.

A backend may hold the same samples of a step in another row order: a data-parallel port that hands replica 0 the
second half of the batch, a strategy that gathers the replicas' outputs in its own order. Where the step's
statistics are global (one program normalising over the whole batch) that is the same computation with its sums
reordered; where they are per replica, the normalised activations themselves differ. Compared row by row, both
disagree from the first layer on, and the first is a false BUG. So, per group of activation probes
(`forward/<layer>`, `eval/<layer>`, and any prefix ending in those), the rows of the first layer in spec order
are matched to the reference's by a bijection of the batch axis (an optimal assignment on the row distances),
accepted only when every matched row agrees within ROW_TOL of its own size and the identity order does not;
every layer of that group with as many rows is then permuted alike (a probe may keep a few rows of a large layer
and every row of a small one: each row count is matched at its first layer). A computation that differs after the matching (per-replica
statistics over other samples, a dropout mask that did not move with its sample, a label that did not) still
disagrees where it happens; one that differs at the first layer by more than ROW_TOL is compared in the order it
came, so the first layer is still where it shows.
"""
from __future__ import annotations

from typing import Any

import numpy as np

# a matched row's error relative to its own size: far above float32 rounding of one layer (~1e-7 .. 1e-6 on the
# built-in models), far below the lowering bugs of the catalogue (>= 1e-2), which are then seen at that layer
ROW_TOL = 1e-3
ROW_KINDS = ("forward/", "eval/")


def _groups(keys: list[str], layers: list[str]) -> dict[str, list[str]]:
    """Activation probe keys by prefix ('forward/', 'eval/', 'joint/forward/'), each list in spec order."""
    rank = {layer: i for i, layer in enumerate(layers)}
    out: dict[str, list[str]] = {}
    for k in keys:
        prefix, _, name = k.rpartition("/")
        if name in rank and (prefix + "/").endswith(ROW_KINDS):
            out.setdefault(prefix + "/", []).append(k)
    return {p: sorted(ks, key=lambda k: rank[k.rpartition("/")[2]]) for p, ks in out.items()}


def _row_errors(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Per row, |x_i - y_i| over max(|y_i|, a tiny floor on the tensor's scale)."""
    floor = max(float(np.max(np.abs(y))), 1e-30) * 1e-6
    return np.linalg.norm(x - y, axis=1) / np.maximum(np.linalg.norm(y, axis=1), floor)


def matching(x: np.ndarray, y: np.ndarray, tol: float = ROW_TOL) -> np.ndarray | None:
    """The order of x's rows that matches y's (x[order] ~ y), when it is not the identity and every matched row
    agrees within `tol` of its size while the identity order does not; None otherwise."""
    if x.shape != y.shape or x.ndim < 1 or x.shape[0] < 2:
        return None
    n = x.shape[0]
    xr, yr = np.asarray(x, np.float64).reshape(n, -1), np.asarray(y, np.float64).reshape(n, -1)
    if not (np.isfinite(xr).all() and np.isfinite(yr).all()) or float(np.max(_row_errors(xr, yr))) <= tol:
        return None
    from scipy.optimize import linear_sum_assignment
    from scipy.spatial.distance import cdist
    rows, cols = linear_sum_assignment(cdist(yr, xr, "sqeuclidean"))
    order = cols[np.argsort(rows)]
    if np.array_equal(order, np.arange(n)) or float(np.max(_row_errors(xr[order], yr))) > tol:
        return None
    return order


def align(a: dict[str, Any], b: dict[str, Any], layers: list[str]) -> tuple[dict[str, Any], dict[str, int]]:
    """(a with each activation group's rows in b's order where `matching` finds one, {prefix: most rows moved}).
    Keys outside the activation groups (the loss, gradients, updates, buffers, optimizer state) are untouched:
    they are sums over the batch, with no row order of their own."""
    common = [k for k in b if k in a]
    out, moved = dict(a), {}
    for prefix, keys in _groups(common, layers).items():
        orders: dict[int, np.ndarray | None] = {}   # per row count: a probe may keep a few rows of a large layer
        for k in keys:
            v = np.asarray(a[k])
            if v.ndim < 1:
                continue
            n = v.shape[0]
            if n not in orders:
                orders[n] = matching(v, np.asarray(b[k]))
            if orders[n] is not None:
                out[k] = v[orders[n]]
        shifted = [int(np.sum(o != np.arange(len(o)))) for o in orders.values() if o is not None]
        if shifted:
            moved[prefix] = max(shifted)
    return out, moved


__all__ = ["align", "matching", "ROW_TOL"]
