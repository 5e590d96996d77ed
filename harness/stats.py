"""`duipai compare --stat`: the chaotic regime, where one pair of runs cannot decide. Several data-order
seeds per backend configuration; each metric at each chosen step is compared between the reference
group and every other group with Welch's t-test (unequal variances), with Cohen's d as effect size
(mean difference over the root mean of the two sample variances). A difference is significant when
p < alpha / (metrics x steps) (Bonferroni over the tests of one group). MLPerf's RCP checker does the
same kind of distribution comparison over seeds (one-sided, olympic mean); here it is two-sided.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from algorithms.contract import MANIFEST_FILE
from algorithms.differences import DIFFERENCES

from .errors import BadInput
from .runs import EVAL_SERIES, SERIES, Run

STAT_FIELDS = ("spec_hash", "data_hash", "base_weights_hash")


def group_label(r: Run) -> str:
    o = r.options.to_dict()
    parts = [r.backend]
    if r.fault:
        parts.append(f"fault={r.fault}")
    for k, default in (("dtype", "float32"), ("devices", 1), ("threads", 1), ("jit", True), ("dropout", "harness")):
        if o.get(k, default) != default:
            parts.append(f"{k}={o.get(k)}")
    if o.get("extra"):
        parts.append("extra=" + json.dumps(o["extra"], sort_keys=True))
    if r.perturb_ulp is not None:
        parts.append(f"ulp={r.perturb_ulp}")
    return " ".join(parts)


def _hp_wo_seed(r: Run) -> dict:
    return {k: v for k, v in (r.manifest.get("hparams") or {}).items() if k != "seed"}


def check_stat_comparable(runs: list[Run], force: bool) -> list[str]:
    forced, ref = [], runs[0]
    for r in runs[1:]:
        diffs = [(f, ref.manifest.get(f), r.manifest.get(f)) for f in STAT_FIELDS if ref.manifest.get(f) != r.manifest.get(f)]
        if _hp_wo_seed(ref) != _hp_wo_seed(r):
            diffs.append(("hparams (other than seed)", _hp_wo_seed(ref), _hp_wo_seed(r)))
        for f, va, vb in diffs:
            msg = f"{f} differs: {ref.name} has {va}, {r.name} has {vb}"
            if not force:
                raise BadInput(msg + " (not the same configuration; --force compares anyway)")
            forced.append(msg)
    return forced


def welch(a: np.ndarray, b: np.ndarray) -> dict[str, Any]:
    """Welch's t-test of b against a, and Cohen's d (b - a over the root mean variance)."""
    from scipy import stats
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    ma, mb = float(a.mean()), float(b.mean())
    va, vb = float(a.var(ddof=1)), float(b.var(ddof=1))
    pooled = math.sqrt((va + vb) / 2)
    if pooled == 0:
        same = ma == mb
        return {"mean_ref": ma, "mean": mb, "sd_ref": 0.0, "sd": 0.0, "t": 0.0 if same else math.copysign(math.inf, mb - ma),
                "df": float(len(a) + len(b) - 2), "p": 1.0 if same else 0.0,
                "d": 0.0 if same else math.copysign(math.inf, mb - ma)}
    t = stats.ttest_ind(b, a, equal_var=False)
    se2a, se2b = va / len(a), vb / len(b)
    df = (se2a + se2b) ** 2 / ((se2a ** 2 / (len(a) - 1) if len(a) > 1 else 0) + (se2b ** 2 / (len(b) - 1) if len(b) > 1 else 0))
    return {"mean_ref": ma, "mean": mb, "sd_ref": math.sqrt(va), "sd": math.sqrt(vb), "t": float(t.statistic),
            "df": float(df), "p": float(t.pvalue), "d": (mb - ma) / pooled}


def value_at(r: Run, metric: str, step: int) -> float:
    g = r.grid(metric)
    if metric not in EVAL_SERIES:
        step = min(step, int(g[-1]))   # the final evaluation step is one past the last training row
    i = int(np.searchsorted(g, step))
    if i >= len(g) or g[i] != step:
        raise BadInput(f"{r.name}: no {metric} at step {step} (has {', '.join(map(str, g[:8]))}"
                       f"{' ...' if len(g) > 8 else ''})")
    return float(r.values[metric][i])


@dataclass
class StatComparison:
    reference_label: str
    groups: dict[str, list[Run]]
    metrics: list[str]
    at: list[int]
    alpha: float
    tests: list[dict[str, Any]]
    verdicts: dict[str, dict[str, Any]]
    forced: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return 1 if any(v["verdict"] == "BUG" for v in self.verdicts.values()) else 0

    def to_dict(self) -> dict[str, Any]:
        return {"schema": 1, "tool": "duipai compare", "mode": "stat", "forced": self.forced, "notes": self.notes,
                "reference_group": self.reference_label, "alpha": self.alpha,
                "bonferroni_tests_per_group": len(self.metrics) * len(self.at),
                "groups": {k: {"runs": [r.name for r in v], "seeds": [r.manifest["hparams"]["seed"] for r in v]}
                           for k, v in self.groups.items()},
                "metrics": self.metrics, "at": self.at, "tests": self.tests, "verdicts": self.verdicts,
                "exit_code": self.exit_code}

    def csv(self) -> str:
        from .compare_output import to_csv
        fields = ["group", "reference_group", "metric", "step", "n_ref", "n", "mean_ref", "mean", "sd_ref", "sd",
                  "t", "df", "p", "d", "significant", "verdict", "forced"]
        rows = [dict(t, verdict=self.verdicts[t["group"]]["verdict"], forced=" | ".join(self.forced)) for t in self.tests]
        return to_csv(rows, fields)


def stat_compare(runs: list[Run], reference: str, metrics: list[str], at: list[int] | None, alpha: float,
                 forced: list[str] | None = None) -> StatComparison:
    bad = [m for m in metrics if m not in SERIES]
    if bad:
        raise BadInput(f"unknown metric(s) {', '.join(bad)}; known: {', '.join(SERIES)}")
    groups: dict[str, list[Run]] = {}
    notes: list[str] = []
    for r in runs:
        lab = group_label(r)
        seeds = [x.manifest["hparams"]["seed"] for x in groups.get(lab, [])]
        if r.manifest["hparams"]["seed"] in seeds:
            notes.append(f"{r.name}: a second run of seed {r.manifest['hparams']['seed']} in group '{lab}', left out")
            continue
        groups.setdefault(lab, []).append(r)
    # the clean group of the reference backend is labelled by the backend alone; else any of its groups
    ref_lab = reference if reference in groups else next((k for k in groups if k.split(" ")[0] == reference), None)
    if ref_lab is None:
        raise BadInput(f"no runs of reference {reference!r}; groups: {', '.join(groups)}")
    small = [f"'{k}' ({len(v)})" for k, v in groups.items() if len(v) < 2]
    if small:
        raise BadInput(f"--stat needs >= 2 seeds per group; too few in {', '.join(small)} (add runs with --seed, "
                       "or --seeds LIST to train them)")
    if len(groups) < 2:
        raise BadInput(f"--stat needs a second group besides '{ref_lab}'")
    if at is None:
        at = [int(groups[ref_lab][0].eval_step[-1])]
    n_tests = len(metrics) * len(at)
    tests, verdicts = [], {}
    for lab, g in groups.items():
        if lab == ref_lab:
            continue
        sig = []
        for m in metrics:
            for t in at:
                a = np.array([value_at(r, m, t) for r in groups[ref_lab]])
                b = np.array([value_at(r, m, t) for r in g])
                nonfinite = not (np.isfinite(a).all() and np.isfinite(b).all())
                if nonfinite:
                    w = {"mean_ref": None, "mean": None, "sd_ref": None, "sd": None, "t": None, "df": None,
                         "p": 0.0 if np.isfinite(a).all() else None, "d": None}
                else:
                    w = welch(a, b)
                row = {"group": lab, "reference_group": ref_lab, "metric": m, "step": t, "n_ref": len(a), "n": len(b),
                       **w, "significant": bool(w["p"] is not None and w["p"] < alpha / n_tests),
                       "non_finite": nonfinite}
                tests.append(row)
                if row["significant"]:
                    sig.append(row)
        declared = sorted({d["id"] for r in g + groups[ref_lab] for d in r.declared})
        if sig:
            worst = min(sig, key=lambda r: r["p"])
            # DECLARED needs evidence that only the lock-step comparison gives (the emulating reference's probes);
            # framework-RNG dropout masks explain no difference of means: that is what this test is for
            movers = [i for i in declared if not (DIFFERENCES.get(i) and DIFFERENCES[i].statistical)]
            v = "INCONCLUSIVE" if movers else "BUG"
            why = (f"{worst['metric']} at step {worst['step']}: mean {worst['mean']!r} vs {worst['mean_ref']!r}, "
                   f"p = {worst['p']:.3g} < {alpha:g}/{n_tests}, d = {worst['d']:.3g}"
                   if worst["mean"] is not None else f"{worst['metric']} at step {worst['step']}: non-finite values")
            if movers:
                why += (f"; declared difference(s) {', '.join(movers)} may cause it, which --stat cannot verify: "
                        "the lock-step comparison (duipai compare) checks them against the emulating reference")
        else:
            ps = [r["p"] for r in tests if r["group"] == lab and r["p"] is not None]
            v, why = "DRIFT", f"no significant difference (smallest p = {min(ps):.3g}, threshold {alpha / n_tests:.3g})"
        verdicts[lab] = {"verdict": v, "reason": why, "declared_differences": declared if sig else [],
                         "runs": [r.name for r in g]}
    return StatComparison(ref_lab, groups, metrics, at, alpha, tests, verdicts, forced or [], notes)


def render_stat(c: StatComparison) -> str:
    lines = [f"FORCED: {f}" for f in c.forced]
    lines.append(f"statistical comparison over seeds; reference group '{c.reference_label}' "
                 f"({len(c.groups[c.reference_label])} seeds); Welch t-test, alpha {c.alpha:g} / {len(c.metrics) * len(c.at)} tests")
    lines.append("")
    lines.append(f"{'group':<36} {'metric':<14} {'step':>6} {'n':>3} {'mean':>12} {'ref mean':>12} {'p':>9} {'d':>8}")
    for t in c.tests:
        f = (lambda x, fmt: "-" if x is None else format(x, fmt))
        lines.append(f"{t['group']:<36} {t['metric']:<14} {t['step']:>6} {t['n']:>3} {f(t['mean'], '12.5g')} "
                     f"{f(t['mean_ref'], '12.5g')} {f(t['p'], '9.3g')} {f(t['d'], '8.3g')}{'  *' if t['significant'] else ''}")
    lines.append("")
    for lab, v in c.verdicts.items():
        lines.append(f"{lab}: {v['verdict']}  {v['reason']}" + (f" (declared: {', '.join(v['declared_differences'])})"
                                                                 if v["declared_differences"] else ""))
    for n in c.notes:
        lines.append(f"note: {n}")
    lines += [f"FORCED: {f}" for f in c.forced]
    return "\n".join(lines)


def ensure_seeds(runs: list[Run], seeds: list[int], root: Path | None, timeout: float | None, log) -> list[Run]:
    """Train the missing seeds of every group (one representative manifest per group), reusing any
    complete folder of the same name and configuration."""
    from algorithms.optim import HParams

    from . import runner
    from .runner import comparability_hashes
    from .runs import config_of, load_run, same_config
    out = list(runs)
    reps: dict[str, Run] = {}
    for r in runs:
        reps.setdefault(group_label(r), r)
    for lab, rep in reps.items():
        have = {r.manifest["hparams"]["seed"] for r in runs if group_label(r) == lab}
        base = Path(root or rep.path.parent)
        for s in seeds:
            if s in have:
                continue
            cfg = config_of(rep.manifest, base, hparams=HParams.from_dict({**rep.manifest["hparams"], "seed": s}))
            prep = runner.prepare(cfg, base)
            folder = base / cfg.default_name(prep.model.name)
            man_path = folder / MANIFEST_FILE
            if man_path.is_file():
                try:
                    if same_config(json.loads(man_path.read_text()), cfg, comparability_hashes(cfg, prep),
                                   runner.code_hash(cfg.backend)):
                        out.append(load_run(folder))
                        continue
                except Exception:
                    pass
            log(f"stat: training {lab} --seed {s} -> {folder}")
            out.append(load_run(runner.execute(cfg, base, folder.name, prepared=prep, timeout=timeout)))
    return out
