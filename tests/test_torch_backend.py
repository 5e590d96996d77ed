"""The reference backend on its own: torch.optim's steps against the reference optimizer maths
(`algorithms.optim.reference_update`, float64 NumPy) as the other backends are checked, exact state
round trips, and the torch-convention layer semantics the spec fixes; the checks every backend passes alike
(probes that leave the state alone, replay, the layer semantics, the faults) are tests/backend_contract.py's.

torch is the reference every other backend is judged against, so it must itself compute the reference
mathematics: a wrong momentum/Nesterov/Adam/weight-decay convention here would turn every other backend's
correct step into a BUG. Runs in this process (torch needs no environment set before import).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from algorithms.optim import HParams, reference_init, reference_update
from algorithms.params import init_params
from algorithms.spec import load_model

torch = pytest.importorskip("torch")

from algorithms.contract import RunOptions  # noqa: E402
from wrappers.torch.backend import TorchBackend  # noqa: E402
from wrappers.worker import masks_for  # noqa: E402

from .backend_contract import BackendContract  # noqa: E402
from .optim_cases import BASE, REFERENCE_CASES as CASES  # noqa: E402


def batch(model, n=16, seed=1, dtype=np.float64):
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (n, *model.input_shape)).astype(dtype)
    y = rng.integers(0, model.num_classes, n).astype(np.int64)
    return x, y


def make(model, hp: HParams, params=None, **opts) -> TorchBackend:
    b = TorchBackend(model, hp, RunOptions(**opts))
    b.load_params(init_params(model, 0) if params is None else params)
    return b


class TestTorchContract(BackendContract):
    """tests/backend_contract.py's checks, on the reference backend."""
    backend = "torch"
    opt_state_empty_before_first_step = True

    def make(self, model, hp, params=None, **opts):
        return make(model, hp, params, **opts)

    def stored(self, b, name):
        return b.p[name].detach().cpu().numpy()


@pytest.mark.parametrize("model_name", ["cnn2d_2conv_2fc", "cnn2d_hard"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_torch_optim_steps_are_the_reference_update_in_float64(model_name, case):
    """Each of 4 steps: torch's new parameters == reference_update(own params, own gradients), in float64."""
    hpd, fault = CASES[case]
    hp = HParams(**hpd)
    m = load_model(model_name)
    b = make(m, hp, dtype="float64", fault=fault)
    x, y = batch(m)
    st = reference_init(hp, {n: v for n, v in b.export_params().items() if n in b.trainable})
    worst = 0.0
    for t in range(hp.steps):
        masks = masks_for(m, hp.seed, t, len(x), b.opts.dropout)
        p = {n: v for n, v in b.export_params().items() if n in b.trainable}
        _, g = b.gradients(x, y, masks)
        ref, st = reference_update(hp, t, p, g, st, adam_eps_hat=fault == "adam_eps_hat")
        b.train_step(t, x, y, masks)
        got = b.export_params()
        for n in ref:      # relative to the size of the update, so a wrong convention of any size shows
            upd = max(float(np.max(np.abs(ref[n] - p[n]))), 1e-12)
            worst = max(worst, float(np.max(np.abs(got[n] - ref[n]))) / upd)
    assert worst < 1e-9, f"{case}: torch.optim differs from reference_update by {worst:.2e} of the update"


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_keras_adam_emulation_is_keras_formula_by_hand(optimizer):
    """The reference's emulation of Keras Adam (adam_eps_hat + adam_float32_betas, through torch.optim's lr,
    eps and weight decay) against Keras' update written out by hand in float64: float32 betas' bias
    corrections, epsilon outside them, decoupled decay lr * wd (AdamW)."""
    from algorithms.optim import float32_bias_corrections
    from wrappers.torch.optim import make_optimizer, set_hyper
    h = HParams(optimizer=optimizer, lr=0.01, weight_decay=0.1 if optimizer == "adamw" else 0.0, eps=1e-7)
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=50)
    w = torch.tensor(w0, dtype=torch.float64, requires_grad=True)
    opt = make_optimizer(h, [w], None)
    p, m, v = w0.copy(), np.zeros(50), np.zeros(50)
    for step in range(5):
        g = rng.normal(size=50) * 10.0 ** -step
        set_hyper(opt, [w], h, step, h.lr, None, "adam_eps_hat+adam_float32_betas")
        w.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
        k1, k2 = float32_bias_corrections(h, step + 1)
        p = p - p * h.weight_decay * h.lr
        m, v = m + (g - m) * (1 - h.beta1), v + (g * g - v) * (1 - h.beta2)
        p = p - h.lr * math.sqrt(k2) / k1 * m / (np.sqrt(v) + h.eps)
        np.testing.assert_allclose(w.detach().numpy(), p, rtol=1e-13, atol=0)


def test_a_wrong_convention_is_caught_by_that_check():
    """The check above can fail: torch's step against the reference of another optimizer is far off."""
    m = load_model("cnn2d_2conv_2fc")
    hp = HParams(optimizer="nesterov", lr=0.1, **BASE)
    b = make(m, hp, dtype="float64")
    x, y = batch(m)
    p = {n: v for n, v in b.export_params().items() if n in b.trainable}
    _, g = b.gradients(x, y, {})
    b.train_step(0, x, y, {})
    plain = hp.with_(optimizer="sgd")         # nesterov's first step is lr * (1 + mu) * g, not lr * g
    ref, _ = reference_update(plain, 0, p, g, reference_init(plain, p))
    got = b.export_params()
    err = max(float(np.max(np.abs(got[n] - ref[n]))) / max(float(np.max(np.abs(ref[n] - p[n]))), 1e-12) for n in ref)
    assert err > 0.5


@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
def test_params_and_opt_state_round_trip_and_replay_bit_exact(optimizer):
    """export -> load into a fresh backend -> the next steps are bitwise those of the original."""
    m = load_model("cnn2d_hard")
    hp = HParams(optimizer=optimizer, lr=0.05 if optimizer == "momentum" else 1e-3, schedule="cosine", **BASE)
    x, y = batch(m, dtype=np.float32)
    a = make(m, hp)
    for t in range(2):
        a.train_step(t, x, y, masks_for(m, hp.seed, t, len(x), a.opts.dropout))
    params, opt = a.export_params(), a.export_opt_state()
    b = make(m, hp)
    b.load_params(params)
    b.load_opt_state(opt, 2)
    for t in (2, 3):
        masks = masks_for(m, hp.seed, t, len(x), a.opts.dropout)
        sa, sb = a.train_step(t, x, y, masks), b.train_step(t, x, y, masks)
        assert (sa.loss, sa.grad_norm, sa.update_norm, sa.param_norm) == (sb.loss, sb.grad_norm, sb.update_norm, sb.param_norm)
    pa, pb = a.export_params(), b.export_params()
    assert all(np.array_equal(pa[n], pb[n]) for n in pa)


def test_batchnorm_keeps_torch_convention():
    """Training mode normalizes with the biased batch variance; the running variance stored is unbiased,
    moved with momentum 0.1 in torch's convention (r = 0.9 r + 0.1 x): the reference the Keras runs declare
    their biased variance against."""
    m = load_model("cnn2d_hard")
    hp = HParams(optimizer="sgd", lr=1e-3, **BASE)
    x, y = batch(m, dtype=np.float32)
    b = make(m, hp, dtype="float64")
    bn = next(l for l in m.layers if l.kind == "batchnorm2d")
    rec = b.forward_layers(x.astype(np.float64), masks_for(m, hp.seed, 0, len(x), b.opts.dropout))
    inp = rec[m.layers[bn.index - 1].name].reshape(-1, bn.out_shape[-1])
    before = b.export_params()
    b.train_step(0, x, y, masks_for(m, hp.seed, 0, len(x), b.opts.dropout))
    after = b.export_params()
    var_key = next(k for k in after if k.startswith(bn.name) and k.endswith("running_var"))
    mom = bn.spec["momentum"]
    want = (1 - mom) * before[var_key] + mom * inp.var(axis=0, ddof=1)
    np.testing.assert_allclose(after[var_key], want, rtol=1e-6)
