"""DECLARED only with evidence: each way a declared difference used to hide a bug, on synthetic runs and
probes (the localizer's probe jobs replaced by arrays, the rest of localization and the verdict real).

A candidate that declares a difference is compared with the reference computing the declared formula
(per-replica BatchNorm: the candidate's replica count; Keras' biased running variance, replicate-padded
average pooling, epsilon-hat Adam, lr-in-velocity momentum: emulation faults). It is DECLARED only when
that reference agrees on every probe, the plain reference does not (evidence), and every diverging series
is one the difference can move."""
from __future__ import annotations

import numpy as np
import pytest

from algorithms.differences import DIFFERENCES
from harness.compare import BUG, DECLARED, INCONCLUSIVE, check_pair, compare, resolve
from harness.envelope import compute
from harness.localize import Localizer
from harness.probe_jobs import ReplayProbes
from harness.pair import can_move, probe_names
from harness.runs import declared_records, load_run, movable_keys

from .synthetic import SPEC, base_eval, base_series, family, write_run

N = 100
LAYERS = [l["name"] for l in SPEC["layers"]]
PARAMS = ["conv1.kernel", "conv1.bias", "fc1.kernel", "fc1.bias"]


def _decl(*ids: str) -> list[dict]:
    return [{"id": i, "probe_keys": ".*"} for i in ids]   # old manifests carried '.*': it must count for nothing


def probes(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    p = {f"forward/{l}": rng.standard_normal((4, 8)) for l in LAYERS}
    p.update({f"eval/{l}": rng.standard_normal((4, 8)) for l in LAYERS})
    p["loss"] = np.asarray(2.3)
    p.update({f"grad/{q}": rng.standard_normal(6) for q in PARAMS})
    for i in range(3):
        p.update({f"update{i}/{q}": rng.standard_normal(6) * 1e-2 for q in PARAMS})
    return p


class FakeLocalizer(Localizer):
    """Probe jobs answered from arrays: `table[(run name, frozenset(change))]`; no replay checkpoints."""

    def __init__(self, root, table):
        super().__init__(root, log=lambda m: None)
        self.table, self.calls = table, []

    def probe0(self, run, **change):
        self.calls.append((run.name, dict(change)))
        key = (run.name, frozenset(change.items()))
        if key not in self.table:
            from harness.runner import BackendFailed
            raise BackendFailed(f"no probe for {key}")
        return self.table[key]

    def probe64(self, ref, cand, **change):
        return None

    def first_batch(self, run):
        return None                  # synthetic runs, synthetic probes: no step-0 report to recompute

    def restart0(self, run):
        return {}                    # no probe job ran: no restart check recorded

    def replay(self, ref, cand, at, change=None):
        return {"error": "no replay in this test"}


@pytest.fixture
def fam(tmp_path):
    ref, members = family(tmp_path, N)
    ref, members = load_run(ref), [load_run(m) for m in members]
    return tmp_path, ref, members, compute(ref, members)


def _cand(root, name, declared, *, devices=1, dropout="harness", series=("update_norm",), at=0, fault=None):
    s, e = base_series(N), base_eval(N)
    for x in series:
        if x in s:
            s[x][at:] = s[x][at:] * 1.02
        else:
            i = int(np.searchsorted(np.arange(0, N + 1, 10), at))
            e[x][i:] = e[x][i:] * 1.02
    opts = {"threads": 1, "dtype": "float32", "fault": fault, "devices": devices, "dropout": dropout}
    return load_run(write_run(root, name, s, e, backend="keras-jax", declared=declared, options=opts, fault=fault))


def _judge(root, ref, env, cand, table, localize=True):
    loc = FakeLocalizer(root, table) if localize else None
    c = compare(ref, [cand], env, [], localize=loc, all_pairs=False)
    return c.pairs[0], loc



class _Declares:
    def __init__(self, *ids):
        self.declared = [{"id": i} for i in ids]


@pytest.mark.parametrize("diff,series,step,moves", [
    ("keras_momentum_velocity", "grad_norm", 0, False),   # its lr acts in the second update
    ("keras_momentum_velocity", "update_norm", 0, False),
    ("keras_momentum_velocity", "grad_norm", 2, True),
    ("adam_epsilon_hat", "update_norm", 0, True),          # the first update
    ("adam_epsilon_hat", "param_norm", 0, True),
    ("adam_epsilon_hat", "loss", 0, False),
    ("adam_epsilon_hat", "eval_loss", 0, False),
    ("adam_epsilon_hat", "eval_loss", 10, True),
    ("running_var_biased", "eval_loss", 0, False),         # evaluated before any step writes a buffer
    ("running_var_biased", "eval_loss", 10, True),
    ("running_var_biased", "loss", 10, False),             # not its series at all
    ("per_replica_batchnorm", "loss", 0, True),            # the forward of the first batch
    ("per_replica_batchnorm", "eval_accuracy", 0, False),
    ("keras_torch_avgpool_same", "eval_loss", 0, True),    # the inference forward itself
])
def test_a_declared_difference_moves_step_0_only_through_what_step_0_computes(diff, series, step, moves):
    """Both runs compute step 0 from the same initial state; a difference moves a series there only if its probe
    keys reach what that row is computed from (harness.pair.STEP0_KEYS), anywhere later if it is one of its series."""
    rec = declared_records(_Declares(diff))[diff]
    assert can_move(rec, series, step) is moves



def test_a_records_own_pattern_that_names_a_layer_moves_step_0_through_that_layer():
    """A manifest's own record (outside the catalogue) may name its layers and parameters: its pattern is matched
    against the model's names as the step-0 keys (harness.pair.probe_names, from the spec the manifest records), not
    only a stand-in name."""
    import re
    from algorithms.spec import load_model
    names = probe_names({"spec": load_model("cnn2d_hard").to_dict()})
    assert "bn1" in names and "fc1.kernel" in names
    rec = {"series": ("loss", "grad_norm"), "probe_keys": re.compile(r"^(forward/bn1|grad/fc1\.kernel)$")}
    assert can_move(rec, "loss", 0, names) and can_move(rec, "grad_norm", 0, names)
    assert not can_move(rec, "loss", 0, ["conv1"]) and not can_move(rec, "eval_loss", 0, names)
    grads = {"series": ("grad_norm",), "probe_keys": re.compile(r"^grad/fc1\.kernel$")}
    assert can_move(grads, "grad_norm", 0, names) and not can_move(grads, "grad_norm", 0, ["fc1"])


def test_a_difference_that_acts_after_a_step_does_not_absorb_a_step_0_divergence(fam):
    """Verified and with evidence, yet a training-side difference cannot explain what the same initial state
    computes: the lr inside Keras' velocity acts from the second update, so a gradient norm off at step 0 is not
    DECLARED; the biased running variance is written by training, so an evaluation off at step 0 (the initial state
    evaluated before any step) is localized at stage eval, not DECLARED. Off from step 10, both are DECLARED."""
    root, ref, _, env = fam
    plain = dict(probes(), **{"buffer0/bn.running_var": np.ones(8)})
    for diff, fault, key, series in (("keras_momentum_velocity", "keras_momentum_schedule", "update1/fc1.bias",
                                      ("grad_norm",)),
                                     ("running_var_biased", "bn_running_var_biased", "buffer0/bn.running_var",
                                      ("eval_loss",))):
        emulated = dict(plain, **{key: plain[key] * 1.5})
        for at in (0, 10):
            cand = _cand(root, f"{diff}{at}", _decl(diff), series=series, at=at)
            table = {(ref.name, frozenset()): plain, (ref.name, frozenset({("fault", fault)})): emulated,
                     (cand.name, frozenset()): emulated}
            p, _ = _judge(root, ref, env, cand, table)
            if at:
                assert p.verdict == DECLARED and p.declared == [diff], (diff, p.notes)
            elif diff == "running_var_biased":
                assert p.verdict == BUG and p.localization["stage"] == "eval", p.notes
                assert "the same initial state evaluated before any step" in p.localization["lines"][0]
            else:
                assert p.verdict == BUG and any(f"cannot move series {series[0]}" in n for n in p.notes), p.notes


def test_step_0_probes_that_disagree_keep_the_evaluation_from_the_start_for_a_resync_that_finds_them_a_kink(fam):
    """The step-0 probes disagree on a gradient (a kink the resync may later find), and the evaluation is off from
    step 0: the localization names the gradient and keeps stage eval as its `fallback` (harness/resync_verdict.py
    takes it when the resync supersedes the gradient)."""
    root, ref, _, env = fam
    plain = probes()
    cand = _cand(root, "evalkink", [], series=("eval_loss",), at=0)
    table = {(ref.name, frozenset()): plain,
             (cand.name, frozenset()): dict(plain, **{"grad/fc1.bias": plain["grad/fc1.bias"] * 2})}
    p, _ = _judge(root, ref, env, cand, table)
    assert p.verdict == BUG and p.localization["stage"] == "backward", p.notes
    assert p.localization["fallback"]["stage"] == "eval"

# --------------------------------------------------------------------------- the catalogue
def test_no_difference_may_move_every_probe_and_each_names_its_series():
    for d in DIFFERENCES.values():
        assert d.probe_keys not in (".*", "") and d.series and "lr" not in d.series, d.id
        assert d.emulated or d.statistical, d.id            # verified, or never DECLARED
    assert DIFFERENCES["running_var_biased"].series == ("eval_loss", "eval_accuracy")
    assert DIFFERENCES["per_replica_batchnorm"].emulated_with == ("devices",)
    assert DIFFERENCES["native_dropout_masks"].statistical and not DIFFERENCES["native_dropout_masks"].emulated


def test_emulations_are_known_faults_and_combine():
    from algorithms.faults import EMULATIONS, FAULTS, check_fault, combine, parts
    assert all(d.emulated_by in FAULTS or d.emulated_by in EMULATIONS for d in DIFFERENCES.values() if d.emulated_by)
    f = combine(["bn_running_var_biased", "adam_eps_hat"])
    assert f == "adam_eps_hat+bn_running_var_biased" and parts(f) == {"adam_eps_hat", "bn_running_var_biased"}
    check_fault(f)
    with pytest.raises(ValueError, match="nonsense"):
        check_fault("adam_eps_hat+nonsense")


# --------------------------------------------------------------------------- per-replica BatchNorm
def test_per_replica_batchnorm_verified_against_the_reference_on_the_candidates_replicas(fam):
    root, ref, _, env = fam
    cand = _cand(root, "dp2", _decl("per_replica_batchnorm"), devices=2, series=("loss", "update_norm"))
    plain = probes()
    per_replica = dict(plain, **{k: plain[k] + 0.3 for k in plain if k != "forward/conv1" and not k.startswith("eval/")})
    table = {(ref.name, frozenset()): plain, (ref.name, frozenset({("devices", 2)})): per_replica,
             (cand.name, frozenset()): per_replica, (cand.name, frozenset({("devices", 1)})): plain}
    p, loc = _judge(root, ref, env, cand, table)
    assert p.verdict == DECLARED and p.declared == ["per_replica_batchnorm"], p.notes
    assert "devices 2" in p.notes[-1] and "verified" in p.notes[-1]
    assert (ref.name, {"devices": 2}) in loc.calls


def test_optimizer_bug_in_a_per_replica_batchnorm_run_is_a_bug_in_the_optimizer(fam):
    root, ref, _, env = fam
    cand = _cand(root, "dp2bug", _decl("per_replica_batchnorm"), devices=2, series=("loss", "update_norm"))
    plain = probes()
    per_replica = dict(plain, **{k: plain[k] + 0.3 for k in plain if k != "forward/conv1" and not k.startswith("eval/")})
    buggy = dict(per_replica, **{f"update0/{q}": per_replica[f"update0/{q}"] * 1.01 for q in PARAMS})
    table = {(ref.name, frozenset()): plain, (ref.name, frozenset({("devices", 2)})): per_replica,
             (cand.name, frozenset()): buggy,
             (cand.name, frozenset({("devices", 1)})): dict(plain, **{f"update0/{q}": plain[f"update0/{q}"] * 1.01
                                                                      for q in PARAMS})}
    p, _ = _judge(root, ref, env, cand, table)
    assert p.verdict == BUG, p.notes
    assert p.localization["stage"] == "optimizer" and p.localization["probe"].startswith("update0/")
    assert "per_replica_batchnorm do not explain probe update0/" in p.notes[-1]


# --------------------------------------------------------------------------- Keras running variance, avgpool
@pytest.mark.parametrize("diff,fault,key", [("running_var_biased", "bn_running_var_biased", "eval/fc1"),
                                            ("keras_torch_avgpool_same", "avgpool_replicate_pad", "forward/fc1")])
def test_emulated_layer_difference_hides_no_bug(fam, diff, fault, key):
    """The candidate computes the declared formula (agrees with the emulating reference) and, for the BUG
    case, something else besides."""
    root, ref, _, env = fam
    series = ("eval_loss",) if diff == "running_var_biased" else ("loss", "update_norm")
    plain = probes()
    emulated = dict(plain, **{key: plain[key] + 0.5})
    for bug, want in ((False, DECLARED), (True, BUG)):
        cand = _cand(root, f"{diff}{bug}", _decl(diff), series=series, at=10)
        got = dict(emulated, **({"grad/conv1.kernel": emulated["grad/conv1.kernel"] * 2} if bug else {}))
        table = {(ref.name, frozenset()): plain, (ref.name, frozenset({("fault", fault)})): emulated,
                 (cand.name, frozenset()): got}
        p, _ = _judge(root, ref, env, cand, table)
        assert p.verdict == want, (diff, bug, p.notes)
        if bug:
            assert p.localization["stage"] == "backward" and p.localization["parameter"] == "conv1.kernel"
        else:
            assert p.declared == [diff] and f"fault {fault}" in p.notes[-1]


def test_running_var_biased_cannot_absorb_a_training_divergence(fam):
    """shows_in enforced: the biased running variance moves the evaluation only."""
    root, ref, _, env = fam
    plain = probes()
    emulated = dict(plain, **{"eval/fc1": plain["eval/fc1"] + 0.5})
    cand = _cand(root, "rvtrain", _decl("running_var_biased"), series=("loss", "eval_loss"), at=10)
    table = {(ref.name, frozenset()): plain, (ref.name, frozenset({("fault", "bn_running_var_biased")})): emulated,
             (cand.name, frozenset()): emulated}
    p, _ = _judge(root, ref, env, cand, table)
    assert p.verdict != DECLARED and any("cannot move series loss" in n for n in p.notes), p.notes


def test_two_emulations_are_applied_at_once(fam):
    root, ref, _, env = fam
    plain = probes()
    both = dict(plain, **{"eval/fc1": plain["eval/fc1"] + 0.5, "update1/fc1.kernel": plain["update1/fc1.kernel"] * 1.1})
    cand = _cand(root, "two", _decl("adam_epsilon_hat", "running_var_biased"), series=("update_norm",), at=0)
    table = {(ref.name, frozenset()): plain,
             (ref.name, frozenset({("fault", "adam_eps_hat+bn_running_var_biased")})): both,
             (cand.name, frozenset()): both}
    p, _ = _judge(root, ref, env, cand, table)
    assert p.verdict == DECLARED and p.declared == ["adam_epsilon_hat", "running_var_biased"], p.notes


# --------------------------------------------------------------------------- Keras momentum at a schedule boundary
class ReplayLocalizer(FakeLocalizer):
    """Replays answered from arrays: the candidate's, the plain and the emulating reference's probes."""

    def __init__(self, root, table, replays):
        super().__init__(root, table)
        self.replays, self.replay_calls = replays, []

    def replay(self, ref, cand, at, change=None):
        self.replay_calls.append((at, change))
        cand_p, plain, emulated = self.replays
        return {"checkpoint_step": at[0], "at": at, "reproduced": None, "emulated64": {},
                "probes": ReplayProbes([(t, (cand_p, emulated if change else plain, None, plain if change else None))
                                        for t in at])}


def test_keras_momentum_boundary_is_verified_on_the_replayed_step_and_a_bug_there_is_a_bug(fam):
    """The step schedule changes the lr at step 40: the step-0 probes agree with both references, the
    curves leave at step 40, and the replay of steps 39 and 40 is compared with the reference computing
    Keras' velocity (fault keras_momentum_schedule)."""
    root, ref, _, env = fam
    plain = probes()
    table = {(ref.name, frozenset()): plain, (ref.name, frozenset({("fault", "keras_momentum_schedule")})): plain}
    at_boundary = dict(plain, **{f"update0/{q}": plain[f"update0/{q}"] * 1.2 for q in PARAMS})
    for bug, want in ((False, DECLARED), (True, BUG)):
        cand = _cand(root, f"nesterov{bug}", _decl("keras_momentum_velocity"), series=("update_norm", "loss"), at=40)
        table[(cand.name, frozenset())] = plain
        got = dict(at_boundary, **({"grad/fc1.bias": at_boundary["grad/fc1.bias"] * 1.5} if bug else {}))
        loc = ReplayLocalizer(root, table, (got, plain, at_boundary))
        p = compare(ref, [cand], env, [], localize=loc, all_pairs=False).pairs[0]
        assert p.verdict == want, (bug, p.notes)
        assert loc.replay_calls == [([39, 40], {"fault": "keras_momentum_schedule"})]
        if bug:
            assert p.localization["stage"] == "backward" and p.localization["step"] == 39
        else:
            assert p.declared == ["keras_momentum_velocity"] and "replay of steps [39, 40]" in p.notes[-1]
            assert all(e.startswith(("step 39:", "step 40:")) for e in p.localization["declared_check"]["evidence"])


# --------------------------------------------------------------------------- no evidence: never DECLARED
class NotEmulated(FakeLocalizer):
    """No backend computes the declared formula from the reference's configuration (harness/emulating.py)."""

    def emulation(self, ref, cand):
        ids = sorted(d["id"] for d in cand.declared)
        return {"change": None, "check": {"differences": ids, "emulated": [], "verified": False, "same": [],
                                          "skipped": "no backend computes it", "skipped_differences": ids}}


def test_a_catalogued_difference_that_was_not_verified_declares_nothing(fam):
    """Every disagreeing probe one the candidate's declared Adam convention may move, every diverging series one
    it names, but nothing computed its formula: INCONCLUSIVE, saying why (it was DECLARED 'not verified')."""
    root, ref, _, env = fam
    cand = _cand(root, "eps", [{"id": "adam_epsilon_hat"}], series=("update_norm",))
    plain = probes()
    moved = dict(plain, **{f"update0/{q}": plain[f"update0/{q}"] * 1.3 for q in PARAMS})
    c = compare(ref, [cand], env, [], localize=NotEmulated(root, {(ref.name, frozenset()): plain,
                                                                  (cand.name, frozenset()): moved}), all_pairs=False)
    p = c.pairs[0]
    assert p.verdict == INCONCLUSIVE, (p.verdict, p.notes)
    assert any("adam_epsilon_hat may move, but they were not verified (no backend computes it): not DECLARED" in n
               for n in p.notes), p.notes


def test_declared_difference_with_no_probe_disagreement_is_not_declared(fam):
    root, ref, _, env = fam
    plain = probes()
    for at, want in ((0, BUG), (40, INCONCLUSIVE)):
        cand = _cand(root, f"noev{at}", _decl("adam_epsilon_hat"), series=("update_norm",), at=at)
        table = {(ref.name, frozenset()): plain, (ref.name, frozenset({("fault", "adam_eps_hat")})): plain,
                 (cand.name, frozenset()): plain}
        p, _ = _judge(root, ref, env, cand, table)
        assert p.verdict == want, p.notes
        assert any("nothing there shows the difference at work" in n for n in p.notes)


def test_no_localize_or_a_failed_localization_is_never_declared(fam):
    root, ref, _, env = fam
    cand = _cand(root, "noloc", _decl("adam_epsilon_hat"), series=("update_norm",))
    p, _ = _judge(root, ref, env, cand, {}, localize=False)
    assert p.verdict == BUG and any("--no-localize" in n and "not checked" in n for n in p.notes)
    p, _ = _judge(root, ref, env, cand, {})      # every probe job fails
    assert p.verdict == BUG and any("localization failed" in n for n in p.notes), p.notes


# --------------------------------------------------------------------------- framework-RNG dropout
def test_native_dropout_is_inconclusive_never_declared_and_a_bug_before_the_dropout_is_a_bug(tmp_path):
    spec = dict(SPEC, layers=SPEC["layers"][:3] + [{"type": "dropout", "name": "drop1"}] + SPEC["layers"][3:])
    ref_dir, members = family(tmp_path, N)
    import json
    for d in [ref_dir] + members:      # the model has a dropout layer after flatten_1
        m = json.loads((d / "manifest.json").read_text())
        (d / "manifest.json").write_text(json.dumps(dict(m, spec=spec)))
    ref, members = load_run(ref_dir), [load_run(m) for m in members]
    env = compute(ref, members)
    layers = [l["name"] for l in spec["layers"]]
    plain = probes()
    plain["forward/drop1"] = plain["forward/flatten_1"]
    masks = dict(plain, **{k: v + 0.4 for k, v in plain.items()
                           if k.startswith(("grad/", "update")) or k in ("forward/drop1", "forward/fc1", "loss")})
    for bug, want in ((False, INCONCLUSIVE), (True, BUG)):
        s = base_series(N)
        s["loss"] = s["loss"] * 1.02
        cand = load_run(write_run(tmp_path, f"native{bug}", s, base_eval(N), backend="tensorflow", spec=spec,
                                  declared=_decl("native_dropout_masks"),
                                  options={"threads": 1, "dtype": "float32", "devices": 1, "dropout": "native"}))
        got = dict(masks, **({"forward/conv1": masks["forward/conv1"] * 1.5} if bug else {}))
        moved = movable_keys(ref, cand, list(got))
        assert "forward/conv1" not in moved and "eval/fc1" not in moved and "forward/fc1" in moved
        table = {(ref.name, frozenset()): plain, (cand.name, frozenset()): got}
        c = compare(ref, [cand], env, [], localize=FakeLocalizer(tmp_path, table), all_pairs=False)
        p = c.pairs[0]
        assert p.verdict == want and DECLARED != p.verdict, (bug, p.notes)
        if bug:
            assert p.localization["stage"] == "forward" and p.localization["layer"] == "conv1"
        else:
            assert any("--stat" in n for n in p.notes)
    # without localization there is nothing to compare: INCONCLUSIVE with the reason, never DECLARED
    p = compare(ref, [cand], env, [], localize=None, all_pairs=False).pairs[0]
    assert p.verdict == INCONCLUSIVE and any("--stat" in n for n in p.notes)
    assert layers.index("drop1") == 3


# --------------------------------------------------------------------------- lr is exact
def test_lr_is_compared_exactly(fam):
    root, ref, _, env = fam
    s = base_series(N)
    for i in (20, 40, 60, 80):          # four isolated points, each far below the envelope floor
        s["lr"][i] = np.nextafter(s["lr"][i], 1.0)
    cand = load_run(write_run(root, "lr", s, base_eval(N)))
    p = check_pair(env, ref, cand)
    assert p.verdict == BUG and p.first["series"] == "lr" and p.first["step"] == 20
    assert p.checks["lr"].reason == "exact"
    resolve(p, False)
    assert p.verdict == BUG


# --------------------------------------------------------------------------- --stat: never DECLARED
@pytest.mark.parametrize("declared,want", [(["adam_epsilon_hat"], INCONCLUSIVE), (["native_dropout_masks"], BUG)])
def test_stat_mode_never_declares(tmp_path, declared, want):
    """A significant difference of means in a group that declares a difference: --stat has no evidence for
    it (INCONCLUSIVE, verify in lock-step); dropout masks explain no difference of means (BUG)."""
    from harness.stats import stat_compare
    rng = np.random.default_rng(0)
    runs = []
    for backend, shift, decl in (("torch", 0.0, []), ("keras-jax", 0.05, _decl(*declared))):
        for sd in range(5):
            e = {k: v.copy() for k, v in base_eval(N).items()}
            e["eval_loss"][-1] = 0.15 + shift + 0.005 * rng.standard_normal()
            runs.append(load_run(write_run(tmp_path, f"{backend}_s{sd}", base_series(N), e, backend=backend,
                                           seed=sd, declared=decl)))
    c = stat_compare(runs, "torch", ["eval_loss"], None, 0.05)
    v = c.verdicts["keras-jax"]
    assert v["verdict"] == want and v["verdict"] != DECLARED, v
    if want == INCONCLUSIVE:
        assert "cannot verify" in v["reason"]


# --------------------------------------------------------------------------- real runs (torch only)
def _judged(results_root, ref: dict, cands: list[dict], folder: str = "declared-dp2", **hparams) -> dict:
    """cnn2d_hard runs of 4 steps (RunConfig fields per run; torch unless they name a backend), the candidates
    judged against `ref` with the reference alone as the envelope: the probe-level verdict is what is tested."""
    from algorithms.contract import RunConfig
    from algorithms.optim import HParams
    from harness import runner

    from .conftest import need
    for b in {kw.get("backend", "torch") for kw in [ref, *cands]}:
        need(b)
    root = results_root / folder
    root.mkdir(exist_ok=True)
    hp = HParams(**{"steps": 4, "eval_every": 4, "checkpoint_every": 4, **hparams})
    run = lambda kw: load_run(runner.execute(RunConfig(**{"model": "cnn2d_hard", "backend": "torch", "hparams": hp,
                                                          **kw}), root))
    r, cs = run(ref), [run(kw) for kw in cands]
    c = compare(r, cs, compute(r, [r]), [r], localize=Localizer(root, log=lambda m: None), all_pairs=False)
    return {p.b.name: p for p in c.pairs}


@pytest.fixture(scope="module")
def dp2_hard(results_root):
    """torch on one device (the reference), torch on 2 DDP ranks clean and with lr_scale_1.001 (every dp=2 run
    leaves the envelope at step 0 by ~700x, per-replica statistics; about 8 backend processes)."""
    pairs = _judged(results_root, {}, [{"devices": 2}, {"devices": 2, "fault": "lr_scale_1.001"}])
    clean, faulty = sorted(pairs, key=lambda n: "fault" in n)
    return pairs, clean, faulty


@pytest.mark.slow
def test_clean_dp2_batchnorm_run_is_declared_against_the_reference_on_two_replicas(dp2_hard):
    pairs, clean, _ = dp2_hard
    p = pairs[clean]
    assert p.first["step"] == 0                                  # it does leave the envelope
    assert p.verdict == DECLARED and p.declared == ["per_replica_batchnorm"], p.notes
    chk = p.localization["declared_check"]
    assert chk["change"] == {"devices": 2} and chk["agree"] and chk["evidence"]


@pytest.mark.slow
def test_optimizer_bug_in_a_dp2_batchnorm_run_is_a_bug_in_the_optimizer(dp2_hard):
    pairs, _, faulty = dp2_hard
    p = pairs[faulty]
    assert p.verdict == BUG and p.first["series"] in ("loss", "lr"), p.notes
    assert p.localization["stage"] == "optimizer" and p.localization["probe"].startswith("update0/")


@pytest.fixture(scope="module")
def dp2_reference(results_root):
    """The reference on 2 DDP ranks (per-replica statistics, which it declares itself): the one-device run
    (global statistics) and a dp 2 run with a BatchNorm eps bug as candidates."""
    pairs = _judged(results_root, {"devices": 2}, [{}, {"devices": 2, "fault": "bn_eps_keras"}])
    one, eps = sorted(pairs, key=lambda n: "fault" in n)
    return pairs, one, eps


@pytest.mark.slow
def test_a_data_parallel_reference_undoes_its_own_per_replica_statistics(dp2_reference):
    """Against a reference on 2 replicas, a candidate with global statistics is DECLARED by the reference's own
    declaration only when the reference on one device agrees with it; a BatchNorm bug in a candidate with the
    reference's own per-replica statistics is a BUG at that BatchNorm (it was set aside as the reference's
    declared difference, DECLARED 'not verified')."""
    pairs, one, eps = dp2_reference
    p = pairs[one]
    assert p.verdict == DECLARED and p.declared == ["per_replica_batchnorm"], p.notes
    chk = p.localization["declared_check"]
    assert chk["change"] == {"devices": 1} and chk["agree"] and chk["evidence"], chk
    q = pairs[eps]
    assert q.verdict == BUG and q.localization["stage"] == "forward", q.notes
    assert q.localization["layer"] == "bn1", q.localization


@pytest.mark.slow
@pytest.mark.parametrize("fault", [None, "lr_rel_1e-02"])
def test_a_keras_references_own_adam_is_undone_and_its_own_steps_checked(results_root, fault):
    """A Keras reference declares its Adam formula itself; a torch candidate computes the plain one. The
    candidate is compared with jax computing the plain formulas from the reference's states, and the reference's
    own step with torch computing Keras' formula from them: clean, DECLARED and verified (before: INCONCLUSIVE,
    'declared by the reference run itself'); with a bug in the reference's own step, BUG there, said so."""
    from .conftest import need
    need("jax")   # the stand-in
    ref = {"backend": "keras-jax", "model": "cnn2d_2conv_2fc", **({"fault": fault} if fault else {})}
    pairs = _judged(results_root, ref, [{"model": "cnn2d_2conv_2fc"}], folder=f"declared-keras-ref-{fault}",
                    optimizer="adam", lr=0.002)
    (p,) = pairs.values()
    chk = p.localization["declared_check"]
    assert chk["change"]["backend"] == "jax", chk
    assert chk["reference_check"]["change"] == {"backend": "torch", "fault": "adam_eps_hat+adam_float32_betas"}, chk
    if fault is None:
        assert p.verdict == DECLARED and p.declared == ["adam_epsilon_hat", "keras_float32_betas"], p.notes
        assert p.evidence.startswith("verified") and "undone" in p.evidence, p.evidence
        assert chk["reference_check"]["agree"] is True
    else:
        assert p.verdict == BUG and p.localization["stage"] == "optimizer", p.notes
        assert p.localization.get("reference_side") and "the reference's own step" in p.localization["summary"]


@pytest.mark.slow
def test_a_keras_references_own_late_bug_is_found_without_a_resync(results_root):
    """Without the shared-state comparison (no resync: the localization replays only the divergent step and the
    one before it), the reference's own replayed steps are checked against its declared formula too. A Keras
    reference declares lr-in-velocity momentum (under a step schedule: it first shows at the decay, step 4);
    with its learning rate 1 % off from step 3 (past what the step-0 probes step through) it is BUG at its own
    step 3, not DECLARED."""
    from .conftest import need
    need("jax")   # the stand-in
    ref = {"backend": "keras-jax", "model": "cnn2d_2conv_2fc", "fault": "lr_rel_1e-02_from_3"}
    pairs = _judged(results_root, ref, [{"model": "cnn2d_2conv_2fc"}], folder="declared-keras-ref-late",
                    optimizer="momentum", lr=0.05, schedule="step", step_size=4, steps=6, checkpoint_every=2,
                    eval_every=6)
    (p,) = pairs.values()
    assert p.verdict == BUG and p.localization.get("reference_side"), (p.notes, p.localization.get("method"))
    assert p.localization["step"] == 3 and p.localization["stage"] == "optimizer", p.localization
    assert "the reference's own step" in p.localization["summary"]
    assert p.localization["declared_check"]["reference_check"]["agree"] is False


# --------------------------------------------------------------------------- the torch emulations themselves
def test_torch_emulations_compute_the_declared_formulas():
    """bn_running_var_biased: the running variance moves towards the biased batch variance (and the
    gradient still flows); avgpool_replicate_pad: edge-replicated padding counted in the mean (only where
    the padding is asymmetric); bn_replica_mean_running_stats: the replicas' running statistics averaged."""
    from .conftest import need
    need("torch")
    import torch
    import torch.nn.functional as F

    from algorithms.spec import load_model
    from algorithms.faults import parts
    from wrappers.torch import TorchEntry
    from wrappers.torch.layers import fold_replica_buffers, forward
    model = load_model("cnn2d_hard")
    assert parts("adam_eps_hat+avgpool_replicate_pad+bn_running_var_biased") <= TorchEntry.emulations
    g = torch.Generator().manual_seed(0)
    params = {q.name: torch.randn(_torch_shape(q), generator=g) * 0.1
              for q in model.params}
    for q in model.params:
        if q.name.endswith("running_var"):
            params[q.name] = torch.ones_like(params[q.name])
        elif q.name.endswith("running_mean"):
            params[q.name] = torch.zeros_like(params[q.name])
    x = torch.randn(8, 1, 8, 8, generator=g)
    rec_plain, rec_emu = {}, {}
    plain = {k: v.clone().requires_grad_(not k.endswith(("running_mean", "running_var"))) for k, v in params.items()}
    emu = {k: v.clone().requires_grad_(not k.endswith(("running_mean", "running_var"))) for k, v in params.items()}
    forward(model, plain, x, train=True, masks=None, fault=None, record=rec_plain)
    out = forward(model, emu, x, train=True, masks=None, fault="avgpool_replicate_pad+bn_running_var_biased",
                  record=rec_emu)
    out.sum().backward()                                          # autograd survives the buffer update
    bn_in = rec_emu["conv1"].detach()
    want = 0.9 * 1.0 + 0.1 * bn_in.var(dim=(0, 2, 3), unbiased=False)
    assert torch.allclose(emu["bn1.running_var"], want, rtol=1e-6)
    assert not torch.allclose(plain["bn1.running_var"], want, rtol=1e-6)   # torch's own is the unbiased one
    pool = next(l for l in model.layers if l.name == "pool1")
    (t, b), (lft, r) = pool.padding
    src = rec_emu[model.layers[pool.index - 1].name].detach()
    ref = F.avg_pool2d(F.pad(src, (lft, r, t, b), mode="replicate"), pool.spec.options["pool"],
                       pool.spec.options["stride"])
    assert torch.allclose(rec_emu["pool1"], ref) and (t, b, lft, r) != (t, t, lft, lft)
    reps = [{"bn1.running_mean": torch.zeros(2)}, {"bn1.running_mean": torch.full((2,), 4.0)}]
    fold_replica_buffers(reps, "bn_replica_mean_running_stats")
    assert reps[0]["bn1.running_mean"].tolist() == [2.0, 2.0]


def _torch_shape(q) -> tuple[int, ...]:
    """A parameter's torch layout shape (conv kernels OIHW, dense kernels out x in)."""
    s = tuple(q.shape)
    if len(s) == 4:            # canonical HWIO
        return (s[3], s[2], s[0], s[1])
    if len(s) == 2:            # canonical in x out
        return (s[1], s[0])
    return s
