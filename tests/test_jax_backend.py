"""The JAX backend on its own: compiled vs eager step, exact state round trips, replay from a
checkpoint, no recompilation under a schedule, probes that leave state alone, the layer semantics
the spec fixes (TF 'SAME', padding-excluded average, torch-convention BatchNorm), the optimizer
against the float64 reference, and two lowering faults that the probes must catch against torch.

Runs in this process (JAX is set up with its registry environment before it is first imported);
the float64 check runs in a child process, since x64 must be switched on before JAX starts.

The checks every backend passes alike run here as TestJaxContract (tests/backend_contract.py).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from algorithms.optim import HParams
from algorithms.params import init_params
from algorithms.spec import load_model

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("optax")
if "jax" not in sys.modules:      # the backend's own environment, as its worker process would set it
    from algorithms.contract import RunOptions
    from wrappers.__main__ import set_backend_env
    from wrappers.registry import REGISTRY
    set_backend_env(REGISTRY["jax"], RunOptions(threads=1))
jax = pytest.importorskip("jax")

from algorithms.contract import RunOptions  # noqa: E402
from wrappers.jax.backend import JaxBackend  # noqa: E402

from .backend_contract import HP, BackendContract, assert_same, batch, run_steps  # noqa: E402


def make(model, hp, params=None, **opts) -> JaxBackend:
    b = JaxBackend(model, hp, RunOptions(**opts))
    b.load_params(init_params(model, 0) if params is None else params)
    return b


class TestJaxContract(BackendContract):
    """tests/backend_contract.py's checks, on this backend."""
    backend = "jax"
    joint_program = True                          # jit: the recorded program is another XLA program

    def make(self, model, hp, params=None, **opts):
        return make(model, hp, params, **opts)

    def stored(self, b, name):
        return np.asarray(b.params[name])


# --------------------------------------------------------------------------- compilation
@pytest.mark.parametrize("case", ["momentum_step", "adamw"])
def test_eager_and_jit_steps_agree(case):
    m = load_model("cnn2d_hard")
    x, y = batch(m)
    jit, eager = make(m, HP[case]), make(m, HP[case], jit=False)
    sj, se = run_steps(jit, x, y, 3), run_steps(eager, x, y, 3)
    assert_same(jit.export_params(), eager.export_params(), exact=False, rtol=1e-4)
    assert_same(jit.export_opt_state(), eager.export_opt_state(), exact=False, rtol=1e-3)
    for a, b in zip(sj, se):
        assert a.loss == pytest.approx(b.loss, rel=1e-5)
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-4)
        assert a.update_norm == pytest.approx(b.update_norm, rel=1e-3)
        assert a.accuracy == b.accuracy


def test_the_step_compiles_once_under_a_schedule():
    m = load_model("cnn2d_2conv_2fc")
    x, y = batch(m)
    b = make(m, HParams(optimizer="momentum", lr=0.1, schedule="cosine", steps=6))
    run_steps(b, x, y, 6)
    assert len({b.lr_for(s) for s in range(6)}) == 6
    assert b._step._cache_size() == 1


# --------------------------------------------------------------------------- state


# --------------------------------------------------------------------------- layer semantics


# --------------------------------------------------------------------------- the optimizer in float64
F64_CHECK = textwrap.dedent("""
    import json, sys
    import numpy as np
    from algorithms.contract import RunOptions
    from wrappers.__main__ import set_backend_env
    from wrappers.registry import REGISTRY
    set_backend_env(REGISTRY["jax"], RunOptions(threads=1, dtype="float64"))
    from algorithms.optim import HParams, reference_init, reference_update
    from algorithms.params import init_params
    from algorithms.spec import load_model
    from algorithms.contract import RunOptions
    from wrappers.jax.backend import JaxBackend
    cases = json.loads(sys.argv[1])
    m = load_model("cnn2d_2conv_2fc")
    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, (16, 8, 8, 1)); y = rng.integers(0, 10, 16)
    masks = {}
    worst = {}
    for name, (hpd, fault) in cases.items():
        hp = HParams(**hpd)
        b = JaxBackend(m, hp, RunOptions(dtype="float64", fault=fault))
        b.load_params(init_params(m, 0))
        st = reference_init(hp, {n: v for n, v in b.export_params().items() if n in b.trainable})
        err = 0.0
        for t in range(3):
            p = {n: v for n, v in b.export_params().items() if n in b.trainable}
            _, g = b.gradients(x, y, masks)
            ref, st = reference_update(hp, t, p, g, st, adam_eps_hat=fault == "adam_eps_hat")
            b.train_step(t, x, y, masks)
            got = b.export_params()
            err = max(err, max(float(np.max(np.abs(got[n] - ref[n]))) / max(float(np.max(np.abs(ref[n] - p[n]))), 1e-12)
                               for n in ref))
        worst[name] = err
    print(json.dumps(worst))
""")


def test_optax_steps_are_the_reference_update_in_float64():
    from .optim_cases import REFERENCE_CASES as cases
    import json
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    r = subprocess.run([sys.executable, "-c", F64_CHECK, json.dumps(cases)], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    worst = json.loads(r.stdout.strip().splitlines()[-1])
    for name, err in worst.items():       # relative to the size of the update
        assert err < 1e-9, f"{name}: optax step differs from reference_update by {err:.2e} of the update"


def test_adam_bias_correction_is_exact_in_float32():
    """optax computes 1 - b2^t in float32 (b2 = 0.999 rounds up: 1.3e-5 off at t = 1); the injected
    lr / eps / weight decay make the float32 step use the exact corrections of the reference."""
    import jax.numpy as jnp
    import optax

    from wrappers.jax.optim import adam_hyperparams
    b1, b2, lr, eps, wd = 0.9, 0.999, 1e-3, 1e-8, 1e-2
    counts = np.array([0, 1, 9, 99, 999, 2999])
    c1 = 1 - b1 ** (counts + 1.0)
    c2 = 1 - b2 ** (counts + 1.0)
    base = {"learning_rate": jnp.float32(lr), "eps": jnp.float32(eps), "weight_decay": jnp.float32(wd)}
    for n, e1, e2 in zip(counts, c1, c2):
        h = adam_hyperparams(base, jnp.int32(n), b1, b2)
        q1 = 1 / float(optax.tree.bias_correction(jnp.float32(1), b1, jnp.int32(n + 1)))   # optax's own
        q2 = 1 / float(optax.tree.bias_correction(jnp.float32(1), b2, jnp.int32(n + 1)))
        if n == 0:
            assert abs(q2 / e2 - 1) > 1e-5           # the float32 error being corrected
        # optax: lr' (m / q1) / (sqrt(v / q2) + eps') = (lr' sqrt(q2) / q1) m / (sqrt(v) + eps' sqrt(q2));
        # the reference: (lr sqrt(c2) / c1) m / (sqrt(v) + eps sqrt(c2))
        assert float(h["learning_rate"]) * np.sqrt(q2) / q1 == pytest.approx(lr * np.sqrt(e2) / e1, rel=1e-6)
        assert float(h["eps"]) * np.sqrt(q2) == pytest.approx(eps * np.sqrt(e2), rel=1e-6)
        assert float(h["learning_rate"]) * float(h["weight_decay"]) == pytest.approx(lr * wd, rel=1e-6)


def test_l2_not_decoupled_is_adam_with_l2():
    m = load_model("cnn2d_2conv_2fc")
    x, y = batch(m)
    hp = HP["adamw"]
    faulty = make(m, hp, fault="l2_not_decoupled")
    adam = make(m, hp.with_(optimizer="adam"))
    run_steps(faulty, x, y, 2)
    run_steps(adam, x, y, 2)
    assert_same(faulty.export_params(), adam.export_params())
    clean = make(m, hp)
    run_steps(clean, x, y, 2)
    assert not np.array_equal(clean.export_params()["fc1.kernel"], faulty.export_params()["fc1.kernel"])


# --------------------------------------------------------------------------- against torch


