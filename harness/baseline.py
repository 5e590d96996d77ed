"""Golden baselines: a run's curves with exact floats, its configuration and the platform it ran on,
in one self-checking JSON file; a matrix's baselines as one set (`results/baselines/<matrix>/`).

A baseline file (`<run name>.json`) holds
  * every per-step series of steps.csv (step, epoch, loss, accuracy, grad_norm, update_norm,
    param_norm, lr, batch_checksum and, under data parallelism, replica_loss_<i>; not step_time_s)
    and of eval.csv, one row per step, floats as their shortest round-trip repr (exact; non-finite
    values as the strings "nan", "inf", "-inf");
  * the run's manifest without what changes from one run to the next (start time, wall times,
    command line, host name), so the configuration can be regenerated and compared;
  * the platform fingerprint (CPU vendor, model and numerics-relevant instruction sets, OS, C
    library, machine, Python) and the run's own (framework versions, determinism switches,
    devices): when both equal the current ones, a rerun must be bitwise equal;
  * optionally the envelope: per series, the spread of 1-ULP-perturbed runs around this one;
  * `sha256`: the SHA-256 of everything else in canonical JSON, so a truncated or edited file is
    refused (naming the file) instead of being compared.

A set (`index.json` next to the files) names the matrix (its definition, to refuse a matrix that
changed since), every run's file and role, the refusals that were expected, and has a SHA-256 too.
Framework-free: reads run folders only.
"""
from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import platform
import shutil
import sys
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from .files import atomic_write_text
from .runner import PROJECT_ROOT, BadInput
from .runs import COMPARABILITY, EVAL_SERIES, SERIES, STEP_SERIES, Run, load_run

SCHEMA = 1
TOOL = "duipai baseline"


def _default_baselines() -> Path:
    """The committed baselines of a source checkout (editable install); installed from a wheel there are
    none, so results/baselines under the user's working directory, like the default --out."""
    committed = PROJECT_ROOT / "results" / "baselines"
    return committed if (PROJECT_ROOT / "pyproject.toml").is_file() and committed.is_dir() else Path("results/baselines")


BASELINES_DIR = _default_baselines()
INDEX = "index.json"
SKIP_COLUMNS = ("step_time_s",)                      # timing, not numerics
VOLATILE_MANIFEST = ("started", "wall_s", "train_wall_s", "command")
# instruction sets whose presence changes which kernels a framework picks (and so its rounding)
NUMERIC_CPU_FLAGS = ("sse2", "sse3", "pni", "ssse3", "sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f",
                     "avx512dq", "avx512bw", "avx512vl", "avx512cd", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                     "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "sve2", "neon")
# series in the order a first difference is reported at equal steps
ORDER = ("batch_checksum",) + STEP_SERIES + ("epoch",)


class BaselineError(BadInput):
    """A missing, unreadable, corrupt or stale baseline: exit 2, naming the file."""


class BaselineMismatch(AssertionError):
    """A run that does not match its baseline (raised by harness.testing)."""


# --------------------------------------------------------------------------- exact series
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


def _float(text: str) -> float:
    return float(text)          # 'nan', 'inf', '-inf' included


def _typed(col: str, values: list[Any]) -> np.ndarray:
    if col in ("step", "epoch"):
        return np.asarray([int(v) for v in values], np.int64)
    if col == "batch_checksum":
        return np.asarray([str(v).encode() for v in values], dtype=bytes)
    return np.asarray([_float(v) if isinstance(v, str) else float(v) for v in values], np.float64)


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
        return {c: _typed(c, v) for c, v in out.items() if c not in SKIP_COLUMNS}
    except ValueError as e:
        raise BadInput(f"{path}: {e}") from None


def read_series(folder: Path) -> Series:
    """The exact numbers of a complete run folder (steps.csv and eval.csv)."""
    return Series(_read_csv_exact(Path(folder) / "steps.csv"), _read_csv_exact(Path(folder) / "eval.csv"))


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


# --------------------------------------------------------------------------- fingerprints
def _cpuinfo() -> dict[str, str]:
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if ":" not in line:
                    if info:
                        break       # the first processor is enough
                    continue
                k, v = (x.strip() for x in line.split(":", 1))
                info.setdefault(k, v)
    except OSError:
        pass
    return info


def platform_fingerprint() -> dict[str, Any]:
    """What, besides the frameworks, decides whether two runs can be bitwise equal."""
    cpu = _cpuinfo()
    flags = set((cpu.get("flags") or cpu.get("Features") or "").split())
    libc = " ".join(x for x in platform.libc_ver() if x)
    return {"machine": platform.machine(), "system": platform.system(), "libc": libc or None,
            "python": platform.python_version(), "byteorder": sys.byteorder,
            "cpu_vendor": cpu.get("vendor_id") or cpu.get("CPU implementer") or None,
            "cpu_model": cpu.get("model name") or platform.processor() or None,
            "cpu_flags": sorted(f for f in NUMERIC_CPU_FLAGS if f in flags)}


def run_fingerprint(manifest: dict[str, Any]) -> dict[str, Any]:
    """The run's own part: framework versions, determinism switches, devices (from its manifest)."""
    return {"versions": manifest.get("versions") or {}, "determinism": manifest.get("determinism") or {},
            "devices": manifest.get("devices") or []}


def fingerprint_changes(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Readable differences: 'tensorflow 2.21.0 -> 2.22.0', 'cpu_flags +avx512f', ..."""
    out = []
    for k in sorted(set(old) | set(new), key=str):
        a, b = old.get(k), new.get(k)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            out += fingerprint_changes(a, b, "" if k == "versions" else f"{prefix}{k}.")
        elif isinstance(a, list) and isinstance(b, list) and k == "cpu_flags":
            plus, minus = sorted(set(b) - set(a)), sorted(set(a) - set(b))
            out.append(f"{prefix}cpu_flags " + " ".join([f"+{x}" for x in plus] + [f"-{x}" for x in minus]))
        else:
            out.append(f"{prefix}{k} {_short(a)} -> {_short(b)}")
    return out


def _short(v: Any) -> str:
    s = "(none)" if v is None else (v if isinstance(v, str) else json.dumps(v, default=str))
    return s if len(s) <= 60 else s[:57] + "..."


# --------------------------------------------------------------------------- the file format
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


def _untable(t: Any, where: str) -> dict[str, np.ndarray]:
    if not isinstance(t, dict) or not isinstance(t.get("columns"), list) or not isinstance(t.get("rows"), list):
        raise ValueError(f"{where}: needs 'columns' and 'rows'")
    cols = t["columns"]
    if "step" not in cols:
        raise ValueError(f"{where}: no 'step' column")
    for i, r in enumerate(t["rows"]):
        if not isinstance(r, list) or len(r) != len(cols):
            raise ValueError(f"{where}: row {i} has {len(r) if isinstance(r, list) else '?'} values, "
                             f"the columns {len(cols)}")
    return {c: _typed(c, [r[j] for r in t["rows"]]) for j, c in enumerate(cols)}


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


def _corrupt(path: Path, why: str) -> BaselineError:
    return BaselineError(f"{path}: corrupt baseline: {why}; regenerate it with `duipai check --update` "
                         "(or restore it from git)")


def _load_checked(p: Path, kind: str, missing: str) -> dict[str, Any]:
    """A self-checking duipai JSON document (tool, schema, sha256 of its content), or BaselineError
    naming the file and what is wrong with it. Shared by baseline files and the set's index."""
    if not p.is_file():
        raise BaselineError(f"{p}: {missing}")
    try:
        doc = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise _corrupt(p, f"unreadable ({e})") from None
    except json.JSONDecodeError as e:
        raise _corrupt(p, f"not valid JSON ({e}; truncated?)") from None
    if not isinstance(doc, dict) or doc.get("tool") != TOOL or "sha256" not in doc:
        raise _corrupt(p, f"not a duipai {kind} (no 'tool'/'sha256')")
    if doc.get("schema") != SCHEMA:
        raise BaselineError(f"{p}: baseline schema {doc.get('schema')!r}, this duipai reads {SCHEMA}; "
                            "regenerate it with `duipai check --update`")
    try:
        ok = digest(doc) == doc["sha256"]
    except (TypeError, ValueError) as e:
        raise _corrupt(p, f"unencodable content ({e})") from None
    if not ok:
        raise _corrupt(p, "its content does not match its sha256 (edited or damaged)")
    return doc


def load_baseline(path: str | Path) -> Baseline:
    """A validated baseline file, or BaselineError naming the file and the problem."""
    p = Path(path)
    doc = _load_checked(p, "baseline file", "missing baseline file (restore it from git, or regenerate the set "
                                            "with `duipai check --update`)")
    try:
        for k in ("run", "manifest", "fingerprint", "steps", "eval"):
            if k not in doc:
                raise ValueError(f"missing field '{k}'")
        s = Series(_untable(doc["steps"], "steps"), _untable(doc["eval"], "eval"))
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
        raise _corrupt(p, str(e)) from None
    return Baseline(p, doc, s)


# --------------------------------------------------------------------------- comparing
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


def config_mismatches(base_manifest: dict[str, Any], manifest: dict[str, Any]) -> list[str]:
    """The comparability fields (model spec, data, batch order, initial weights, hyper-parameters)
    that differ: a baseline of another configuration."""
    return [f"{f} {base_manifest.get(f)} -> {manifest.get(f)}" for f in COMPARABILITY
            if base_manifest.get(f) != manifest.get(f)]


def same_platform(base: dict[str, Any], manifest: dict[str, Any], platform_fp: dict[str, Any]) -> list[str]:
    """[] when a rerun must be bitwise equal to the baseline; else why not (the differences)."""
    return (fingerprint_changes(base.get("platform", {}), platform_fp)
            + fingerprint_changes(base.get("run", {}), run_fingerprint(manifest)))


def spread_envelope(ref: Run, spread: dict[str, list[Any]], rule=None):
    """The envelope (harness.envelope) of a stored spread around `ref`."""
    from .envelope import DEFAULT_RULE, envelope_of, quantum
    rule = rule or DEFAULT_RULE
    out = {}
    for c in SERIES:
        d = np.asarray([_float(x) if isinstance(x, str) else float(x) for x in spread[c]], np.float64)
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


# --------------------------------------------------------------------------- sets
def matrix_definition(m: Any) -> dict[str, Any]:
    """What a matrix computes (not its description, timeout or file): compared on every check."""
    keys = ("models", "backends", "devices", "seeds", "optimizers", "faults", "data", "steps", "batch_size",
            "reference", "envelope_k", "envelope_fp64", "hparams")
    return {k: getattr(m, k) for k in keys}


def _rel(p: str | Path) -> str:
    try:
        return str(Path(p).resolve().relative_to(PROJECT_ROOT))
    except ValueError:
        return str(p)


@dataclass
class BaselineSet:
    folder: Path
    index: dict[str, Any]
    runs: dict[str, Baseline] = field(default_factory=dict)

    @property
    def unsupported(self) -> dict[str, str]:
        return {u["name"]: u.get("message", "") for u in self.index.get("unsupported", [])}


def set_folder(root: Path, matrix_name: str) -> Path:
    return Path(root) / matrix_name


def load_index(folder: Path) -> dict[str, Any]:
    p = folder / INDEX
    idx = _load_checked(p, "baseline index", f"missing: no baselines for this matrix in {folder} (create them "
                                             f"with `duipai baseline save --matrix {folder.name}`)")
    if not isinstance(idx.get("runs"), list) or not all(isinstance(r, dict) and "name" in r and "file" in r
                                                        for r in idx["runs"]):
        raise _corrupt(p, "'runs' must list {name, file}")
    return idx


def load_set(folder: Path, *, strict: bool = True) -> tuple[BaselineSet, list[BaselineError]]:
    """Every baseline of a set, validated. strict: raise the first problem; else collect them."""
    folder = Path(folder)
    idx = load_index(folder)
    bs = BaselineSet(folder, idx)
    errors: list[BaselineError] = []
    for r in idx["runs"]:
        p = folder / r["file"]
        try:
            b = load_baseline(p)
            if b.name != r["name"]:
                raise _corrupt(p, f"holds run {b.name!r}, the index says {r['name']!r}")
            if r.get("sha256") and b.doc["sha256"] != r["sha256"]:
                raise _corrupt(p, f"its sha256 is not the one {folder / INDEX} lists (a file from another save?)")
            bs.runs[r["name"]] = b
        except BaselineError as e:
            if strict:
                raise
            errors.append(e)
    return bs, errors


def write_set(folder: Path, matrix: Any, docs: dict[str, dict[str, Any]], unsupported: dict[str, str],
              platform_fp: dict[str, Any]) -> None:
    """Replace the whole set at once: files written (atomically) into a fresh folder, then swapped in;
    a reader sees the old set or the new one."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".tmp-{folder.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        runs = []
        for name, doc in docs.items():
            text = render(doc)
            atomic_write_text(tmp / f"{name}.json", text)
            runs.append({"name": name, "file": f"{name}.json", "role": doc.get("role"),
                         "backend": doc["manifest"].get("backend"), "sha256": json.loads(text)["sha256"]})
        idx = {"schema": SCHEMA, "tool": TOOL, "matrix": {"name": matrix.name, "source": _rel(matrix.source),
                                                          "definition": matrix_definition(matrix)},
               "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "platform": platform_fp, "runs": runs,
               "unsupported": [{"name": n, "message": m} for n, m in sorted(unsupported.items())]}
        atomic_write_text(tmp / INDEX, json.dumps(dict(idx, sha256=digest(idx)), indent=1) + "\n")
        if folder.exists():
            old = folder.parent / f".old-{folder.name}-{os.getpid()}"
            os.replace(folder, old)
            os.replace(tmp, folder)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def set_changes(old: BaselineSet | None, old_errors: list[BaselineError], new_docs: dict[str, dict[str, Any]],
                new_platform: dict[str, Any]) -> list[str]:
    """What an update changes: runs added and removed, per run the series that moved (max |diff|,
    points) or 'bitwise unchanged', fingerprint changes."""
    lines: list[str] = []
    for e in old_errors:
        lines.append(f"replacing an unreadable baseline: {str(e).split(';')[0]}")
    if old is None:
        lines.append(f"new baseline set: {len(new_docs)} runs")
        return lines
    olds = old.runs
    listed = {r["name"] for r in old.index.get("runs", [])}
    for n in sorted(set(new_docs) - listed):
        lines.append(f"added    {n}")
    for n in sorted(listed - set(new_docs)):
        lines.append(f"removed  {n}")
    pch = fingerprint_changes(old.index.get("platform") or {}, new_platform)
    if pch:
        lines.append("platform: " + "; ".join(pch))
    same = 0
    for n in sorted(set(new_docs) & set(olds)):
        doc = new_docs[n]
        new_s = Series(_untable(doc["steps"], "steps"), _untable(doc["eval"], "eval"))
        d = series_diff(olds[n].series, new_s)
        fch = fingerprint_changes(olds[n].fingerprint.get("run", {}), doc["fingerprint"]["run"])
        cfg = config_mismatches(olds[n].manifest, doc["manifest"])
        if d is None and not fch and not cfg:
            same += 1
            continue
        parts = []
        if d is not None:
            parts += [f"{c} max|diff| {x['max_abs']:.3g} ({x['count']}/{x['of']} points)" if "max_abs" in x else
                      f"{c} ({x['count']}/{x['of']} points)" for c, x in d["differing"].items()]
            parts += d["grid"]
        else:
            parts.append("numbers bitwise unchanged")
        if fch:
            parts.append("fingerprint: " + ", ".join(fch))
        if cfg:
            parts.append("configuration: " + ", ".join(cfg))
        lines.append(f"changed  {n}: " + "; ".join(parts))
    if same:
        lines.append(f"unchanged {same} run(s) (bitwise, same fingerprint)")
    return lines


__all__ = ["Baseline", "BaselineError", "BaselineMismatch", "BaselineSet", "Series", "baseline_doc", "load_baseline",
           "load_set", "write_set", "save_baseline", "series_diff", "describe_diff", "platform_fingerprint",
           "run_fingerprint", "fingerprint_changes", "same_platform", "set_changes", "read_series", "load_current",
           "spread_envelope", "merge_envelopes", "BASELINES_DIR"]
