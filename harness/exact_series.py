"""A run's numbers exactly as written (int steps, float64 values parsed with float(), checksums) and
the bit-for-bit difference of two such runs: what `duipai check` compares in bitwise mode.
Framework-free: reads steps.csv and eval.csv of run folders."""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from algorithms.contract import EVAL_FILE, STEPS_FILE

from .errors import BadInput
from .runs import EVAL_SERIES, STEP_SERIES, Run, load_run

SKIP_COLUMNS = ("step_time_s",)                      # timing, not numerics
# series in the order a first difference is reported at equal steps
ORDER = ("batch_checksum",) + STEP_SERIES + ("epoch",)


@dataclass
class Series:
    """A run's numbers exactly as written: int steps, float64 values parsed with float(), checksums."""
    steps: dict[str, np.ndarray]          # column -> array on the step grid ('step' included)
    evals: dict[str, np.ndarray]          # column -> array on the eval grid ('step' included)

    def columns(self) -> list[str]:
        return [c for c in self.steps if c != "step"] + [c for c in self.evals if c != "step"]

    def array(self, col: str) -> np.ndarray:
        return self.evals[col] if col in EVAL_SERIES else self.steps[col]

    def grid(self, col: str) -> np.ndarray:
        return self.evals["step"] if col in EVAL_SERIES else self.steps["step"]


def parse_float(text: str) -> float:
    """A number as written ('nan', 'inf', '-inf' included)."""
    return float(text)


def typed_column(col: str, values: list[Any]) -> np.ndarray:
    """One column, typed exactly: int steps and epochs, checksums as bytes, the rest float64."""
    if col in ("step", "epoch"):
        return np.asarray([int(v) for v in values], np.int64)
    if col == "batch_checksum":
        return np.asarray([str(v).encode() for v in values], dtype=bytes)
    return np.asarray([parse_float(v) if isinstance(v, str) else float(v) for v in values], np.float64)


def _read_csv_exact(path: Path) -> dict[str, np.ndarray]:
    try:
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"{path}: unreadable ({e})") from None
    if not rows:
        raise BadInput(f"{path}: empty")
    head, body = rows[0], rows[1:]
    out: dict[str, list[str]] = {c: [] for c in head}
    for i, r in enumerate(body):
        if len(r) != len(head):
            raise BadInput(f"{path}: row {i + 2} has {len(r)} fields, the header {len(head)}")
        for c, v in zip(head, r):
            out[c].append(v)
    try:
        return {c: typed_column(c, v) for c, v in out.items() if c not in SKIP_COLUMNS}
    except ValueError as e:
        raise BadInput(f"{path}: {e}") from None


def read_series(folder: Path) -> Series:
    """The exact numbers of a complete run folder (steps.csv and eval.csv)."""
    return Series(_read_csv_exact(Path(folder) / STEPS_FILE), _read_csv_exact(Path(folder) / EVAL_FILE))


def as_run(path: Path, manifest: dict[str, Any], s: Series) -> Run:
    """A harness.runs.Run made of exact series (for the envelope and the verdict engine)."""
    values = {c: np.asarray(s.steps[c], np.float64) for c in STEP_SERIES}
    values.update({c: np.asarray(s.evals[c], np.float64) for c in EVAL_SERIES})
    return Run(Path(path), manifest, s.steps["step"], values, s.steps["batch_checksum"], s.evals["step"])


def load_current(folder: Path) -> tuple[Run, Series]:
    """A published run, validated by harness.runs.load_run, with its exact series."""
    r = load_run(folder)
    s = read_series(r.path)
    return as_run(r.path, r.manifest, s), s


def _bits(a: np.ndarray) -> np.ndarray:
    if a.dtype == np.float64:
        return a.view(np.int64)
    return a


def series_diff(base: Series, cur: Series) -> dict[str, Any] | None:
    """Bit for bit: None when every column and grid is equal; else the first difference (step,
    series, both values) and, per differing column, the count of differing points and max |diff|."""
    cols_b, cols_c = base.columns(), cur.columns()
    only_b = [c for c in cols_b if c not in cols_c]
    only_c = [c for c in cols_c if c not in cols_b]
    differing: dict[str, dict[str, Any]] = {}
    first: dict[str, Any] | None = None
    grid_notes = []
    for part in ("steps", "evals"):
        gb, gc = getattr(base, part)["step"], getattr(cur, part)["step"]
        if not np.array_equal(gb, gc):
            grid_notes.append(f"{'step' if part == 'steps' else 'eval'} grid differs: baseline {len(gb)} points "
                              f"({gb[:1].tolist()}..{gb[-1:].tolist()}), now {len(gc)}")
    rank = {c: i for i, c in enumerate(ORDER)}
    for c in cols_b:
        if c not in cols_c:
            continue
        a, b = base.array(c), cur.array(c)
        ga, gb_ = base.grid(c), cur.grid(c)
        common, ia, ib = np.intersect1d(ga, gb_, return_indices=True)
        x, y = a[ia], b[ib]
        neq = _bits(x) != _bits(y)
        if x.dtype == np.float64:
            neq &= ~(np.isnan(x) & np.isnan(y))     # NaN is NaN whatever its payload
        if not neq.any():
            continue
        i = int(np.argmax(neq))
        info: dict[str, Any] = {"count": int(neq.sum()), "of": int(len(common)), "first_step": int(common[i])}
        if x.dtype == np.float64:
            from .envelope import deviation
            d = deviation(x, y)
            info["max_abs"] = float(np.max(d))
            info["max_abs_step"] = int(common[int(np.argmax(d))])
        differing[c] = info
        cand = {"step": int(common[i]), "series": c, "baseline": _val(x[i]), "current": _val(y[i])}
        if x.dtype == np.float64:
            cand["abs_diff"] = float(abs(float(x[i]) - float(y[i]))) if np.isfinite(x[i]) and np.isfinite(y[i]) else None
        key = (cand["step"], rank.get(c, len(rank) + (1 if c in EVAL_SERIES else 0)))
        if first is None or key < first["_key"]:
            first = dict(cand, _key=key)
    if not differing and not only_b and not only_c and not grid_notes:
        return None
    if first is not None:
        first.pop("_key")
    return {"first": first, "differing": differing, "only_in_baseline": only_b, "only_now": only_c,
            "grid": grid_notes}


def _val(v: Any) -> Any:
    if isinstance(v, (bytes, np.bytes_)):
        return v.decode()
    if isinstance(v, (np.integer,)):
        return int(v)
    return float(v)


def fmt_value(v: Any) -> str:
    """A float as its exact repr and its hex (so two values that print alike still show their bits)."""
    if isinstance(v, float):
        return f"{v!r} ({v.hex()})" if math.isfinite(v) else repr(v)
    return repr(v)


def describe_diff(d: dict[str, Any]) -> str:
    parts = []
    f = d.get("first")
    if f:
        s = f"step {f['step']} {f['series']}: baseline {fmt_value(f['baseline'])}, now {fmt_value(f['current'])}"
        if f.get("abs_diff") is not None:
            s += f", |diff| {f['abs_diff']:.3g}"
        parts.append(s)
        counts = ", ".join(f"{c} {x['count']}/{x['of']}" for c, x in d["differing"].items())
        parts.append(f"differing points: {counts}")
    if d.get("only_in_baseline"):
        parts.append("series only in the baseline: " + ", ".join(d["only_in_baseline"]))
    if d.get("only_now"):
        parts.append("series only in this run: " + ", ".join(d["only_now"]))
    parts += d.get("grid", [])
    return "; ".join(parts)
