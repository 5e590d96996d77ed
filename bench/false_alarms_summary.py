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
    when = json.loads(f.read_text())["meta"]["when"]
    day = re.search(r"\d{4}-\d{2}-\d{2}", when).group()
    return datetime.strptime(f"{day} {re.findall(r'[0-9]{2}:[0-9]{2}', when)[-1]}", "%Y-%m-%d %H:%M")


def latest_rows(files: list[Path]) -> dict[tuple[str, str], tuple[dict, Path, dict]]:
    """(configuration, candidate) -> (row, file, meta) of the latest judgement."""
    out: dict[tuple[str, str], tuple[dict, Path, dict]] = {}
    for f in sorted(files, key=judged_at):
        doc = json.loads(f.read_text())
        for row in doc["rows"]:
            out[(row["config"], row["candidate"])] = (row, f, doc["meta"])
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
           "## The straight-line models (`python bench/false_alarms.py`, 45 configurations)",
           "", *table(straight), "",
           "## The graph models (`python bench/false_alarms.py --models resnet_tiny mobilenet_tiny convnext_tiny`)",
           "", *table(graph), ""]
    (RESULTS / "false_alarms-summary.md").write_text("\n".join(out))
    print("\n".join(out))


if __name__ == "__main__":
    main()
