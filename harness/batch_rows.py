"""The candidate's batch rows matched to the reference's before activations are compared.

A backend may hold the same samples of a step in another row order: a data-parallel port that hands replica 0 the
second half of the batch, a strategy that gathers the replicas' outputs in its own order. Where the step's
statistics are global (one program normalising over the whole batch) that is the same computation with its sums
reordered; where they are per replica, the normalised activations themselves differ. Compared row by row, both
disagree from the first layer on, and the first is a false BUG.

So the rows of the activation probes (`forward/<layer>`, `eval/<layer>`, and the candidate's `joint/forward/<layer>`
of the same step) are matched to the reference's by a bijection of the batch axis: an optimal assignment on the row
distances of the first layer in spec order (ties between equal rows broken by the later layers), accepted only when
every matched row agrees within ROW_TOL of its own size while the given order does not. Every layer with as many
rows is then permuted alike; the inference-mode forward runs on the same batch, so it takes the training forward's
order where that fits it. A probe may keep every s-th sample of a large layer and every sample of a small one
(algorithms.params.thin_activations): each row count is matched on its own. The kept rows are the same samples on
both sides when the candidate's order moves them as blocks do (shards); an order that scatters them leaves other
samples in the candidate's kept rows, compared as they came (a disagreement there, while the whole-batch probes of
step 0 agree).

A computation that differs after the matching (per-replica statistics over other samples, a dropout mask that did
not move with its sample, a label that did not: the loss) still disagrees where it happens; one that differs at the
first layer by more than ROW_TOL is compared in the order it came, so the first layer is still where it shows.
"""
from __future__ import annotations

from typing import Any

import numpy as np

# a matched row's error relative to its own size: far above float32 rounding of one layer (~1e-7 .. 1e-6 on the
# built-in models), far below the lowering bugs of the catalogue (>= 1e-2), which are then seen at that layer
ROW_TOL = 1e-3
KINDS = ("forward", "eval")
TIE_WEIGHT = 1e-9   # the later layers' share of the assignment's cost: it decides between equal first-layer rows only


def _rows(v: Any) -> np.ndarray:
    v = np.asarray(v, np.float64)
    return v.reshape(v.shape[0], -1)


def _row_errors(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Per row, |x_i - y_i| over max(|y_i|, a tiny floor on the tensor's scale)."""
    floor = max(float(np.max(np.abs(y))), 1e-30) * 1e-6
    return np.linalg.norm(x - y, axis=1) / np.maximum(np.linalg.norm(y, axis=1), floor)


def fits(order: np.ndarray | None, x: Any, y: Any, tol: float = ROW_TOL) -> bool:
    """Whether x's rows in `order` (None: as they are) agree with y's within `tol` of each row's size."""
    xr, yr = _rows(x), _rows(y)
    if xr.shape != yr.shape or not (np.isfinite(xr).all() and np.isfinite(yr).all()):
        return False
    return float(np.max(_row_errors(xr if order is None else xr[order], yr))) <= tol


def matching(x: Any, y: Any, tol: float = ROW_TOL, later: list[tuple[Any, Any]] = ()) -> np.ndarray | None:
    """The order of x's rows that matches y's (x[order] ~ y), when it is not the identity and every matched row
    agrees within `tol` of its size while the identity order does not; None otherwise. `later`: (x, y) pairs of
    later layers with as many rows, whose distances break ties between equal rows of x."""
    if np.shape(x) != np.shape(y) or np.ndim(x) < 1 or np.shape(x)[0] < 2:
        return None
    xr, yr = _rows(x), _rows(y)
    n = xr.shape[0]
    if not (np.isfinite(xr).all() and np.isfinite(yr).all()) or fits(None, xr, yr, tol):
        return None
    # a bijection within tol moves no row's norm by more than tol x the largest: sorted norms must agree that far
    # (the bottleneck matching of two sorted lists), a cheap no before the assignment
    nx, ny = np.sort(np.linalg.norm(xr, axis=1)), np.sort(np.linalg.norm(yr, axis=1))
    if float(np.max(np.abs(nx - ny))) > tol * max(float(ny[-1]), 1e-30):
        return None
    from scipy.optimize import linear_sum_assignment
    from scipy.spatial.distance import cdist
    cost = cdist(yr, xr, "sqeuclidean") / max(float(np.sum(yr ** 2)), 1e-300)
    for lx, ly in later:
        if np.shape(lx) == np.shape(ly) and np.shape(lx)[0] == n:
            lxr, lyr = _rows(lx), _rows(ly)
            if np.isfinite(lxr).all() and np.isfinite(lyr).all():
                cost = cost + TIE_WEIGHT * cdist(lyr, lxr, "sqeuclidean") / max(float(np.sum(lyr ** 2)), 1e-300)
    rows, cols = linear_sum_assignment(cost)
    order = cols[np.argsort(rows)]
    if np.array_equal(order, np.arange(n)) or not fits(order, xr, yr, tol):
        return None
    return order


def _place(key: str, rank: dict[str, int]) -> tuple[str, str] | None:
    """(kind, layer) of an activation probe key, any prefix before its kind ('joint/forward/x' -> forward, x)."""
    head, _, name = key.rpartition("/")
    kind = head.rpartition("/")[2]
    return (kind, name) if kind in KINDS and name in rank else None


def align(a: dict[str, Any], b: dict[str, Any], layers: list[str]) -> tuple[dict[str, Any], dict[str, int]]:
    """(a with its activation rows in b's order where `matching` finds one, {kind: most rows moved}). Keys outside
    the activation probes (the loss, gradients, updates, buffers, optimizer state) are untouched: they are sums
    over the batch, with no row order of their own."""
    rank = {layer: i for i, layer in enumerate(layers)}
    out, moved = dict(a), {}
    orders: dict[tuple[str, int], np.ndarray | None] = {}
    for kind in KINDS:
        base = sorted((k for k in a if k in b and _place(k, rank) and k.startswith(kind + "/")),
                      key=lambda k: rank[k.rpartition("/")[2]])
        counts = sorted({np.shape(a[k])[0] for k in base if np.ndim(a[k]) >= 1})
        for n in counts:
            keys = [k for k in base if np.ndim(a[k]) >= 1 and np.shape(a[k])[0] == n]
            first, rest = keys[0], keys[1:]
            got = orders.get(("forward", n)) if kind == "eval" else None
            if got is None or not fits(got, a[first], b[first]):   # matching: None where the given order fits
                got = matching(a[first], b[first], later=[(a[k], b[k]) for k in rest])
            orders[(kind, n)] = got
            if got is not None:
                moved[kind] = max(moved.get(kind, 0), int(np.sum(got != np.arange(n))))
    for k, v in a.items():
        place = _place(k, rank)
        if place is not None and np.ndim(v) >= 1:
            got = orders.get((place[0], np.shape(v)[0]))
            if got is not None:
                out[k] = np.asarray(v)[got]
    return out, moved


__all__ = ["align", "fits", "matching", "ROW_TOL"]
