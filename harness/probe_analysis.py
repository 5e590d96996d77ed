"""One probe comparison analysed: the stage (forward, loss, backward, optimizer, buffers, eval), the layer or
parameter, per-layer errors with CRADLE's change rate, and the words that describe it. Pure: probes in,
a dict out (harness/localize.py runs the jobs that make the probes)."""
from __future__ import annotations

from typing import Any

import numpy as np

from . import batch_rows, probes, reported

R_EPS = 1e-7   # CRADLE's denominator guard
# Where an inherited error arose (see `origin`): it grew at least ORIGIN_JUMP-fold across one layer, to at
# least ORIGIN_OWN times the reference's own float32 error there, which rounding does not do
ORIGIN_JUMP = 10.0
ORIGIN_OWN = 100.0


class SpecLayers(list):
    """The spec's layer names in order, and what each layer reads (`inputs`: the previous layer where the spec names
    none), so that a backward span follows the graph's edges, not the order alone."""

    def __init__(self, names: list[str], inputs: dict[str, list[str]]) -> None:
        super().__init__(names)
        self.inputs = inputs


def spec_layers(man: dict[str, Any]) -> SpecLayers:
    decl = (man.get("spec") or {}).get("layers", [])
    names = [l["name"] for l in decl]
    return SpecLayers(names, {l["name"]: list(l.get("inputs") or names[max(i - 1, 0):i]) for i, l in enumerate(decl)})


def param_layer(param: str) -> str:
    return param.rsplit(".", 1)[0]


def param_order(keys: list[str], prefix: str, layers: list[str], backward: bool) -> list[str]:
    """Probe keys `prefix<param>` in layer order (reversed for backward), then anything else."""
    rank = {l: i for i, l in enumerate(reversed(layers) if backward else layers)}
    ks = [k for k in keys if k.startswith(prefix)]
    return sorted(ks, key=lambda k: (rank.get(param_layer(k[len(prefix):]), len(rank)), ks.index(k)))


def layer_table(diffs: dict[str, probes.ProbeDiff], prefix: str, layers: list[str]) -> list[dict[str, Any]]:
    """Per layer in the spec's order: the error of `prefix<layer>`, whether it and its input agree, and
    CRADLE's change rate R."""
    table, prev = [], 0.0
    for name in layers:
        d = diffs.get(f"{prefix}{name}")
        if d is None:
            continue
        rel = d.rel
        r = (rel - prev) / (prev + R_EPS)
        table.append({"layer": name, "rel": rel, "max_abs": d.max_abs, "ok": d.ok, "R": r, "tol": d.tol, "own": d.own,
                      "input_ok": not table or table[-1]["ok"]})
        prev = rel
    return table


def muffin_row(table: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Muffin's rule on a layer table: the first layer that disagrees while its input agrees (None: none)."""
    return next((t for t in table if not t["ok"] and t["input_ok"]), None)


def origin(table: list[dict[str, Any]], first_bad: dict[str, Any]) -> dict[str, Any] | None:
    """Muffin's layer is the first over its tolerance; when its change rate is below 1 it inherited most of
    its error from its input, and a small error that arose upstream (under a tolerance floor) crossed the
    floor there. The layer where it arose: the nearest earlier one whose error jumped (R >= ORIGIN_JUMP) to
    ORIGIN_OWN times the reference's own float32 error there or more. None when the layer's own change is
    large, or no earlier layer qualifies (the reference's own error unknown: no float64 probe)."""
    if not first_bad["R"] < 1.0:
        return None
    for t in reversed(table[:table.index(first_bad)]):
        if t["R"] >= ORIGIN_JUMP and t["own"] > 0 and t["rel"] >= ORIGIN_OWN * t["own"]:
            return t
    return None


def _forward_place(out: dict[str, Any], table: list[dict[str, Any]], first_bad: dict[str, Any], prefix: str) -> None:
    """The layer a forward (or inference-mode) disagreement is named by: Muffin's, or where its error arose."""
    place = origin(table, first_bad) or first_bad
    out.update(layer=place["layer"], probe=f"{prefix}{place['layer']}", rel=place["rel"])
    if place is not first_bad:
        out["over_tolerance_at"] = {"layer": first_bad["layer"], "rel": first_bad["rel"], "tol": first_bad["tol"],
                                    "R": first_bad["R"]}


def backward_span(grads: list[dict[str, Any]], first_bad: dict[str, Any], layers: list[str]) -> list[str]:
    """The layers whose backward pass can hold a backward-only bug, in the spec's order: the first disagreeing
    parameter's own layer (its weight gradient) and every layer downstream of it on the graph's edges, up to and
    including the first layer on each path whose parameters' gradients agree (its input gradient can still be
    wrong: a LayerNorm whose gamma and beta gradients are right hands on a wrong gradient). Every later parameter's
    gradient agrees (`first_bad` is the first to disagree in backward order). `layers` without edges (a plain list):
    a chain."""
    start = param_layer(first_bad["parameter"])
    if start not in layers:
        return []
    inputs = getattr(layers, "inputs", None) or {n: layers[i - 1:i] for i, n in enumerate(layers) if i}
    readers: dict[str, list[str]] = {}
    for name, srcs in inputs.items():
        for src in srcs:
            readers.setdefault(src, []).append(name)
    agreeing = {param_layer(g["parameter"]) for g in grads[:grads.index(first_bad)]} - {start}
    span, todo = {start}, [start]
    while todo:
        for nxt in readers.get(todo.pop(), []):
            if nxt not in span:
                span.add(nxt)
                if nxt not in agreeing:
                    todo.append(nxt)
    return [n for n in layers if n in span]


def analyse(a: dict[str, np.ndarray], b: dict[str, np.ndarray], layers: list[str],
            rel_tol: float = probes.REL_TOL, ref64: dict[str, np.ndarray] | None = None,
            margin: float = 3.0, nudged: list[dict[str, np.ndarray]] | None = None,
            rows: dict[str, list | None] | None = None) -> dict[str, Any]:
    """Compare candidate probes `a` with reference probes `b` (with `ref64`, the reference's float64
    probes: harness.probes' Inductor rule, tolerance 3x the reference's own error): the stage and place
    of the first disagreement, per-layer forward errors with the change rate R, per-parameter gradients.
    `rows`: what each side's training step reported from the probes' state (harness.reported.rows_at): an
    update off while the probes' loss and gradients agree is placed upstream when the step's own loss or
    gradient norm is not its probe's (harness.reported.step_upstream).
    The candidate's activation rows are first matched to the reference's (harness.batch_rows: the same samples in
    another row order are not a different computation); `rows_matched` says where that moved rows."""
    a, moved = batch_rows.align(a, b, layers)
    logits = f"forward/{layers[-1]}" if layers else None
    diffs = {d.key: d for d in probes.compare(a, b, rel_tol, ref64=ref64, margin=margin, logits_key=logits,
                                                          nudged=nudged)}
    missing = probes.missing_keys(a, b)
    out: dict[str, Any] = {"stage": None, "layer": None, "parameter": None, "probe": None, "rel": None,
                           "disagreeing_keys": [k for k, d in diffs.items() if not d.ok], "missing_keys": missing}
    if moved:
        out["rows_matched"] = moved
    # forward, layer by layer, in the spec's order
    table = layer_table(diffs, "forward/", layers)
    out["layers"] = table
    if table and not all(t["ok"] for t in table):   # CRADLE's suspect, when there is something to suspect
        top = max(table, key=lambda t: t["R"] if np.isfinite(t["R"]) else np.inf)
        out["max_R_layer"] = top["layer"]
    grads = []
    for k in param_order(list(diffs), "grad/", layers, backward=True):
        d = diffs[k]
        x, y = np.asarray(a[k], np.float64).ravel(), np.asarray(b[k], np.float64).ravel()
        yy = float(y @ y)
        scale = float(x @ y) / yy if yy > 0 and np.isfinite(yy) else float("nan")
        resid = float(np.linalg.norm(x - scale * y) / max(np.linalg.norm(x), 1e-300)) if np.isfinite(scale) else float("nan")
        grads.append({"parameter": k[5:], "rel": d.rel, "ok": d.ok, "scale": scale, "residual": resid})
    out["gradients"] = grads
    muffin = muffin_row(table)
    loss = diffs.get("loss")
    bad_grads = [g for g in grads if not g["ok"]]
    if muffin is not None:
        out["stage"] = "forward"
        _forward_place(out, table, muffin, "forward/")
    elif loss is not None and not loss.ok:
        out.update(stage="loss", probe="loss", rel=loss.rel)
    elif bad_grads:
        g = bad_grads[0]
        out.update(stage="backward", parameter=g["parameter"], layer=param_layer(g["parameter"]),
                   probe=f"grad/{g['parameter']}", rel=g["rel"], backward_span=backward_span(grads, g, layers))
        scales = [x["scale"] for x in grads if np.isfinite(x["scale"])]
        if scales and all(x["residual"] < 1e-3 for x in grads) and max(scales) - min(scales) < 1e-3 * max(abs(s) for s in scales):
            out["gradient_scale"] = float(np.mean(scales))
    else:
        steps = sorted({d.step for d in diffs.values() if d.kind in ("update", "buffer", "opt")})
        for i in steps:
            ups = [k for k in param_order(list(diffs), f"update{i}/", layers, False) if not diffs[k].ok]
            bufs = [k for k in param_order(list(diffs), f"buffer{i}/", layers, False) if not diffs[k].ok]
            opts = [k for k in diffs if k.startswith(f"opt{i}/") and not diffs[k].ok]
            if bufs and not ups:   # running statistics: the forward pass of a normalisation layer
                k = bufs[0]
                out.update(stage="forward", layer=param_layer(k.split("/", 1)[1]), parameter=k.split("/", 1)[1],
                           probe=k, rel=diffs[k].rel, note="running statistics")
                break
            if ups or opts:
                k = (ups or opts)[0]
                par = k.split("/", 1)[1]
                out.update(stage="optimizer", probe=k, rel=diffs[k].rel, optimizer_step=i,
                           parameter=par.split("/", 1)[-1] if k.startswith("opt") else par)
                out["layer"] = param_layer(out["parameter"]) if "." in out["parameter"] else None
                if not ups:
                    out["note"] = "optimizer state only"
                upstream = reported.step_upstream(rows, a, b, layers[-1]) if rows and layers else None
                if upstream:        # the step's own report places it before the optimizer
                    out = {k: v for k, v in out.items() if k not in ("note", "optimizer_step")} | upstream
                break
    evals = layer_table(diffs, "eval/", layers)
    if evals:
        out["eval_layers"] = evals
    bad_eval = muffin_row(evals)
    if out["stage"] is None and bad_eval is not None:   # training agrees; inference from the same state does not
        out["stage"] = "eval"
        _forward_place(out, evals, bad_eval, "eval/")
    if out["stage"] is None and missing:
        out.update(stage="probe-keys", probe=missing[0], note="a probe exists in one backend only")
    out["diffs"] = [d.to_dict() for d in diffs.values()]
    return out


def eval_disagreement(res: dict[str, Any]) -> dict[str, Any]:
    """`res` (an analysis) with its training step set aside, explained elsewhere (a kink its rounding flipped:
    harness.resync): what is left is the inference-mode forward, placed as `analyse` places an evaluation-path
    disagreement (the first inference-mode layer whose input agrees and output does not, or where its error arose)."""
    keys = [k for k in res["disagreeing_keys"] if k.startswith("eval/")]
    out = {k: v for k, v in res.items() if k not in ("gradient_scale", "note", "optimizer_step", "over_tolerance_at",
                                                     "max_R_layer", "step_report")}
    out.update(stage="eval", parameter=None, layer=None, probe=keys[0] if keys else None, disagreeing_keys=keys,
               training_set_aside=[k for k in res["disagreeing_keys"] if k not in keys])
    d = next((x for x in res.get("diffs") or [] if x["key"] == out["probe"]), None)
    out["rel"] = d["rel"] if d else None
    evals = res.get("eval_layers") or []
    bad = muffin_row(evals)
    if bad is not None:
        _forward_place(out, evals, bad, "eval/")
    return out


STAGE_ORDER = ("forward", "loss", "backward", "optimizer", "eval", "probe-keys")   # analyse's order of search


def first_disagreement_later(one: dict[str, Any], res: dict[str, Any]) -> bool:
    """Does analysis `one` first disagree strictly later than `res` in analyse's order (forward, loss,
    backward, the optimizer step by step, eval), or nowhere? Then everything up to `res`'s first
    disagreement agrees in `one`."""
    if one["stage"] is None:
        return True
    if res["stage"] is None:
        return False
    a, b = STAGE_ORDER.index(one["stage"]), STAGE_ORDER.index(res["stage"])
    if a != b:
        return a > b
    return one["stage"] == "optimizer" and one.get("optimizer_step", 0) > res.get("optimizer_step", 0)


def agrees(res: dict[str, Any]) -> bool:
    return res["stage"] is None and not res["disagreeing_keys"]


def change_text(change: dict[str, Any] | None) -> str:
    """How the reference was changed to compute declared formulas, for notes: 'fault a+b, devices 2'."""
    return ", ".join(f"{k} {v}" for k, v in sorted((change or {}).items())) or "no change"


def describe(res: dict[str, Any], method: str) -> tuple[str, list[str]]:
    """A one-line summary and detail lines for the terminal."""
    st = res.get("stage")
    lines = []
    if st is None:
        return "", lines
    over = res.get("over_tolerance_at")
    arose = (f"where the error arose: rel {res['rel']:.3g}, a jump over its input's; it crosses the tolerance "
             f"at {over['layer']}, rel {over['rel']:.3g} of {over['tol']:.3g}, carried from its input)") if over else ""
    if st == "forward" and res.get("note") != "running statistics":
        s = f"forward, layer {res['layer']} (" + (arose or f"first layer whose input agrees and output does not, "
                                                           f"rel {res['rel']:.3g})")
    elif st == "forward":
        s = f"forward, layer {res['layer']} running statistics ({res['probe']}, rel {res['rel']:.3g})"
    elif st == "loss" and res.get("step_report"):
        s = f"loss (forward and the probed loss agree; the training step's own loss rel {res['rel']:.3g})"
    elif st == "loss":
        s = f"loss (forward agrees, loss rel {res['rel']:.3g})"
    elif st == "backward" and res.get("step_report"):
        s = f"backward (the probed gradients agree; the training step's own gradient norm rel {res['rel']:.3g})"
    elif st == "backward":
        s = f"backward, parameter {res['parameter']} (first gradient to disagree in backward order, rel {res['rel']:.3g})"
        if res.get("gradient_scale") is not None:
            s += f"; every gradient is the reference's x {res['gradient_scale']:.6g}"
        elif len(res.get("backward_span") or []) > 1:
            span = res["backward_span"]
            s += f"; in the backward pass of one of {', '.join(span)} (the gradients of every parameter after {span[0]} agree)"
    elif st == "eval":
        s = (f"evaluation path, layer {res['layer']} (training agrees; " + (f"inference mode, {arose}" if over else
             f"the first layer whose inference-mode output disagrees from the same state, rel {res['rel']:.3g})"))
    elif st == "optimizer":
        s = (f"optimizer update, parameter {res['parameter']} ({res['probe']}, rel {res['rel']:.3g}; "
             f"gradients agree)")
    else:
        s = f"{st} ({res.get('probe')}" + (f"; {res['note']})" if res.get("note") else ")")
    if res.get("across_replicas"):
        s += f"; {res['across_replicas']}"
    where = res.get("layer") if st in ("forward", "eval") else (res.get("parameter") or res.get("layer"))
    summary = f"{st}: {where or res.get('probe') or ''}".rstrip(": ")
    lines.append(f"localized by {method}: {s}")
    if res.get("step_report"):
        lines.append(f"  {res['step_report']['line']}")
    if res.get("rows_matched"):
        lines.append(f"  the candidate's batch rows came in another order ({', '.join(res['rows_matched'])}): compared "
                     "after matching each row to the reference's")
    table = res.get("eval_layers") if st == "eval" else res.get("layers")
    if table:
        lines.append("  layer            rel. error   R (change rate)  agrees" + ("   (inference mode)" if st == "eval" else ""))
        for t in table:
            lines.append(f"  {t['layer']:<16} {t['rel']:10.3g}   {t['R']:14.4g}  {'yes' if t['ok'] else 'NO'}")
        if res.get("max_R_layer"):
            lines.append(f"  largest R: {res['max_R_layer']}")
    bad = [g for g in res.get("gradients", []) if not g["ok"]]
    if res.get("training_set_aside"):
        n = len(res["training_set_aside"])
        lines.append(f"  the training step's {n} disagreeing key(s) ({', '.join(res['training_set_aside'][:3])}"
                     f"{' ...' if n > 3 else ''}) are explained apart (a kink its rounding flipped, or the optimizer's "
                     "formula): set aside")
        bad = []
    if bad:
        lines.append("  gradients that disagree (backward order): "
                     + ", ".join(f"{g['parameter']} rel {g['rel']:.3g}" for g in bad[:6])
                     + (" ..." if len(bad) > 6 else ""))
    return summary, lines


__all__ = ["SpecLayers", "analyse", "backward_span", "describe", "eval_disagreement", "muffin_row", "change_text", "agrees", "spec_layers", "param_layer",
           "param_order", "layer_table", "origin"]
