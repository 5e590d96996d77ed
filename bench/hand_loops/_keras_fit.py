"""The Keras hand loops' shared tail: one plain `model.fit` over arrays already in the harness's batch order,
timed by a callback, and the JSON report. Imported after Keras (its backend chosen by $KERAS_BACKEND)."""
from __future__ import annotations

import keras

from bench.hand_loops._common import BATCH, Problem, Timer, report


class StepTimer(keras.callbacks.Callback):
    """perf_counter stamps at each batch's end (and before the first); like the harness (and like any logging
    callback) it makes Keras hand the batch logs (loss, accuracy) to Python every step."""

    def __init__(self) -> None:
        super().__init__()
        self.timer, self.losses = Timer(), []

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 0:
            self.timer.stamp()

    def on_train_batch_end(self, batch, logs=None):
        self.timer.stamp()
        self.losses.append(logs["loss"])   # Keras 3 logs hold the running epoch mean, as its progress bar shows


def fit_and_report(model: keras.Model, problem: Problem, steps: int, warmup: int, backend: str) -> None:
    """One epoch of `steps` batches of BATCH in the harness's order (shuffle off), then the report line (with the
    trained weights' absolute sum, a fingerprint of what was trained)."""
    assert problem.order.shape == (steps, BATCH)
    flat = problem.order.reshape(-1)
    cb = StepTimer()
    model.fit(problem.x_train[flat], problem.y_train[flat], batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[cb])
    report(f"keras-{backend}", cb.timer.t, warmup, cb.losses, versions={"keras": keras.__version__, "backend": backend},
           jit_compile=getattr(model, "jit_compile", None),
           final_weights_sum=float(sum(abs(v).sum() for v in model.get_weights())))
