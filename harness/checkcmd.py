"""`duipai check` and `duipai baseline save`: rerun a matrix (the CI matrix by default) and compare
every run with its committed golden baseline (harness/baseline.py).

Per run, the mode is chosen and said:
  bitwise   the platform fingerprint and the run's framework versions, determinism switches and
            devices equal the baseline's: every value of every series must be bit-for-bit equal;
            any difference is a regression, reported at its first step and series with both values
            (repr and hex), diagnosed against the envelope (DRIFT: a change of rounding; BUG: of the
            computation, localized).
  envelope  something in the fingerprint differs (e.g. 'tensorflow 2.21.0 -> 2.22.0'): the run is
            judged by the verdict engine (harness/compare.py) with the baseline curve as the reference
            and the envelope of the matrix's 1-ULP runs (the wider of the baseline's and this rerun's).

Exit: 0 every run matches; 1 a numerical regression; 2 bad input (a missing, corrupt or stale
baseline, a bad matrix, a backend not installed; nothing is run); 3 a backend crashed or was
killed (the rest of the matrix still runs and is reported).
"""
from __future__ import annotations

import json
import math
import socket
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import click

from . import baseline as BL
from . import matrix as M
from . import runner
from .files import atomic_write_text
from .runner import BadInput

PASS, FAIL, ERROR, SKIP, UNJUDGED = "PASS", "FAIL", "ERROR", "SKIP", "UNJUDGED"
EXIT_NAMES = {0: "pass", 1: "numerical regression", 2: "bad input", 3: "a backend crashed"}


def _say(msg: str) -> None:
    click.echo(msg, err=True)


def _fail(msg: str, code: int = runner.EXIT_BAD_INPUT) -> None:
    click.echo(f"duipai: error: {msg}", err=True)
    sys.exit(code)


@dataclass
class Result:
    entry: M.Entry
    baseline: str                   # the baseline's run name (the entry's name without an injected fault)
    injected: str | None = None     # --fault injected into this run
    status: str = PASS
    mode: str = "-"
    mode_reason: str = ""
    detail: str = ""                # one line
    short: str = ""                 # the table's cell (detail when empty)
    lines: list[str] = field(default_factory=list)
    verdict: str | None = None      # the envelope verdict against the baseline (when judged or diagnosed)
    where: str = ""                 # localization summary
    diff: dict[str, Any] | None = None
    run: Any = None                 # harness.runs.Run of this rerun
    pair: Any = None

    def to_dict(self) -> dict[str, Any]:
        e = self.entry
        return {"run": e.name, "baseline": self.baseline, "backend": e.cfg.backend, "role": e.role,
                "devices": e.cfg.devices, "injected_fault": self.injected, "status": self.status, "mode": self.mode,
                "mode_reason": self.mode_reason, "detail": self.detail, "lines": self.lines,
                "envelope_verdict": self.verdict, "localized": self.where, "bitwise_difference": self.diff,
                "run_status": e.status, "seconds": round(e.seconds, 2), "folder": e.folder, "log": e.log}


# --------------------------------------------------------------------------- preparing
def _parse_faults(specs: tuple[str, ...], m: M.Matrix) -> dict[str, str]:
    from algorithms.faults import FAULTS
    out: dict[str, str] = {}
    for s in specs:
        b, sep, f = s.partition(":")
        if not sep or not b or not f:
            raise BadInput(f"--fault {s!r}: expected BACKEND:FAULT (e.g. torch:flatten_no_permute)")
        if b not in m.backends:
            raise BadInput(f"--fault {s!r}: backend {b!r} is not in matrix {m.name} ({', '.join(m.backends)})")
        if f not in FAULTS:
            raise BadInput(f"--fault {s!r}: unknown fault {f!r}; see `duipai faults`")
        if b in out:
            raise BadInput(f"--fault: two faults for backend {b!r}")
        out[b] = f
    return out


def _installed(m: M.Matrix) -> None:
    info = runner.backend_info()
    for b in dict.fromkeys([m.reference] + m.backends):
        if info[b]["missing"]:
            raise BadInput(f"backend {b!r} of matrix {m.name} is not installed (missing {', '.join(info[b]['missing'])}): "
                           "a check needs every backend its baselines hold")


def _entries(m: M.Matrix, faults: dict[str, str]) -> tuple[list[M.Entry], dict[str, tuple[str, str | None]]]:
    """The matrix's entries, faults injected into the 'run' entries of their backends; for each entry
    name: (baseline name, injected fault)."""
    from algorithms.spec import load_model
    out, names = [], {}
    for e in M.expand(m):
        f = faults.get(e.cfg.backend) if e.role == "run" else None
        base = e.name
        if f:
            cfg = replace(e.cfg, fault=f)
            e = M.Entry(cfg, cfg.default_name(load_model(cfg.model).name), e.role)
        out.append(e)
        names[e.name] = (base, f)
    return out, names


def _check_set(m: M.Matrix, bs: BL.BaselineSet, names: dict[str, tuple[str, str | None]]) -> None:
    """The baselines must be of this matrix: the same definition, one baseline per run."""
    idx = BL.INDEX
    old = (bs.index.get("matrix") or {}).get("definition") or {}
    new = json.loads(json.dumps(BL.matrix_definition(m)))
    if old != new:
        ch = [f"{k} {json.dumps(old.get(k))} -> {json.dumps(new.get(k))}" for k in sorted(set(old) | set(new))
              if old.get(k) != new.get(k)]
        raise BL.BaselineError(f"{bs.folder / idx}: the baselines are of another definition of matrix {m.name} "
                               f"({'; '.join(ch)}); regenerate them with `duipai check --update`")
    want = {b for b, _ in names.values()}
    have = set(bs.runs) | set(bs.unsupported)
    missing = sorted(want - have)
    if missing:
        raise BL.BaselineError(f"{bs.folder / (missing[0] + '.json')}: missing: no baseline for run {missing[0]}"
                               + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                               + "; regenerate with `duipai check --update`")
    extra = sorted(have - want)
    if extra:
        raise BL.BaselineError(f"{bs.folder / (extra[0] + '.json')}: baseline of run {extra[0]}, which matrix "
                               f"{m.name} does not have; regenerate with `duipai check --update`")


# --------------------------------------------------------------------------- judging
def _group_key(e: M.Entry) -> tuple:
    return (e.cfg.model, e.cfg.data, e.cfg.hparams)


def _is_reference(e: M.Entry, m: M.Matrix) -> bool:
    c = e.cfg
    return (e.role == "run" and c.backend == m.reference and c.devices == 1 and c.perturb_ulp is None
            and c.dtype == "float32")


class Judge:
    allow_drift: bool = False     # bitwise mode: a bit change the envelope calls drift is reported, not failed

    def __init__(self, m: M.Matrix, bs: BL.BaselineSet, results: list[Result], runs_dir: Path, mode: str,
                 localize: bool, timeout: float | None):
        self.m, self.bs, self.results, self.runs_dir = m, bs, results, runs_dir
        self.mode, self.localize_on, self.timeout = mode, localize, timeout
        self.platform = BL.platform_fingerprint()
        self._env: dict[tuple, Any] = {}
        self._cur_env: dict[tuple, Any] = {}

    # ---- envelopes, per group of one configuration
    def _members(self, key: tuple) -> tuple[Result | None, list[Result]]:
        ref = next((r for r in self.results if _group_key(r.entry) == key and _is_reference(r.entry, self.m)), None)
        mem = [r for r in self.results if _group_key(r.entry) == key and r.entry.role == "envelope"]
        return ref, mem

    def envelope(self, key: tuple, current_only: bool = False):
        from .envelope import compute
        if key not in self._env:
            ref, mem = self._members(key)
            base_env = cur_env = None
            if ref is not None and mem and ref.baseline in self.bs.runs:
                bm = [self.bs.runs[r.baseline].run() for r in mem if r.baseline in self.bs.runs]
                base_env = compute(self.bs.runs[ref.baseline].run(), bm) if bm else None
            if ref is not None and ref.run is not None and not ref.injected:
                cm = [r.run for r in mem if r.run is not None and not r.injected]
                cur_env = compute(ref.run, cm) if cm else None
            self._cur_env[key] = cur_env
            self._env[key] = BL.merge_envelopes(cur_env, base_env)
        return self._cur_env[key] if current_only else self._env[key]

    # ---- one run
    def judge(self, r: Result) -> None:
        e = r.entry
        unsup = self.bs.unsupported
        if e.status == "failed":
            r.status, r.detail = ERROR, f"backend crashed: {e.message}"
            r.lines = [f"log: {e.log}"] if e.log and e.log not in e.message else []
            return
        if e.status in ("unsupported", "skipped"):
            if r.baseline in unsup:
                r.status, r.detail = SKIP, f"refused, as when the baseline was saved: {e.message}"
            else:
                r.status, r.detail = ERROR, f"refused now, but it ran when the baseline was saved: {e.message}"
                r.lines = [f"log: {e.log}"] if e.log else []
            return
        try:
            r.run, series = BL.load_current(Path(e.folder))
        except BadInput as err:
            r.status, r.detail = ERROR, f"unreadable result: {err}"
            return
        if r.baseline in unsup:
            r.status, r.detail = FAIL, (f"ran, but the baseline records a refusal ({unsup[r.baseline]}); "
                                        "if intended: `duipai check --update`")
            return
        b = self.bs.runs[r.baseline]
        why = BL.same_platform(b.fingerprint, r.run.manifest, self.platform)
        mode = self.mode if self.mode != "auto" else ("envelope" if why else "bitwise")
        r.mode = mode
        r.mode_reason = ("; ".join(why) if why else "fingerprint and versions equal the baseline's") \
            if self.mode == "auto" else f"--mode {self.mode}" + (f" ({'; '.join(why)})" if why else "")
        cfg = BL.config_mismatches(b.manifest, r.run.manifest)
        if cfg:
            r.lines.append("the prepared inputs differ from the baseline's: " + ", ".join(cfg))
        env = self.envelope(_group_key(e))
        pair = None
        if env is not None:
            from .compare import check_pair
            pair = check_pair(env, b.run(), r.run)
            r.pair, r.verdict = pair, pair.verdict
        if mode == "bitwise":
            r.diff = BL.series_diff(b.series, series)
            if r.diff is None and not cfg:
                r.status, r.detail = PASS, f"bitwise identical ({len(series.steps['step'])} steps, " \
                                           f"{len(series.columns())} series)"
                return
            r.status = FAIL
            r.detail = ("bitwise difference: " + BL.describe_diff(r.diff)) if r.diff else \
                "prepared inputs differ: " + ", ".join(cfg)
            f = (r.diff or {}).get("first")
            if f:
                r.short = (f"bitwise: step {f['step']} {f['series']} {BL.fmt_value(f['baseline'])} -> "
                           f"{BL.fmt_value(f['current'])}; {len(r.diff['differing'])} series differ")
            if pair is None:
                r.lines.append("no envelope runs in this matrix: not diagnosed")
            elif pair.verdict in ("IDENTICAL", "DRIFT", "INCONCLUSIVE"):
                r.lines.append(f"inside the envelope ({pair.verdict}, largest {_inside(pair):.3g}x the envelope): "
                               "a change of rounding (reordered arithmetic, another kernel), not of the computation; "
                               "if intended: `duipai check --update`")
                if self.allow_drift and r.diff is not None and not cfg:
                    r.status = PASS
                    r.detail = "drift allowed (--allow-drift): " + r.detail
                    r.short = r.short and "drift allowed (--allow-drift): " + r.short
            return
        if pair is None:
            r.status, r.detail = UNJUDGED, ("envelope mode needs the matrix's envelope runs (envelope_k >= 1 or "
                                            "envelope_fp64), and this matrix has none")
            return
        if pair.verdict in ("IDENTICAL", "DRIFT"):
            r.status = PASS
            r.detail = ("bitwise identical" if pair.verdict == "IDENTICAL" else
                        f"DRIFT: inside the envelope (largest {_inside(pair):.3g}x)")
        elif pair.verdict == "INCONCLUSIVE":
            r.status, r.detail = PASS, "INCONCLUSIVE: " + "; ".join(pair.notes)
        else:
            r.status = FAIL
            f = pair.first
            r.detail = _first_line(f)

    # ---- localizing a failure
    def localize(self, r: Result) -> None:
        from .compare import BUG, resolve
        from .localize import Localizer
        p = r.pair
        if p is None or p.first is None:
            return
        f = p.first
        r.lines.insert(0, f"envelope verdict: BUG from {_first_line(f)}")
        if not self.localize_on:
            r.lines.append("not localized (--no-localize)")
            r.where = "not localized"
            return
        loc = Localizer(self.runs_dir, timeout=self.timeout, log=_say)
        b = self.bs.runs[r.baseline]
        if r.injected or _options(b.manifest) != _options(r.run.manifest):
            # the configuration differs from the baseline's: probe both configurations now
            p.localization = loc(p)
            resolve(p, True)
            res = p.localization or {}
            r.where = res.get("summary") or "not localized"
            r.lines.append(f"localized against the baseline's configuration ({p.verdict}):")
            r.lines += ["  " + x for x in res.get("lines", [])]
            if p.verdict == BUG:
                r.verdict = BUG
            return
        # same configuration, different numbers: the code changed. Where does this run now part from a
        # run of another backend that still matches its own baseline?
        partner = self._partner(r)
        if partner is None:
            r.lines.append("not localized: no run of another backend of this configuration matches its baseline")
            r.where = "not localized"
            return
        from .compare import check_pair
        env = self.envelope(_group_key(r.entry), current_only=True) or self.envelope(_group_key(r.entry))
        q = check_pair(env, partner.run, r.run)
        if q.first is None:
            r.lines.append(f"agrees with {partner.entry.name} ({partner.entry.cfg.backend}, which matches its "
                           f"baseline) within the envelope ({q.verdict}): a change shared by both backends "
                           "(harness, algorithms, data) or too small to localize")
            r.where = "not localized (shared change)"
            return
        q.localization = loc(q)
        resolve(q, True)
        res = q.localization or {}
        r.where = res.get("summary") or "not localized"
        r.lines.append(f"against {partner.entry.cfg.backend} ({partner.entry.name}, which matches its baseline): "
                       f"{q.verdict} from {_first_line(q.first, partner.entry.cfg.backend)}")
        r.lines += ["  " + x for x in res.get("lines", [])]
        for n in q.notes:
            r.lines.append(f"  note: {n}")

    def _partner(self, r: Result) -> Result | None:
        key = _group_key(r.entry)
        ok = [x for x in self.results if x is not r and x.status == PASS and x.run is not None and x.entry.role == "run"
              and _group_key(x.entry) == key and x.entry.cfg.backend != r.entry.cfg.backend and not x.injected]
        ok.sort(key=lambda x: (x.entry.cfg.backend != self.m.reference, x.entry.cfg.devices != r.entry.cfg.devices))
        return ok[0] if ok else None


def _options(man: dict[str, Any]) -> dict[str, Any]:
    return {"options": man.get("options"), "init": man.get("init"), "backend": man.get("backend")}


def _inside(p) -> float:
    return max((c.max_ratio for c in p.checks.values() if math.isfinite(c.max_ratio)), default=0.0)


def _first_line(f: dict[str, Any], against: str = "baseline") -> str:
    if f["series"] == "batch_checksum":
        return f"step {f['step']} batch_checksum: {f['b_value']} vs {against} {f['a_value']} (a different batch)"
    fac = "inf" if f["factor"] is None or not math.isfinite(f["factor"]) else f"{f['factor']:.3g}x"
    return (f"step {f['step']} {f['series']}: {f['b_value']!r} vs {against} {f['a_value']!r}, "
            f"{fac} the envelope ({f['reason']})" + (f"; also: {', '.join(f['also'])}" if f.get("also") else ""))


# --------------------------------------------------------------------------- outputs
def exit_code(results: list[Result]) -> int:
    st = {r.status for r in results}
    if ERROR in st:
        return runner.EXIT_CRASH
    if UNJUDGED in st:
        return runner.EXIT_BAD_INPUT
    if FAIL in st:
        return runner.EXIT_BUG
    return runner.EXIT_OK


def _md(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def markdown(m: M.Matrix, bs: BL.BaselineSet, results: list[Result], code: int, wall: float,
             faults: dict[str, str]) -> str:
    word = "PASS" if code == 0 else f"FAIL (exit {code}: {EXIT_NAMES[code]})"
    counts = {s: sum(r.status == s for r in results) for s in (PASS, FAIL, ERROR, SKIP, UNJUDGED)}
    reused = sum(r.entry.status == "cached" for r in results)
    lines = [f"# duipai check: {m.name}: {word}", "",
             f"Matrix `{m.name}` ({BL._rel(m.source)}), baselines `{BL._rel(bs.folder)}` (saved "
             f"{bs.index.get('created', '?')}), {len(results)} runs"
             + (f" ({reused} reused, --reuse)" if reused else "") + f" in {wall:.1f} s: "
             + ", ".join(f"{n} {s}" for s, n in counts.items() if n) + "."]
    if faults:
        lines.append("Injected: " + ", ".join(f"`--fault {b}:{f}`" for b, f in faults.items()) + ".")
    modes: dict[tuple[str, str], list[str]] = {}
    for r in results:
        if r.mode != "-":
            modes.setdefault((r.mode, r.mode_reason), []).append(r.entry.cfg.backend)
    lines.append("")
    for (mode, why), bks in modes.items():
        lines.append(f"- **{mode}** for {len(bks)} run(s) ({', '.join(dict.fromkeys(bks))}): {why}")
    lines += ["", "| run | backend | mode | result | detail | localized |", "|---|---|---|---|---|---|"]
    for r in results:
        res = r.status if r.status != FAIL or r.verdict != "BUG" else "FAIL (BUG)"
        lines.append(f"| {_md(r.entry.name)} | {r.entry.cfg.backend} | {r.mode} | **{res}** | {_md(r.short or r.detail)} | "
                     f"{_md(r.where) or '-'} |")
    bad = [r for r in results if r.status not in (PASS, SKIP)]
    for r in bad:
        lines += ["", f"## {r.status}: {r.entry.name}", ""]
        if r.injected:
            lines.append(f"- fault injected on purpose: `--fault {r.entry.cfg.backend}:{r.injected}` "
                         f"(compared with the clean baseline {r.baseline})")
        lines.append(f"- {r.detail}")
        if r.mode != "-":
            lines.append(f"- mode: {r.mode} ({r.mode_reason})")
        if r.lines:
            lines += ["", "```"] + r.lines + ["```"]
    notes = [r for r in results if r.status == PASS and r.lines]
    for r in notes:
        lines.append(f"- note on {r.entry.name}: " + "; ".join(r.lines))
    return "\n".join(lines) + "\n"


def junit(m: M.Matrix, results: list[Result], wall: float) -> str:
    """JUnit XML (the schema Jenkins, GitLab and GitHub reporters read): one testcase per run; a
    regression is a <failure>, a crash a <error>, an expected refusal <skipped>."""
    counts = {s: sum(r.status == s for r in results) for s in (FAIL, ERROR, SKIP, UNJUDGED)}
    ts = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    root = ET.Element("testsuites", name="duipai check", tests=str(len(results)), failures=str(counts[FAIL]),
                      errors=str(counts[ERROR] + counts[UNJUDGED]), skipped=str(counts[SKIP]), time=f"{wall:.3f}")
    suite = ET.SubElement(root, "testsuite", name=f"duipai check {m.name}", tests=str(len(results)),
                          failures=str(counts[FAIL]), errors=str(counts[ERROR] + counts[UNJUDGED]),
                          skipped=str(counts[SKIP]), time=f"{wall:.3f}", timestamp=ts, hostname=socket.gethostname())
    props = ET.SubElement(suite, "properties")
    ET.SubElement(props, "property", name="matrix", value=str(m.source))
    for r in results:
        tc = ET.SubElement(suite, "testcase", classname=f"duipai.{m.name}.{r.entry.cfg.backend}", name=r.entry.name,
                           time=f"{r.entry.seconds:.3f}")
        body = "\n".join([f"mode: {r.mode} ({r.mode_reason})"] + r.lines)
        if r.status == FAIL:
            el = ET.SubElement(tc, "failure", message=r.detail, type="numerical-regression")
            el.text = body
        elif r.status in (ERROR, UNJUDGED):
            el = ET.SubElement(tc, "error", message=r.detail,
                               type="backend-crash" if r.status == ERROR else "bad-input")
            el.text = "\n".join(r.lines + [runner._log_tail(Path(r.entry.log), 20) if r.entry.log else ""]).strip()
        elif r.status == SKIP:
            ET.SubElement(tc, "skipped", message=r.detail)
        else:
            ET.SubElement(tc, "system-out").text = f"{r.detail}; mode {r.mode} ({r.mode_reason})"
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


# --------------------------------------------------------------------------- the commands
COMMON = [
    click.option("--matrix", "matrix_file", default="ci", show_default=True,
                 help="Matrix name (harness/matrices/NAME.toml) or file."),
    click.option("--baselines", type=click.Path(path_type=Path), default=BL.BASELINES_DIR, show_default=True,
                 help="Baselines root; the set is <baselines>/<matrix name>/."),
    click.option("--out", type=click.Path(path_type=Path), default=Path("results"), show_default=True,
                 help="Results root; the runs go to <out>/<matrix name>/runs/."),
    click.option("-j", "--jobs", type=int, default=1, show_default=True, help="Backend processes at once."),
    click.option("--reuse", is_flag=True, help="Reuse up-to-date runs (same run key) instead of rerunning them."),
]


def common(f):
    for o in reversed(COMMON):
        f = o(f)
    return f


def _run(m: M.Matrix, entries: list[M.Entry], out: Path, jobs: int, reuse: bool) -> Path:
    folder = out / m.name
    M.run_entries(entries, folder, out, jobs, force=not reuse, timeout=m.timeout_s, log=_say)
    M.write_status(folder, m, entries)
    return folder


def _save(m: M.Matrix, entries: list[M.Entry], folder: Path) -> int:
    """Write the set from the runs just made; print what changed. Nothing is written if a run failed."""
    failed = [e for e in entries if e.status in ("failed", "skipped")]
    if failed:
        for e in failed:
            _say(f"FAILED {e.name}: {e.message}" + (f" (log: {e.log})" if e.log else ""))
        _say(f"duipai: error: {len(failed)} run(s) failed: baselines in {BL._rel(folder)} left as they were")
        return runner.EXIT_CRASH
    old, errors = None, []
    try:
        old, errors = BL.load_set(folder, strict=False)
    except BL.BaselineError as e:
        if (folder / BL.INDEX).exists():
            errors = [e]
    platform_fp = BL.platform_fingerprint()
    docs = {e.name: BL.baseline_doc(Path(e.folder), role=e.role, key=e.key, matrix=m.name, platform_fp=platform_fp)
            for e in entries if e.status in ("ran", "cached")}
    unsupported = {e.name: e.message for e in entries if e.status == "unsupported"}
    changes = BL.set_changes(old, errors, docs, platform_fp)
    BL.write_set(folder, m, docs, unsupported, platform_fp)
    click.echo(f"baselines: {BL._rel(folder)} ({len(docs)} runs" + (f", {len(unsupported)} refusals" if unsupported
                                                                      else "") + ")")
    for line in changes:
        click.echo(f"  {line}")
    return runner.EXIT_OK


def _load(matrix_file: str, fault: tuple[str, ...] = ()) -> tuple[M.Matrix, dict[str, str]]:
    m = M.load_matrix(matrix_file)
    faults = _parse_faults(fault, m)
    _installed(m)
    return m, faults


@click.command("check")
@common
@click.option("--update", is_flag=True, help="Rerun and regenerate the baselines; print what changed.")
@click.option("--mode", type=click.Choice(["auto", "bitwise", "envelope"]), default="auto", show_default=True,
              help="auto: bitwise when the fingerprint and versions match the baseline's, else envelope.")
@click.option("--fault", multiple=True, metavar="BACKEND:FAULT",
              help="Inject a catalogued bug into BACKEND's runs (a demonstration: the check must fail).")
@click.option("--junit", "junit_path", type=click.Path(path_type=Path), default=None, help="Write JUnit XML here.")
@click.option("--summary", "summary_path", type=click.Path(path_type=Path), default=None,
              help="Write the Markdown summary here (it is printed too).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON instead of the summary.")
@click.option("--no-localize", is_flag=True, help="Do not run probe jobs to localize a regression.")
@click.option("--allow-drift", is_flag=True,
              help="Bitwise mode: a bit-level change that the envelope calls drift is reported in the summary but "
                   "passes (a gate for real regressions only); without it any changed bit fails.")
@click.option("--timeout", type=float, default=None, help="Kill a localization job after this many seconds.")
def check_cmd(matrix_file: str, baselines: Path, out: Path, jobs: int, reuse: bool, update: bool, mode: str,
              fault: tuple[str, ...], junit_path: Path | None, summary_path: Path | None, as_json: bool,
              no_localize: bool, timeout: float | None, allow_drift: bool) -> None:
    """Rerun a matrix (the CI matrix by default) and compare every run with its golden baseline.

    \b
    Exit 0: every run matches its baseline; 1: a numerical regression; 2: bad input (a missing,
    corrupt or stale baseline, a bad matrix: nothing is run); 3: a backend crashed or was killed.
    Writes <out>/<matrix>/check/{summary.md,junit.xml,check.json}.
    \b
    Examples:
      duipai check -j 2                          the CI matrix against results/baselines/ci/
      duipai check --junit report.xml            and JUnit XML for the CI server
      duipai check --fault jax:flatten_no_permute   a demonstration: exit 1, the BUG localized
      duipai check --update                      rerun, rewrite the baselines, print what changed
    """
    t0 = time.time()
    try:
        m, faults = _load(matrix_file, fault)
        if update and faults:
            raise BadInput("--update with --fault would save a faulty baseline")
        entries, names = _entries(m, faults)
        folder = BL.set_folder(baselines, m.name)
        if update:
            out_folder = _run(m, entries, out, jobs, reuse)
            sys.exit(_save(m, entries, folder))
        bs, _ = BL.load_set(folder)
        _check_set(m, bs, names)
    except BadInput as e:
        _fail(str(e))
    out_folder = _run(m, entries, out, jobs, reuse)
    results = [Result(e, *names[e.name]) for e in entries]
    judge = Judge(m, bs, results, out_folder / "runs", mode, not no_localize, timeout)
    judge.allow_drift = allow_drift
    for r in results:
        judge.judge(r)
    for r in results:
        if r.status == FAIL and r.pair is not None and r.pair.first is not None:
            judge.localize(r)
    code = exit_code(results)
    wall = time.time() - t0
    md = markdown(m, bs, results, code, wall, faults)
    doc = {"schema": 1, "tool": "duipai check", "matrix": m.name, "baselines": str(bs.folder), "exit_code": code,
           "result": EXIT_NAMES[code], "wall_s": round(wall, 2), "injected": faults,
           "platform": judge.platform, "runs": [r.to_dict() for r in results]}
    check_dir = out_folder / "check"
    atomic_write_text(check_dir / "summary.md", md)
    atomic_write_text(check_dir / "junit.xml", junit(m, results, wall))
    atomic_write_text(check_dir / "check.json", json.dumps(doc, indent=1, default=str) + "\n")
    if summary_path:
        atomic_write_text(summary_path, md)
    if junit_path:
        atomic_write_text(junit_path, junit(m, results, wall))
    if as_json:
        click.echo(json.dumps(doc, default=str))
    else:
        click.echo(md.rstrip())
        click.echo(f"\nwritten: {check_dir / 'summary.md'}, {check_dir / 'junit.xml'}, {check_dir / 'check.json'}"
                   + "".join(f", {p}" for p in (summary_path, junit_path) if p))
    sys.exit(code)


@click.group("baseline")
def baseline_group() -> None:
    """Golden baselines of a matrix (results/baselines/<matrix>/): save, show."""


@baseline_group.command("save")
@common
def baseline_save(matrix_file: str, baselines: Path, out: Path, jobs: int, reuse: bool) -> None:
    """Run the matrix and store every run's curves (exact floats), configuration and platform
    fingerprint as its baseline; print what changed against the previous baselines."""
    try:
        m, _ = _load(matrix_file)
        entries, _ = _entries(m, {})
    except BadInput as e:
        _fail(str(e))
    _run(m, entries, out, jobs, reuse)
    sys.exit(_save(m, entries, BL.set_folder(baselines, m.name)))


@baseline_group.command("show")
@click.option("--matrix", "matrix_file", default="ci", show_default=True)
@click.option("--baselines", type=click.Path(path_type=Path), default=BL.BASELINES_DIR, show_default=True)
def baseline_show(matrix_file: str, baselines: Path) -> None:
    """Validate a baseline set (every file's SHA-256) and list its runs and fingerprint."""
    name = Path(matrix_file).stem if Path(matrix_file).suffix else matrix_file
    try:
        m = M.load_matrix(matrix_file)
        name = m.name
    except BadInput:
        pass
    try:
        bs, _ = BL.load_set(BL.set_folder(baselines, name))
    except BadInput as e:
        _fail(str(e))
    click.echo(f"{BL._rel(bs.folder)}: matrix {bs.index['matrix']['name']}, saved {bs.index.get('created')}, "
               f"{len(bs.runs)} runs, every file's sha256 verified")
    click.echo("platform: " + json.dumps(bs.index.get("platform")))
    for n, b in bs.runs.items():
        v = ", ".join(f"{k} {x}" for k, x in b.fingerprint["run"].get("versions", {}).items())
        click.echo(f"  {n:<62} {b.doc.get('role', ''):<9} {v}")
    for n, msg in bs.unsupported.items():
        click.echo(f"  {n:<62} refused: {msg}")


__all__ = ["check_cmd", "baseline_group"]
