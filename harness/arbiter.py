"""The arbiter: which side of a BUG the exact computation supports.

With two framework backends a BUG says only that they disagree; the odd-one-out vote needs three, and three
frameworks may share a kernel library or a convention. The arbiter is a backend named by the user (`duipai
compare --arbiter NAME`) or the matrix (`arbiter = "NAME"`), never by this module, that implements the
spec's formulas in float64. For every pair judged BUG it is probed on the same configuration (model, data,
hyper-parameters, the reference's initial weights; no fault) at step 0, and, when the bug was localized by
replay, from the reference's own states at the replayed steps. Walking the probe keys in computation order
(forward in the spec's layer order, loss, gradients in backward order, per optimizer step the updates,
buffers and optimizer state, then the inference-mode forward), the first key where a side leaves the exact
values is where that side disagrees with the exact computation.

Tolerance: a float32 framework is off the exact values by its rounding. The yardstick is the arbiter run in
float32 on the same inputs: a correct float32 implementation of the same formulas. Per key, a side leaves when
its RMS error against the exact values (over max|exact|, PyTorch Inductor's measure) exceeds MARGIN times that
float32 RMS error, and never below REL_FLOOR. Measured (bench/arbiter_tolerance.py, docs/backend-api.md):
clean backends stay far inside it; every catalogued fault exceeds it by orders of magnitude.

Pure comparison (`arbitrate`) is framework-free NumPy on dicts of arrays; the jobs run through the
Localizer's public `probe0` and `replay` (runner.execute in child processes).
"""
from __future__ import annotations

import copy
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable

import numpy as np

from .compare import Comparison
from .compare_output import labels
from .pair import BUG, Pair
from .errors import BackendFailed, BadInput

MARGIN = 3.0          # x the arbiter's own float32 RMS error at the key (Inductor: 2 for fp32; the probes use 3)
REL_FLOOR = 1e-6      # keys a float32 computation gets (nearly) exact: ~8 float32 ULPs of the tensor's scale
REL_TOL = 1e-4        # without a float32 calibration probe: the probes' fixed float32 tolerance (harness.probes)
ABS_FLOOR = 1e-6      # scale floor for (nearly) all-zero tensors, as in the probe comparison
SIDES = ("candidate", "reference", "both", "neither")

# options of the compared runs that change how, not what, is computed: the arbiter runs without those it
# cannot honour, and says so; any other option it cannot honour stops it (capability -> option)
LAYOUT_EXTRAS = {"channels_last": "channels_last", "xla": "xla", "onednn": "onednn", "hosts": "hosts",
                 "platform": None}
SEMANTIC_EXTRAS = {"sync_bn": "sync_bn"}


# --------------------------------------------------------------------------- errors against the exact values
def _finite_pair(x: np.ndarray, exact: np.ndarray) -> bool:
    return x.shape == exact.shape and bool(np.isfinite(x).all())


def _relative(x: Any, exact: Any, size: Any) -> float:
    """size(x - exact) over max(max|exact|, ABS_FLOOR); inf for a shape mismatch or a non-finite x."""
    x, exact = np.asarray(x, np.float64), np.asarray(exact, np.float64)
    if not _finite_pair(x, exact):
        return float("inf")
    if not x.size:
        return 0.0
    return float(size(x - exact)) / max(float(np.max(np.abs(exact))), ABS_FLOOR)


def rms_rel(x: Any, exact: Any) -> float:
    """RMS of x - exact, relative to the exact tensor's scale (inf: shape mismatch or non-finite x)."""
    return _relative(x, exact, lambda d: np.sqrt(np.mean(d ** 2)))


def max_rel(x: Any, exact: Any) -> float:
    """max|x - exact|, relative to the exact tensor's scale (inf: shape mismatch or non-finite x)."""
    return _relative(x, exact, lambda d: np.max(np.abs(d)))


# --------------------------------------------------------------------------- computation order
_STEP_KINDS = {"update": 0, "buffer": 1, "opt": 2}


def key_order(key: str, layers: list[str] | None = None) -> tuple:
    """Sort key of a probe key in computation order: forward (layer order), loss, gradients (backward
    order), then per optimizer step i update<i>, buffer<i>, opt<i> (layer order), inference forward last."""
    head, _, rest = key.partition("/")
    rank = {l: i for i, l in enumerate(layers or [])}
    n = len(rank)

    def layer_rank(name: str, backward: bool = False) -> int:
        for cand in (name, name.rsplit(".", 1)[0], name.split("/")[-1].rsplit(".", 1)[0]):
            if cand in rank:
                return n - 1 - rank[cand] if backward else rank[cand]
        return n
    if head == "forward":
        return (0, 0, 0, layer_rank(rest), key)
    if head == "loss":
        return (1, 0, 0, 0, key)
    if head == "grad":
        return (2, 0, 0, layer_rank(rest, backward=True), key)
    m = re.fullmatch(r"(update|buffer|opt)(\d+)", head)
    if m:
        return (3, int(m.group(2)), _STEP_KINDS[m.group(1)], layer_rank(rest), key)
    if head == "eval":
        return (4, 0, 0, layer_rank(rest), key)
    return (5, 0, 0, 0, key)


# --------------------------------------------------------------------------- the pure decision
@dataclass
class KeyErrors:
    key: str
    candidate: float          # RMS relative errors against the exact values
    reference: float
    candidate_tol: float      # the tolerances each side was held to
    reference_tol: float
    candidate_max: float      # max relative errors (for the reader)
    reference_max: float


@dataclass
class Arbitration:
    """The side that leaves the exact computation first: `key` and both sides' errors there. `compared` keys
    were judged; `unjudged` keys had non-finite exact values; `missing` keys lacked in a side."""
    side: str                                  # candidate | reference | both | neither
    key: str | None = None
    candidate_error: float = 0.0
    reference_error: float = 0.0
    candidate_tol: float = 0.0
    reference_tol: float = 0.0
    candidate_first: str | None = None         # each side's first key off the exact values
    reference_first: str | None = None
    candidate_keys: int = 0                    # how many keys each side leaves
    reference_keys: int = 0
    compared: int = 0
    worst: KeyErrors | None = None             # with side neither: the key closest to its tolerance
    unjudged: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    calibrated: bool = True                    # tolerance from the arbiter's float32 probes (else REL_TOL)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def tolerance(exact: Any, calib: Any | None, own32: Any | None = None, own64: Any | None = None,
              margin: float = MARGIN, floor: float = REL_FLOOR) -> float:
    """How far a float32 side may be off the exact values at one key: MARGIN x the larger of the arbiter's
    float32 RMS error (`calib`: a correct float32 computation of the same formulas) and the side's own float32
    vs float64 RMS error (`own32`, `own64`: its code path's rounding, PyTorch Inductor's yardstick), never below
    REL_FLOOR; REL_TOL when neither is available."""
    parts = []
    if calib is not None:
        parts.append(rms_rel(calib, exact))
    if own32 is not None and own64 is not None:
        parts.append(rms_rel(own32, own64))
    parts = [x for x in parts if np.isfinite(x)]
    return max(floor, margin * max(parts)) if parts else REL_TOL


def arbitrate(candidate: dict[str, Any], reference: dict[str, Any], exact: dict[str, Any],
              calib: dict[str, Any] | None = None, *, candidate64: dict[str, Any] | None = None,
              reference64: dict[str, Any] | None = None, layers: list[str] | None = None,
              keys: list[str] | None = None, margin: float = MARGIN, floor: float = REL_FLOOR) -> Arbitration:
    """Which side leaves the exact values first, over the keys of `exact` (or `keys`), in computation order.

    A side leaves a key when its RMS error against the exact values exceeds its tolerance there (`tolerance`:
    from the arbiter's float32 probes `calib` and the side's own float64 probes `candidate64`/`reference64`,
    each optional; a shape mismatch or a non-finite value is an infinite error). Keys whose exact values are
    not finite cannot be judged and are listed, as are keys one side lacks."""
    pool = list(keys) if keys is not None else list(exact)
    out = Arbitration("neither", calibrated=calib is not None)
    worst_ratio = -1.0
    c64, r64 = candidate64 or {}, reference64 or {}
    for k in sorted(pool, key=lambda k: key_order(k, layers)):
        if k not in exact:
            continue
        if k not in candidate or k not in reference:
            out.missing.append(k)
            continue
        ex = np.asarray(exact[k], np.float64)
        if not np.isfinite(ex).all():
            out.unjudged.append(k)
            continue
        cal = None if calib is None else calib.get(k)
        tc = tolerance(ex, cal, candidate[k], c64.get(k), margin, floor)
        tr = tolerance(ex, cal, reference[k], r64.get(k), margin, floor)
        ke = KeyErrors(k, rms_rel(candidate[k], ex), rms_rel(reference[k], ex), tc, tr,
                       max_rel(candidate[k], ex), max_rel(reference[k], ex))
        out.compared += 1
        c_off, r_off = ke.candidate > tc, ke.reference > tr
        out.candidate_keys += c_off
        out.reference_keys += r_off
        if c_off and out.candidate_first is None:
            out.candidate_first = k
        if r_off and out.reference_first is None:
            out.reference_first = k
        if (c_off or r_off) and out.key is None:
            out.side = "both" if c_off and r_off else "candidate" if c_off else "reference"
            out.key, out.candidate_error, out.reference_error = k, ke.candidate, ke.reference
            out.candidate_tol, out.reference_tol = tc, tr
        ratio = max(ke.candidate / tc, ke.reference / tr)
        if ratio > worst_ratio:
            worst_ratio, out.worst = ratio, ke
    return out


# --------------------------------------------------------------------------- words
def _g(x: float) -> str:
    return "inf" if not np.isfinite(x) else f"{x:.2g}"


def statement(a: Arbitration | None, arbiter: str, ref: str, cand: str, replayed: int | None = None,
              reason: str | None = None) -> str:
    """One sentence for every output: 'arbiter (NAME float64): the exact computation supports X; Y
    disagrees at KEY (err e; X e')'; why it did not run, in capitals, when it did not."""
    head = f"arbiter ({arbiter} float64)"
    if a is None:
        return f"{head} NOT RUN: {reason}"
    at = "" if replayed is None else f" (replayed step {replayed}, from the reference's state)"
    if a.side == "reference":
        return (f"{head}: the exact computation supports {cand}; the reference {ref} disagrees with it at {a.key}{at} "
                f"(err {_g(a.reference_error)}, tolerance {_g(a.reference_tol)}; {cand} {_g(a.candidate_error)})")
    if a.side == "candidate":
        return (f"{head}: the exact computation supports the reference {ref}; {cand} disagrees with it at {a.key}{at} "
                f"(err {_g(a.candidate_error)}, tolerance {_g(a.candidate_tol)}; {ref} {_g(a.reference_error)})")
    if a.side == "both":
        return (f"{head}: both sides disagree with the exact computation at {a.key}{at} "
                f"({ref} err {_g(a.reference_error)}, {cand} err {_g(a.candidate_error)}; tolerances "
                f"{_g(a.reference_tol)}, {_g(a.candidate_tol)})")
    w = a.worst
    worst = (f"; closest: {w.key}, {ref} err {_g(w.reference)} (tolerance {_g(w.reference_tol)}), {cand} err "
             f"{_g(w.candidate)} (tolerance {_g(w.candidate_tol)})" if w else "")
    return (f"{head}: neither side disagrees with the exact computation in the {a.compared} probes compared"
            f"{worst}; the bug is beyond what one step's probes resolve")


# --------------------------------------------------------------------------- running the arbiter backend
def check_arbiter(name: str) -> None:
    """BadInput unless `name` is a registered, installed backend that computes in float64."""
    from .runner import backend_info
    info = backend_info()
    if name not in info:
        raise BadInput(f"--arbiter {name}: unknown backend; known: {', '.join(info)}")
    if info[name]["missing"]:
        raise BadInput(f"--arbiter {name}: not installed ({', '.join(info[name]['missing'])})")
    if "float64" not in info[name].get("capabilities", []):
        raise BadInput(f"--arbiter {name}: it does not declare float64; the exact computation needs it")


def arbiter_options(ref_options: dict[str, Any], capabilities: set[str] | frozenset[str]
                    ) -> tuple[dict[str, Any] | None, list[str], str | None]:
    """The arbiter's options for the reference's configuration: (options or None, what it does not honour,
    why it cannot run). No fault, float64; layout and compiler switches it lacks are dropped (said); an option
    that changes the computation and that it cannot honour stops it."""
    o = dict(ref_options)
    o.update(fault=None, dtype="float64")
    adjusted: list[str] = []
    if o.get("devices", 1) > 1 and "data_parallel" not in capabilities:
        return None, adjusted, f"--devices {o['devices']}: no data_parallel capability"
    if o.get("dropout", "harness") != "harness":
        return None, adjusted, (f"--dropout {o['dropout']}: framework-RNG masks, which an exact computation "
                                "cannot share")
    extra = {}
    for k, v in (o.get("extra") or {}).items():
        if k == "port" or v in (None, False):
            continue
        if k in SEMANTIC_EXTRAS and SEMANTIC_EXTRAS[k] not in capabilities:
            return None, adjusted, f"{k}={v}: no {SEMANTIC_EXTRAS[k]} capability (it changes what is computed)"
        if k in SEMANTIC_EXTRAS or LAYOUT_EXTRAS.get(k, "-") in capabilities:
            extra[k] = v
        else:
            adjusted.append(f"{k}={v} (not honoured: it changes how the compared runs compute, not what)")
    o["extra"] = extra
    if not o.get("jit", True) and "eager" not in capabilities:
        adjusted.append("jit=False (not honoured: the arbiter has one execution mode)")
        o["jit"] = True
    if o.get("threads", 1) != 1 and "threads" not in capabilities:
        adjusted.append(f"threads={o['threads']} (not honoured: one thread)")
        o["threads"] = 1
    return o, adjusted, None


def variant(run, backend: str | None = None, **options: Any):
    """A Run standing for `run` computed by another backend and/or with other options, for the Localizer's jobs:
    the same manifest (data, weights, hashes) with the backend and options replaced; no folder of its own (its
    jobs live under .localize). With another backend: no fault and no declared differences."""
    from .runs import Run
    man = copy.deepcopy(run.manifest)
    if backend is not None and backend != run.backend:
        man.update(backend=backend, fault=None, declared_differences=[])
        options = {"fault": None, **options}
    before = man.get("options") or {}
    tag = "__".join(f"{k}-{v}" for k, v in sorted(options.items())
                    if k not in ("extra", "fault") and before.get(k) != v) or "same"
    man["options"] = dict(before, **options)
    return Run(run.path.parent / f"{run.name}__{backend or run.backend}__{tag}", man, run.step, run.values,
               run.checksum, run.eval_step)


def _own64(loc, run) -> tuple[dict[str, Any] | None, str | None]:
    """A side's step-0 probes in float64 (its own rounding, for its tolerance), or None and why not."""
    if run.options.get("dtype", "float32") == "float64":
        return None, None
    try:
        return loc.probe0(run, dtype="float64"), None
    except BackendFailed as e:
        return None, f"{run.backend} float64 probe unavailable ({str(e).splitlines()[0]})"


def _layers(run) -> list[str]:
    return [l["name"] for l in (run.manifest.get("spec") or {}).get("layers", [])]


def _without(d: dict[str, Any], drop: set[str]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k not in drop}


def _replayed(loc, ref, cand, exact_run, calib_run, at: list[int]) -> list[tuple]:
    """Per replayed step: (step, candidate, reference, exact, calibration, candidate64, reference64) probes (the
    optional ones None), all from the reference's own state at that step (the Localizer's replay jobs; those
    of the localization are reused)."""
    def optional(run) -> dict[int, Any]:
        try:
            return {t: p for t, p, *_ in loc.replay(ref, run, at)["probes"]}
        except BackendFailed:
            return {}
    c_rep = {t: (p, p64) for t, p, _, p64, *_ in loc.replay(ref, cand, at)["probes"]}
    e_rep = {t: (p, pb) for t, p, pb, *_ in loc.replay(ref, exact_run, at)["probes"]}
    k_rep = optional(calib_run)
    c64 = optional(variant(cand, dtype="float64")) if cand.options.get("dtype", "float32") != "float64" else {}
    return [(t, c_rep[t][0], e_rep[t][1], e_rep[t][0], k_rep.get(t), c64.get(t), c_rep[t][1])
            for t in at if t in c_rep and t in e_rep]


def arbitrate_pair(pair: Pair, arbiter: str, loc, *, capabilities: set[str],
                   log: Callable[[str], None]) -> dict[str, Any]:
    """The arbiter's section of one BUG pair: step-0 probes of the arbiter (float64 exact, float32 calibration)
    against the pair's two sides, then the replayed steps when the localization replayed. Keys that a declared
    difference may move are set aside (the arbiter computes the reference formula)."""
    from .runs import movable_keys
    ref, cand = pair.a, pair.b
    lab = labels([ref, cand])
    ref_l, cand_l = lab[ref.name], lab[cand.name]
    sec: dict[str, Any] = {"backend": arbiter, "dtype": "float64", "ran": False, "reason": None, "adjusted": [],
                           "side": None, "supports": None, "disagrees": None, "key": None, "step": None,
                           "candidate_error": None, "reference_error": None, "candidate_tol": None,
                           "reference_tol": None, "set_aside": [],
                           "results": []}
    loc_res = pair.localization or {}
    log(f"arbiter: {arbiter} float64 on {cand_l} vs the reference {ref_l}")

    def not_run(why: str) -> dict[str, Any]:
        sec["reason"] = why
        sec["statement"] = statement(None, arbiter, ref_l, cand_l, reason=f"for {cand_l}: {why}")
        return sec
    if loc_res.get("stage") == "data":
        return not_run("the runs were fed different batches (localized: data); probes feed both sides the same batch "
                       "and cannot say whose data order is wrong")
    opts, adjusted, why = arbiter_options(ref.options, capabilities)
    sec["adjusted"] = adjusted
    if opts is None:
        return not_run(f"it cannot run the reference's configuration: {why}")
    exact_run = variant(ref, arbiter, **dict(opts, dtype="float64"))
    calib_run = variant(ref, arbiter, **dict(opts, dtype="float32"))
    layers = _layers(ref)
    try:
        exact = loc.probe0(exact_run)
        cp, rp = loc.probe0(cand), loc.probe0(ref)
    except BackendFailed as e:
        return not_run(f"a probe job failed: {str(e).splitlines()[0]}")
    try:
        calib = loc.probe0(calib_run)
    except BackendFailed as e:
        calib = None
        sec["adjusted"].append(f"no float32 calibration ({str(e).splitlines()[0]}): fixed tolerance {REL_TOL:g}")
    (c64, why_c), (r64, why_r) = _own64(loc, cand), _own64(loc, ref)
    sec["adjusted"] += [w + ": its tolerance from the arbiter's float32 rounding only" for w in (why_c, why_r) if w]
    aside = set(movable_keys(ref, cand, list(exact)))
    sec["set_aside"] = sorted(aside)
    sec["ran"] = True
    a = arbitrate(_without(cp, aside), _without(rp, aside), exact, calib, candidate64=c64, reference64=r64,
                  layers=layers)
    t = 0
    sec["results"].append(dict(a.to_dict(), step=0))
    rep = loc_res.get("replay") or {}
    if a.side == "neither" and rep.get("at") and not rep.get("error"):
        # step 0 says nothing: the replayed steps, from the reference's own states there
        try:
            for t_, c, r, ex, cal, c64_, r64_ in _replayed(loc, ref, cand, exact_run, calib_run, sorted(rep["at"])):
                a, t = arbitrate(_without(c, aside), _without(r, aside), ex, cal, candidate64=c64_,
                                 reference64=r64_, layers=layers), t_
                sec["results"].append(dict(a.to_dict(), step=t_))
                if a.side != "neither":
                    break
        except BackendFailed as e:
            sec["adjusted"].append(f"replayed steps not arbitrated: {str(e).splitlines()[0]}")
    sec.update(side=a.side, key=a.key, step=t, candidate_error=a.candidate_error, reference_error=a.reference_error,
               candidate_tol=a.candidate_tol, reference_tol=a.reference_tol)
    sec["supports"] = {"candidate": cand.name, "reference": ref.name}.get(
        {"reference": "candidate", "candidate": "reference"}.get(a.side, ""))
    sec["disagrees"] = {"candidate": cand.name, "reference": ref.name, "both": "both"}.get(a.side)
    sec["statement"] = statement(a, arbiter, ref_l, cand_l, t if len(sec["results"]) > 1 else None)
    return sec


@dataclass
class ArbitratedComparison(Comparison):
    """A Comparison with the arbiter's section per BUG pair (comparison.json `pairs[i].arbiter`, and
    `arbiter` at the top: the backend and the lead sentences)."""
    arbiter: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        secs = self.arbiter.get("pairs", {})
        for p in d["pairs"]:
            if p.get("with_reference") and p["candidate"] in secs:
                p["arbiter"] = secs[p["candidate"]]
        d["arbiter"] = {k: v for k, v in self.arbiter.items() if k != "pairs"}
        return d


def lead_lines(arb: dict[str, Any]) -> list[str]:
    """What leads every output: the arbiter naming the reference, and an arbiter that did not run."""
    secs = arb.get("pairs", {}).values()
    return ([s["statement"] for s in secs if s.get("side") in ("reference", "both")]
            + [s["statement"] for s in secs if not s.get("ran")])


def arbitrate_comparison(c: Comparison, arbiter: str, *, timeout: float | None = None,
                         log: Callable[[str], None] = lambda m: None) -> ArbitratedComparison:
    """Run the arbiter on every BUG pair with the reference; its sentence goes into the pair's notes, its
    section into comparison.json, and `lead_lines` into the head of the outputs."""
    from .localize import Localizer
    from .runner import backend_info
    check_arbiter(arbiter)
    caps = set(backend_info()[arbiter].get("capabilities", []))
    loc = Localizer(c.reference.path.parent, timeout=timeout, log=log)
    pairs: dict[str, Any] = {}
    for p in c.pairs:
        if not p.with_reference or p.verdict != BUG:
            continue
        sec = arbitrate_pair(p, arbiter, loc, capabilities=caps, log=log)
        for a in sec["adjusted"]:
            p.notes.append(f"arbiter ({arbiter}): {a}")
        p.notes.insert(0, sec["statement"])
        pairs[p.b.name] = sec
    arb = {"backend": arbiter, "dtype": "float64", "margin": MARGIN, "rel_floor": REL_FLOOR, "pairs": pairs}
    arb["lead"] = lead_lines(arb)
    return ArbitratedComparison(**{f.name: getattr(c, f.name) for f in fields(c)}, arbiter=arb)


def lead_text(comparisons: list[Any]) -> str:
    """The arbiter's leading lines of several comparisons as a block ending in a blank line ('' for none)."""
    lines = [x for c in comparisons for x in (getattr(c, "arbiter", None) or {}).get("lead", [])]
    return "\n".join(lines) + "\n\n" if lines else ""


__all__ = ["arbitrate", "Arbitration", "KeyErrors", "arbitrate_comparison", "arbitrate_pair", "ArbitratedComparison",
           "check_arbiter", "arbiter_options", "statement", "lead_lines", "lead_text", "rms_rel", "max_rel",
           "tolerance", "key_order", "MARGIN", "REL_FLOOR", "REL_TOL"]
