"""The calibrated envelope: how far two correct runs of one configuration may drift apart, measured.

The reference run is re-trained K times (default 3) with every initial weight moved by one ULP in a
seeded random direction (`--perturb-ulp k`; Summers & Dinneen 2021: a one-bit change of the initial
weights gives the run-to-run diversity of any other nondeterminism source), plus once in float64
(`--dtype float64 --perturb-ulp k1`; PyTorch Inductor's check: the float32 run's distance to float64
is its own rounding error). Per series and step, the raw spread is d_t = max_k |member_k[t] - ref[t]|.

THE RULE (measured by bench/calibrate_envelope.py; the numbers are in docs/verdict.md)

  smoothing   S_t = max(d_u : |u - t| <= 5 points of the series' grid). One point's spread is 0
              whenever the members happen to round alike (at step 0 for most series); the rolling
              maximum also pools 11 x K samples of a spread that changes slowly.
  floor       E_t = max(S_t, 8 float32 ULPs of |ref_t|, 1e-7).
  quantum     accuracies are counts: one sample more or less (1/batch for `accuracy`, 1/n_test for
              `eval_accuracy`) is never an exceedance by itself.
  margin      a point EXCEEDS when |cand_t - ref_t| > 3 E_t (pairs without the reference: 6 E_t,
              the triangle inequality for two runs each within 3 E_t of the reference).
  persistence a series DIVERGES at the first exceedance of a run of >= 2 consecutive exceeding points,
              or at its first exceedance once it has more than max(4, 0.1 % of its points) isolated
              ones, or where one run is finite and the other not (never tolerated).
  saturation  from the first point where S_t >= 0.5 x scale_t (|ref_t|; 1 for accuracies) the
              envelope is O(1) and later exceedances of that series are not counted (a non-finite
              value still is): nothing before it left -> INCONCLUSIVE.
  exact       `lr` (EXACT_SERIES) has zero spread by construction: any difference at any step diverges
              there (reason "exact"); no smoothing, floor, isolated exceedance or saturation applies.
  arbiter     an excess is a BUG when it starts at step 0, or when a one-step probe reproduces it
              (step 0 from the canonical weights, or the divergent step replayed from the
              reference's own state: harness/localize.py). Otherwise INCONCLUSIVE: over 300 steps,
              27 of 252 held-out drift-only runs left a 3-run envelope, all after step 60 (Adam
              trajectories that bifurcate, chaotic growth); every catalogued fault left it at
              step 0, by 37x or more.

The factor reported for a divergence is |cand - ref| / E at the divergent point; for an accuracy, E is
at least quantum / margin there, the tolerance the rule applies (one sample more is never 'x1000').
"""
from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from algorithms.contract import MANIFEST_FILE

from .errors import BackendFailed
from .runs import SERIES, Run, check_reproduces, config_of, load_run, same_config

BOUNDED = ("accuracy", "eval_accuracy")
# series with zero spread by construction (the schedule does not depend on the arithmetic): compared
# exactly, no envelope, no isolated exceedance tolerated
EXACT_SERIES = ("lr",)
# a norm past this overflows a float32 sum of squares: inf in a float32 backend, finite in a float64 one
F32_NORM_MAX = float(np.sqrt(np.finfo(np.float32).max))


@dataclass(frozen=True)
class Rule:
    margin: float = 3.0
    window: int = 5                 # half-width of the rolling maximum, in steps
    ulps: float = 8.0               # floor in float32 ULPs of the reference value
    abs_floor: float = 1e-7         # absolute floor for values near zero
    max_isolated: int = 4           # isolated exceedances tolerated per series ...
    isolated_fraction: float = 1e-3  # ... or this fraction of its points, if more
    saturation: float = 0.5         # relative smoothed spread at which a series loses its power
    pair_factor: float = 2.0        # margin multiplier for pairs without the reference

    def to_dict(self) -> dict:
        return asdict(self)


DEFAULT_RULE = Rule()


# --------------------------------------------------------------------------- elementwise pieces
def as_float32_norm(series: str, x):
    """`x` with a norm past F32_NORM_MAX as inf: past there a float32 sum of squares has overflowed, so a float64
    backend's finite norm and a float32 one's inf say the same (any other series: `x` itself)."""
    return np.where(np.abs(x) > F32_NORM_MAX, np.inf, x) if series.endswith("_norm") else x


def deviation(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b|; 0 where both are non-finite (both left float range: inf or NaN is each framework's convention);
    inf where exactly one is."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(a - b)
    fa, fb = np.isfinite(a), np.isfinite(b)
    if fa.all() and fb.all():
        return d
    d = np.where(fa & fb, d, np.inf)
    return np.where(~fa & ~fb, 0.0, d)


def rolling_max(d: np.ndarray, w: int, grid: np.ndarray | None = None) -> np.ndarray:
    """The maximum of `d` over the points within +-w steps of each point: `grid` holds the points' steps
    (increasing; None: one point per step). On a sparse grid (the evaluations, every eval_every steps) a
    neighbour further than w steps away is another state of the run, not the same spread sampled again:
    it is left out (before 2026-12-02 the window counted points, so with evaluations every 50 steps the
    envelope at step 0 was the spread of steps 0-250, and an evaluation-path bug hid inside it)."""
    out = d.copy()
    steps = np.arange(len(d)) if grid is None else np.asarray(grid)
    for k in range(1, min(w, len(d) - 1) + 1):
        near = (steps[k:] - steps[:-k]) <= w
        if not near.any():
            break
        np.maximum(out[k:], np.where(near, d[:-k], out[k:]), out=out[k:])
        np.maximum(out[:-k], np.where(near, d[k:], out[:-k]), out=out[:-k])
    return out


def ulp32(x: np.ndarray) -> np.ndarray:
    """The float32 spacing at |x| (inf for values beyond float32, nan for nan)."""
    ax = np.abs(np.asarray(x, np.float64))
    with np.errstate(over="ignore", invalid="ignore"):
        big = ax > np.finfo(np.float32).max
        sp = np.spacing(np.where(big | ~np.isfinite(ax), 1.0, ax).astype(np.float32)).astype(np.float64)
    return np.where(big, np.inf, np.where(np.isfinite(ax), sp, np.nan))


def quantum(series: str, manifest: dict) -> float:
    if series == "accuracy":
        return 1.0 / float(manifest.get("hparams", {}).get("batch_size", 1))
    if series == "eval_accuracy":
        return 1.0 / float((manifest.get("data") or {}).get("n_test", 1))
    return 0.0


# --------------------------------------------------------------------------- the envelope
@dataclass
class SeriesEnvelope:
    series: str
    grid: np.ndarray           # steps
    ref: np.ndarray
    raw: np.ndarray            # d_t
    smooth: np.ndarray         # S_t
    env: np.ndarray            # E_t = max(S_t, F_t)
    quantum: float
    saturated_at: int | None   # index into grid
    saturation_reason: str = ""

    def summary(self) -> dict:
        finite = self.raw[np.isfinite(self.raw)]
        rel = self.smooth / np.maximum(self._scale(), 1e-300)
        return {"series": self.series, "points": int(len(self.grid)),
                "zero_spread_points": int(np.sum(self.raw == 0)),
                "max_spread": float(finite.max()) if finite.size else None,
                "max_relative_spread": float(np.nanmax(rel)) if len(rel) else None,
                "saturated_at_step": None if self.saturated_at is None else int(self.grid[self.saturated_at]),
                "saturation_reason": self.saturation_reason, "quantum": self.quantum}

    def _scale(self) -> np.ndarray:
        if self.series in BOUNDED:
            return np.ones_like(self.ref)
        return np.abs(self.ref)


def envelope_of(series: str, grid: np.ndarray, ref: np.ndarray, members: list[np.ndarray], q: float,
                rule: Rule = DEFAULT_RULE) -> SeriesEnvelope:
    n = len(ref)
    raw = np.zeros(n)
    for m in members:
        np.maximum(raw, deviation(m, ref), out=raw)
    # where the reference is not finite (it overflowed: harness.finite_range compares up to that step) there is
    # no rounding spread to measure: a member or candidate agrees there when it is not finite either, and a
    # finite one differs (deviation: inf); a member's inf is not smoothed onto the finite steps before it
    finite_ref = np.isfinite(ref)
    smooth = rolling_max(np.where(finite_ref, raw, 0.0), rule.window, grid)
    floor = np.maximum(rule.ulps * ulp32(ref), rule.abs_floor)
    floor = np.where(finite_ref, floor, rule.abs_floor)
    env = np.maximum(smooth, floor)
    scale = np.ones(n) if series in BOUNDED else np.abs(ref)
    with np.errstate(invalid="ignore", divide="ignore"):
        sat = (smooth >= rule.saturation * np.maximum(scale, floor)) & finite_ref
    sat_at, why = None, ""
    if sat.any():
        sat_at = int(np.argmax(sat))
        why = f"spread {smooth[sat_at]:.3g} >= {rule.saturation} x {'range' if series in BOUNDED else '|value|'}"
    return SeriesEnvelope(series, grid, ref, raw, smooth, env, q, sat_at, why)


def compute(ref: Run, members: list[Run], rule: Rule = DEFAULT_RULE) -> dict[str, SeriesEnvelope]:
    """Per series, the envelope of `members` around `ref` (all on the reference's grid)."""
    out = {}
    for s in SERIES:
        grid = ref.grid(s)
        vals = []
        for m in members:
            g = m.grid(s)
            if len(g) != len(grid) or not np.array_equal(g, grid):
                common, ia, ib = np.intersect1d(grid, g, return_indices=True)
                v = np.full(len(grid), np.nan)
                v[ia] = m.values[s][ib]
                # a member that lacks a step gives no information there: let it agree with the reference
                v = np.where(np.isin(np.arange(len(grid)), ia), v, ref.values[s])
                vals.append(v)
            else:
                vals.append(m.values[s])
        out[s] = envelope_of(s, grid, ref.values[s], vals, quantum(s, ref.manifest), rule)
    return out


# --------------------------------------------------------------------------- one series of one pair
@dataclass
class SeriesCheck:
    series: str
    points: int
    identical: bool
    max_dev: float
    max_ratio: float
    max_ratio_step: int | None
    exceedances: int
    isolated: int
    first_exceed_step: int | None
    diverged_step: int | None
    factor: float | None              # |dev| / E at the divergent point
    dev_at_divergence: float | None
    env_at_divergence: float | None
    reason: str                       # sustained | isolated | non-finite | ""
    saturated_step: int | None
    nonfinite_step: int | None
    a_value: float | None = None      # the two values at the divergent point
    b_value: float | None = None
    ratios: np.ndarray | None = field(default=None, repr=False)

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "ratios"}
        return {k: (None if isinstance(v, float) and not np.isfinite(v) and k not in ("factor", "max_ratio", "max_dev")
                    else v) for k, v in d.items()}


def check_series(env: SeriesEnvelope, idx: np.ndarray, a: np.ndarray, b: np.ndarray, rule: Rule = DEFAULT_RULE,
                 with_reference: bool = True) -> SeriesCheck:
    """Compare values a, b (candidate pair) at envelope indices idx."""
    grid = env.grid[idx]
    n = len(idx)
    ident = bool(np.array_equal(a.view(np.int64), b.view(np.int64))) if a.dtype == np.float64 == b.dtype else False
    dev = deviation(as_float32_norm(env.series, a), as_float32_norm(env.series, b))
    E = env.env[idx]
    margin = rule.margin * (1.0 if with_reference else rule.pair_factor)
    q = env.quantum
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = dev / E
    ratio = np.where(dev == 0, 0.0, ratio)
    E_applied = np.maximum(E, q / margin)   # the factor shown is against the tolerance applied: for an accuracy
    with np.errstate(divide="ignore", invalid="ignore"):    # one sample (the quantum) is never an exceedance
        shown = np.where(dev == 0, 0.0, dev / E_applied)
    nonfinite = np.isinf(dev)
    sat_idx = n if env.saturated_at is None else int(np.searchsorted(idx, env.saturated_at))
    valid = np.arange(n) < sat_idx
    exact = env.series in EXACT_SERIES
    if exact:   # zero spread by construction: any difference is one, wherever it is, however small
        sat_idx, valid = n, np.ones(n, bool)
        exceed = (dev > 0) | nonfinite
    else:
        exceed = ((ratio > margin) & (dev > q * (1 + 1e-9)) & valid) | nonfinite
    ex_idx = np.flatnonzero(exceed)
    diverged, reason = None, ""
    n_iso = 0
    if exact and ex_idx.size:
        diverged, reason = int(ex_idx[0]), ("non-finite" if nonfinite[ex_idx[0]] else "exact")
    elif ex_idx.size:
        # runs of consecutive exceeding points
        breaks = np.flatnonzero(np.diff(ex_idx) != 1) + 1
        starts = np.concatenate([[0], breaks])
        ends = np.concatenate([breaks, [ex_idx.size]])
        lengths = ends - starts
        first_nf = int(np.argmax(nonfinite)) if nonfinite.any() else None
        cand: list[tuple[int, str]] = []
        if first_nf is not None:
            cand.append((first_nf, "non-finite"))
        long_runs = np.flatnonzero(lengths >= 2)
        if long_runs.size:
            cand.append((int(ex_idx[starts[long_runs[0]]]), "sustained"))
        iso_pos = ex_idx[starts[lengths == 1]]
        n_iso = int(iso_pos.size)
        if n_iso > max(rule.max_isolated, int(rule.isolated_fraction * n)):
            cand.append((int(iso_pos[0]), "isolated"))
        if cand:
            diverged, reason = min(cand)
    fin = np.isfinite(shown) & valid      # the largest factor where the series still has power
    mr_i = int(np.argmax(np.where(fin, shown, -1))) if n else None
    if n and nonfinite.any():
        mr_i = int(np.argmax(nonfinite))
    first_nf_step = int(grid[np.argmax(~np.isfinite(a) | ~np.isfinite(b))]) if n and (
        ~np.isfinite(a) | ~np.isfinite(b)).any() else None
    return SeriesCheck(
        series=env.series, points=n, identical=ident,
        max_dev=float(np.max(dev)) if n else 0.0,
        max_ratio=float(shown[mr_i]) if n and (fin[mr_i] or nonfinite[mr_i]) else 0.0,
        max_ratio_step=int(grid[mr_i]) if n else None,
        exceedances=int(ex_idx.size), isolated=n_iso,
        first_exceed_step=int(grid[ex_idx[0]]) if ex_idx.size else None,
        diverged_step=None if diverged is None else int(grid[diverged]),
        factor=None if diverged is None else float(shown[diverged]),
        dev_at_divergence=None if diverged is None else float(dev[diverged]),
        env_at_divergence=None if diverged is None else float(E_applied[diverged]),
        reason=reason,
        saturated_step=None if sat_idx >= n else int(grid[sat_idx]),
        nonfinite_step=first_nf_step,
        a_value=None if diverged is None else float(a[diverged]),
        b_value=None if diverged is None else float(b[diverged]),
        ratios=shown)


# --------------------------------------------------------------------------- generating the envelope runs
def envelope_seeds(k: int, avoid: set[int]) -> list[int]:
    """The first k positive perturbation seeds not used by any compared run."""
    out, s = [], 1
    while len(out) < k:
        if s not in avoid:
            out.append(s)
        s += 1
    return out


def envelope_runs(ref: Run, seeds: list[int], root: Path | None = None, *, precision: bool = True,
                  timeout: float | None = None, log: Callable[[str], None] | None = None,
                  jobs: int = 1) -> tuple[list[Run], list[str]]:
    """The reference configuration re-trained with --perturb-ulp k for each seed and, with `precision`,
    once more in float64 (--dtype float64 --perturb-ulp seeds[0]), through runner.execute (`jobs` at once);
    an existing complete folder of the same name and configuration is reused. Returns (runs, notes)."""
    root = Path(root or ref.path.parent)
    log = log or (lambda m: print(m, file=sys.stderr))
    wanted = [{"perturb_ulp": k} for k in seeds]
    notes: list[str] = []
    if precision and ref.options.dtype != "float64":
        wanted.append({"perturb_ulp": seeds[0], "dtype": "float64"})
    def one(change: dict) -> Run | BackendFailed:
        try:
            return _cached_run(ref, change, root, timeout, log)
        except BackendFailed as e:
            return e

    if jobs > 1 and len(wanted) > 1:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            got = list(pool.map(one, wanted))
    else:
        got = [one(c) for c in wanted]
    out = []
    for change, r in zip(wanted, got):
        if isinstance(r, BackendFailed):
            if "dtype" not in change:
                raise r
            notes.append(f"no float64 envelope run ({str(r).splitlines()[0]}): the envelope is the "
                         f"{len(seeds)} 1-ULP runs alone")
        else:
            out.append(r)
    return out, notes


def _cached_run(ref: Run, change: dict, root: Path, timeout: float | None, log: Callable[[str], None]) -> Run:
    import json
    from . import runner
    cfg = config_of(ref.manifest, root, **change)
    prep = runner.prepare(cfg, root)
    check_reproduces(ref.manifest, cfg, prep, "the envelope")
    folder = root / cfg.default_name(prep.model.name)
    if (folder / MANIFEST_FILE).is_file():
        try:
            if same_config(json.loads((folder / MANIFEST_FILE).read_text()), cfg, ref.manifest,
                           runner.code_hash(cfg.backend)):
                return load_run(folder)
        except Exception:   # an unreadable cached run is simply made again
            pass
    log(f"envelope: training {cfg.backend} " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in change.items())
        + f" -> {folder}")
    return load_run(runner.execute(cfg, root, folder.name, prepared=prep, timeout=timeout))


__all__ = ["as_float32_norm", "F32_NORM_MAX", "Rule", "DEFAULT_RULE", "SeriesEnvelope", "SeriesCheck", "compute", "check_series", "envelope_runs",
           "envelope_seeds", "deviation", "rolling_max", "ulp32"]
