"""Where a weight-decay error shows in a resynced step: the update's deviation projected on the update itself (what
the sequential test uses, harness/bias_test.py) and on the parameter. Reads the replays a comparison left under its
.localize folder; trains nothing.

Why: a decay error e moves the update by lr x e x p, along the parameter. Before a BatchNorm a convolution's gradient
is orthogonal to its weight (the loss does not change with the weight's scale), so without decay the update is nearly
orthogonal to the parameter and its own projection does not see the error (measured: cnn2d_hard's MDE for weight
decay is 1e-5 where the models without BatchNorm reach 1e-7, bench/results/mde.md). This measures both projections
on faulted and on clean candidates, so the projection on the parameter can be judged for power and false alarms
before any rule uses it.

Per candidate replay (`replay__<cand>__<tag>__from-<reftag>__<at>`) beside its reference's (`replay__<ref>__<reftag>__<at>`)
and float64 one, every resynced point, every `update0/` key: the deviation's projection on the update (<d, u>/<u, u>)
and on the parameter (<d, p>/(|p| |u|)), in float32 ULPs; the reference's own float32-vs-float64 deviation on the
parameter's direction; a one-sample t-test over the points of H0 |mean| <= max(8, 3 x own) ULP (the per-key test's
null), Bonferroni over the candidate's keys at 0.01. A candidate that declares emulated differences is compared with
the reference's replay computing their formula, as the resync compares it (the change read from the comparison.json
beside the runs); without that file, with the plain reference, and its row says so.

    python bench/update_projection.py DIR/.localize [more .localize folders] [--candidates REGEX]
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from algorithms.contract import split_state  # noqa: E402
from algorithms.params import load_npz  # noqa: E402
from harness.bias_test import (KEY_MARGIN, SEQ_ALPHA, SEQ_DELTA, along_parameter, beyond_null,  # noqa: E402
                               projection)
from harness.probes import EPS32  # noqa: E402
from harness.probe_jobs import change_tag  # noqa: E402

REPLAY = re.compile(r"replay__(.+?)__([0-9a-f]{8})__from-([0-9a-f]{8})__(at.+)$")


def projections(cand: Path, ref: Path, ref64: Path, plain: Path) -> dict[str, dict[str, list[float]]]:
    """Per update key: the candidate's deviation on the update and on the parameter, the reference's own on the
    parameter, one entry per resynced point (ULPs of the update's norm). The states are the plain reference
    replay's (`plain`): every replay of the comparison starts from them."""
    states = json.loads((plain / "worker.json").read_text())["states"]
    out: dict[str, dict[str, list[float]]] = {}
    for i, t in enumerate(sorted(int(s) for s in states)):
        path = Path(states[str(t)])
        path = path if path.is_absolute() else plain / path
        if not path.exists() or not (cand / f"probe-{i}.npz").exists():
            break
        params = split_state(load_npz(path))[0]
        a, b, z = (load_npz(f / f"probe-{i}.npz") for f in (cand, ref, ref64))
        for k in b:
            name = k.split("/", 1)[1] if k.startswith("update0/") else None
            if name is None or k not in a or k not in z or name not in params:
                continue
            # the sequential test's own measures (harness.bias_test), in float32 ULPs
            got = (projection(a[k], b[k]), along_parameter(a[k], b[k], params[name]),
                   abs(along_parameter(b[k], z[k], params[name])))
            if not all(math.isfinite(g) for g in got):
                continue
            row = out.setdefault(name, {"on_update": [], "on_param": [], "own": []})
            for col, g in zip(("on_update", "on_param", "own"), got):
                row[col].append(g / EPS32)
    return out


def judge(rows: dict[str, dict[str, list[float]]]) -> dict:
    """The per-key test on each projection; the key with the smallest p of each."""
    keys = {k: v for k, v in rows.items() if len(v["on_param"]) >= 3}
    thr = SEQ_ALPHA / max(len(keys), 1)
    best = {}
    for proj in ("on_update", "on_param"):
        ps = sorted((beyond_null(np.asarray(v[proj]), max(SEQ_DELTA, KEY_MARGIN * max(v["own"])))[1], k)
                    for k, v in keys.items())
        if ps:
            p, k = ps[0]
            best[proj] = {"key": k, "p": p, "mean": float(np.mean(keys[k][proj])), "significant": p < thr}
    return {"points": max((len(v["on_param"]) for v in keys.values()), default=0), "threshold": thr, **best}


def changes(folder: Path) -> dict[str, str] | None:
    """Candidate run name -> the change tag of the reference its resync was compared with ('' for the plain one),
    from the comparison.json beside the runs whose .localize `folder` is; None without one."""
    for comp in (folder.parent / "comparison.json", folder.parent.parent / "comparison.json"):
        if comp.is_file():
            pairs = json.loads(comp.read_text()).get("pairs") or []
            return {p["candidate"]: change_tag(((p.get("resync") or {}).get("against") or {}).get("change") or {})
                    for p in pairs if p.get("with_reference")}
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path, help=".localize folders of comparisons")
    ap.add_argument("--candidates", default="", help="only candidate run names matching this regular expression")
    a = ap.parse_args()
    print("| candidate | points | on the update: key, mean ULP, p | on the parameter: key, mean ULP, p | threshold |")
    print("|---|---|---|---|---|")
    for folder in a.folders:
        against = changes(folder)
        for cand in sorted(folder.glob("replay__*__from-*")):
            m = REPLAY.match(cand.name)
            if not m or "rows-all" in cand.name or not re.search(a.candidates, m.group(1)):
                continue
            name, _, reftag, at = m.groups()
            tag = (against or {}).get(name, "")
            mid = f"__{tag}" if tag else ""
            ref = [r for r in folder.glob(f"replay__*__{reftag}{mid}__{at}") if "__from-" not in r.name]
            ref64 = list(folder.glob(f"replay__*__{reftag}{mid}__float64__{at}"))
            if not ref or not ref64 or not (ref[0] / "worker.json").exists():
                continue
            # the states are the plain reference's (an emulating replay probes them, it does not write them)
            plain = [r for r in folder.glob(f"replay__*__{reftag}__{at}") if "__from-" not in r.name]
            if not plain or not (plain[0] / "worker.json").exists():
                continue
            got = judge(projections(cand, ref[0], ref64[0], plain[0]))
            if got["points"] < 3:   # a localization's replay of two steps, not a resync
                continue
            if against is None:
                name += " (against the plain reference: no comparison.json)"
            elif tag:
                name += f" (against {tag})"
            cells = [f"{g['key']} {g['mean']:+.1f}, p {g['p']:.2g}" + (" **significant**" if g["significant"] else "")
                     if (g := got.get(proj)) else "-" for proj in ("on_update", "on_param")]
            print(f"| {name} | {got['points']} | {cells[0]} | {cells[1]} | {got['threshold']:.2g} |", flush=True)


if __name__ == "__main__":
    main()
