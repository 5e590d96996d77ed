"""What every hand-written loop shares, and nothing framework-specific: the pinned single-thread
environment, the digits data, the batch order and the canonical initial weights (exactly what the
harness prepares), the evaluation cadence, the per-step timer and the JSON report.

Each loop evaluates on the test set (loss and accuracy, fetched to Python) before training and after every
EVAL_EVERY-th step and the last, as the harness does at its default cadence: the same work on both sides, so the
whole-loop ratio measures what the harness adds (its statistics, CSV rows and checkpoints), not the
evaluation a user asked for. The evaluations are timed apart and left out of the per-step times.

Each hand loop is a script (`python bench/hand_loops/torch.py --steps 400`) whose first lines drop
its own folder from sys.path (the scripts are named torch.py, jax.py, ... and would shadow the
frameworks) and call `setup_env()` before importing its framework.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from algorithms.data import batch_order, load_data  # noqa: E402
from algorithms.optim import HParams  # noqa: E402
from algorithms.params import init_params  # noqa: E402
from algorithms.spec import load_model  # noqa: E402

MODEL = "cnn2d_2conv_2fc"
LR, MOMENTUM, BATCH, SEED, INIT_SEED = 0.05, 0.9, 64, 0, 0
WARMUP = 10     # steps excluded from the figures (first call / tracing / compilation), as for the harness
EVAL_EVERY = HParams().eval_every    # the harness's default evaluation cadence


def evaluates_after(done: int, steps: int) -> bool:
    """Whether the loop evaluates after its `done`-th step (the harness's rule: every EVAL_EVERY and the last)."""
    return done % EVAL_EVERY == 0 or done == steps


def setup_env(threads: int = 1) -> None:
    """The same pinning as the harness's `python -m wrappers` process, set before any framework import."""
    n = str(threads)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TF_NUM_INTRAOP_THREADS",
                "TF_NUM_INTEROP_THREADS"):
        os.environ[var] = n
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if threads == 1:
        os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false"
    os.environ["PYTHONHASHSEED"] = "0"


def keras_backend_pinned() -> str:
    """KERAS_BACKEND (default tensorflow), its framework's thread pools pinned to one before Keras is imported
    (Keras starts the runtime on import); returns the backend's name."""
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    kb = os.environ["KERAS_BACKEND"]
    if kb == "tensorflow":
        import tensorflow as tf
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    elif kb == "torch":
        import torch
        torch.set_num_threads(1)
    return kb


def parse_args(doc: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--steps", type=int, default=400, help="training steps in all, warm-up included")
    ap.add_argument("--warmup", type=int, default=WARMUP, help="first steps left out of the figures")
    args = ap.parse_args()
    if args.steps <= args.warmup:
        ap.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    return args


@dataclass
class Problem:
    x_train: np.ndarray        # (N, 8, 8, 1) float32, normalised as the harness normalises
    y_train: np.ndarray        # (N,) int32
    order: np.ndarray          # (steps, 64) sample indices, the harness's batch order
    params: dict[str, np.ndarray]   # canonical layout (HWIO conv kernels, (in, out) dense kernels)
    x_test: np.ndarray         # the harness's evaluation set, evaluated in one batch as the harness does
    y_test: np.ndarray


def problem(steps: int, model: str = MODEL) -> Problem:
    """What the harness prepares for `model` with `--data digits`: the digits at the model's input shape
    (8x8x1, or the 32x32x3 colour digits), the batch order, the canonical initial weights."""
    spec = load_model(model)
    ds = load_data("digits", image_shape=tuple(spec.input_shape))
    return Problem(ds.x_train, ds.y_train, batch_order(len(ds.x_train), BATCH, steps, SEED), init_params(spec, INIT_SEED),
                   ds.x_test, ds.y_test)


# resnet_tiny (algorithms/models/resnet_tiny.toml) as the hand-written ResNets build it: (name, input channels,
# output channels, stride); a stride-2 block has a 1x1 projection shortcut with its BatchNorm. BatchNorm: torch's
# momentum 0.1 (Keras' 0.9), eps 1e-5; 'same' convolutions with TF's padding (the odd pixel bottom/right).
RESNET_BLOCKS = (("block1", 16, 16, 1), ("block2", 16, 32, 2), ("block3", 32, 64, 2))
BN_MOMENTUM, BN_EPS = 0.1, 1e-5


def flatten_perm(h: int = 4, w: int = 4, c: int = 32) -> np.ndarray:
    """perm[j] = the canonical (H, W, C) row of a channels-first (C, H, W) flatten position j."""
    return np.arange(h * w * c).reshape(h, w, c).transpose(2, 0, 1).ravel()


class Timer:
    """perf_counter stamps at step boundaries: stamp(0) before the first step, then one per step; time spent
    inside `evaluating()` is counted apart (`evals`: the step whose interval it falls in, and its seconds)."""

    def __init__(self) -> None:
        self.t: list[float] = []
        self.evals: list[tuple[int, float]] = []
        self.end = 0.0      # when the last stamp or evaluation ended

    def stamp(self) -> None:
        self.t.append(time.perf_counter())
        self.end = self.t[-1]

    @contextmanager
    def evaluating(self) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self.end = time.perf_counter()
        self.evals.append((len(self.t) - 1, self.end - t0))


def report(framework: str, timer: Timer, warmup: int, losses: list[float] | None = None,
           evals: list[tuple[float, float]] | None = None, **extra) -> None:
    """Print the JSON line bench_step.py reads. `timer.t` has steps + 1 entries (before step 0, after each
    step); step i took t[i+1] - t[i] less any evaluation timed inside that interval. wall_s: from the end of the
    warm-up to the end of the last step or evaluation (the harness's whole loop); eval_s: its evaluations.
    `evals`: the (loss, accuracy) of every evaluation, the first one before training."""
    stamps = np.asarray(timer.t)
    st = np.diff(stamps)
    for i, secs in timer.evals:
        if 0 <= i < len(st):
            st[i] -= secs
    timed = st[warmup:]
    wall = float(timer.end - stamps[warmup])
    out = {"framework": framework, "steps": int(len(timed)), "total_steps": int(len(st)), "warmup": warmup,
           "wall_s": wall, "per_step_s": wall / len(timed), "median_step_s": float(statistics.median(timed)),
           "eval_s": float(sum(secs for i, secs in timer.evals if i >= warmup)), "eval_every": EVAL_EVERY,
           "warmup_wall_s": float(stamps[warmup] - stamps[0]),
           "step_times_s": [float(v) for v in timed]}
    if evals:
        out["evals"] = [[float(l), float(a)] for l, a in evals]
    if losses:
        out["first_loss"], out["last_loss"] = float(losses[0]), float(losses[-1])
    out.update(extra)
    print(json.dumps(out))
