"""Make-style matrix runs: models x backends x device counts x seeds x optimizers (x faults), plus
the reference backend's 1-ULP envelope runs, each keyed by a content hash of everything that
determines its numbers. Up-to-date runs are not rerun; `-j N` runs N backend processes at once;
a crash or hang is recorded with its log and the rest of the matrix completes.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from algorithms.contract import MANIFEST_FILE
from algorithms.documents import parse_document
from algorithms.faults import FAULTS, perturbation
from algorithms.optim import OPTIMIZERS, HParamError, HParams

from . import runner
from .files import atomic_write_text
from .progress import RunsProgress
from .defaults import MATRICES_DIR, REFERENCE
from .errors import BackendFailed, BadInput
from algorithms.contract import RunConfig

LIST_FIELDS = {"models": str, "backends": str, "devices": int, "seeds": int, "optimizers": str, "faults": str}
SCALAR_FIELDS = {"name": str, "data": str, "steps": int, "batch_size": int, "reference": str, "envelope_k": int,
                 "envelope_fp64": bool, "timeout_s": (int, float), "description": str, "arbiter": str}


@dataclass
class Matrix:
    name: str
    models: list[str]
    backends: list[str]
    devices: list[int] = field(default_factory=lambda: [1])
    seeds: list[int] = field(default_factory=lambda: [0])
    optimizers: list[str] = field(default_factory=lambda: ["momentum"])
    faults: list[str] = field(default_factory=list)
    data: str = "digits"
    steps: int = 300
    batch_size: int = 64
    reference: str = REFERENCE
    envelope_k: int = 3
    envelope_fp64: bool = True
    timeout_s: float = 900
    hparams: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    source: str = ""
    arbiter: str = ""               # a backend probed in float64 on every BUG (harness/arbiter.py); "" for none

    def beside(self, path: str) -> str:
        """A relative file path written in the matrix file, as its author means it: beside the matrix file (a
        user's project run from another folder), else from the working directory (where it was looked up before);
        as written when neither holds it (the error then names it)."""
        if not self.source or Path(path).is_absolute():
            return path
        near = Path(os.path.abspath(self.source)).parent / path     # links kept, as runner.user_path keeps them
        return str(near) if near.exists() else path

    def model_spec(self, model: str) -> str:
        """A `models` entry: a built-in name as it is, a model file beside the matrix file when it is there."""
        return self.beside(model) if model.endswith((".toml", ".json")) else model

    def data_spec(self) -> str:
        """`data`: each .csv / .npz file of it beside the matrix file when it is there."""
        return ",".join(self.beside(part) if part.endswith((".csv", ".npz")) else part for part in self.data.split(","))


@dataclass
class Entry:
    """One run of the matrix: its configuration, its role and its folder name."""
    cfg: RunConfig
    name: str
    role: str                       # run | envelope | fault
    key: str = ""
    status: str = "pending"         # cached | ran | failed | unsupported | skipped
    message: str = ""
    folder: str = ""
    log: str = ""
    seconds: float = 0.0
    cached: bool = False            # an earlier refusal of the same key, not asked again

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "role": self.role, "backend": self.cfg.backend, "model": self.cfg.model,
                "devices": self.cfg.devices, "seed": self.cfg.hparams.seed, "optimizer": self.cfg.hparams.optimizer,
                "fault": self.cfg.fault, "perturb_ulp": self.cfg.perturb_ulp, "key": self.key, "status": self.status,
                "message": self.message, "folder": self.folder, "log": self.log, "seconds": round(self.seconds, 2)}


def load_matrix(path: str | Path) -> Matrix:
    """Parse and validate a matrix file; every error names the file, the field and the entry."""
    p = Path(path)
    if not p.suffix:
        p = MATRICES_DIR / f"{path}.toml"
    if not p.is_file():
        known = ", ".join(sorted(q.stem for q in MATRICES_DIR.glob("*.toml")))
        raise BadInput(f"matrix {path}: no such file (built-in matrices: {known})")
    raw = parse_document(p, tomllib.loads, bad=lambda e: BadInput(f"matrix {p}: not valid TOML: {e}"))

    def bad(msg: str) -> BadInput:
        return BadInput(f"matrix {p}: {msg}")

    unknown = set(raw) - set(LIST_FIELDS) - set(SCALAR_FIELDS) - {"hparams"}
    if unknown:
        raise bad(f"unknown field(s) {', '.join(sorted(unknown))}")
    kw: dict[str, Any] = {"source": str(p), "name": raw.get("name", p.stem)}
    for f, typ in LIST_FIELDS.items():
        if f not in raw:
            continue
        v = raw[f]
        if not isinstance(v, list) or not all(isinstance(x, typ) and not isinstance(x, bool) for x in v):
            raise bad(f"field '{f}' must be a list of {typ.__name__}, got {v!r}")
        dups = sorted({x for x in v if v.count(x) > 1}, key=str)
        if dups:
            raise bad(f"field '{f}': duplicate entries {dups}")
        if not v and f != "faults":
            raise bad(f"field '{f}' must not be empty (leave it out for the default)")
        kw[f] = v
    for f, typ in SCALAR_FIELDS.items():
        if f in raw:
            if not isinstance(raw[f], typ) or (isinstance(raw[f], bool) and typ is not bool):
                raise bad(f"field '{f}' has the wrong type: {raw[f]!r}")
            kw[f] = raw[f]
    if "hparams" in raw:
        if not isinstance(raw["hparams"], dict):
            raise bad("[hparams] must be a table")
        kw["hparams"] = raw["hparams"]
    for f in ("models", "backends"):
        if not kw.get(f):
            raise bad(f"field '{f}' is required and must not be empty")
    m = Matrix(**kw)
    validate(m, bad)
    return m


HPARAMS_FROM_FIELDS = {"optimizer": "optimizers", "steps": "steps", "batch_size": "batch_size", "seed": "seeds",
                       "eval_every": "steps", "checkpoint_every": "steps"}


def validate(m: Matrix, bad: Callable[[str], BadInput]) -> None:
    from dataclasses import fields
    from algorithms.spec import SpecError, load_model
    for f, low in (("steps", 1), ("batch_size", 1), ("envelope_k", 0)):
        if getattr(m, f) < low:
            raise bad(f"field '{f}' must be >= {low}, got {getattr(m, f)}")
    if not (math.isfinite(m.timeout_s) and m.timeout_s > 0):    # TOML has nan and inf
        raise bad(f"field 'timeout_s' must be a finite number > 0, got {m.timeout_s}")
    # the name is the matrix's folder under --out: one plain folder name, never a path out of it
    if not runner.is_folder_name(m.name):
        raise bad(f"field 'name' must be a plain folder name (no '/', not '.' or '..'), got {m.name!r}")
    known_hp = {f.name for f in fields(HParams)}
    for k in m.hparams:
        if k in HPARAMS_FROM_FIELDS:
            raise bad(f"[hparams]: '{k}' is set by the matrix field '{HPARAMS_FROM_FIELDS[k]}', not in [hparams]")
        if k not in known_hp:
            raise bad(f"[hparams]: unknown hyper-parameter '{k}'; known: "
                      f"{', '.join(sorted(known_hp - set(HPARAMS_FROM_FIELDS)))}")
    info = runner.backend_info()
    where = {b: "backends" for b in m.backends}
    where.setdefault(m.reference, "reference")
    if m.arbiter:
        where.setdefault(m.arbiter, "arbiter")
    for b, field_name in where.items():
        if b not in info:
            raise bad(f"{field_name}: unknown backend {b!r}; known: {', '.join(info)}")
    if m.arbiter and "float64" not in info[m.arbiter].get("capabilities", []):
        raise bad(f"arbiter: {m.arbiter!r} does not declare float64; the exact computation needs it")
    seen: dict[str, str] = {}
    for name in m.models:
        try:
            spec = load_model(m.model_spec(name))
        except SpecError as e:
            raise bad(f"models: {name!r}: {e}") from None
        if spec.name in seen:   # run folders are named after the model's name: they would collide
            raise bad(f"models: {seen[spec.name]!r} and {name!r} are both model '{spec.name}' (duplicate entries)")
        seen[spec.name] = name
    for o in m.optimizers:
        if o not in OPTIMIZERS:
            raise bad(f"optimizers: unknown optimizer {o!r}; known: {', '.join(OPTIMIZERS)}")
    for f in m.faults:
        if f not in FAULTS and perturbation(f) is None:
            raise bad(f"faults: unknown fault {f!r}; see `duipai faults`")
    for n in m.devices:
        if n < 1 or n > m.batch_size or m.batch_size % n:
            raise bad(f"devices: {n} is impossible with batch_size {m.batch_size} "
                      "(needs 1 <= N <= batch and batch divisible by N)")
    try:
        for o in m.optimizers:
            hparams_for(m, o, m.seeds[0] if m.seeds else 0)
    except (HParamError, TypeError) as e:
        raise bad(f"[hparams]: {e}") from None


def arbiter_of(m: Matrix) -> tuple[str | None, str | None]:
    """The matrix's arbiter when it is installed, else (None, why not) -- said by `duipai all`, never silent."""
    if not m.arbiter:
        return None, None
    missing = runner.backend_info()[m.arbiter]["missing"]
    if missing:
        return None, (f"arbiter {m.arbiter} not installed ({', '.join(missing)}): BUGs are not arbitrated "
                      "by an exact computation")
    return m.arbiter, None


def hparams_for(m: Matrix, optimizer: str, seed: int) -> HParams:
    base = {"lr": 0.05 if optimizer in ("sgd", "momentum", "nesterov") else 1e-3}
    base.update(m.hparams)
    return HParams(optimizer=optimizer, steps=m.steps, batch_size=m.batch_size, seed=seed,
                   eval_every=min(50, m.steps), checkpoint_every=min(50, m.steps), **base)


def expand(m: Matrix) -> list[Entry]:
    """Every run of the matrix, the envelope runs of the reference first (they are the yardstick)."""
    entries: list[Entry] = []
    seen: set[str] = set()

    def add(cfg: RunConfig, role: str) -> None:
        from algorithms.spec import load_model
        name = cfg.default_name(load_model(cfg.model).name)
        if name not in seen:
            seen.add(name)
            entries.append(Entry(cfg, name, role))

    data = m.data_spec()
    for model, opt, seed in itertools.product(map(m.model_spec, m.models), m.optimizers, m.seeds):
        hp = hparams_for(m, opt, seed)
        add(RunConfig(model=model, backend=m.reference, hparams=hp, data=data), "run")
        for k in range(1, m.envelope_k + 1):
            add(RunConfig(model=model, backend=m.reference, hparams=hp, data=data, perturb_ulp=k), "envelope")
        if m.envelope_fp64:   # the float64 member: 1-ULP runs share the reference's rounding (docs/verdict.md)
            add(RunConfig(model=model, backend=m.reference, hparams=hp, data=data, perturb_ulp=1, dtype="float64"),
                "envelope")
        for b, n in itertools.product(m.backends, m.devices):
            add(RunConfig(model=model, backend=b, hparams=hp, data=data, devices=n), "run")
        for b, f in itertools.product(m.backends, m.faults):
            add(RunConfig(model=model, backend=b, hparams=hp, data=data, fault=f), "fault")
    return entries


def run_key(cfg: RunConfig, prep: runner.Prepared) -> str:
    """Content hash of everything that determines a run's numbers."""
    info = runner.backend_info()[cfg.backend]
    blob = {"spec": prep.model.hash(), "data": prep.dataset_meta["hash"], "weights": prep.weights_hash,
            "order": hashlib.sha256(prep.order.tobytes()).hexdigest()[:16], "hparams": cfg.hparams.to_dict(),
            "backend": cfg.backend, "versions": info.get("versions", {}), "sources": runner.sources_hash(info["sources"]),
            "options": {k: getattr(cfg, k) for k in ("threads", "deterministic", "dropout", "fault", "devices",
                                                      "jit", "dtype", "extra")},
            "python": sys.version.split()[0]}
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:20]


def up_to_date(folder: Path, key: str) -> bool:
    try:
        man = json.loads((folder / MANIFEST_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return man.get("status") == "complete" and man.get("run_key") == key


def run_matrix(m: Matrix, out_root: Path, jobs: int = 1, *, force: bool = False,
               log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> list[Entry]:
    """Run (or reuse) every entry of the matrix; writes <out_root>/<name>/matrix.json."""
    out = Path(out_root) / m.name
    try:
        entries = run_entries(expand(m), out, Path(out_root), jobs, force=force, timeout=m.timeout_s, log=log)
    except BadInput as err:   # a configuration the matrix file describes: the file, then what is wrong with it
        raise BadInput(f"matrix {m.source or m.name}: {err}") from None
    write_status(out, m, entries)
    return entries


def run_entries(entries: list[Entry], out: Path, cache_root: Path, jobs: int = 1, *, force: bool = False,
                timeout: float | None = None,
                log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
                live: bool | None = None) -> list[Entry]:
    """Run (or reuse) every entry into out/runs; never raises for one backend's failure. Progress: live
    bars when stderr is a terminal (live=None) or live=True, else one `log` line per finished run."""
    runs = out / "runs"
    out_root = cache_root
    info = runner.backend_info()
    preps: dict[tuple, runner.Prepared] = {}
    for e in entries:
        if info[e.cfg.backend]["missing"]:
            e.status, e.message = "skipped", f"package(s) not installed: {', '.join(info[e.cfg.backend]['missing'])}"
            continue
        pk = (e.cfg.model, e.cfg.data, e.cfg.hparams, e.cfg.perturb_ulp, e.cfg.devices)
        if pk not in preps:  # noqa: SIM401
            preps[pk] = runner.prepare(e.cfg, Path(out_root))
        e.key = run_key(e.cfg, preps[pk])
        e.folder = str(runs / e.name)
        if not force and up_to_date(runs / e.name, e.key):
            e.status = "cached"
    runs.mkdir(parents=True, exist_ok=True)   # after every configuration is prepared: bad input writes nothing
    previous = {}
    try:   # a refusal is a property of the configuration: remembered by key like a result
        previous = {x["name"]: x for x in (load_status(out) or {}).get("entries", [])}
    except (OSError, BadInput, KeyError, TypeError):
        pass
    for e in entries:
        p = previous.get(e.name)
        if e.status == "pending" and not force and p and p.get("status") == "unsupported" and p.get("key") == e.key:
            e.status, e.message, e.log = "unsupported", p.get("message", ""), p.get("log", "")
            e.cached = True
    todo = [e for e in entries if e.status == "pending"]

    def one(e: Entry) -> None:
        t0 = time.time()
        pk = (e.cfg.model, e.cfg.data, e.cfg.hparams, e.cfg.perturb_ulp, e.cfg.devices)
        try:
            runner.execute(e.cfg, runs, e.name, timeout=timeout, prepared=preps[pk], on_progress=bars.started(e.name),
                           manifest_extra={"run_key": e.key, "matrix": out.name, "role": e.role})
            e.status = "ran"
        except BackendFailed as err:
            e.status = "unsupported" if err.unsupported else "failed"
            e.message, e.log = str(err).splitlines()[0], str(err.log or "")
        except BadInput as err:
            e.status, e.message = "failed", str(err)
        e.seconds = time.time() - t0
        bars.finished(e.name, f"{e.status:<11} {e.name} ({e.seconds:.1f} s){' - ' + e.message if e.message else ''}")

    cached = sum(e.status == "cached" for e in entries)
    if cached:
        log(f"{cached} run(s) up to date, {len(todo)} to run")
    with RunsProgress([e.name for e in todo], log, live=live) as bars, \
            ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for f in as_completed([pool.submit(one, e) for e in todo]):
            f.result()
    return entries


def write_status(out: Path, m: Matrix | Any, entries: list[Entry]) -> None:
    atomic_write_text(out / "matrix.json", json.dumps({"matrix": m.name, "source": m.source,
                                                        "entries": [e.to_dict() for e in entries]}, indent=2))


def load_status(out: Path) -> dict[str, Any] | None:
    """A matrix folder's matrix.json (None without one), or BadInput naming the file (hand-edited, truncated)."""
    path = out / "matrix.json"
    if not path.exists():
        return None
    status = parse_document(path, json.loads, bad=lambda e: BadInput(f"{path}: not valid JSON: {e}"))
    if not isinstance(status, dict) or not isinstance(status.get("entries", []), list):
        raise BadInput(f"{path}: not a duipai matrix status (needs a list 'entries')")
    return status


__all__ = ["Matrix", "Entry", "load_matrix", "arbiter_of", "expand", "run_matrix", "run_key", "os"]
