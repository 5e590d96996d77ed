"""The two output formats of `duipai check`: the Markdown summary (printed, and for a CI page) and
JUnit XML (for CI servers)."""
from __future__ import annotations

import socket
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path

from . import matrix as M
from .baseline_set import BaselineSet, rel_path
from .check_judge import ERROR, FAIL, PASS, SKIP, UNJUDGED, Result
from .runner import log_tail

EXIT_NAMES = {0: "pass", 1: "numerical regression", 2: "bad input", 3: "a backend crashed"}


def _md(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def markdown(m: M.Matrix, bs: BaselineSet, results: list[Result], code: int, wall: float,
             faults: dict[str, str]) -> str:
    """The summary: the verdict, the mode of each run and why, a table, then every failure in full."""
    word = "PASS" if code == 0 else f"FAIL (exit {code}: {EXIT_NAMES[code]})"
    counts = {s: sum(r.status == s for r in results) for s in (PASS, FAIL, ERROR, SKIP, UNJUDGED)}
    reused = sum(r.entry.status == "cached" for r in results)
    lines = [f"# duipai check: {m.name}: {word}", "",
             f"Matrix `{m.name}` ({rel_path(m.source)}), baselines `{rel_path(bs.folder)}` (saved "
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
            el.text = "\n".join(r.lines + [log_tail(Path(r.entry.log), 20) if r.entry.log else ""]).strip()
        elif r.status == SKIP:
            ET.SubElement(tc, "skipped", message=r.detail)
        else:
            ET.SubElement(tc, "system-out").text = f"{r.detail}; mode {r.mode} ({r.mode_reason})"
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
