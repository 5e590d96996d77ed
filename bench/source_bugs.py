"""Bugs written straight into a wrapper's source (not through `--fault`), as a porting engineer makes them,
and equivalent rewrites that are no bug: would `duipai compare` tell which is which, and say where?

Each mutation is one exact text replacement in one wrapper file of a pristine copy of HEAD (`git archive`).
The candidate backend is trained from that copy, from a folder outside both trees (as a user would), and
compared with a torch reference trained from the unmodified copy (`duipai compare REF CANDIDATE`, the
reference's envelope trained on demand). A bug must be BUG with its expected stage (and layer or parameter
where one is named); a rewrite that computes the same thing must be IDENTICAL or DRIFT.

    python bench/source_bugs.py [--only NAME,...] [-j 2] [--work DIR] [--keep]
        -> bench/results/source_bugs.{md,json}; exit 1 when a verdict is wrong

The fault catalogue (`duipai faults`, the self-test) exercises the seams every wrapper exposes for faults;
these mutations sit elsewhere in the lowering: in the data-parallel loss scaling, an optimizer's constructor,
the evaluation function, BatchNorm's arguments, a pooling divisor, an activation.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
STEPS = 300


@dataclass(frozen=True)
class Mutation:
    name: str
    model: str
    backend: str
    devices: int
    file: str
    old: str
    new: str
    expect: tuple[str, ...]          # the verdicts that are right
    stages: tuple[str, ...] = ()     # a BUG's right stages (empty: any)
    where: str = ""                  # the layer or parameter a BUG must name ("" when none is expected)
    why: str = ""


MUTATIONS = (
    Mutation("tf_dp_loss_per_replica_batch", "cnn2d_2conv_2fc", "tensorflow", 2, "wrappers/tensorflow/parallel.py",
             "global_batch_size=b)", "global_batch_size=b // n)", ("BUG",), ("reduction", "backward"), "",
             "each replica divides its loss by its own batch, then the all-reduce sums: gradients x 2"),
    Mutation("keras_sgd_nesterov_always", "cnn2d_2conv_2fc", "keras-jax", 1, "wrappers/keras/optim.py",
             'nesterov=hp.optimizer == "nesterov")', "nesterov=True)", ("BUG",), ("optimizer",), "",
             "a config copied from another project: Nesterov momentum where plain momentum is asked for"),
    Mutation("jax_eval_label_smoothing", "cnn2d_2conv_2fc", "jax", 1, "wrappers/jax/backend.py",
             "return cross_entropy(logits, y), jnp.mean", "return cross_entropy(logits, y, 0.1), jnp.mean",
             ("BUG",), ("eval",), "", "the training loss's label smoothing leaks into the evaluation loss"),
    Mutation("keras_bn_momentum_torch_convention", "cnn2d_hard", "keras-tensorflow", 1, "wrappers/keras/layers.py",
             "momentum=keras_mom, epsilon=eps", "momentum=1.0 - keras_mom, epsilon=eps", ("BUG",),
             ("forward", "eval"), "bn1",
             "torch's BatchNorm momentum 0.1 handed to Keras, whose momentum is the weight of the old running value"),
    Mutation("jax_bn_eps_keras_default", "cnn2d_hard", "jax", 1, "wrappers/jax/layers.py",
             "            mom, eps = seams.bn_params(o)\n", "            mom, eps = seams.bn_params(o); eps = 1e-3\n",
             ("BUG",), ("forward",), "bn1", "Keras' BatchNorm epsilon default (1e-3) instead of the spec's 1e-5"),
    Mutation("jax_avgpool_counts_padding", "cnn2d_hard", "jax", 1, "wrappers/jax/layers.py",
             "x = num / jnp.asarray(den, x.dtype)", 'x = num / (o["pool"] * o["pool"])', ("BUG",), ("forward",),
             "pool1", "'same' average pooling divided by the window size, padding counted (torch's count_include_pad)"),
    Mutation("tf_gelu_tanh_always", "convnext_tiny", "tensorflow", 1, "wrappers/tensorflow/layers.py",
             'x = gelu(x, o["approximate"])', 'x = gelu(x, "tanh")', ("BUG",), ("forward",), "stage1_gelu",
             "GELU's tanh approximation where the spec asks for the exact erf form"),
    Mutation("jax_relu_rewritten", "cnn2d_2conv_2fc", "jax", 1, "wrappers/jax/layers.py",
             "x = jax.nn.relu(x)", "x = jnp.maximum(x, 0.0)", ("IDENTICAL", "DRIFT"), (), "",
             "no bug: jax.nn.relu written out as a maximum"),
    Mutation("tf_dp_loss_times_reciprocal", "cnn2d_3conv_3fc", "tensorflow", 2, "wrappers/tensorflow/parallel.py",
             "loss = tf.nn.compute_average_loss(per_sample, global_batch_size=b)",
             "loss = tf.reduce_sum(per_sample) * (1.0 / b)", ("IDENTICAL", "DRIFT"), (), "",
             "no bug: the replica's loss scaled by a rounded reciprocal of the global batch instead of divided"),
)


def tree_copy(dest: Path) -> Path:
    """HEAD's tracked files, pristine, in `dest` (what a clone holds)."""
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def harness(tree: Path, args: list[str], cwd: Path, log: Path, timeout: float = 3600) -> int:
    """`python -m harness ARGS` with `tree` first on the path, from `cwd`, output to `log`."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    with log.open("w") as fh:
        return subprocess.run([sys.executable, "-m", "harness", *args], cwd=cwd, env=env, stdout=fh,
                              stderr=subprocess.STDOUT, timeout=timeout).returncode


def run_folder(out: Path) -> Path:
    found = [p.parent for p in out.glob("*/manifest.json")]
    if len(found) != 1:
        raise RuntimeError(f"{out}: expected one run folder, found {len(found)}")
    return found[0]


def judge(m: Mutation, pair: dict) -> tuple[bool, str]:
    """Is the verdict right, and why not."""
    v = pair["verdict"]
    if v not in m.expect:
        return False, f"verdict {v}, expected {'/'.join(m.expect)}"
    if v != "BUG":
        return True, ""
    loc = pair.get("localization") or {}
    if m.stages and loc.get("stage") not in m.stages:
        return False, f"stage {loc.get('stage')}, expected {'/'.join(m.stages)}"
    named = " ".join(str(loc.get(k) or "") for k in ("layer", "parameter", "summary"))
    if m.where and m.where not in named:
        return False, f"localized to {named.strip()!r}, expected {m.where}"
    return True, ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated mutation names (default: all)")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    ap.add_argument("--work", type=Path, default=None, help="work folder (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--results-name", default="source_bugs")
    a = ap.parse_args()
    chosen = [m for m in MUTATIONS if not a.only or m.name in a.only.split(",")]
    unknown = set(filter(None, a.only.split(","))) - {m.name for m in MUTATIONS}
    if unknown:
        print(f"--only: unknown mutation(s) {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    work = a.work or Path(tempfile.mkdtemp(prefix="duipai-source-bugs-"))
    work.mkdir(parents=True, exist_ok=True)
    user_dir = work / "user"                 # the folder the commands are run from: neither tree
    user_dir.mkdir(exist_ok=True)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    t0, load0 = time.time(), os.getloadavg()
    pristine = tree_copy(work / "pristine") if not (work / "pristine").exists() else work / "pristine"
    refs: dict[str, Path] = {}
    rows = []
    for m in chosen:
        if m.model not in refs:
            out = work / f"ref-{m.model}"
            if not any(out.glob("*/manifest.json")):
                shutil.rmtree(out, ignore_errors=True)
                rc = harness(pristine, ["run", "-m", m.model, "-b", "torch", "--steps", str(STEPS), "--out", str(out)],
                             user_dir, work / f"ref-{m.model}.log")
                if rc:
                    raise RuntimeError(f"reference run of {m.model} failed (rc {rc}): {work / f'ref-{m.model}.log'}")
            refs[m.model] = run_folder(out)
        t1 = time.time()
        tree = work / f"tree-{m.name}"
        shutil.rmtree(tree, ignore_errors=True)
        tree_copy(tree)
        src = tree / m.file
        text = src.read_text()
        if text.count(m.old) != 1:
            raise RuntimeError(f"{m.name}: {m.file} holds {text.count(m.old)} copies of the text to replace")
        src.write_text(text.replace(m.old, m.new))
        out = work / f"runs-{m.name}"
        shutil.rmtree(out, ignore_errors=True)
        rc = harness(tree, ["run", "-m", m.model, "-b", m.backend, "--devices", str(m.devices), "--steps", str(STEPS),
                            "--out", str(out)], user_dir, work / f"{m.name}.run.log")
        row = {**{k: v for k, v in asdict(m).items() if k not in ("old", "new")}, "diff": f"- {m.old.strip()}\n+ {m.new.strip()}"}
        if rc:
            row.update(verdict="CRASH", correct=False, problem=f"training failed (rc {rc}), {work / f'{m.name}.run.log'}")
        else:
            rc = harness(tree, ["compare", str(refs[m.model]), str(run_folder(out)), "-j", str(a.jobs), "--out",
                                str(out / "cmp")], user_dir, work / f"{m.name}.cmp.log")
            cand = run_folder(out).name
            pair = next(p for p in json.loads((out / "cmp" / "comparison.json").read_text())["pairs"]
                        if p.get("with_reference") and p["candidate"] == cand)
            ok, problem = judge(m, pair)
            loc = pair.get("localization") or {}
            first = pair.get("first_divergence") or {}
            row.update(verdict=pair["verdict"], exit=rc, stage=loc.get("stage"), summary=loc.get("summary"),
                       first=f"{first.get('series', '')} @ {first.get('step', '')}" if first else "",
                       notes=pair.get("notes") or [], correct=ok, problem=problem)
        row["seconds"] = round(time.time() - t1, 1)
        rows.append(row)
        print(f"{m.name}: {row['verdict']} {row.get('summary') or ''} -> {'ok' if row['correct'] else 'WRONG: ' + row['problem']}"
              f" ({row['seconds']} s)", flush=True)
        if not a.keep:
            shutil.rmtree(tree, ignore_errors=True)
    meta = {"when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": commit,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "load": f"{load0[0]:.1f} -> {os.getloadavg()[0]:.1f}", "seconds": round(time.time() - t0),
            "command": "python bench/source_bugs.py" + (f" --only {a.only}" if a.only else "") + f" -j {a.jobs}"}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{a.results_name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (RESULTS / f"{a.results_name}.md").write_text(render(rows, meta))
    print(render(rows, meta))
    if not a.keep and a.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r["correct"] for r in rows) else 1


def render(rows: list[dict], meta: dict) -> str:
    right = sum(r["correct"] for r in rows)
    lines = [f"# Bugs written into a wrapper's source ({meta['when']}, {meta['machine']}, load {meta['load']}, "
             f"commit {meta['commit']})", "",
             f"`{meta['command']}`: {len(rows)} mutations, {STEPS} steps each, torch reference; "
             f"**{right}/{len(rows)} verdicts right**; {meta['seconds']} s.", "",
             "| mutation | model | backend | the change | expected | verdict | where | first | right |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        exp = "/".join(r["expect"]) + (f" ({'/'.join(r['stages'])}{' ' + r['where'] if r['where'] else ''})"
                                       if r["stages"] else "")
        change = r["diff"].replace("\n", "<br>").replace("|", "\\|")
        lines.append(f"| {r['name']} ({r['why']}) | {r['model']} | {r['backend']}{' dp' + str(r['devices']) if r['devices'] > 1 else ''} "
                     f"| `{change}` | {exp} | {r['verdict']} | {r.get('summary') or ''} | {r.get('first', '')} | "
                     f"{'yes' if r['correct'] else 'NO: ' + r['problem']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
