"""A matrix's golden baselines as one set (`results/baselines/<matrix>/`): an `index.json` next to the
baseline files (harness/baseline_file.py) names the matrix (its definition, to refuse a matrix that
changed since), every run's file and role, the refusals that were expected, and has a SHA-256 too.
The set is replaced as a whole; an update says what changed."""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .baseline_file import SCHEMA, TOOL, Baseline, BaselineError, config_mismatches, corrupt, digest, load_baseline, \
    load_checked, render, untable
from .exact_series import Series, series_diff
from .files import atomic_write_text
from .fingerprint import fingerprint_changes
from .runner import PROJECT_ROOT


def _default_baselines() -> Path:
    """The committed baselines of a source checkout (editable install); installed from a wheel there are
    none, so results/baselines under the user's working directory, like the default --out."""
    committed = PROJECT_ROOT / "results" / "baselines"
    return committed if (PROJECT_ROOT / "pyproject.toml").is_file() and committed.is_dir() else Path("results/baselines")


BASELINES_DIR = _default_baselines()


INDEX = "index.json"


def matrix_definition(m: Any) -> dict[str, Any]:
    """What a matrix computes (not its description, timeout or file): compared on every check."""
    keys = ("models", "backends", "devices", "seeds", "optimizers", "faults", "data", "steps", "batch_size",
            "reference", "envelope_k", "envelope_fp64", "hparams")
    return {k: getattr(m, k) for k in keys}


def rel_path(p: str | Path) -> str:
    """A path as the project shows it: relative to the checkout when inside it."""
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
    """Where the set of a matrix lives under a baselines root."""
    return Path(root) / matrix_name


def load_index(folder: Path) -> dict[str, Any]:
    p = folder / INDEX
    idx = load_checked(p, "baseline index", f"missing: no baselines for this matrix in {folder} (create them "
                                             f"with `duipai baseline save --matrix {folder.name}`)")
    if not isinstance(idx.get("runs"), list) or not all(isinstance(r, dict) and "name" in r and "file" in r
                                                        for r in idx["runs"]):
        raise corrupt(p, "'runs' must list {name, file}")
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
                raise corrupt(p, f"holds run {b.name!r}, the index says {r['name']!r}")
            if r.get("sha256") and b.doc["sha256"] != r["sha256"]:
                raise corrupt(p, f"its sha256 is not the one {folder / INDEX} lists (a file from another save?)")
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
        idx = {"schema": SCHEMA, "tool": TOOL, "matrix": {"name": matrix.name, "source": rel_path(matrix.source),
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
        new_s = Series(untable(doc["steps"], "steps"), untable(doc["eval"], "eval"))
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
