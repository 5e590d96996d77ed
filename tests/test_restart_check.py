"""The restart check (wrappers.base.Backend.restart_check): a fresh backend loading the state exported after
the probe's first step takes the second as the continued backend does, in every backend, with the optimizers
whose state is converted (momentum buffers, Keras velocities under a schedule, Adam moments and step count);
and a step that keeps state outside the checkpoint (torch's .grad buffers when zero_grad is forgotten) fails it.

Why: the resync starts every step from a loaded checkpoint, so a bug in state the checkpoint does not hold
is invisible to it, and the step-0 probes' later-step disagreement it causes was explained away as a kink
flipped by rounding (bench/source_bugs.py torch_zero_grad_forgotten: DRIFT). One subprocess per backend
(`python -m tests.test_restart_check BACKEND OUT.pkl`, this file's __main__).
"""
from __future__ import annotations

import pickle
import sys

import pytest

from harness.resync_verdict import RESTART_TOL, restart_differs, superseded_by_resync

from .conftest import across_workers, collected_in_subprocess

BACKENDS = ["torch", "jax", "tensorflow", "numpy", "keras-tensorflow", "keras-jax", "keras-torch"]
CASES = {"momentum_step": dict(optimizer="momentum", lr=0.05, schedule="step", step_size=1, gamma=0.5),
         "adamw": dict(optimizer="adamw", lr=1e-3, weight_decay=1e-2)}


def _collect(backend: str, path: str) -> None:
    import numpy as np

    from algorithms.contract import RunOptions
    from algorithms.optim import HParams
    from algorithms.params import init_params
    from algorithms.spec import load_model
    from wrappers.__main__ import set_backend_env
    from wrappers.registry import REGISTRY
    from wrappers.worker import masks_for
    set_backend_env(REGISTRY[backend], RunOptions(threads=1))
    cls = REGISTRY[backend].load()
    model = load_model("cnn2d_hard")
    out = {}
    for case, kw in CASES.items():
        hp = HParams(steps=3, batch_size=16, **kw)
        rng = np.random.default_rng(0)
        x = rng.random((hp.batch_size, *model.input_shape)).astype(np.float32)
        y = rng.integers(0, model.num_classes, hp.batch_size).astype(np.int32)
        masks = [masks_for(model, hp.seed, s, hp.batch_size, "harness") for s in range(3)]
        b = cls(model, hp, RunOptions())
        b.load_params(init_params(model, 0))
        probed = b.probe(x, y, masks)
        out[case] = b.restart_check(x, y, masks, probed)
    if backend == "torch":          # zero_grad forgotten: the gradients are state no checkpoint holds
        hp = HParams(steps=3, batch_size=16, **CASES["momentum_step"])
        b = cls(model, hp, RunOptions())
        b.load_params(init_params(model, 0))
        b._zero_grads = lambda: None
        probed = b.probe(x, y, masks)
        out["zero_grad_forgotten"] = b.restart_check(x, y, masks, probed)
    with open(path, "wb") as f:
        pickle.dump(out, f)


_CACHE: dict[str, dict] = {}


def collected(backend: str, tmp_path_factory) -> dict:
    return collected_in_subprocess("tests.test_restart_check", backend, across_workers(tmp_path_factory), _CACHE,
                                   timeout=900)


# keras-jax's and keras-tensorflow's collectors cost 33 s of `make test` (07d016c, --durations=0): the Keras restart path
# (wrappers/keras/backend.py) runs there on keras-torch, these two in `make test-slow`
SLOW_BACKENDS = ("keras-tensorflow", "keras-jax")


@pytest.mark.parametrize("backend", [pytest.param(b, marks=pytest.mark.slow) if b in SLOW_BACKENDS else b
                                     for b in BACKENDS])
@pytest.mark.parametrize("case", list(CASES))
def test_a_restart_steps_as_the_continued_run(backend, case, tmp_path_factory):
    r = collected(backend, tmp_path_factory)[case]
    assert r["checked"], r
    assert r["rel"] <= RESTART_TOL, r


def test_state_outside_the_checkpoint_fails_the_restart_check(tmp_path_factory):
    r = collected("torch", tmp_path_factory)["zero_grad_forgotten"]
    assert r["checked"] and r["rel"] > 100 * RESTART_TOL, r


def test_a_failed_restart_check_keeps_the_later_steps_disagreement():
    """Later probe steps disagreeing (update1/...) are not superseded as a kink by an agreeing resync when the
    candidate fails the restart check; they are when it passes (the clean ReLU6 case)."""
    rs = {"points": [0, 1, 2, 3, 25]}
    loc = {"disagreeing_keys": ["update1/conv1.kernel", "update2/conv1.kernel"], "method": "step-0 probes"}
    assert superseded_by_resync(dict(loc, restart={"checked": True, "rel": 1e-7, "key": "update1/x"}), rs)
    failed = dict(loc, restart={"checked": True, "rel": 0.27, "key": "update1/conv1.kernel"})
    assert restart_differs(failed) and superseded_by_resync(failed, rs) is None


if __name__ == "__main__":
    _collect(sys.argv[1], sys.argv[2])
