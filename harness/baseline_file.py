"""A golden baseline file: a run's curves with exact floats, its configuration and the platform it ran
on, in one self-checking JSON file (`<run name>.json`). It holds
  * every per-step series of steps.csv (step, epoch, loss, accuracy, grad_norm, update_norm,
    param_norm, lr, batch_checksum and, under data parallelism, replica_loss_<i>; not step_time_s)
    and of eval.csv, one row per step, floats as their shortest round-trip repr (exact; non-finite
    values as the strings "nan", "inf", "-inf");
  * the run's manifest without what changes from one run to the next (start time, wall times,
    command line, host name), so the configuration can be regenerated and compared;
  * the platform fingerprint and the run's own (harness/fingerprint.py): when both equal the
    current ones, a rerun must be bitwise equal;
  * optionally the envelope: per series, the spread of 1-ULP-perturbed runs around this one;
  * `sha256`: the SHA-256 of everything else in canonical JSON, so a truncated or edited file is
    refused (naming the file) instead of being compared.
A matrix's baselines as one set: harness/baseline_set.py. Framework-free: reads run folders only.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from .errors import BadInput
from .exact_series import Series, as_run, load_current, parse_float, typed_column
from .files import atomic_write_text
from .fingerprint import platform_fingerprint, run_fingerprint
from .config_diff import differences
from .runs import EVAL_SERIES, SERIES, STEP_SERIES, Run

SCHEMA = 1
TOOL = "duipai baseline"
VOLATILE_MANIFEST = ("started", "wall_s", "train_wall_s", "command")


class BaselineError(BadInput):
    """A missing, unreadable, corrupt or stale baseline: exit 2, naming the file."""


class BaselineMismatch(AssertionError):
    """A run that does not match its baseline (raised by harness.testing)."""


def _enc(v: Any) -> Any:
    if isinstance(v, (float, np.floating)):
        v = float(v)
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return v
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (bytes, np.bytes_)):
        return v.decode()
    return v


def _table(cols: dict[str, np.ndarray]) -> dict[str, Any]:
    names = list(cols)
    n = len(cols[names[0]]) if names else 0
    return {"columns": names, "rows": [[_enc(cols[c][i]) for c in names] for i in range(n)]}


def untable(t: Any, where: str) -> dict[str, np.ndarray]:
    """The columns of a stored {columns, rows} table, typed exactly; ValueError naming `where`."""
    if not isinstance(t, dict) or not isinstance(t.get("columns"), list) or not isinstance(t.get("rows"), list):
        raise ValueError(f"{where}: needs 'columns' and 'rows'")
    cols = t["columns"]
    if "step" not in cols:
        raise ValueError(f"{where}: no 'step' column")
    for i, r in enumerate(t["rows"]):
        if not isinstance(r, list) or len(r) != len(cols):
            raise ValueError(f"{where}: row {i} has {len(r) if isinstance(r, list) else '?'} values, "
                             f"the columns {len(cols)}")
    return {c: typed_column(c, [r[j] for r in t["rows"]]) for j, c in enumerate(cols)}


def canonical(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def digest(doc: dict[str, Any]) -> str:
    return hashlib.sha256(canonical({k: v for k, v in doc.items() if k != "sha256"})).hexdigest()


def render(doc: dict[str, Any]) -> str:
    """Indented JSON with one line per step (a rerun that changes step 7 changes one line in git)."""
    doc = dict(doc, sha256=digest(doc))
    marks: dict[str, str] = {}
    shown = dict(doc)
    for part in ("steps", "eval"):
        if part in shown:
            cmark, rmark = f"@@COLUMNS-{part}@@", f"@@ROWS-{part}@@"
            marks[cmark] = json.dumps(shown[part]["columns"])
            marks[rmark] = "[\n" + ",\n".join("   " + json.dumps(r, allow_nan=False) for r in shown[part]["rows"]) + "\n  ]"
            shown[part] = {"columns": cmark, "rows": rmark}
    text = json.dumps(shown, indent=1, allow_nan=False)
    for mark, rows in marks.items():
        text = text.replace(json.dumps(mark), rows)
    return text + "\n"


@dataclass
class Baseline:
    path: Path
    doc: dict[str, Any]
    series: Series

    @property
    def name(self) -> str:
        return self.doc["run"]

    @property
    def manifest(self) -> dict[str, Any]:
        return self.doc["manifest"]

    @property
    def backend(self) -> str:
        return self.manifest.get("backend", "?")

    @property
    def fingerprint(self) -> dict[str, Any]:
        return self.doc["fingerprint"]

    def run(self) -> Run:
        """The baseline as a harness.runs.Run (its path: the file without .json; no checkpoints)."""
        return as_run(self.path.with_suffix(""), self.manifest, self.series)


def baseline_doc(folder: Path, *, role: str = "run", key: str = "", matrix: str | None = None,
                 envelope: Iterable[Path] = (), platform_fp: dict[str, Any] | None = None) -> dict[str, Any]:
    """The baseline of one complete run folder (envelope: folders of 1-ULP-perturbed runs of it)."""
    run, s = load_current(Path(folder))
    man = {k: v for k, v in run.manifest.items() if k not in VOLATILE_MANIFEST}
    if isinstance(man.get("host"), dict):
        man["host"] = {k: v for k, v in man["host"].items() if k != "hostname"}
    doc: dict[str, Any] = {
        "schema": SCHEMA, "tool": TOOL, "run": run.name, "role": role, "matrix": matrix,
        "run_key": key or run.manifest.get("run_key", ""),
        "fingerprint": {"platform": platform_fp or platform_fingerprint(), "run": run_fingerprint(run.manifest)},
        "manifest": man, "steps": _table(s.steps), "eval": _table(s.evals)}
    members = [load_current(Path(p)) for p in envelope]
    if members:
        from .compare import check_comparable
        check_comparable([run] + [m for m, _ in members], False)
        spread = {}
        for c in SERIES:
            d = np.zeros(len(run.grid(c)))
            for m, _ in members:
                if not np.array_equal(m.grid(c), run.grid(c)):
                    raise BadInput(f"{m.name}: its {c} steps are not those of {run.name}")
                from .envelope import deviation
                np.maximum(d, deviation(m.values[c], run.values[c]), out=d)
            spread[c] = [_enc(x) for x in d]
        doc["envelope"] = {"members": [m.name for m, _ in members],
                           "perturb_ulp_seeds": [m.perturb_ulp for m, _ in members], "spread": spread}
    return doc


def write_baseline(path: Path, doc: dict[str, Any]) -> None:
    atomic_write_text(path, render(doc))


def save_baseline(run_dir: str | Path, path: str | Path, *, envelope: Iterable[str | Path] = ()) -> Path:
    """Write the baseline of one run folder to `path` (envelope: 1-ULP-perturbed runs of the same
    configuration, whose spread is stored for envelope-mode comparisons on other platforms)."""
    p = Path(path)
    write_baseline(p, baseline_doc(Path(run_dir), envelope=[Path(e) for e in envelope]))
    return p


def corrupt(path: Path, why: str) -> BaselineError:
    """The error for a damaged baseline file or index (what to do about it included)."""
    return BaselineError(f"{path}: corrupt baseline: {why}; regenerate it with `duipai check --update` "
                         "(or restore it from git)")


def load_checked(p: Path, kind: str, missing: str) -> dict[str, Any]:
    """A self-checking duipai JSON document (tool, schema, sha256 of its content), or BaselineError
    naming the file and what is wrong with it. Shared by baseline files and the set's index."""
    if not p.is_file():
        raise BaselineError(f"{p}: {missing}")
    try:
        doc = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise corrupt(p, f"unreadable ({e})") from None
    except json.JSONDecodeError as e:
        raise corrupt(p, f"not valid JSON ({e}; truncated?)") from None
    if not isinstance(doc, dict) or doc.get("tool") != TOOL or "sha256" not in doc:
        raise corrupt(p, f"not a duipai {kind} (no 'tool'/'sha256')")
    if doc.get("schema") != SCHEMA:
        raise BaselineError(f"{p}: baseline schema {doc.get('schema')!r}, this duipai reads {SCHEMA}; "
                            "regenerate it with `duipai check --update`")
    try:
        ok = digest(doc) == doc["sha256"]
    except (TypeError, ValueError) as e:
        raise corrupt(p, f"unencodable content ({e})") from None
    if not ok:
        raise corrupt(p, "its content does not match its sha256 (edited or damaged)")
    return doc


def load_baseline(path: str | Path) -> Baseline:
    """A validated baseline file, or BaselineError naming the file and the problem."""
    p = Path(path)
    doc = load_checked(p, "baseline file", "missing baseline file (restore it from git, or regenerate the set "
                                            "with `duipai check --update`)")
    try:
        for k in ("run", "manifest", "fingerprint", "steps", "eval"):
            if k not in doc:
                raise ValueError(f"missing field '{k}'")
        s = Series(untable(doc["steps"], "steps"), untable(doc["eval"], "eval"))
        missing = [c for c in STEP_SERIES + ("batch_checksum",) if c not in s.steps] + \
                  [c for c in EVAL_SERIES if c not in s.evals]
        if missing:
            raise ValueError(f"missing series {', '.join(missing)}")
        want = int((doc["manifest"].get("hparams") or {}).get("steps", -1))
        if len(s.steps["step"]) != want or (want and not np.array_equal(s.steps["step"], np.arange(want))):
            raise ValueError(f"{len(s.steps['step'])} step rows, the manifest promises {want} steps")
        for c in ("platform", "run"):
            if not isinstance(doc["fingerprint"].get(c), dict):
                raise ValueError(f"fingerprint has no '{c}' part")
    except (ValueError, TypeError, AttributeError) as e:
        raise corrupt(p, str(e)) from None
    return Baseline(p, doc, s)


def config_mismatches(base_manifest: dict[str, Any], manifest: dict[str, Any]) -> list[str]:
    """The comparability fields (model spec, data, batch order, initial weights, hyper-parameters)
    that differ: a baseline of another configuration."""
    return [f"{f} {va} -> {vb} ({words})" for f, va, vb, words in differences(base_manifest, manifest)]


def spread_envelope(ref: Run, spread: dict[str, list[Any]], rule=None):
    """The envelope (harness.envelope) of a stored spread around `ref`."""
    from .envelope import DEFAULT_RULE, envelope_of, quantum
    rule = rule or DEFAULT_RULE
    out = {}
    for c in SERIES:
        d = np.asarray([parse_float(x) if isinstance(x, str) else float(x) for x in spread[c]], np.float64)
        out[c] = envelope_of(c, ref.grid(c), ref.values[c], [ref.values[c] + d], quantum(c, ref.manifest), rule)
    return out


def merge_envelopes(*envs):
    """Pointwise the larger of several envelopes on one grid (the wider of two platforms' spreads)."""
    envs = [e for e in envs if e]
    if not envs:
        return None
    out = {}
    for s, e0 in envs[0].items():
        e = e0
        for other in envs[1:]:
            o = other.get(s)
            if o is None or len(o.grid) != len(e.grid) or not np.array_equal(o.grid, e.grid):
                continue
            sat = [x for x in (e.saturated_at, o.saturated_at) if x is not None]
            e = replace(e, raw=np.maximum(e.raw, o.raw), smooth=np.maximum(e.smooth, o.smooth),
                        env=np.maximum(e.env, o.env), saturated_at=min(sat) if sat else None,
                        saturation_reason=e.saturation_reason if e.saturated_at is not None and (
                            o.saturated_at is None or e.saturated_at <= o.saturated_at) else o.saturation_reason)
        out[s] = e
    return out
