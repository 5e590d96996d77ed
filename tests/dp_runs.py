"""Training a backend object in the test's own process, as the worker does, for the data-parallel tests
that train many configurations under one framework import, and through the runner (`Runs`), for those that
compare whole runs."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd


def train_in_process(b: Any, prep: Any, hp: Any) -> tuple[list[list[float]], dict]:
    """Train `b` from the prepared canonical weights over the harness's batch order with harness dropout
    masks. Returns per step [loss, grad_norm, replica losses...] and the exported final parameters."""
    from algorithms.params import load_npz
    from wrappers.worker import masks_for
    arrays = load_npz(prep.dataset_path)
    x, y = arrays["x_train"], arrays["y_train"]
    b.load_params(prep.params)
    rows = []
    for step in range(hp.steps):
        idx = prep.order[step]
        st = b.train_step(step, x[idx], y[idx], masks_for(prep.model, hp.seed, step, hp.batch_size, "harness"))
        rows.append([st.loss, st.grad_norm] + (st.replica_losses or []))
    return rows, b.export_params()


def joint_agreement(b: Any, model: Any, hp: Any) -> dict[str, Any]:
    """Backend.layers_and_gradients on one random batch against the backend's own forward and gradient probes
    (another compiled program: equal up to its rounding): the largest relative difference of any layer output,
    any gradient and the loss; {"none": True} when the backend records no joint program."""
    from wrappers.worker import masks_for
    n = hp.batch_size
    rng = np.random.default_rng(0)
    x = rng.random((n, *model.input_shape)).astype(np.float32)
    y = rng.integers(0, model.num_classes, n).astype(np.int64)
    masks = masks_for(model, hp.seed, 0, n, "harness")
    got = b.layers_and_gradients(x, y, masks)
    if got is None:
        return {"none": True}
    layers, loss, grads = got
    plain_loss, plain = b.gradients(x, y, masks)
    fwd = b.forward_layers(x, masks)

    def rel(a: dict, c: dict) -> float:
        return max(float(np.max(np.abs(np.asarray(a[k], np.float64) - c[k])) / (np.max(np.abs(c[k])) or 1.0))
                   for k in c)
    return {"none": False, "layer_names": sorted(layers) == sorted(fwd), "grad_names": sorted(grads) == sorted(plain),
            "layers": rel(layers, fwd), "grads": rel(grads, plain),
            "loss": abs(loss - plain_loss) / abs(plain_loss)}


def steps_column(folder: Path, name: str = "loss") -> np.ndarray:
    """One column of a run's steps.csv, in float64."""
    return pd.read_csv(folder / "steps.csv")[name].to_numpy(np.float64)


def max_diff(a: Path, b: Path) -> float:
    """The largest |loss difference| of two runs, step by step."""
    return float(np.max(np.abs(steps_column(a) - steps_column(b))))


class Runs:
    """Training runs of one backend (runner.execute: one backend launch each, as `duipai run` does), each
    configuration made once per test module."""

    def __init__(self, out: Path, backend: str, steps: int) -> None:
        self.out, self.backend, self.steps, self.made = out, backend, steps, {}

    def get(self, devices: int = 1, steps: int | None = None, model: str = "cnn2d_2conv_2fc", **cfg: Any) -> Path:
        from algorithms.optim import HParams
        from harness import runner
        steps = steps or self.steps
        key = (model, steps, devices, tuple(sorted((k, str(v)) for k, v in cfg.items())))
        if key not in self.made:
            hp = HParams(steps=steps, eval_every=min(50, steps), checkpoint_every=min(50, steps))
            self.made[key] = runner.execute(runner.RunConfig(model=model, backend=self.backend, hparams=hp,
                                                             devices=devices, **cfg), self.out)
        return self.made[key]

    def ulp_spread(self) -> float:
        """The loss distance of two dp=1 runs one ULP apart in their initial weights (--perturb-ulp 1 and 2)."""
        return max_diff(self.get(perturb_ulp=1), self.get(perturb_ulp=2))
