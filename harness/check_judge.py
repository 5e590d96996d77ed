"""The judge of `duipai check`: one rerun against its golden baseline.

Per run, the mode is chosen and said:
  bitwise   the platform fingerprint and the run's framework versions, determinism switches and
            devices equal the baseline's: every value of every series must be bit-for-bit equal;
            any difference is a regression, reported at its first step and series with both values
            (repr and hex), diagnosed against the envelope (DRIFT: a change of rounding; BUG: of the
            computation, localized).
  envelope  something in the fingerprint differs (e.g. a framework's version): the run is judged by
            the verdict engine (harness/compare.py) with the baseline curve as the reference and the
            envelope of the matrix's 1-ULP runs (the wider of the baseline's and this rerun's).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import matrix as M
from .baseline_file import config_mismatches, merge_envelopes
from .baseline_set import BaselineSet
from .errors import BadInput
from .exact_series import describe_diff, fmt_value, load_current, series_diff
from .fingerprint import platform_fingerprint, same_platform

PASS, FAIL, ERROR, SKIP, UNJUDGED = "PASS", "FAIL", "ERROR", "SKIP", "UNJUDGED"


@dataclass
class Result:
    """One rerun's judgement (a row of the summary, a JUnit testcase)."""
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


def group_key(e: M.Entry) -> tuple:
    """Runs of one configuration (one envelope) share this key."""
    return (e.cfg.model, e.cfg.data, e.cfg.hparams)


def is_reference(e: M.Entry, m: M.Matrix) -> bool:
    """The clean single-device float32 run of the matrix's reference backend."""
    c = e.cfg
    return (e.role == "run" and c.backend == m.reference and c.devices == 1 and c.perturb_ulp is None
            and c.dtype == "float32")


class Judge:
    """Judges each rerun of a matrix against its baseline, and localizes the ones that fail."""

    allow_drift: bool = False     # bitwise mode: a bit change the envelope calls drift is reported, not failed

    def __init__(self, m: M.Matrix, bs: BaselineSet, results: list[Result], runs_dir: Path, mode: str,
                 localize: bool, timeout: float | None, log: Callable[[str], None]):
        self.m, self.bs, self.results, self.runs_dir, self.log = m, bs, results, runs_dir, log
        self.mode, self.localize_on, self.timeout = mode, localize, timeout
        self.platform = platform_fingerprint()
        self._env: dict[tuple, Any] = {}
        self._cur_env: dict[tuple, Any] = {}

    # ---- envelopes, per group of one configuration
    def _members(self, key: tuple) -> tuple[Result | None, list[Result]]:
        ref = next((r for r in self.results if group_key(r.entry) == key and is_reference(r.entry, self.m)), None)
        mem = [r for r in self.results if group_key(r.entry) == key and r.entry.role == "envelope"]
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
            self._env[key] = merge_envelopes(cur_env, base_env)
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
            r.run, series = load_current(Path(e.folder))
        except BadInput as err:
            r.status, r.detail = ERROR, f"unreadable result: {err}"
            return
        if r.baseline in unsup:
            r.status, r.detail = FAIL, (f"ran, but the baseline records a refusal ({unsup[r.baseline]}); "
                                        "if intended: `duipai check --update`")
            return
        b = self.bs.runs[r.baseline]
        why = same_platform(b.fingerprint, r.run.manifest, self.platform)
        mode = self.mode if self.mode != "auto" else ("envelope" if why else "bitwise")
        r.mode = mode
        r.mode_reason = ("; ".join(why) if why else "fingerprint and versions equal the baseline's") \
            if self.mode == "auto" else f"--mode {self.mode}" + (f" ({'; '.join(why)})" if why else "")
        cfg = config_mismatches(b.manifest, r.run.manifest)
        if cfg:
            r.lines.append("the prepared inputs differ from the baseline's: " + ", ".join(cfg))
        env = self.envelope(group_key(e))
        pair = None
        if env is not None:
            from .compare import check_pair
            pair = check_pair(env, b.run(), r.run)
            r.pair, r.verdict = pair, pair.verdict
        if mode == "bitwise":
            r.diff = series_diff(b.series, series)
            if r.diff is None and not cfg:
                r.status, r.detail = PASS, f"bitwise identical ({len(series.steps['step'])} steps, " \
                                           f"{len(series.columns())} series)"
                return
            r.status = FAIL
            r.detail = ("bitwise difference: " + describe_diff(r.diff)) if r.diff else \
                "prepared inputs differ: " + ", ".join(cfg)
            f = (r.diff or {}).get("first")
            if f:
                r.short = (f"bitwise: step {f['step']} {f['series']} {fmt_value(f['baseline'])} -> "
                           f"{fmt_value(f['current'])}; {len(r.diff['differing'])} series differ")
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
            r.detail = first_line(f)

    # ---- localizing a failure
    def localize(self, r: Result) -> None:
        from .compare import BUG, resolve
        from .localize import Localizer
        p = r.pair
        if p is None or p.first is None:
            return
        f = p.first
        r.lines.insert(0, f"envelope verdict: BUG from {first_line(f)}")
        if not self.localize_on:
            r.lines.append("not localized (--no-localize)")
            r.where = "not localized"
            return
        loc = Localizer(self.runs_dir, timeout=self.timeout, log=self.log)
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
        env = self.envelope(group_key(r.entry), current_only=True) or self.envelope(group_key(r.entry))
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
                       f"{q.verdict} from {first_line(q.first, partner.entry.cfg.backend)}")
        r.lines += ["  " + x for x in res.get("lines", [])]
        for n in q.notes:
            r.lines.append(f"  note: {n}")

    def _partner(self, r: Result) -> Result | None:
        key = group_key(r.entry)
        ok = [x for x in self.results if x is not r and x.status == PASS and x.run is not None and x.entry.role == "run"
              and group_key(x.entry) == key and x.entry.cfg.backend != r.entry.cfg.backend and not x.injected]
        ok.sort(key=lambda x: (x.entry.cfg.backend != self.m.reference, x.entry.cfg.devices != r.entry.cfg.devices))
        return ok[0] if ok else None


def _options(man: dict[str, Any]) -> dict[str, Any]:
    return {"options": man.get("options"), "init": man.get("init"), "backend": man.get("backend")}


def _inside(p) -> float:
    return max((c.max_ratio for c in p.checks.values() if math.isfinite(c.max_ratio)), default=0.0)


def first_line(f: dict[str, Any], against: str = "baseline") -> str:
    """One line for the first divergent point of a pair (step, series, both values, factor)."""
    if f["series"] == "batch_checksum":
        return f"step {f['step']} batch_checksum: {f['b_value']} vs {against} {f['a_value']} (a different batch)"
    fac = "inf" if f["factor"] is None or not math.isfinite(f["factor"]) else f"{f['factor']:.3g}x"
    return (f"step {f['step']} {f['series']}: {f['b_value']!r} vs {against} {f['a_value']!r}, "
            f"{fac} the envelope ({f['reason']})" + (f"; also: {', '.join(f['also'])}" if f.get("also") else ""))
