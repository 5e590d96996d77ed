"""The false-alarm matrix over all its runs: one table of verdict counts per configuration, from the results
that bench/false_alarms.py wrote (bench/results/false_alarms*.json), the latest judgement of a pair winning.

A configuration may have been judged more than once (a re-comparison after a rule change, a run stopped and
continued): for every (configuration, candidate) the row of the file with the latest `meta.when` counts. The
straight-line models' 45 configurations and the graph models' are counted apart.

    python bench/false_alarms_summary.py        -> bench/results/false_alarms-summary.md (and prints it)
"""
from __future__ import annotations

import json
import re
from collections import Counter
from datetime import datetime
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
VERDICTS = ("DRIFT", "DECLARED", "IDENTICAL", "BUG", "INCONCLUSIVE")
GRAPH_MODELS = ("resnet_tiny", "mobilenet_tiny", "convnext_tiny")


def judged_at(f: Path) -> datetime:
    """When a results file was judged: its `meta.when` (a date and one or more times: the last one counts)."""
    return judged_at_text(json.loads(f.read_text())["meta"]["when"])


def judged_at_text(when: str) -> datetime:
    day = re.search(r"\d{4}-\d{2}-\d{2}", when).group()
    return datetime.strptime(f"{day} {re.findall(r'[0-9]{2}:[0-9]{2}', when)[-1]}", "%Y-%m-%d %H:%M")


def setting(meta: dict) -> str:
    """What a run changed from the matrix's own settings (300 steps, each optimizer's own learning rate): a
    configuration run otherwise is another configuration, counted in its own row."""
    parts = (["default lr 0.05"] if "--default-lr" in meta.get("command", "") else []) + (
        [f"{meta['steps']} steps"] if meta.get("steps", 300) != 300 else [])
    return f" ({', '.join(parts)})" if parts else ""


def latest_rows(files: list[Path]) -> dict[tuple[str, str], tuple[dict, Path, dict]]:
    """(configuration, candidate) -> (row, file, meta) of the latest judgement; a file's `rejudged` entries
    (the same runs compared again after a rule change, recorded in its .md) count at their own time."""
    judged = []
    for f in files:
        doc = json.loads(f.read_text())
        judged.append((judged_at(f), doc["rows"], f, doc["meta"]))
        for again in doc.get("rejudged", []):
            meta = dict(doc["meta"], when=again["when"], commit=again["commit"])
            judged.append((judged_at_text(again["when"]), again["rows"], f, meta))
    out: dict[tuple[str, str], tuple[dict, Path, dict]] = {}
    for _, rows, f, meta in sorted(judged, key=lambda j: j[0]):
        for row in rows:
            out[(row["config"] + setting(meta), row["candidate"])] = (row, f, meta)
    return out


def table(rows: dict[tuple[str, str], tuple[dict, Path, dict]]) -> list[str]:
    configs = sorted({c for c, _ in rows})
    lines = ["| configuration | pairs | " + " | ".join(VERDICTS) + " | judged by (file, commit) |",
             "|---|---:|" + "---:|" * len(VERDICTS) + "---|"]
    total: Counter = Counter()
    for c in configs:
        mine = [v for (cc, _), v in rows.items() if cc == c]
        n = Counter(r["verdict"] for r, _, _ in mine)
        total.update(n)
        src = sorted({f"{f.name} ({m.get('commit', '?')})" for _, f, m in mine})
        lines.append(f"| {c} | {len(mine)} | " + " | ".join(str(n.get(v, 0)) for v in VERDICTS) + f" | {', '.join(src)} |")
    lines.append(f"| **all {len(configs)}** | **{sum(total.values())}** | "
                 + " | ".join(f"**{total.get(v, 0)}**" for v in VERDICTS) + " | |")
    return lines


def main() -> None:
    files = [f for f in RESULTS.glob("false_alarms*.json") if f.name != "false_alarms-summary.json"]
    rows = latest_rows(files)
    graph = {k: v for k, v in rows.items() if k[0].split("__")[0] in GRAPH_MODELS}
    straight = {k: v for k, v in rows.items() if k not in graph}
    out = ["# The false-alarm matrix, every run together",
           "",
           "`python bench/false_alarms_summary.py`: per configuration (model__optimizer__schedule), the clean pairs with",
           "the reference and their verdicts, each pair as its latest judgement in "
           f"{', '.join(sorted(f'`{f.name}`' for f in files))}.",
           "The commands, machines and loads of each run are in its own file.",
           "",
           "## The straight-line models (`python bench/false_alarms.py`, 45 configurations; a setting in brackets is "
           "a run of one with other settings, counted in its own row)",
           "", *table(straight), "",
           "## The graph models (`python bench/false_alarms.py --models resnet_tiny mobilenet_tiny convnext_tiny`)",
           "", *table(graph), ""]
    (RESULTS / "false_alarms-summary.md").write_text("\n".join(out))
    print("\n".join(out))


if __name__ == "__main__":
    main()
