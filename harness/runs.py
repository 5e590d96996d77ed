"""Reading published run folders for comparison: validated series, the comparability check, and the
RunConfig that regenerates a run (for envelope, probe, replay and seed runs).

Framework-free: a run is its folder (manifest.json, steps.csv, eval.csv, checkpoints/).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from algorithms.contract import (EVAL_COLUMNS, EVAL_FILE, EVAL_SERIES, MANIFEST_FILE, STEP_COLUMNS, STEP_SERIES,
                                 STEPS_FILE, RunConfig, RunOptions)
from algorithms.documents import parse_document

from .config_diff import COMPARABILITY
from .errors import BadInput

SERIES = STEP_SERIES + EVAL_SERIES

CHECKSUM_WIDTH = 24   # bytes read per batch_checksum (algorithms.data writes 12 hex digits)


def manifest_options(man: dict[str, Any], where: Path | str) -> RunOptions:
    """A manifest's options as the contract's RunOptions; BadInput naming the file and the field otherwise."""
    try:
        return RunOptions.from_dict(man.get("options") or {})
    except (ValueError, TypeError) as e:
        raise BadInput(f"{where}: options: {e}") from None


@dataclass
class Run:
    path: Path
    manifest: dict[str, Any]
    step: np.ndarray                      # int64 step indices of steps.csv
    values: dict[str, np.ndarray]         # series name -> float64 (step series on `step`, eval on `eval_step`)
    checksum: np.ndarray                  # batch_checksum as bytes, on `step`
    eval_step: np.ndarray
    compared_to: int | None = None        # the last step compared (harness.finite_range.cut); None: every step

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def backend(self) -> str:
        return self.manifest.get("backend", "?")

    @property
    def options(self) -> RunOptions:
        """How the run was computed (the manifest's options; a missing field has its default)."""
        return manifest_options(self.manifest, self.path / MANIFEST_FILE)

    @property
    def steps_trained(self) -> int:
        """The run's number of training steps (its hyper-parameters; else its last row + 1)."""
        return int(self.manifest.get("hparams", {}).get("steps") or (int(self.step[-1]) + 1))

    @property
    def steps_compared(self) -> int:
        """The steps a comparison takes from this run: all it trained, or those before its cut."""
        return self.steps_trained if self.compared_to is None else min(self.steps_trained, self.compared_to + 1)

    @property
    def perturb_ulp(self) -> int | None:
        return (self.manifest.get("init") or {}).get("perturb_ulp_seed")

    @property
    def fault(self) -> str | None:
        return self.manifest.get("fault")

    @property
    def declared(self) -> list[dict[str, Any]]:
        return list(self.manifest.get("declared_differences") or [])

    def grid(self, series: str) -> np.ndarray:
        return self.eval_step if series in EVAL_SERIES else self.step

    def is_clean(self) -> bool:
        """No fault, no perturbation, the default dtype: what a reference should be."""
        return self.fault is None and self.perturb_ulp is None and self.options.dtype == "float32"


def _read_csv(path: Path, columns: tuple[str, ...], what: str) -> pd.DataFrame:
    if not path.is_file():
        raise BadInput(f"{path}: missing ({what} of a run folder)")
    try:   # pandas >= 3 parses shortest-repr floats exactly; an empty field stays '' (a cut line)
        # checksums as fixed-width bytes (3x faster than Python strings on 1e6 rows); a value that
        # fills the width might have been cut: then read them as strings
        df = pd.read_csv(path, dtype={"batch_checksum": f"S{CHECKSUM_WIDTH}"}, keep_default_na=False,
                         na_values=["nan", "-nan", "NaN"])
        if "batch_checksum" in df and len(df) and np.char.str_len(df["batch_checksum"].to_numpy()).max() >= CHECKSUM_WIDTH:
            df = pd.read_csv(path, dtype={"batch_checksum": str}, keep_default_na=False, na_values=["nan", "-nan", "NaN"])
            df["batch_checksum"] = df["batch_checksum"].astype(str).str.encode("utf-8")
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise BadInput(f"{path}: not a readable CSV ({str(e).splitlines()[0]})") from None
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise BadInput(f"{path}: missing column(s) {', '.join(missing)}")
    for c in columns:
        if c == "batch_checksum":
            empty = np.char.str_len(df[c].to_numpy().astype(bytes)) == 0
        elif not pd.api.types.is_numeric_dtype(df[c]):
            col = df[c]
            empty = (col == "").fillna(False).to_numpy(bool)
            bad = (pd.to_numeric(col.where(~empty, "0"), errors="coerce").isna() & col.notna()).to_numpy(bool)
            if bad.any():
                i = int(np.argmax(bad))
                raise BadInput(f"{path}: row {i + 2}, column {c}: {col.iloc[i]!r} is not a number")
        else:
            continue
        if empty.any():
            i = int(np.argmax(empty))
            raise BadInput(f"{path}: row {i + 2} is truncated (no {c} value)")
    if not pd.api.types.is_integer_dtype(df["step"]):
        raise BadInput(f"{path}: the step column holds non-integers")
    return df


def _check_steps(path: Path, steps: np.ndarray) -> None:
    if len(steps) and (np.any(np.diff(steps) <= 0)):
        i = int(np.argmax(np.diff(steps) <= 0))
        raise BadInput(f"{path}: steps are not strictly increasing (step {steps[i]} then {steps[i + 1]})")


def load_run(path: str | Path) -> Run:
    """A complete published train run, or BadInput naming the file and the problem."""
    p = Path(path).resolve()   # backend jobs run in the project root: every path they get is absolute
    if not p.is_dir():
        raise BadInput(f"{p}: not a run folder")
    mp = p / MANIFEST_FILE
    if not mp.is_file():
        raise BadInput(f"{p}: no {MANIFEST_FILE} (not a duipai run folder, or an unfinished run)")
    man = parse_document(mp, json.loads, bad=lambda e: BadInput(f"{mp}: not valid JSON ({e})"))
    if man.get("status") != "complete":
        raise BadInput(f"{p}: manifest status is {man.get('status')!r}, not 'complete'")
    if man.get("kind", "train") != "train":
        raise BadInput(f"{p}: a {man.get('kind')!r} job, not a training run")
    missing = [k for k in COMPARABILITY if k not in man]
    if missing:
        raise BadInput(f"{mp}: missing field(s) {', '.join(missing)}")
    manifest_options(man, mp)
    s = _read_csv(p / STEPS_FILE, STEP_COLUMNS, "per-step series")
    e = _read_csv(p / EVAL_FILE, EVAL_COLUMNS, "evaluation series")
    want = int((man.get("hparams") or {}).get("steps", len(s)))
    if len(s) != want:
        raise BadInput(f"{p / STEPS_FILE}: truncated: {len(s)} rows, the manifest promises {want} steps")
    step = s["step"].to_numpy(np.int64)
    _check_steps(p / STEPS_FILE, step)
    if len(step) and step[0] != 0:
        raise BadInput(f"{p / STEPS_FILE}: starts at step {step[0]}, not 0")
    estep = e["step"].to_numpy(np.int64)
    _check_steps(p / EVAL_FILE, estep)
    if len(estep) and estep[-1] < want:
        raise BadInput(f"{p / EVAL_FILE}: truncated: last evaluation at step {estep[-1]}, the run has {want} steps")
    values = {c: s[c].to_numpy(np.float64) for c in STEP_SERIES}
    values.update({c: e[c].to_numpy(np.float64) for c in EVAL_SERIES})
    return Run(p, man, step, values, s["batch_checksum"].to_numpy().astype(bytes), estep)


def is_run_folder(p: Path) -> bool:
    return (p / MANIFEST_FILE).is_file() and (p / STEPS_FILE).is_file()


def discover(root: Path, skipped: list[str] | None = None) -> list[Path]:
    """The complete train runs directly inside a results folder (hidden folders are the harness's own); a run
    folder whose manifest cannot be read is left out and said in `skipped`."""
    out = []
    for d in sorted(root.iterdir()):
        if d.name.startswith(".") or not d.is_dir() or not is_run_folder(d):
            continue
        try:
            man = json.loads((d / MANIFEST_FILE).read_text())
        except (OSError, ValueError) as e:
            if skipped is not None:
                skipped.append(f"{d.name}: left out, its {MANIFEST_FILE} cannot be read ({type(e).__name__}: {e})")
            continue
        if not isinstance(man, dict):
            if skipped is not None:
                skipped.append(f"{d.name}: left out, its {MANIFEST_FILE} is not a run manifest")
            continue
        if man.get("kind", "train") == "train" and man.get("status") == "complete":
            out.append(d)
    return out


def declared_records(*runs: Run) -> dict[str, dict[str, Any]]:
    """Each difference declared in these runs' manifests (first record of an id wins) -> what it may move:
    `probe_keys` (a regex, or None: nothing), `series` (names), `statistical`, `after_kind`, from the
    catalogue (algorithms/differences.py), else from the manifest's own record. There is no default: a
    record that names no probe keys explains no probe."""
    from algorithms.differences import DIFFERENCES
    out: dict[str, dict[str, Any]] = {}
    for r in runs:
        for d in r.declared:
            if d["id"] in out:
                continue
            c = DIFFERENCES.get(d["id"])
            src = vars(c) if c is not None else d
            pk = src.get("probe_keys")
            out[d["id"]] = {"probe_keys": re.compile(pk) if pk and pk not in (".*", "^.*$") else None,
                            "series": tuple(src.get("series") or ()), "statistical": bool(src.get("statistical")),
                            "after_kind": src.get("after_kind")}
    return out


def movable_keys(a: Run, b: Run, keys: list[str], exclude: set[str] = frozenset()) -> dict[str, list[str]]:
    """Probe key -> the declared differences (of runs a and b, but those in `exclude`) that may move it.
    A difference with `after_kind` does not move the forward probes or step-0 buffers of the layers
    before the first layer of that kind (dropout masks act after the dropout layer)."""
    layers = (a.manifest.get("spec") or {}).get("layers", [])
    out: dict[str, list[str]] = {}
    for i, rec in declared_records(a, b).items():
        if i in exclude or rec["probe_keys"] is None:
            continue
        before: set[str] = set()
        if rec["after_kind"]:
            kinds = [l.get("type", l.get("kind")) for l in layers]
            n = kinds.index(rec["after_kind"]) if rec["after_kind"] in kinds else len(layers)
            before = {l["name"] for l in layers[:n]}
        for k in keys:
            head, _, rest = k.partition("/")
            layer = rest.rsplit(".", 1)[0] if head.startswith("buffer") else rest
            if head in ("forward", "buffer0") and layer in before:
                continue
            if rec["probe_keys"].search(k):
                out.setdefault(k, []).append(i)
    return out


def comparability_key(run: Run) -> tuple:
    return tuple(run.manifest.get(f) for f in COMPARABILITY)


# --------------------------------------------------------------------------- regenerating a configuration
def _data_spec(source: str) -> str:
    """The `--data` argument that reproduces a dataset, from its manifest `source`: only for a run folder
    written before manifests stored their configuration (`config`)."""
    if source.startswith("synthetic(n="):
        return f"synthetic:{source[len('synthetic(n='):].split(',', 1)[0]}"
    if source.startswith(("csv:", "npz:")):
        return source.split(":", 1)[1]
    return source


def model_ref(man: dict[str, Any], root: Path) -> str:
    """A `--model` argument whose spec hash is the manifest's: the model the run was given (a built-in name or
    a file), else the built-in model of that name, else the manifest's own spec written as a model file (JSON)
    into root/.cache (the user's file was edited or removed since)."""
    from algorithms.spec import SpecError, load_model
    for ref in dict.fromkeys([(man.get("config") or {}).get("model"), man.get("model")]):
        try:
            if ref and load_model(ref).hash() == man["spec_hash"]:
                return ref
        except (SpecError, KeyError):
            pass
    if "spec" not in man:
        raise BadInput(f"run {man.get('run')}: model {man.get('model')!r} is not built in and the manifest has no spec")
    from .runner import cache_dir
    path = cache_dir(root) / f"spec-{man['spec_hash']}.json"
    if not path.exists():
        path.write_text(json.dumps(man["spec"], indent=2))
    return str(path)


def config_of(man: dict[str, Any], root: Path, **change: Any) -> RunConfig:
    """The RunConfig that regenerates the run of this manifest (fields in `change` replaced): the manifest's
    stored configuration, its model as a file whose spec hash is the run's."""
    if "config" in man:
        try:
            cfg = RunConfig.from_dict(man["config"])
        except (ValueError, TypeError) as e:
            raise BadInput(f"run {man.get('run')}: manifest field config: {e}") from None
    else:   # a run folder from before configurations were stored
        from algorithms.optim import HParams
        o = RunOptions.from_dict(man.get("options") or {}).to_dict()
        cfg = RunConfig(backend=man["backend"], hparams=HParams.from_dict(man["hparams"]),
                        data=_data_spec(man["data"]["source"]),
                        perturb_ulp=(man.get("init") or {}).get("perturb_ulp_seed"), **o)
    fields = dict(cfg.__dict__, model=model_ref(man, root))
    fields.update(change)
    return RunConfig(**fields)


def check_reproduces(man: dict[str, Any], cfg: RunConfig, prep, what: str) -> None:
    """The prepared inputs of a regenerated configuration must be those of the original run."""
    from .runner import comparability_hashes
    for k, v in comparability_hashes(cfg, prep).items():
        if man.get(k) != v:
            raise BadInput(f"cannot regenerate {what} of run {man.get('run')}: its {k} is {man.get(k)} "
                           f"but the configuration now gives {v} (data or model file changed?)")


def same_config(man: dict[str, Any], cfg: RunConfig, ref_man: dict[str, Any], code: str) -> bool:
    """Whether an existing run folder's manifest is the run `cfg` would produce (for cache reuse): the same
    configuration, made by the same code (`code`: runner.code_hash of the backend now; a run from before a
    change of the wrapper or the framework, or without the hash, is made again)."""
    if man.get("status") != "complete" or man.get("kind", "train") != "train" or man.get("code_hash") != code:
        return False
    if any(man.get(k) != ref_man.get(k) for k in COMPARABILITY):
        return False
    o, want = man.get("options", {}), cfg.options.to_dict()
    return (man.get("backend") == cfg.backend and all(o.get(k) == v for k, v in want.items())
            and (man.get("init") or {}).get("perturb_ulp_seed") == cfg.perturb_ulp)


__all__ = ["Run", "load_run", "discover", "config_of", "same_config", "SERIES", "STEP_SERIES",
           "EVAL_SERIES", "COMPARABILITY"]
