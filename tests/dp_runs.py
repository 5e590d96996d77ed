"""Training a backend object in the test's own process, as the worker does, for the data-parallel tests
that train many configurations under one framework import."""
from __future__ import annotations

from typing import Any


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
