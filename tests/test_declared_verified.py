"""Declared differences are verified, not trusted: where the difference has an emulation in the reference
backend (`emulated_by`, a fault computing the declared formula), the candidate must agree with that
emulated reference on every step-0 probe. A real optimizer bug in a Keras AdamW run (coupled L2,
`l2_not_decoupled`) is no longer hidden by the declared `adam_epsilon_hat`, whose probe-key pattern
covers every optimizer update."""
from __future__ import annotations

import pytest

from algorithms.differences import DIFFERENCES
from harness.compare import BUG, DECLARED, check_pair, compare, resolve
from harness.envelope import compute
from harness.runs import load_run

from .synthetic import base_eval, base_series, family, write_run

N = 100
EPS_HAT = [{"id": "adam_epsilon_hat", "probe_keys": DIFFERENCES["adam_epsilon_hat"].probe_keys}]
RUNNING_VAR = [{"id": "running_var_biased", "probe_keys": DIFFERENCES["running_var_biased"].probe_keys}]


def test_emulations_are_catalogued_faults():
    from algorithms.faults import FAULTS
    assert DIFFERENCES["adam_epsilon_hat"].emulated_by == "adam_eps_hat"
    assert DIFFERENCES["keras_momentum_velocity"].emulated_by == "keras_momentum_schedule"
    assert all(d.emulated_by in FAULTS for d in DIFFERENCES.values() if d.emulated_by)


# --------------------------------------------------------------------------- resolve, on synthetic runs
@pytest.fixture
def pair_with(tmp_path):
    ref, members = family(tmp_path, N)
    ref, members = load_run(ref), [load_run(m) for m in members]
    env = compute(ref, members)
    s = base_series(N)
    s["update_norm"] = s["update_norm"] * 1.02

    def make(declared, loc):
        cand = load_run(write_run(tmp_path, f"keras{len(list(tmp_path.iterdir()))}", s, base_eval(N),
                                  backend="keras-jax", declared=declared))
        p = check_pair(env, ref, cand)
        p.localization = loc
        resolve(p, True)
        return p
    return make


def test_verified_agreement_is_declared_and_says_so(pair_with):
    chk = {"differences": ["adam_epsilon_hat"], "emulated": "adam_epsilon_hat", "fault": "adam_eps_hat",
           "verified": True, "agree": True}
    p = pair_with(EPS_HAT, {"stage": "optimizer", "disagreeing_keys": ["update0/fc1.kernel"], "declared_check": chk})
    assert p.verdict == DECLARED and p.declared == ["adam_epsilon_hat"]
    assert "verified: the reference with the declared formula (fault adam_eps_hat) agrees" in p.notes[-1]


def test_probe_left_by_the_emulation_is_a_bug_although_the_pattern_covers_it(pair_with):
    chk = {"differences": ["adam_epsilon_hat"], "emulated": "adam_epsilon_hat", "fault": "adam_eps_hat",
           "verified": True, "agree": False, "unexplained": "update0/fc1.kernel"}
    p = pair_with(EPS_HAT, {"stage": "optimizer", "disagreeing_keys": ["update0/fc1.kernel"], "declared_check": chk})
    assert p.verdict == BUG
    assert "adam_epsilon_hat does not explain probe update0/fc1.kernel" in p.notes[-1]
    assert "adam_epsilon_hat's formula" in p.notes[-1]


def test_difference_without_emulation_keeps_the_pattern_rule_and_says_unverified(pair_with):
    p = pair_with(RUNNING_VAR, {"stage": "forward", "disagreeing_keys": ["buffer0/bn1.running_var"]})
    assert p.verdict == DECLARED and p.declared == ["running_var_biased"]
    assert "not verified (no emulation of this difference)" in p.notes[-1]


def test_two_emulations_needed_at_once_fall_back_to_the_pattern_rule(pair_with):
    both = EPS_HAT + [{"id": "keras_momentum_velocity", "probe_keys": DIFFERENCES["keras_momentum_velocity"].probe_keys}]
    chk = {"differences": ["adam_epsilon_hat", "keras_momentum_velocity"], "emulated": None, "fault": None,
           "verified": False, "skipped": "two emulations would be needed at once (...)"}
    p = pair_with(both, {"stage": "optimizer", "disagreeing_keys": ["update1/fc1.kernel"], "declared_check": chk})
    assert p.verdict == DECLARED and "two emulations would be needed at once" in p.notes[-1]


# --------------------------------------------------------------------------- real runs: torch vs keras AdamW
@pytest.fixture(scope="module")
def adamw(results_root):
    """torch AdamW reference, keras AdamW clean and with coupled L2, one comparison: the reference's probe
    jobs (float32, float64, and both with the adam_eps_hat emulation) are shared. The envelope is the
    reference alone (zero spread, the rule's ULP floors): both keras runs leave it at step 0 by >100x,
    and what is tested here is the probe-level verdict, not the envelope (8 backend processes in all)."""
    from algorithms.optim import HParams
    from harness import runner
    from harness.localize import Localizer
    from harness.runner import RunConfig

    from .conftest import need
    need("torch")
    backend = next((b for b in ("keras-tensorflow", "keras-jax", "keras-torch") if not _missing(b)), None)
    if backend is None:
        pytest.skip("no keras backend installed")
    root = results_root / "declared"
    root.mkdir(exist_ok=True)
    hp = HParams(steps=5, optimizer="adamw", lr=1e-3, weight_decay=0.01, eval_every=5, checkpoint_every=5)
    cfg = lambda **kw: RunConfig(model="cnn2d_2conv_2fc", hparams=hp, **{"backend": "torch", **kw})
    ref = load_run(runner.execute(cfg(), root))
    env_runs = [ref]
    clean = load_run(runner.execute(cfg(backend=backend), root))
    faulty = load_run(runner.execute(cfg(backend=backend, fault="l2_not_decoupled"), root))
    c = compare(ref, [clean, faulty], compute(ref, env_runs), env_runs, localize=Localizer(root, log=lambda m: None),
                all_pairs=False)
    return {p.b.name: p for p in c.pairs}, clean.name, faulty.name


def _missing(backend: str) -> bool:
    from .conftest import INFO
    return bool(INFO[backend]["missing"])


def test_keras_adamw_clean_is_declared_and_verified(adamw):
    pairs, clean, _ = adamw
    p = pairs[clean]
    assert p.verdict == DECLARED and p.declared == ["adam_epsilon_hat"], p.notes
    chk = p.localization["declared_check"]
    assert chk["verified"] and chk["agree"] and chk["fault"] == "adam_eps_hat"
    assert "verified: the reference with the declared formula (fault adam_eps_hat) agrees" in p.notes[-1]


def test_keras_adamw_coupled_l2_is_a_bug_in_the_optimizer(adamw):
    pairs, _, faulty = adamw
    p = pairs[faulty]
    assert p.verdict == BUG, p.notes
    loc = p.localization
    assert loc["stage"] == "optimizer" and loc["probe"].startswith("update0/")
    assert loc["declared_check"]["verified"] and not loc["declared_check"]["agree"]
    assert any("adam_epsilon_hat does not explain probe" in n for n in p.notes)
    p.to_dict()   # the record stays serializable with the added field
