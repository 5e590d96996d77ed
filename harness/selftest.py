"""`duipai selftest`: inject every catalogued fault into every backend that implements it, run the
drift-only variants, compare each against the clean reference, and write the detection matrix.

A fault is detected when its run is BUG and the localized stage is the catalogue's (and the layer,
where the catalogue names one). A drift-only variant must never be BUG. Exit 1 otherwise.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from algorithms.fault_reach import expected_layer
from algorithms.faults import FAULTS, fault_info
from algorithms.optim import HParams
from algorithms.spec import load_model, model_names

from . import matrix as M
from . import runner
from .compare_runs import compare_folder
from .defaults import REFERENCE
from .errors import EXIT_BUG, EXIT_OK
from .files import atomic_write_text
from .report import find_comparisons
from algorithms.contract import RunConfig


@dataclass(frozen=True)
class Scenario:
    """The hyper-parameters with which a fault bites (or a variant runs): every fault runs at the default
    evaluation cadence, on its scenario's model in the reduced self-test and on every built-in model whose
    layers it touches in the full one (the layer a correct localization names comes from the model:
    `expected_layer`)."""
    model: str = "cnn2d_2conv_2fc"
    optimizer: str = "momentum"
    schedule: str = "constant"
    weight_decay: float = 0.0
    devices: int = 1
    min_steps: int = 1                # a fault that starts late needs the run to get there

    def hparams(self, steps: int) -> HParams:
        lr = 0.05 if self.optimizer in ("sgd", "momentum", "nesterov") else 1e-3
        return HParams(optimizer=self.optimizer, lr=lr, schedule=self.schedule, weight_decay=self.weight_decay,
                       step_size=max(steps // 3, 1), steps=steps, eval_every=min(50, max(steps // 2, 1)),
                       checkpoint_every=min(50, steps // 2))


# a model of the graph layers no built-in model has (leaky_relu, dilation, a channel multiplier, concat), for the
# faults of those layers: algorithms/models/scenarios/, loaded by this name, not listed among the built-in models
GRAPH_SCENARIO = "scenarios/graph_ops_tiny"
SCENARIO_MODELS = (GRAPH_SCENARIO,)

FAULT_SCENARIOS: dict[str, Scenario] = {
    "flatten_no_permute": Scenario(),
    "symmetric_same_padding": Scenario(model="cnn2d_hard"),
    "bn_momentum_flipped": Scenario(model="cnn2d_hard"),
    "bn_eps_keras": Scenario(model="cnn2d_hard"),
    "adam_eps_hat": Scenario(optimizer="adam"),
    "keras_momentum_schedule": Scenario(schedule="step"),
    "l2_not_decoupled": Scenario(optimizer="adamw", weight_decay=0.01),
    "grad_sum_replicas": Scenario(devices=2),
    "overlapping_shards": Scenario(devices=2),
    "data_shift_one_batch": Scenario(),
    "label_smoothing": Scenario(),
    "lr_schedule_off_by_one": Scenario(schedule="step"),
    "dropout_in_eval": Scenario(model="cnn2d_hard"),
    "missing_bias": Scenario(),
    "maxpool_ceil": Scenario(model="cnn2d_hard"),
    "grad_double": Scenario(optimizer="adam"),
    "lr_scale_1.001": Scenario(),
    # the subtle faults: one step moves by <= ~1e-4 relative (algorithms/faults.py)
    "lr_rel_1e-05": Scenario(),
    "lr_rel_1e-04_from_100": Scenario(min_steps=150),
    "momentum_abs_1e-05": Scenario(),
    "weight_decay_abs_1e-05": Scenario(),
    "eps_abs_9e-08": Scenario(optimizer="adam"),
    "bn_eps_abs_1e-05": Scenario(model="cnn2d_hard"),
    "bn_momentum_abs_1e-04": Scenario(model="cnn2d_hard"),
    "eval_input_rel_1e-04": Scenario(),
    # the graph layers' faults: on the built-in graph model they touch, or on the scenario model of the layers
    # no built-in model has
    "gelu_tanh_approx": Scenario(model="convnext_tiny"),
    "layernorm_eps_default": Scenario(model="convnext_tiny"),
    "residual_after_activation": Scenario(model="resnet_tiny"),
    "projection_without_bn": Scenario(model="resnet_tiny"),
    "leaky_relu_default_alpha": Scenario(model=GRAPH_SCENARIO),
    "dilation_dropped": Scenario(model=GRAPH_SCENARIO),
    "concat_wrong_axis": Scenario(model=GRAPH_SCENARIO),
    "depthwise_multiplier_order": Scenario(model=GRAPH_SCENARIO),
}
# the models the full self-test injects every fault into (where the fault touches their layers): every built-in
# model and the graph scenario model
SELFTEST_MODELS = (*model_names(), GRAPH_SCENARIO)


# drift-only variants: name -> (RunConfig overrides, the capability a backend must declare for it to apply);
# which backends have it is theirs to say (wrappers' Entry.capabilities, read through runner.backend_info)
DRIFT_VARIANTS: dict[str, tuple[dict[str, Any], str]] = {
    "dp2": ({"devices": 2}, "data_parallel"),
    "dp4": ({"devices": 4}, "data_parallel"),
    "threads2": ({"threads": 2}, "threads"),
    "eager": ({"jit": False}, "eager"),
    "xla": ({"extra": {"xla": True}}, "xla"),
    "float64": ({"dtype": "float64"}, "float64"),
    "channels_last": ({"extra": {"channels_last": True}}, "channels_last"),
    "onednn_off": ({"extra": {"onednn": "off"}}, "onednn"),
}


def builtin_data(model: str) -> str:
    """The built-in data set of the model's input shape: digits (8x8x1) or digits32 (32x32x3)."""
    return "digits32" if load_model(model).input_shape == (32, 32, 3) else "digits"


def registered_backends() -> tuple[str, ...]:
    """Every registered backend configuration, in registry order (what the full self-test covers)."""
    return tuple(runner.backend_info())


def declares(backend: str, capability: str) -> bool:
    return capability in runner.backend_info()[backend].get("capabilities", ())


def implements(backend: str, fault: str) -> bool:
    return fault in runner.backend_info()[backend].get("faults", ())


REDUCED = {"backends": (REFERENCE,), "steps": 40,
           "faults": ("flatten_no_permute", "symmetric_same_padding", "bn_momentum_flipped", "adam_eps_hat",
                      "grad_sum_replicas", "data_shift_one_batch", "label_smoothing", "grad_double", "lr_scale_1.001",
                      "lr_rel_1e-05", "eval_input_rel_1e-04"),
           "variants": ("dp2", "threads2", "float64")}


@dataclass
class Plan:
    entries: list[M.Entry] = field(default_factory=list)
    expect: dict[str, dict[str, Any]] = field(default_factory=dict)    # run name -> what it must be


def plan(backends: tuple[str, ...], faults: tuple[str, ...], variants: tuple[str, ...], steps: int,
         reference: str = REFERENCE, k: int = 3, models: tuple[str, ...] | None = None) -> Plan:
    """Every fault in every backend on `models` (None: each fault's scenario model only) where it touches
    the model's layers, at the default evaluation cadence; the clean runs and drift-only variants."""
    p = Plan()
    seen: set[str] = set()

    def add(cfg: RunConfig, role: str, expect: dict[str, Any] | None = None, run: bool = True) -> None:
        name = cfg.default_name(load_model(cfg.model).name)
        if name in seen:
            return
        seen.add(name)
        if run:
            p.entries.append(M.Entry(cfg, name, role))
        if expect:
            p.expect[name] = expect

    def group(model: str, sc: Scenario) -> HParams:
        hp, data = sc.hparams(steps), builtin_data(model)
        add(RunConfig(model=model, backend=reference, hparams=hp, data=data), "run")
        for s in range(1, k + 1):
            add(RunConfig(model=model, backend=reference, hparams=hp, data=data, perturb_ulp=s), "envelope")
        add(RunConfig(model=model, backend=reference, hparams=hp, data=data, perturb_ulp=1, dtype="float64"), "envelope")
        return hp

    for f in faults:
        sc = FAULT_SCENARIOS[f]
        if steps < sc.min_steps:
            continue
        for model in (models or (sc.model,)):
            touches, layer = expected_layer(f, load_model(model))
            if not touches:
                continue
            hp = group(model, sc)
            for b in backends:     # a fault the wrapper does not implement is n/a, said without starting it
                add(RunConfig(model=model, backend=b, hparams=hp, data=builtin_data(model), devices=sc.devices,
                              fault=f), "fault",
                    {"kind": "fault", "fault": f, "backend": b, "model": model, "stage": fault_info(f).stage,
                     "layer": layer}, run=implements(b, f))
    # the clean control: every backend's clean run of the default scenario on the default model and on every model
    # a fault ran on, so that a fault's BUG stands beside the same model's clean verdict in that backend
    base = Scenario()
    hp = group(base.model, base)
    injected = [e.cfg.model for e in p.entries if e.role == "fault"]
    candidates = [b for b in backends if b != reference]
    for model in dict.fromkeys([base.model, *injected]) if candidates else ():
        group(model, base)      # that model's reference and envelope (the hyper-parameters are the scenario's: hp)
        for b in candidates:
            add(RunConfig(model=model, backend=b, hparams=hp, data=builtin_data(model)), "run",
                {"kind": "clean", "variant": "clean", "backend": b, "model": model})
    for v in variants:
        over, capability = DRIFT_VARIANTS[v]
        for b in backends:
            if declares(b, capability):
                add(RunConfig(model=base.model, backend=b, hparams=hp, **over), "variant",
                    {"kind": "variant", "variant": v, "backend": b})
    return p


def _comparisons(folder: Path) -> dict[str, dict[str, Any]]:
    """candidate run name -> its pair record (with the reference), from every comparison.json."""
    out = {}
    for c in find_comparisons(folder):
        doc = json.loads(c.read_text())
        for pair in doc.get("pairs", []):
            if pair.get("with_reference"):
                out[pair["candidate"]] = pair
    return out


def judge(p: Plan, entries: list[M.Entry], folder: Path) -> list[dict[str, Any]]:
    pairs = _comparisons(folder)
    status = {e.name: e for e in entries}
    rows = []
    for name, exp in p.expect.items():
        e = status.get(name)
        row = {"kind": exp["kind"], "what": exp.get("fault") or exp.get("variant"), "model": exp.get("model"),
               "backend": exp["backend"],
               "run": name, "verdict": None, "stage": None, "layer": None, "step": None, "factor": None,
               "expected": "", "correct": None, "note": ""}
        if e is None:
            row.update(verdict="n/a", correct=None,
                       note=f"{exp['backend']} does not implement fault {exp['fault']} (its declared faults)")
            rows.append(row)
            continue
        if e.status in ("unsupported", "skipped"):
            row.update(verdict="n/a", correct=None, note=e.message)
            rows.append(row)
            continue
        if e.status == "failed":
            row.update(verdict="FAILED", correct=False, note=e.message)
            rows.append(row)
            continue
        pair = pairs.get(name)
        if pair is None:
            row.update(verdict="NOT COMPARED", correct=False, note="no comparison record")
            rows.append(row)
            continue
        loc = pair.get("localization") or {}
        first = pair.get("first_divergence") or {}
        row.update(verdict=pair["verdict"], stage=loc.get("stage"), layer=loc.get("layer"),
                   step=first.get("step"), factor=first.get("factor"))
        if exp["kind"] == "fault":
            row["expected"] = f"BUG, stage {exp['stage']}" + (f", layer {exp['layer']}" if exp["layer"] else "")
            stage_ok = loc.get("stage") == exp["stage"]
            layer_ok = exp["layer"] is None or loc.get("layer") == exp["layer"]
            row["correct"] = pair["verdict"] == "BUG" and stage_ok
            row["layer_correct"] = None if exp["layer"] is None else layer_ok
        else:
            row["expected"] = "not BUG"
            row["correct"] = pair["verdict"] != "BUG"
        rows.append(row)
    return rows


def render(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    def cell(r):
        if r["verdict"] == "n/a":
            return "n/a"
        mark = "ok" if r["correct"] else "**MISSED**" if r["kind"] == "fault" else "**FALSE ALARM**"
        where = " / ".join(str(x) for x in (r["stage"], r["layer"]) if x)
        return f"{r['verdict']} {('(' + where + ')') if where else ''} {mark}".strip()
    order = registered_backends()
    backends = sorted({r["backend"] for r in rows}, key=lambda b: order.index(b) if b in order else len(order))
    lines = [f"Detection matrix ({meta['when']}, {meta['machine']}, {meta['steps']} steps, "
             f"`{meta['command']}`, {meta['seconds']:.0f} s)", ""]
    for kind, title in (("fault", "fault"), ("variant", "drift-only variant"), ("clean", "clean run")):
        sub = [r for r in rows if r["kind"] == kind]
        if not sub:
            continue
        lines += [f"| {title} | " + " | ".join(backends) + " |", "|---|" + "---|" * len(backends)]
        for what, model in dict.fromkeys((r["what"], r.get("model")) for r in sub):
            cells = []
            for b in backends:
                r = next((x for x in sub if x["what"] == what and x.get("model") == model and x["backend"] == b), None)
                cells.append(cell(r) if r else "-")
            lines.append(f"| {what}{f' ({model})' if model else ''} | " + " | ".join(cells) + " |")
        lines.append("")
    faults = [r for r in rows if r["kind"] == "fault" and r["verdict"] != "n/a"]
    with_layer = [r for r in faults if r.get("layer_correct") is not None]
    lines.append(f"Faults detected with the right stage: {sum(bool(r['correct']) for r in faults)}/{len(faults)}; "
                 f"right layer: {sum(bool(r['layer_correct']) for r in with_layer)}/{len(with_layer)}; "
                 f"drift-only variants called BUG: {sum(r['kind'] != 'fault' and r['verdict'] == 'BUG' for r in rows)}.")
    return "\n".join(lines) + "\n"


def run_selftest(out_root: Path, *, reduced: bool, backends: tuple[str, ...] | None = None, steps: int | None = None,
                 faults: tuple[str, ...] | None = None, variants: tuple[str, ...] | None = None,
                 jobs: int = 1, timeout: float = 900, argv: list[str] | None = None,
                 models: tuple[str, ...] | None = None) -> int:
    """Run the self-test; None for backends/faults/variants/steps/models means the full (or reduced) default
    (models: SELFTEST_MODELS in the full self-test, each fault's scenario model when reduced)."""
    t0 = time.time()
    import platform
    cfg = REDUCED if reduced else {"backends": registered_backends(), "steps": 300, "faults": tuple(FAULTS),
                                   "variants": tuple(DRIFT_VARIANTS), "models": SELFTEST_MODELS}
    models = models or cfg.get("models")
    backends = backends or cfg["backends"]
    steps = steps or cfg["steps"]
    faults = cfg["faults"] if faults is None else faults
    variants = cfg["variants"] if variants is None else variants
    installed = set(runner.installed_backends())
    missing = [b for b in backends if b not in installed]
    if missing:
        print(f"SKIPPED backends (not installed): {', '.join(missing)}", file=sys.stderr)
    backends = tuple(b for b in backends if b in installed)
    name = "selftest-reduced" if reduced else "selftest"
    folder = Path(out_root) / name
    pl = plan(backends, faults, variants, steps, models=models)
    entries = M.run_entries(pl.entries, folder, Path(out_root), jobs, timeout=timeout)
    M.write_status(folder, type("S", (), {"name": name, "source": "duipai selftest"})(), entries)
    compare_folder(folder, reference=REFERENCE, k=3, jobs=jobs, timeout=timeout)
    rows = judge(pl, entries, folder)
    meta = {"when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.node()} ({platform.machine()}, {__import__('os').cpu_count()} cores)",
            "steps": steps, "command": " ".join(["duipai"] + (argv if argv is not None else sys.argv[1:])),
            "seconds": time.time() - t0}
    text = render(rows, meta)
    atomic_write_text(folder / "selftest.md", text)
    atomic_write_text(folder / "selftest.json", json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    print(text)
    bad = [r for r in rows if r["correct"] is False]
    return EXIT_BUG if bad else EXIT_OK
