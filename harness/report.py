"""The comparison report: `report/index.html` (self-contained, figures embedded) and `summary.md`.

Built only from files — comparison.json / comparison-steps.csv written by `duipai compare`, the
run folders (steps.csv, manifest.json) and matrix.json — so `duipai report` regenerates it without
training. Every piece of text that comes from a file is escaped.
"""
from __future__ import annotations

import base64
import html
import io
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd

from algorithms.contract import EVAL_FILE, MANIFEST_FILE, STEPS_FILE
from algorithms.documents import parse_document

from .compare_output import declared_apart, declared_where, inside_factor, odd_one_out_line, other_pairs_lines, side_of
from .errors import BadInput
from .files import atomic_write_text
from .matrix import load_status

SERIES = ("loss", "accuracy", "grad_norm", "update_norm", "param_norm", "eval_loss", "eval_accuracy")
COLOURS = {"IDENTICAL": "#cfe8cf", "DRIFT": "#dff0d8", "BUG": "#f2b8b5", "DECLARED": "#fde9b5",
           "INCONCLUSIVE": "#d9d9f3", "DIFFER": "#f6d0cc", "FAILED": "#f2b8b5", "UNSUPPORTED": "#fde9b5",
           "SKIPPED": "#e8e8e8"}


def esc(x: Any) -> str:
    return html.escape("" if x is None else str(x), quote=True)


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def read_comparison(path: Path) -> dict[str, Any]:
    """A comparison.json, or BadInput naming the file: a hand-edited or truncated one is one line, not a traceback."""
    comp = parse_document(path, json.loads, bad=lambda e: BadInput(f"{path}: not valid JSON: {e}"))
    ok = (isinstance(comp, dict) and isinstance(comp.get("reference"), dict) and "run" in comp["reference"]
          and isinstance(comp.get("runs"), list) and isinstance(comp.get("pairs"), list))
    if not ok:
        raise BadInput(f"{path}: not a duipai comparison (needs 'reference.run', 'runs' and 'pairs'); "
                       "rewrite it with `duipai compare`")
    return comp


def find_comparisons(folder: Path) -> list[Path]:
    """Every comparison.json under `folder`, but in runs/, report/ and hidden folders (the harness's own:
    .localize, .failed, .replaced: a run kept aside may hold a comparison written beside it)."""
    def ours(rel: tuple[str, ...]) -> bool:
        return "runs" not in rel[:-1] and "report" not in rel and not any(part.startswith(".") for part in rel)
    return sorted(p for p in folder.rglob("comparison.json") if ours(p.relative_to(folder).parts))


def _short(name: str, ref: str) -> str:
    """The parts of a run name that differ from the reference's (the backend first)."""
    a, b = name.split("__"), ref.split("__")
    keep = [p for i, p in enumerate(a) if i >= len(b) or p != b[i]]
    if len(a) > 1 and (not keep or keep[0] != a[1]):
        keep.insert(0, a[1])          # always name the backend (model__backend__...)
    return " ".join(keep) or name


def _fmt(x: Any, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


# --------------------------------------------------------------------------- figures
def fig_curves(runs: dict[str, Path], title: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 4, figsize=(16, 6.5))
    for ax, s in zip(axes.ravel(), SERIES):
        for label, folder in runs.items():
            src = folder / (EVAL_FILE if s.startswith("eval_") else STEPS_FILE)
            try:
                df = pd.read_csv(src)
            except (OSError, pd.errors.ParserError):
                continue
            if s in df:
                ax.plot(df["step"], df[s], label=label, lw=1, marker="o" if s.startswith("eval_") else None, ms=3)
        ax.set_title(s, fontsize=10)
        if s in ("loss", "grad_norm", "update_norm", "eval_loss"):
            ax.set_yscale("log")
    axes.ravel()[-1].axis("off")
    handles, labels = axes.ravel()[0].get_legend_handles_labels()
    axes.ravel()[-1].legend(handles, labels, loc="center", fontsize=8)
    fig.suptitle(title, fontsize=11)
    return _png(fig)


def fig_differences(steps_csv: Path, comp: dict[str, Any]) -> str | None:
    """|candidate - reference| per step (log axis), the envelope band (margin x envelope) shaded."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    if not steps_csv.exists():
        return None
    df = pd.read_csv(steps_csv)
    margin = comp.get("rule", {}).get("margin", 3.0)
    ref = comp["reference"]["run"]
    fig, axes = plt.subplots(2, 4, figsize=(16, 6.5))
    for ax, s in zip(axes.ravel(), SERIES):
        d = df[df["series"] == s]
        if d.empty:
            ax.axis("off")
            continue
        ax.fill_between(d["step"], 1e-12, (margin * d["envelope"]).clip(lower=1e-12), color="#9ecae1", alpha=0.5,
                        label=f"{margin:g} x envelope", step="mid")
        for col in [c for c in d.columns if c.endswith(":value")]:
            diff = (d[col] - d["reference"]).abs().clip(lower=1e-12)
            ax.plot(d["step"], diff, lw=1, label=_short(col[:-6], ref))
        ax.set_yscale("log")
        ax.set_title(f"|{s} - reference|", fontsize=10)
    axes.ravel()[-1].axis("off")
    handles, labels = axes.ravel()[0].get_legend_handles_labels()
    axes.ravel()[-1].legend(handles, labels, loc="center", fontsize=8)
    fig.suptitle(f"difference from {ref} and the calibrated envelope", fontsize=11)
    return _png(fig)


def fig_timing(runs: dict[str, Path]) -> str | None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = []
    for label, folder in runs.items():
        try:
            t = pd.read_csv(folder / STEPS_FILE, usecols=["step_time_s"])["step_time_s"]
            man = json.loads((folder / MANIFEST_FILE).read_text())
        except (OSError, ValueError):
            continue
        rows.append((label, 1e3 * float(t.iloc[min(10, len(t) - 1):].median()), man.get("options", {}).get("devices", 1)))
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(rows) + 1.2))
    ax.barh([r[0] for r in rows], [r[1] for r in rows], color=["#6baed6" if r[2] == 1 else "#fd8d3c" for r in rows])
    ax.set_xlabel("median step time (ms), first 10 steps excluded; orange: data parallel")
    ax.invert_yaxis()
    return _png(fig)


# --------------------------------------------------------------------------- page
CSS = """body{font-family:system-ui,sans-serif;margin:1.5em;max-width:1400px;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.2em;font-size:13px}td,th{border:1px solid #ccc;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f3f3f3}h1{font-size:22px}h2{font-size:18px;margin-top:1.6em}img{max-width:100%}
.small{color:#666;font-size:12px}code{background:#f6f6f6;padding:0 3px}
.lead{font-size:16px;font-weight:bold;background:#fde9b5;border-left:6px solid #d9822b;padding:.5em .8em}"""


def _verdict_cell(v: str) -> str:
    return f'<td style="background:{COLOURS.get(v, "#fff")}"><b>{esc(v)}</b></td>'


def _place(loc: dict) -> str | None:
    """Where in the stage: the layer or parameter, or the series a `report` localization names."""
    return loc.get("layer") or loc.get("parameter") or ", ".join(loc.get("series") or []) or None


def _series_cell(s: dict[str, Any] | None) -> str:
    if not s:
        return "<td>-</td>"
    if s.get("diverged_step") is not None:
        return (f'<td style="background:{COLOURS["BUG"]}">step {esc(s["diverged_step"])}, '
                f'{esc(_fmt(s.get("factor")))}x</td>')
    if s.get("identical"):
        return f'<td style="background:{COLOURS["IDENTICAL"]}">bitwise</td>'
    return f'<td style="background:{COLOURS["DRIFT"]}">max {esc(_fmt(s.get("max_ratio")))} of env</td>'


def verdict_table(comp: dict[str, Any]) -> str:
    ref = comp["reference"]["run"]
    odd = comp.get("odd_one_out") or {}
    head = "".join(f"<th>{esc(s)}</th>" for s in SERIES)
    rows = []
    for p in comp["pairs"]:
        if not p.get("with_reference"):
            continue
        f = p.get("first_divergence") or {}
        loc = p.get("localization") or {}
        where = " / ".join(esc(x) for x in (loc.get("stage"), _place(loc)) if x)
        series = "".join(_series_cell(p["series"].get(s)) for s in SERIES)
        extra = ""
        if p.get("declared_differences"):
            extra = esc(declared_where(p["declared_differences"], p.get("declared_evidence"))
                        if p["verdict"] == "DECLARED" else "declared: " + ", ".join(p["declared_differences"]))
        if p.get("candidate") in (odd.get("runs") or [odd.get("run")]):
            extra += " odd group" if len(odd.get("runs") or ()) > 1 else " odd one out"
        if p.get("arbiter"):
            extra += (" " if extra else "") + f"<span class=arbiter>{esc(p['arbiter'].get('statement'))}</span>"
        rows.append(f"<tr><td>{esc(_short(p['candidate'], ref))}</td>{_verdict_cell(p['verdict'])}"
                    f"<td>{esc(f.get('step', '-'))}</td><td>{esc(f.get('series', '-'))}</td>"
                    f"<td>{esc(_fmt(f.get('factor')))}</td><td>{where or '-'}</td><td>{extra}</td>{series}</tr>")
    return (f"<table><tr><th>candidate (vs {esc(ref)})</th><th>verdict</th><th>first divergent step</th>"
            f"<th>series</th><th>factor over envelope</th><th>located stage / layer</th><th>notes</th>{head}</tr>"
            + "".join(rows) + "</table>")


def environment_table(folders: list[Path]) -> str:
    rows = []
    for f in folders:
        try:
            m = json.loads((f / MANIFEST_FILE).read_text())
        except (OSError, ValueError):
            continue
        det = ", ".join(f"{k}={v}" for k, v in (m.get("determinism") or {}).items())
        par = m.get("parallel") or {}
        rows.append(f"<tr><td>{esc(f.name)}</td><td>{esc(', '.join(f'{k} {v}' for k, v in m.get('versions', {}).items()))}</td>"
                    f"<td>{esc(', '.join(m.get('devices', [])))}</td><td>{esc(par.get('strategy', ''))}</td>"
                    f"<td class=small>{esc(det)}</td><td>{esc((m.get('host') or {}).get('hostname'))}</td></tr>")
    return ("<table><tr><th>run</th><th>versions</th><th>devices</th><th>parallel</th><th>determinism</th><th>host</th></tr>"
            + "".join(rows) + "</table>")


def declared_table(folders: list[Path]) -> str:
    seen: dict[str, tuple[dict, list[str]]] = {}
    for f in folders:
        try:
            m = json.loads((f / MANIFEST_FILE).read_text())
        except (OSError, ValueError):
            continue
        for d in m.get("declared_differences", []):
            seen.setdefault(d["id"], (d, []))[1].append(m.get("backend", "?"))
    if not seen:
        return "<p>No run declared a semantic difference.</p>"
    rows = "".join(f"<tr><td><code>{esc(i)}</code></td><td>{esc(d['title'])}</td><td>{esc(d['formula'])}</td>"
                   f"<td>{esc(', '.join(sorted(set(b))))}</td></tr>" for i, (d, b) in seen.items())
    return f"<table><tr><th>id</th><th>difference</th><th>formula</th><th>backends</th></tr>{rows}</table>"


def problems_table(status: dict[str, Any] | None) -> str:
    if not status:
        return ""
    bad = [e for e in status.get("entries", []) if e["status"] in ("failed", "unsupported", "skipped")]
    if not bad:
        return ""
    rows = "".join(f"<tr>{_verdict_cell(e['status'].upper())}<td>{esc(e['name'])}</td><td>{esc(e['message'])}</td>"
                   f"<td>{esc(e.get('log', ''))}</td></tr>" for e in bad)
    return ("<h2>Runs that did not complete</h2><table><tr><th>status</th><th>run</th><th>why</th><th>log</th></tr>"
            + rows + "</table>")


def odd_lead(comp: dict[str, Any]) -> tuple[bool, str] | None:
    """The odd-one-out sentence of a comparison.json: (whether it is the reference, the sentence)."""
    ref, backend = comp["reference"]["run"], comp["reference"]["backend"]
    return odd_one_out_line(comp.get("odd_one_out"), ref, lambda n: backend if n == ref else _short(n, ref))


def arbiter_lead(comp: dict[str, Any]) -> list[str]:
    """The arbiter's sentences that lead a comparison (harness/arbiter.py lead_lines): the reference named as
    the side the exact computation does not support, and an arbiter that could not run."""
    return list((comp.get("arbiter") or {}).get("lead") or [])


def arbiter_lines(comp: dict[str, Any]) -> list[str]:
    """Every arbitrated pair's sentence, with what the arbiter did not honour."""
    out = []
    for p in comp["pairs"]:
        a = p.get("arbiter")
        if p.get("with_reference") and a:
            out.append(a.get("statement", ""))
            out += [f"  arbiter ({a.get('backend')}): {x}" for x in a.get("adjusted") or []]
    return out


def _finite(x: Any) -> float:
    return x if isinstance(x, (int, float)) and x == x and abs(x) != float("inf") else 0.0


def other_pairs(comp: dict[str, Any], verbose: bool = False, hint: str = "; -v lists them") -> list[str]:
    """The lines about the pairs without the reference (harness/compare.py other_pairs_lines)."""
    ref = comp["reference"]["run"]
    sides = {_short(p["candidate"], ref): side_of(p["verdict"], p.get("declared_differences") or [],
                                                   p.get("declared_evidence"), p.get("resync"))
             for p in comp["pairs"] if p.get("with_reference")}
    rows = [(_short(p["reference"], ref), _short(p["candidate"], ref), p["verdict"], p.get("first_divergence"),
             inside_factor(p["verdict"], bool(p.get("first_divergence") or p.get("saturated")),
                           max((_finite(c.get("max_ratio")) for c in p.get("series", {}).values()), default=0.0)),
             declared_apart(sides, _short(p["reference"], ref), _short(p["candidate"], ref), p["verdict"]),
             (p.get("resync") or {}).get("agree") is not None)
            for p in comp["pairs"] if not p.get("with_reference")]
    rule = comp.get("rule", {})
    odd = (comp.get("odd_one_out") or {}).get("runs") or []
    group = {_short(n, ref) for n in odd} if len(odd) > 1 else set()
    return other_pairs_lines(rows, rule.get("margin", 3.0) * rule.get("pair_factor", 2.0), verbose, hint, group,
                             sides=sides)


def markdown(folder: Path, verbose: bool = False) -> str:
    """summary.md: per comparison the odd one out first when it is the reference, the verdict table,
    the pairs without the reference (one line when they agree), then the runs that did not complete."""
    folder = Path(folder)
    md = [f"# duipai: {folder.name}", ""]
    for c in find_comparisons(folder):
        comp = read_comparison(c)
        ref = comp["reference"]["run"]
        odd = odd_lead(comp)
        md += [f"## {ref}", ""] + ([f"**WARNING: {comp['range_warning']}**", ""] if comp.get("range_warning") else [])
        md += [x for line in arbiter_lead(comp) for x in (f"**{line}**", "")]
        if odd and odd[0]:
            md += [f"**{odd[1]}**", ""]
        md += ["| candidate | verdict | first step | series | factor | located |", "|---|---|---|---|---|---|"]
        for p in comp["pairs"]:
            if p.get("with_reference"):
                f = p.get("first_divergence") or {}
                loc = p.get("localization") or {}
                where = " / ".join(str(x) for x in (loc.get("stage"), _place(loc)) if x)
                if p["verdict"] == "DECLARED":
                    where = declared_where(p.get("declared_differences") or [], p.get("declared_evidence"))
                md.append(f"| {_short(p['candidate'], ref)} | **{p['verdict']}** | {f.get('step', '-')} | "
                          f"{f.get('series', '-')} | {_fmt(f.get('factor'))} | {where or '-'} |")
        md.append("")
        md += [f"- {x.strip()}" for x in arbiter_lines(comp)] + ([""] if arbiter_lines(comp) else [])
        more = ([odd[1]] if odd and not odd[0] else []) + other_pairs(comp, verbose)
        if more:
            md += ["```", *more, "```", ""]
    status = load_status(folder)
    for e in (status or {}).get("entries", []):
        if e["status"] in ("failed", "unsupported", "skipped"):
            md.append(f"- **{e['status'].upper()}** {e['name']}: {e['message']}")
    return "\n".join(md) + "\n"


def build(folder: Path, out: Path | None = None, verbose: bool = False) -> Path:
    """Write <folder>/report/index.html and summary.md from the comparisons found under `folder`;
    verbose lists every pair without the reference in summary.md (the page always has them, folded)."""
    folder = Path(folder)
    out = out or folder / "report"
    comps = find_comparisons(folder)
    status = load_status(folder)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>duipai report: {esc(folder.name)}</title>"
             f"<style>{CSS}</style></head><body><h1>duipai report: {esc(folder.name)}</h1>"
             f"<p class=small>generated {esc(datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC'))} from "
             f"{esc(folder.resolve())}; regenerate with <code>duipai report {esc(folder)}</code></p>"]
    all_runs: list[Path] = []
    if not comps:
        parts.append("<p><b>No comparison found.</b> Run <code>duipai compare</code> on this folder first.</p>")
    for c in comps:
        comp = read_comparison(c)
        ref = comp["reference"]["run"]
        runs = {(_short(r["run"], ref) if r["run"] != ref else f"{r['backend']} (reference)"): Path(r["path"])
                for r in comp["runs"]}
        all_runs += list(runs.values())
        parts.append(f"<h2>Verdicts: {esc(ref)}</h2>")
        odd = odd_lead(comp)
        if comp.get("range_warning"):   # the reference overflowed: compared up to that step only
            parts.append(f"<p class=lead id=range-warning>WARNING: {esc(comp['range_warning'])}</p>")
        for line in arbiter_lead(comp):
            parts.append(f"<p class=lead id=arbiter>{esc(line)}</p>")
        if odd and odd[0]:
            parts.append(f"<p class=lead id=odd-one-out>{esc(odd[1])}</p>")
        for note in comp.get("forced", []) + comp.get("notes", []):
            parts.append(f"<p><b>Note:</b> {esc(note)}</p>")
        parts.append(verdict_table(comp))
        if odd and not odd[0]:
            parts.append(f"<p id=odd-one-out><b>{esc(odd[1])}</b></p>")
        arb = arbiter_lines(comp)
        if arb:
            parts.append("<h3>Arbiter</h3><pre class=arbiter>" + esc(chr(10).join(arb)) + "</pre>")
        summary, every = other_pairs(comp, hint=""), other_pairs(comp, verbose=True)
        if summary:
            parts.append(f"<p class=pairs>{'<br>'.join(esc(x) for x in summary)}</p>"
                         f"<details><summary>every pair without the reference</summary><pre>"
                         f"{esc(chr(10).join(every))}</pre></details>")
        parts.append(f"<h3>Curves</h3><img alt='curves' src='{fig_curves(runs, ref)}'>")
        diff = fig_differences(c.parent / "comparison-steps.csv", comp)
        if diff:
            parts.append(f"<h3>Differences and envelope</h3><img alt='differences' src='{diff}'>")
        t = fig_timing(runs)
        if t:
            parts.append(f"<h3>Step time</h3><img alt='step time' src='{t}'>")
    parts.append(problems_table(status))
    parts.append("<h2>Declared semantic differences</h2>" + declared_table(all_runs))
    parts.append("<h2>Environment</h2>" + environment_table(all_runs))
    parts.append("</body></html>")
    atomic_write_text(out / "index.html", "\n".join(parts))
    atomic_write_text(out / "summary.md", markdown(folder, verbose))
    return out / "index.html"
