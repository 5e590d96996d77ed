"""The gradient probe of every native backend is the gradient its training step computes, bit for bit.

Localization and the resynced steps read a backend's gradients through `Backend.gradients`; if that ran
another program than the training step (an eager GradientTape beside a tf.function step, a separately
compiled function), a kink that flipped in training (a ReLU6 at its clip) would be invisible to the
probes, and a disagreeing update would look like a bug with agreeing gradients. Before the probe went
through the step's compiled forward and backward, native TensorFlow's probe matched its step in 0 of
12 gradients on cnn2d_hard (0 of 35 on mobilenet_tiny, one 1.2 relative off). The Keras backends are checked in
tests/test_keras_backend.py (the same construction, in their collector).

How the step's gradient is read: momentum SGD at lr 1 from a zero buffer makes the first step's
momentum buffer exactly g (b = 0.9 * 0 + g), so the exported optimizer state after step 0 is the
gradient the step computed. One subprocess per backend (`python -m tests.test_probe_is_the_step
BACKEND OUT.pkl`, this file's __main__).
"""
from __future__ import annotations

import pickle
import sys
from pathlib import Path

import numpy as np
import pytest

from .conftest import across_workers, collected_in_subprocess

MODELS = ["cnn2d_hard"]   # measured too: every backend on mobilenet_tiny, jax on resnet_tiny and convnext_tiny
NATIVE = ["torch", "jax", "tensorflow", "numpy"]


def _collect(backend: str, path: str) -> None:
    from algorithms.contract import RunOptions
    from wrappers.__main__ import set_backend_env
    from wrappers.registry import REGISTRY
    set_backend_env(REGISTRY[backend], RunOptions(threads=1, devices=1))
    cls = REGISTRY[backend].load()
    from algorithms.optim import HParams
    from algorithms.params import init_params
    from algorithms.spec import load_model
    from algorithms.contract import RunOptions
    from wrappers.worker import masks_for
    out = {}
    for name in MODELS:
        model = load_model(name)
        hp = HParams(optimizer="momentum", lr=1.0, steps=1, batch_size=32)
        b = cls(model, hp, RunOptions())
        b.load_params(init_params(model, 0))
        rng = np.random.default_rng(0)
        x = rng.random((hp.batch_size, *model.input_shape)).astype(np.float32)
        y = rng.integers(0, model.num_classes, hp.batch_size).astype(np.int32)
        masks = masks_for(model, hp.seed, 0, hp.batch_size, "harness")
        _, probe = b.gradients(x, y, masks)
        probe = {k: np.array(v, copy=True) for k, v in probe.items()}
        b.train_step(0, x, y, masks)
        out[name] = {"probe": probe, "opt": {k: np.array(v, copy=True) for k, v in b.export_opt_state().items()}}
    with open(path, "wb") as f:
        pickle.dump(out, f)


_CACHE: dict[str, dict] = {}


def collected(backend: str, shared: Path) -> dict:
    return collected_in_subprocess("tests.test_probe_is_the_step", backend, shared, _CACHE, timeout=900)


@pytest.mark.parametrize("backend", NATIVE)
@pytest.mark.parametrize("model", MODELS)
def test_the_gradient_probe_is_the_training_steps_gradient(backend, model, tmp_path_factory):
    r = collected(backend, across_workers(tmp_path_factory))[model]
    assert r["probe"]
    for k, g in r["probe"].items():
        np.testing.assert_array_equal(g, r["opt"][f"momentum/{k}"], err_msg=f"{backend} {model} {k}")


if __name__ == "__main__":
    _collect(sys.argv[1], sys.argv[2])
