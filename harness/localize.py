"""Where a BUG comes from: the stage (data, forward, loss, backward, optimizer, reduction, eval), the
layer or parameter, and the per-layer change rate. Framework-free: backends are run only through
runner.execute (probe and replay jobs); their .npz probes are compared here.

In this order, the first that finds a disagreement answers:
  (a) data     the batch checksums of the two runs differ at or before the first divergent step;
  (b) step 0   both configurations probed from the canonical weights on the first batch (forward per layer,
               its rows matched first: harness.batch_rows, loss, gradient per parameter, optimizer steps); Muffin's rule names
               the first layer whose input agrees but whose output does not (layers in the spec's
               order), CRADLE's change rate R = (d_l - d_prev) / (d_prev + 1e-7) is given for every
               layer; the first gradient that disagrees, in backward order (last layer first);
               the inference-mode forward of the same state is compared last, layer by layer (stage eval:
               the evaluation path itself, e.g. dropout left on; running statistics are the training
               step's, seen in the buffers);
  (b2) report  the step-0 probes agree and one run's reported step-0 statistics are not what its own probe
               computed (harness/reported.py: a wrapper's slip in the statistics it writes, not in training);
               after (d) finds nothing, the same at its replayed steps: each backend's training step from the
               reference's state there against its probe of that state;
  (c) eval     the evaluation diverges from step 0 (the same initial state evaluated), no declared difference moves
               it (pair.can_move), the step-0 probes agree; else (b2), (c) kept as the step-0 finding's `fallback`;
  (d) replay   the reference re-trains from its checkpoint at or before the divergent step d up to d-1 and d
               and saves its state there; both backends probe those steps from exactly those states (`replay`)
               (an update off, loss and gradients agreeing: upstream if the step's own report is not its probe's).
A disagreement that disappears when the candidate is probed with --devices 1 is in the gradient
combination across replicas (stage reduction), in how replicas split the batch (data), or, when its first
layer computes batch statistics (BatchNorm) and has a layer upstream (agreeing over the global batch: each replica
had its samples), in those statistics across replicas (forward, at that layer).

Declared differences are verified, not trusted: when the step-0 disagreement touches probes that a
difference declared by the candidate may move, and that difference has an emulation (`emulated_by`: a
fault that makes the reference backend compute the declared formula), the reference is probed again
with that fault and the candidate compared against it with the same tolerance rule (`declared_check`
in the result). Every probe agrees: the difference explains the disagreement. Some still disagree:
they are localized from that comparison, and the difference does not explain them. A declared
difference that cannot be verified explains at most the probes its `probe_keys` name: those are set
aside and the disagreement is localized on the probes left (`set_aside` in the result), so a bug in
the evaluation path is not hidden behind a declared running-statistics difference.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from algorithms.differences import DIFFERENCES
from algorithms.faults import combine
from algorithms.spec import load_model

from . import kinks, probes, reported, runner
from .batch_rows import align
from .emulating import emulation
from .probe_analysis import agrees, analyse, change_text, describe, first_disagreement_later, spec_layers
from .pair import against_text, eval_from_start
from .resync_verdict import restart_differs
from .errors import BackendFailed, BadInput
from .probe_jobs import PROBE_KEYS, SENSITIVITY_SEEDS, ProbeJobs, change_tag, checkpoints, same_path
from .runs import EVAL_SERIES, Run, model_ref, movable_keys


def divergent_steps(pair) -> list[int]:
    """The steps a divergence of the pair's free-running curves asks to replay: the first divergent step of
    the training series (of any series when only the evaluation diverges), the one before it and the
    PROBE_STEPS from it, and the steps the step-0 probes run (0..PROBE_STEPS-1): so that the resync computes,
    calibrated and from the reference's state, every step the localization's probes hold
    (harness.resync_verdict.superseded_by_resync; the step-0 probes' later steps run from the candidate's own
    state); none for a pair that does not diverge or is fed a different batch."""
    if pair.first is None or pair.first.get("series") in ("batch_checksum", None):
        return []
    train = [c.diverged_step for s, c in pair.checks.items() if s not in EVAL_SERIES and c.diverged_step is not None]
    d = min(train) if train else int(pair.first["step"])
    return sorted({*range(runner.PROBE_STEPS), max(d - 1, 0), *(d + i for i in range(runner.PROBE_STEPS))})


def implied_step(ref: Run, rep: dict[str, Any], change: dict[str, Any] | None):
    """The check of an update against the formula on the candidate's own gradient (harness.implied), for a
    resync from `ref`'s states computing `change`'s declared formulas and, on its own backend, its own (Keras'
    Adam); None where the reference computes a formula the check does not know, carries a fault, or has no hp."""
    from algorithms.optim import HParams
    from . import resync as R
    from .implied import ImpliedStep, formulas_of
    own = [] if (change or {}).get("backend") else [
        DIFFERENCES[d["id"]].emulated_by or "" for d in ref.declared if d["id"] in DIFFERENCES]
    formulas = formulas_of(combine([f for f in [(change or {}).get("fault"), *own] if f]))
    hp = ref.manifest.get("hparams")
    if formulas is None or ref.fault is not None or not hp or not rep.get("states"):
        return None   # a reference with a fault computes something else: its own error would set the tolerance
    return ImpliedStep(HParams.from_dict(hp), rep["states"], formulas, margin=R.MARGIN, floor=R.FLOOR)


class Localizer(ProbeJobs):
    """Where a pair's BUG comes from, from the probe and replay jobs ProbeJobs runs; and the shared-state
    comparison (`resync`) whose replay the localization of the divergent step reuses."""

    def resync(self, pair, every: int, extra: list[int] | None = None) -> dict[str, Any]:
        """One step of the candidate from the reference's state at every resync point (every `every`-th
        step, every evaluation step of the reference, the steps around each kink of its learning-rate
        schedule (resync.schedule_points), and the first divergent step of the training series and the one
        before it), against the reference there (computing the candidate's declared formulas when it declares emulated
        differences); `extra` replaces the divergent steps (compare passes every pair's, so that one reference
        job serves all candidates): harness.resync.judge's section, or {"skipped": why} / {"error": why}. The replay is
        kept, so that localizing the divergent step reuses it (one reference, one float64, one candidate
        process for every point)."""
        from . import resync as R
        ref, cand = pair.a, pair.b
        recs = {d["id"]: d for d in cand.declared}
        statistical = sorted(i for i in recs if DIFFERENCES.get(i) is not None and DIFFERENCES[i].statistical)
        if statistical:
            return {"skipped": f"framework-RNG dropout ({', '.join(statistical)}): no deterministic step to compare"}
        emu = self.emulation(ref, cand)
        chk, change = emu["check"], emu["change"]
        if chk.get("skipped"):
            return {"skipped": f"declared difference(s) {', '.join(chk['skipped_differences'])} not emulated "
                               f"({chk['skipped']}): no reference step to compare with"}
        steps = ref.steps_compared
        evals = [int(t) for t in np.asarray(ref.eval_step)] if every > 0 else []   # the evaluation points too
        sched = R.schedule_points(ref.values["lr"]) if every > 0 else []           # and the schedule's kinks
        at = R.resync_points(steps, every, list(divergent_steps(pair) if extra is None else extra) + evals + sched)
        if not at:
            return {"skipped": f"no resync point (no checkpoint of {ref.name} with a step after it)"}
        try:
            rep = self.replay(ref, cand, at, change)
        except (BackendFailed, BadInput) as e:
            return {"error": str(e).splitlines()[0], "points": at}
        if "error" in rep:
            return {"error": rep["error"], "points": at}
        out, rep = self._judged(ref, cand, rep, change, implied_step(ref, rep, change), emulated=change is not None)
        self._replays[(ref.name, cand.name, change_tag(change or {}))] = rep
        out["sensitivity_seeds"] = rep.get("sensitivity_seeds", len(SENSITIVITY_SEEDS))
        out["every"] = every
        if pair.first is not None or pair.saturated:   # the curves diverged or say nothing: does each side
            out["self_replay"] = self.self_replay(cand)   # reproduce its own training from its own checkpoints?
            out["self_replay_reference"] = self.self_replay(ref)
        if change is not None:
            out["against"] = {"emulated": chk.get("emulated"), "change": change,
                              **({"reference_check": chk["reference_check"]} if chk.get("reference_check") else {})}
        try:
            own = self.reference_check(ref, chk, at) if out["agree"] else None
        except (BackendFailed, BadInput) as e:
            own = {"agree": False, "error": str(e).splitlines()[0]}
        if own is not None and own.get("error"):   # reference_check: a DECLARED made without it is withdrawn
            return {"error": f"the reference's own steps: {own['error']}", "points": at, "reference_check": True}
        return own if own is not None and own.get("reference_side") else out   # the reference's own step differs

    def __call__(self, pair) -> dict[str, Any]:
        try:
            return self.localize(pair)
        except (BackendFailed, BadInput) as e:
            msg = str(e).splitlines()[0]
            return {"stage": None, "method": None, "error": msg, "summary": "not localized (a job failed)",
                    "lines": [f"localization failed: {msg}"]}

    def localize(self, pair) -> dict[str, Any]:
        ref, cand, first = pair.a, pair.b, pair.first
        layers = spec_layers(ref.manifest)
        d = int(first["step"])
        # (a) data
        if pair.checksum_step is not None and pair.checksum_step <= d:
            t = pair.checksum_step
            i, j = int(np.searchsorted(ref.step, t)), int(np.searchsorted(cand.step, t))
            line = (f"localized by batch checksums: data: step {t} was fed a different batch "
                    f"({cand.checksum[j].decode()} vs reference {ref.checksum[i].decode()})")
            return {"stage": "data", "method": "batch checksum", "step": t, "layer": None, "parameter": None,
                    "probe": None, "summary": f"data: batch of step {t}", "lines": [line], "disagreeing_keys": []}
        # (b) step-0 probes of both configurations; against the reference computing every emulated difference
        # the candidate declares, when it declares some (`declared_check`)
        emu = self.emulation(ref, cand)
        cand0, ref0 = self.probe0(cand), self.probe0(ref)   # each loaded once: analysed, then its report
        chk = emu["check"]
        change = emu["change"]
        nudged0, plain0 = (self.nudged_at_step0(ref, cand, change, s) for s in ("sensitivity", "plain_sensitivity"))
        res = analyse(cand0, ref0, layers, ref64=self.probe64(ref, cand), nudged=plain0)
        method = "step-0 probes"
        if change is not None:
            plain = res
            res = analyse(cand0, self.probe0(ref, **change), layers, ref64=self.probe64(ref, cand, **change),
                          nudged=nudged0)
            chk.update(verified=True, agree=agrees(res), change=change,
                       before={"stage": plain["stage"], "probe": plain["probe"],
                               "disagreeing_keys": plain["disagreeing_keys"]},
                       evidence=[f"step 0: {k}" for k in plain["disagreeing_keys"]])
            method = f"step-0 probes against {against_text(chk)}"
        if res["stage"] is None and change is not None and (own := self.reference_check(ref, chk)) is not None:
            chk["reference_check"]["agree"] = own["agree"]
            if not own["agree"]:
                res, method = own, (f"the reference's own step-0 probes against its declared formula computed "
                                    f"by {change_text(chk['reference_check']['change'])}")
        if res["stage"] is not None and not res.get("reference_side"):
            res = self._reduction(ref, cand, res, layers, change or {})
        if res["stage"] is not None:
            res = self._set_aside_declared(ref, cand, cand0, res, layers, change or {}, chk.get("same", [])
                                           + (chk.get("emulated", []) if change is not None else []))
        def report0(gaps: tuple[str, ...] = reported.GAP_SERIES) -> dict[str, Any] | None:   # (b2) at step 0
            return reported.localize(pair, ref0, align(cand0, ref0, layers)[0], layers[-1], self.first_batch,
                                     replayed=self.replayed_rows(ref, cand, 0, change), gaps=gaps)
        if res["stage"] is None and (rep := report0()):
            return dict(rep, step0=res, declared_check=chk or None)
        if res["stage"] is not None and not res.get("reference_side") and not res.get("missing_keys"):
            # for a resync that finds the probes' disagreement a kink, what step 0 shows besides (a kink moves the norms)
            res["fallback"] = report0(("loss",)) or eval_from_start(pair, "the step-0 probes' disagreement aside", True)
        if res["stage"] is None or (res.get("set_aside") or {}).get("all"):
            train_div = [c.diverged_step for s, c in pair.checks.items() if s not in EVAL_SERIES and c.diverged_step is not None]
            # (c) the evaluation of the same initial state differs; no declared difference moves that (pair.can_move)
            if res["stage"] is None and (ev := eval_from_start(pair)) is not None:
                return dict(ev, step0=res, declared_check=chk or None)
            # (d) replay from the reference's state just before the divergence
            dt = min(train_div) if train_div else d
            last = int(ref.step[-1])
            at = sorted({max(dt - 1, 0), min(dt, last)})
            if at != [0] and res["stage"] is None:
                cached = self._cached_replay(ref, cand, at, change)   # a resync's: its reference check ran there
                rep, step0 = cached or self.replay(ref, cand, at, change), res
                if "error" in rep:
                    res = dict(step0, replay=rep)
                else:
                    for t, pa, pb, p64, plain_b in rep["probes"]:
                        if plain_b is not None:   # what the plain reference's step disagrees in: the evidence
                            chk["evidence"] += [f"step {t}: {k}" for k in
                                                analyse(pa, plain_b, layers, ref64=p64, nudged=(
                                                    rep.get("plain_sensitivity") or {}).get(t))["disagreeing_keys"]]
                        r = analyse(pa, pb, layers, ref64=p64 if plain_b is None else rep["emulated64"].get(t),
                                    nudged=(rep.get("sensitivity") or {}).get(t), rows=reported.rows_at(rep, t, plain_b))
                        if r["stage"] is not None:
                            res, method = r, f"replay of step {t} from the reference's state" + (
                                f", against {against_text(chk)}" if change is not None else "")
                            res["step"] = t
                            if chk.get("verified"):
                                chk["agree"] = False
                            break
                    res["replay"] = {k: v for k, v in rep.items() if k not in PROBE_KEYS}
                    res["step0"] = {k: step0[k] for k in ("stage", "disagreeing_keys")}
                if res["stage"] is None and cached is None and "error" not in rep and chk.get("reference_check"):
                    own = self.reference_check(ref, chk, at)     # no resync: the reference's own replayed steps
                    if own and own.get("first_disagreement"):
                        res, method = dict(own["first_disagreement"], reference_side=True), (
                            f"the reference's own replayed step {own['first_disagreement']['step']} against its "
                            f"declared formula computed by {change_text(chk['reference_check']['change'])}")
                        chk["reference_check"]["agree"] = False
                if res["stage"] is None and "error" not in rep and (late := self.report_at(pair, rep, layers[-1])):
                    return dict(late, step0=step0, replay=res.get("replay"), declared_check=chk or None)   # (b2)
        if chk:
            res["declared_check"] = chk
        restart = self.restart0(cand)
        if restart.get("checked"):
            res["restart"] = restart
        summary, lines = describe(res, method)
        summary += " (the reference's own step)" if res.get("reference_side") and summary else ""
        if res["stage"] is None:
            where = "step-0 probes" + (f" and replayed steps {res['replay'].get('at')}" if res.get("replay") else "")
            lines = [f"not localized: {where} agree within the probe tolerance (rel {probes.REL_TOL:g} for "
                     f"derivatives, {probes.CONTINUOUS_TOL:g} for activations, loss, buffers and eval, or 3x the "
                     "reference's own error against its float64 probe for another code path)"
                     + ("" if change is None else f", against {against_text(chk)}")]
            summary = "not localized"
            if (res.get("replay") or {}).get("error"):
                lines.append(f"replay: {res['replay']['error']}")
        if res.get("set_aside"):
            sa = res["set_aside"]
            lines.append(f"set aside: {len(sa['keys'])} probes that declared difference(s) {', '.join(sa['differences'])} "
                         f"may move ({', '.join(sa['keys'][:3])}{' ...' if len(sa['keys']) > 3 else ''}; no emulation)"
                         + ("; no other probe disagrees" if sa.get("all") else "; localized on the probes left"))
        if chk.get("verified"):
            lines.append(f"declared difference(s) {', '.join(chk['emulated'])} checked against {against_text(chk)}: "
                         f"{len(chk['before']['disagreeing_keys'])} step-0 probes "
                         f"disagreed with the plain reference, {len(chk['evidence'])} probes in all; "
                         + ("every compared probe agrees with the emulating reference" if chk["agree"] else
                            f"{len(res['disagreeing_keys'])} still disagree with it"))
        if chk.get("skipped"):
            lines.append(f"declared difference(s) {', '.join(chk['skipped_differences'])}: not verified ({chk['skipped']})")
        if restart_differs(res):
            lines.append(f"restart check: a fresh backend loading the state {cand.name} exported after its first "
                         f"probe step takes the second differently ({restart['key']} rel {restart['rel']:.2g}): state "
                         "the checkpoint does not hold (e.g. gradients accumulated across steps)")
        rep = res.get("replay") or {}
        if rep.get("reproduced"):
            r = rep["reproduced"]
            lines.append(f"replay from checkpoint {r['from_step']} reproduced the reference's steps "
                         f"{r['from_step']}..{r['to_step']} " + ("bitwise" if r["bitwise"] else
                                                                 f"to within {r['max_abs_diff']:.3g} (NOT bitwise)"))
        res.update(method=method if res["stage"] else None, summary=summary, lines=lines)
        return res

    def nudged_at_step0(self, ref: Run, cand: Run, change: dict | None, side: str = "sensitivity") -> list | None:
        """The reference's own 1-ULP-nudged steps from its initial state, from the pair's resync when it resynced
        step 0 (its replay probed them there): the step-0 probes are then held as the resync holds its step 0,
        a kink the reference's own rounding flips there allowed for (harness.probes.compare's `nudged`; their
        thinned activations have other shapes and are left out; `side` "plain_sensitivity": the plain
        reference's, not the emulating one's). None without such a resync."""
        rep = self._cached_replay(ref, cand, [0], change)
        return (rep.get(side) or {}).get(0) if rep else None

    def reference_check(self, ref: Run, chk: dict[str, Any], at: list[int] | None = None) -> dict[str, Any] | None:
        """The reference's own steps (step 0, or with `at` the resynced ones, their bias too) against another backend
        computing its declared formula from the same states (`chk["reference_check"]`, harness.emulating). None with
        nothing to check; else {"agree": True}, or the analysis that disagrees."""
        if not (rc := chk.get("reference_check")):
            return None
        layers, change = spec_layers(ref.manifest), rc["change"]
        if at is None:
            res = analyse(self.probe0(ref), self.probe0(ref, **change), layers, ref64=self.probe64(ref, ref, **change))
            return {"agree": True} if res["stage"] is None else dict(res, agree=False, reference_side=True, step=0)
        from . import resync as R
        rep = self.replay(ref, ref, at, change)
        if "error" in rep:
            return {"agree": False, "error": rep["error"]}
        # (sensitivity: the backend computing the formula's; the reference's nudges carry its bug); kinks as a candidate's
        out = self._judged(ref, ref, rep, change, implied_step(ref, rep, change), emulated=True)[0]
        against = {"emulated": rc["differences"], "change": change}
        return (dict(out, reference_side=True, against=against)
                if not out["agree"] or out["sequential"].get("bias") is not None else {"agree": True})

    def _judged(self, ref: Run, cand: Run, rep: dict[str, Any], change: dict[str, Any] | None, implied: Any, *,
                emulated: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        """(harness.resync.judge of `rep`, `rep` with more nudged steps). A point off in the backward pass only asks for
        them at every point, then for the candidate's own crossings there (harness.kinks), point by point."""
        from . import resync as R
        layers = spec_layers(ref.manifest)
        out = R.judge(rep, layers, analyse, emulated=emulated, implied=implied)
        if R.wants_more_sensitivity(out):
            rep = self.more_sensitivity(ref, rep)
            out = R.judge(rep, layers, analyse, emulated=emulated, implied=implied)
        crossings: dict[int, list[dict[str, Any]] | None] = {}
        while R.wants_more_sensitivity(out) and out["first_disagreement"]["step"] not in crossings:
            t = int(out["first_disagreement"]["step"])
            got = self.every_sample(ref, cand, rep, t, change)
            model = load_model(model_ref(ref.manifest, self.root))
            crossings[t] = None if got is None else (kinks.crossed(model, *got[:2]) + kinks.saturated(model, *got[:2])
                                                      + kinks.same_in_float64(got[2], got[1])
                                                      + kinks.same_when_recorded(model, *got[:2]))
            out = R.judge(dict(rep, crossings=crossings), layers, analyse, emulated=emulated, implied=implied)
        return out, rep

    def emulation(self, ref: Run, cand: Run) -> dict[str, Any]:
        """harness.emulating.emulation, with the installed backends' declarations."""
        return emulation(ref, cand, runner.backend_info())

    def _set_aside_declared(self, ref: Run, cand: Run, cand0: dict[str, np.ndarray], res: dict[str, Any],
                            layers: list[str], change: dict[str, Any], emulated: list[str]) -> dict[str, Any]:
        """Localize on the probes that no unverified declared difference may move.

        A difference that is not emulated here (framework-RNG dropout masks, a record outside the catalogue)
        is credited with at most the probes it names (`harness.runs.movable_keys`); a disagreement elsewhere
        is not its doing, and the first one of those is where the bug shows. When every disagreeing probe is
        one it may move, the result carries set_aside.all: the verdict engine decides (INCONCLUSIVE for a
        statistical difference, never DECLARED without an emulation unless the record names its keys and
        series exactly)."""
        keys = res.get("disagreeing_keys") or []
        if not keys or res.get("stage") in ("data", "reduction"):
            return res
        moves = movable_keys(ref, cand, keys, exclude=set(emulated))
        aside = [k for k in keys if moves.get(k)]
        if not aside:
            return res
        used = sorted({i for k in aside for i in moves[k]})
        statistical = any(DIFFERENCES[i].statistical for i in used if i in DIFFERENCES)
        if len(aside) == len(keys):
            return dict(res, set_aside={"differences": used, "keys": aside, "all": True, "statistical": statistical})
        drop = set(aside)
        r = analyse({k: v for k, v in cand0.items() if k not in drop},
                    {k: v for k, v in self.probe0(ref, **change).items() if k not in drop},
                    layers, ref64=self.probe64(ref, cand, **change))
        if r["stage"] is None:
            return res
        r["set_aside"] = {"differences": used, "keys": aside, "all": False, "statistical": statistical}
        return r

    def _reduction(self, ref: Run, cand: Run, res: dict[str, Any], layers: list[str], change: dict[str, Any]) -> dict[str, Any]:
        """A candidate on several replicas that agrees with the reference once run on one (the reference with
        the emulations in `change` but its own replica count)."""
        change = {k: v for k, v in change.items() if k != "devices"}
        if cand.options.devices == ref.options.devices or cand.options.devices == 1:
            return res
        try:
            single = self.probe0(cand, devices=1)
        except BackendFailed as e:
            if not e.unsupported:
                raise
            # a fault that exists only across replicas (grad_sum_replicas, overlapping_shards) is refused at
            # --devices 1: the same code on one device is then the run without it
            single = self.probe0(cand, devices=1, fault=None)
        one = analyse(single, self.probe0(ref, **change), layers, ref64=self.probe64(ref, cand, **change))
        # on one device everything up to where the replicas first disagree agrees (a later disagreement of the
        # single-device run, e.g. a BatchNorm beta's cancelling sum at the third probe step, is its own matter)
        if first_disagreement_later(one, res) and res.get("probe") not in one["disagreeing_keys"]:
            first = f"(first disagreement {res['probe']})"
            if one["stage"] is not None:
                first += f"; on one device the first is later, {one['probe']}"
            if res["stage"] != "forward":
                res = dict(res, stage="reduction",
                           note=f"agrees with --devices 1: the replicas combine gradients differently {first}")
            elif res["layer"] is not None and kinks.reads_fed_statistics(load_model(model_ref(ref.manifest, self.root)),
                                                                         res["layer"]):
                res = dict(res, across_replicas=f"agrees with --devices 1: the replicas' batch statistics at "
                                                f"{res['layer']} are not the single-device ones")
            else:
                res = dict(res, stage="data",
                           note=f"agrees with --devices 1: the replicas split the batch differently {first}")
        return res


__all__ = ["Localizer", "analyse", "checkpoints", "describe", "divergent_steps", "same_path"]
