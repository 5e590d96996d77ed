"""Which backend computes a candidate's declared formula from the reference's states.

A declared difference is verified against the reference computing the candidate's convention (an emulation
fault: algorithms.faults.EMULATIONS, or a catalogued fault that emulates a framework's convention). Each
backend declares the emulations it computes (Entry.emulations, '+'-joinable; a catalogued fault in its
`faults` alone). Where the run chosen as the reference (`-r`) does not compute one, another installed backend
that does computes it: it loads the same canonical states and the same batches, so its step is the
reference's step with the declared formula in it, rounded by that backend (its own float32-vs-float64 error
calibrates the tolerance). Its configuration is the reference's, less the options that change how a step is
run but not what it computes (compilation, threads, memory format, oneDNN, processes standing in for hosts);
a backend that cannot run what is left (data parallelism, synchronized BatchNorm, float64) is not chosen.
Framework-free: the backends' declarations come from `python -m wrappers info` (harness.runner.backend_info).
"""
from __future__ import annotations

from typing import Any

from algorithms.differences import DIFFERENCES, REPLICA_MEAN_FOLD
from algorithms.faults import combine, parts

from .runs import Run

# RunConfig fields and `extra` switches that choose how a step runs, not what it computes: left at their
# defaults when another backend computes the reference's step
HOW_IT_RUNS = {"jit": True, "threads": 1}
EXTRA_THAT_CHANGES_THE_STEP = ("sync_bn",)


def computes(info: dict[str, Any], fault: str) -> bool:
    """Whether a backend (its `wrappers info` entry) computes the emulation `fault` ('+'-joined parts)."""
    return fault in info.get("faults", ()) or parts(fault) <= set(info.get("emulations", ()))


def _can_run(info: dict[str, Any], ref: Run, devices: int) -> bool:
    o, caps = ref.options, set(info.get("capabilities", ()))
    return (not info.get("missing") and (devices <= 1 or not info.get("no_data_parallel"))
            and (o.dtype != "float64" or "float64" in caps)
            and (not o.extra.get("sync_bn") or "sync_bn" in caps))


def _fault_on(info: dict[str, Any], faults: list[str], fold: bool | None) -> str | None:
    """The '+'-joined emulation a backend must run for `faults` and, where `fold` is not None (per-replica
    statistics emulated at dp > 1), running statistics folded as the candidate's (True: the MEAN over the
    replicas): its own fold, or replica 0's plus the MEAN emulation; None where it cannot (it folds the MEAN and
    the candidate keeps replica 0's, or it normalises over the global batch at dp N: one program over all replicas)."""
    how = info.get("replica_running_stats")
    mean = how == "mean"
    if fold is not None and (how == "global" or mean and not fold):
        return None     # no per-replica statistics at dp N at all, or the MEAN where the candidate keeps replica 0's
    return combine(faults + (["bn_replica_mean_running_stats"] if fold and not mean else [])) or ""


def emulating_backend(ref: Run, faults: list[str], info: dict[str, dict[str, Any]], devices: int | None = None,
                      fold: bool | None = None, avoid: str = "", exclude: frozenset[str] = frozenset(),
                      shared: tuple[str, ...] = ()) -> tuple[dict[str, Any] | None, str]:
    """(the RunConfig fields to change for the backend that computes `faults` (with the candidate's `fold` of
    per-replica running statistics, harness `_fault_on`) from `ref`'s states at `devices` replicas (default: the
    reference's): {"fault": ...} for the reference's own backend, with "backend" for another -- `avoid` (the
    candidate's: its own code would vouch for itself) last, `exclude` never --, which computes the `shared`
    emulations too (the reference's own conventions the candidate has as well: a Keras reference's Adam for a
    Keras candidate); None for none; why, when it is another or none)."""
    def fault_of(name: str) -> str | None:
        f = _fault_on(info[name], faults + ([] if name == ref.backend else list(shared)), fold)
        return f if f is not None and (not f or computes(info[name], f)) else None
    if ref.backend in info and ref.backend not in exclude and fault_of(ref.backend) is not None:
        return {"fault": fault_of(ref.backend)}, ""
    fault = (combine(faults + list(shared) + (["bn_replica_mean_running_stats"] if fold else []))
             or ("per-replica statistics" if fold is not None else "the plain formulas"))
    # another backend stands in only where it declares emulations: a backend that computes the reference's formulas
    # (one that declares none may run conventions of its own, or global statistics at dp N)
    able = sorted((n for n, i in info.items()
                   if not i.get("missing") and i.get("emulations") and n not in exclude and fault_of(n) is not None),
                  key=lambda n: (n == avoid, n))
    runs = [n for n in able if _can_run(info[n], ref, ref.options.devices if devices is None else devices)]
    if not runs:
        return None, (f"the reference's backend {ref.backend} does not compute {fault}, and "
                      + (f"{', '.join(able)}, which do, cannot run the reference's configuration" if able
                         else "no installed backend does")
                      + (f" (a {able[0]} run as the reference would verify it: -r {able[0]})" if able else ""))
    sub = runs[0]
    change: dict[str, Any] = {"backend": sub, "fault": fault_of(sub)}
    for k, default in HOW_IT_RUNS.items():
        if getattr(ref.options, k) != default:
            change[k] = default
    extra = {k: v for k, v in ref.options.extra.items() if k in EXTRA_THAT_CHANGES_THE_STEP}
    if extra != ref.options.extra:
        change["extra"] = extra
    return change, (f"the reference's backend {ref.backend} does not compute {fault}: {sub} computes it from the "
                    f"reference's states")


def _formulas(ids: list[str]) -> tuple[str, ...]:
    """The emulation faults of declared differences (those with one)."""
    return tuple(DIFFERENCES[i].emulated_by or "" for i in ids if i in DIFFERENCES and DIFFERENCES[i].emulated_by)


def _stand_in(ref: Run, cand: Run, mirrored: list[str], on: dict[str, Any], info: dict[str, dict[str, Any]],
              chk: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """The stand-in `on` (a backend other than the reference's and the candidate's, computing the candidate's
    formulas from the reference's states) kept when another backend computes the reference's own `mirrored`
    formulas from those states, for `chk["reference_check"]`; (None, why) otherwise."""
    faults = [DIFFERENCES[i].emulated_by or "" for i in mirrored]
    per_replica = ref.options.devices > 1 and any(d["id"] == PER_REPLICA for d in ref.declared)
    rc, _ = emulating_backend(ref, faults, info, avoid=cand.backend, exclude=frozenset({ref.backend}),
                              shared=_formulas(chk["same"]), fold=_folds_replica_mean(ref) if per_replica else None)
    if rc is None:
        return None, (f"declared by the reference run itself ({', '.join(mirrored)}), and no installed backend "
                      f"other than {ref.backend} computes {combine(faults)} from its configuration")
    chk["reference_check"] = {"differences": mirrored, "change": rc}
    return on, (f"the reference's own declared difference(s) {', '.join(mirrored)} undone: {on['backend']} computes "
                f"the candidate's formulas from the reference's states, and {rc['backend']} the reference's declared "
                f"formula ({rc.get('fault')}), checked against the reference's own steps")


PER_REPLICA = "per_replica_batchnorm"
# a difference the reference alone declares, and the RunConfig fields that undo it on the reference
UNDONE_ON_THE_REFERENCE = {PER_REPLICA: {"devices": 1}}


def _folds_replica_mean(run: Run) -> bool:
    """Whether a data-parallel run's running statistics are the MEAN of its replicas' (tf.distribute)."""
    return REPLICA_MEAN_FOLD in str((run.manifest.get("parallel") or {}).get("batchnorm", ""))


def emulation(ref: Run, cand: Run, info: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What the reference must run to compute every difference the candidate declares: `change` (the
    RunConfig fields: a '+'-joined emulation fault, the candidate's replica count), or None when there is
    nothing to emulate or it cannot be; `check` (for `declared_check`): differences, emulated ids, and
    skipped (why some declared difference is not verified) with skipped_differences, same (declared by both
    runs with one convention: no difference between them, nothing to set aside), emulated_on (why another
    backend than the reference's computes the formula). `info`: harness.runner.backend_info()."""
    ref_ids, cand_ids = {d["id"] for d in ref.declared}, {d["id"] for d in cand.declared}
    ids = sorted(cand_ids - ref_ids)
    emul = [i for i in ids if i in DIFFERENCES and DIFFERENCES[i].emulated]
    folds, ref_folds = _folds_replica_mean(cand), _folds_replica_mean(ref)
    ref_own = sorted(i for i in ref_ids - cand_ids if i not in UNDONE_ON_THE_REFERENCE)
    if PER_REPLICA in cand_ids & ref_ids:   # per-replica statistics on both sides
        if ref_folds and not folds:        # the reference's MEAN of its replicas' running statistics: not undone
            ref_own.append(PER_REPLICA)
        elif cand.options.devices != ref.options.devices or folds != ref_folds:
            emul.append(PER_REPLICA)       # over another replica count, or folded otherwise: emulated as usual
    # the reference's own formula differences (a Keras reference's Adam): undone by a stand-in, a third backend
    # computing the candidate's formulas from the reference's states, with the reference's own step checked
    # against its declared formula computed by another backend (`reference_check`)
    mirrored = [i for i in ref_own if i in DIFFERENCES and DIFFERENCES[i].emulated_by and not DIFFERENCES[i].emulated_with]
    ref_own = [i for i in ref_own if i not in mirrored]
    # the reference's own per-replica statistics against a candidate with global ones (one device's program
    # over the sharded batch, synchronized BatchNorm): the reference on one device computes the candidate's
    undone = sorted(i for i in ref_ids - cand_ids if i in UNDONE_ON_THE_REFERENCE)
    undo = {k: v for i in undone for k, v in UNDONE_ON_THE_REFERENCE[i].items()}
    chk: dict[str, Any] = {"differences": sorted(cand_ids | ref_ids), "emulated": emul + undone + mirrored,
                           "verified": False,
                           "same": sorted(cand_ids & ref_ids - set(emul) - set(ref_own))}   # one convention: none
    skipped = []
    if ref_own:
        skipped.append(("declared by the reference run itself: its emulation exists for the reference side "
                        "only", ref_own))
    rest = [i for i in ids if i not in emul]
    if rest:
        skipped.append(("no emulation: " + ", ".join(
            "framework-RNG masks, comparable only statistically" if DIFFERENCES.get(i) and DIFFERENCES[i].statistical
            else "not in the catalogue" if i not in DIFFERENCES else "none defined" for i in rest), rest))
    change: dict[str, Any] | None = None
    if (emul or undo) and ref.fault is not None:
        skipped.append((f"the reference carries fault {ref.fault}: it cannot also emulate the difference",
                        emul + undone + mirrored))
        chk["emulated"] = []
    elif emul or undo or mirrored:
        change = dict(undo)
        faults = [DIFFERENCES[i].emulated_by for i in emul if DIFFERENCES[i].emulated_by]
        for i in emul:
            for opt in DIFFERENCES[i].emulated_with:
                change[opt] = getattr(cand.options, opt)
        # per-replica statistics at dp > 1 (emulated, or shared and computed by another backend): the emulating
        # backend's running statistics folded as the candidate's
        fold = folds if (PER_REPLICA in emul + chk["same"]) and change.get("devices", ref.options.devices) > 1 else None
        exclude = frozenset({ref.backend, cand.backend}) if mirrored else frozenset()
        on, why = emulating_backend(ref, faults, info, change.get("devices"), fold, avoid=cand.backend,
                                    exclude=exclude, shared=_formulas(chk["same"]))
        if on is not None and mirrored:
            on, why = _stand_in(ref, cand, mirrored, on, info, chk)
        if on is None:                 # no backend computes it from the reference's configuration
            skipped.append((why, emul + undone + mirrored))
            chk["emulated"], change = [], None
            chk.pop("reference_check", None)
        else:
            change.update({k: v for k, v in on.items() if v})      # no "fault" key for an empty one
            if mirrored and ref.fault is not None:   # the stand-in computes the plain formulas: not the reference's fault
                change.setdefault("fault", None)
            chk.update({"emulated_on": why} if why else {})
    if skipped:
        chk["skipped"] = "; ".join(why for why, _ in skipped)
        chk["skipped_differences"] = sorted({i for _, xs in skipped for i in xs})
    if not ids and not ref_ids:
        chk = {}
    return {"change": change, "check": chk}


__all__ = ["computes", "emulating_backend", "emulation"]
