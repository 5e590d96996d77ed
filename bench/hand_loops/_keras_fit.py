"""The Keras hand loops' shared tail: one plain `model.fit` over arrays already in the harness's batch order,
timed by a callback that also evaluates the test set every 50 steps, and the JSON report. Imported after Keras
(its backend chosen by $KERAS_BACKEND)."""
from __future__ import annotations

import keras
import numpy as np

from bench.hand_loops._common import BATCH, Problem, Timer, evaluates_after, report


def evaluate(model: keras.Model, problem: Problem) -> tuple[float, float]:
    """The test set's loss and accuracy as the harness's Keras backend evaluates: one predict_on_batch, Keras' own
    sparse cross-entropy of the logits, the accuracy on the host."""
    logits = model.predict_on_batch(problem.x_test)
    loss = keras.ops.mean(keras.losses.sparse_categorical_crossentropy(problem.y_test, logits, from_logits=True))
    return float(keras.ops.convert_to_numpy(loss)), float((np.argmax(logits, -1) == problem.y_test).mean())


class StepTimer(keras.callbacks.Callback):
    """perf_counter stamps at each batch's end (and before the first); like the harness (and like any logging
    callback) it makes Keras hand the batch logs (loss, accuracy) to Python every step. After every 50th
    step and the last it evaluates (`self.model`: with JAX, reading it syncs the training state to the model)."""

    def __init__(self, problem: Problem, steps: int) -> None:
        super().__init__()
        self.timer, self.losses = Timer(), []
        self.problem, self.steps = problem, steps
        self.evals: list[tuple[float, float]] = []

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 0:
            self.timer.stamp()

    def on_train_batch_end(self, batch, logs=None):
        self.timer.stamp()
        self.losses.append(logs["loss"])   # Keras 3 logs hold the running epoch mean, as its progress bar shows
        if evaluates_after(batch + 1, self.steps):
            with self.timer.evaluating():
                self.evals.append(evaluate(self.model, self.problem))


def fit_and_report(model: keras.Model, problem: Problem, steps: int, warmup: int, backend: str) -> None:
    """One epoch of `steps` batches of BATCH in the harness's order (shuffle off), then the report line (with the
    trained weights' absolute sum, a fingerprint of what was trained)."""
    assert problem.order.shape == (steps, BATCH)
    flat = problem.order.reshape(-1)
    cb = StepTimer(problem, steps)
    cb.evals.append(evaluate(model, problem))
    model.fit(problem.x_train[flat], problem.y_train[flat], batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[cb])
    report(f"keras-{backend}", cb.timer, warmup, cb.losses, cb.evals, versions={"keras": keras.__version__, "backend": backend},
           jit_compile=getattr(model, "jit_compile", None),
           final_weights_sum=float(sum(abs(v).sum() for v in model.get_weights())))
