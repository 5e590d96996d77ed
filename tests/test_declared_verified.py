"""Declared differences are verified, not trusted: where the difference has an emulation in the reference
backend (`emulated_by`, a fault computing the declared formula), the candidate must agree with that
emulated reference on every probe (the synthetic cases are in test_declared_evidence.py). A real optimizer bug in a Keras AdamW run (coupled L2,
`l2_not_decoupled`) is no longer hidden by the declared `adam_epsilon_hat`, whose probe-key pattern
covers every optimizer update."""
from __future__ import annotations

import pytest

from algorithms.differences import DIFFERENCES
from harness.compare import BUG, DECLARED, compare
from harness.envelope import compute
from harness.runs import load_run




def test_emulations_of_the_keras_optimizers_are_catalogued_faults():
    from algorithms.faults import FAULTS
    assert DIFFERENCES["adam_epsilon_hat"].emulated_by == "adam_eps_hat" in FAULTS
    assert DIFFERENCES["keras_momentum_velocity"].emulated_by == "keras_momentum_schedule" in FAULTS


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
    from algorithms.contract import RunConfig

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
    pairs, clean, faulty = adamw
    p = pairs[clean]
    assert p.verdict == DECLARED and p.declared == ["adam_epsilon_hat", "keras_float32_betas"], p.notes
    chk = p.localization["declared_check"]
    both = "adam_eps_hat+adam_float32_betas"
    assert chk["verified"] and chk["agree"] and chk["change"] == {"fault": both} and chk["evidence"]
    assert f"verified: the reference computing the declared formula (fault {both}) agrees" in p.notes[-1]
    # the table's "where" and comparison.json say what makes it DECLARED (not the localization's "not localized")
    assert p.evidence.startswith("verified (step-0 probes") and p.to_dict()["declared_evidence"] == p.evidence
    assert pairs[faulty].to_dict()["declared_evidence"] is None


def test_keras_adamw_coupled_l2_is_a_bug_in_the_optimizer(adamw):
    pairs, _, faulty = adamw
    p = pairs[faulty]
    assert p.verdict == BUG, p.notes
    loc = p.localization
    assert loc["stage"] == "optimizer" and loc["probe"].startswith("update0/")
    assert loc["declared_check"]["verified"] and not loc["declared_check"]["agree"]
    assert any("adam_epsilon_hat, keras_float32_betas do not explain probe" in n for n in p.notes), p.notes
    p.to_dict()   # the record stays serializable with the added field
