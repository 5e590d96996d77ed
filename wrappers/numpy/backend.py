"""NumPy backend: layers.py's forward and hand-written backward, optim.py's reference optimizer, canonical
layout throughout (nothing to permute), replicas simulated in-process with an explicit all-reduce (parallel.py)."""
from __future__ import annotations

import platform
from typing import Any

import numpy as np

from algorithms.contract import RunOptions
from algorithms.optim import HParams
from algorithms.spec import ModelSpec

from ..base import Backend, Masks, StepStats, UnsupportedError
from . import NumpyEntry
from .layers import backward, forward, softmax_xent
from .optim import ReferenceOptimizer
from .parallel import DataParallel, all_reduce, shards

BUFFER_ROLES = ("running_mean", "running_var")


def _limit_blas_threads(n: int) -> int | None:
    """NumPy's BLAS is loaded before the worker sets OPENBLAS_NUM_THREADS, so it is limited here, at run time
    (threadpoolctl comes with scikit-learn, a base dependency): a 2-thread BLAS on small matrices on a
    busy machine is ~10 x slower than one thread. None: no limit could be set (threadpoolctl missing)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return None
    threadpool_limits(limits=n, user_api="blas")
    return n


class NumpyBackend(DataParallel, Backend):
    framework = "numpy"
    faults = NumpyEntry.faults
    layer_kinds = NumpyEntry.layer_kinds

    def __init__(self, model: ModelSpec, hp: HParams, opts: RunOptions) -> None:
        super().__init__(model, hp, opts)
        if opts.dtype not in ("float32", "float64"):
            raise UnsupportedError(f"--dtype {opts.dtype}: the numpy backend computes in float32 or float64")
        if self.hosts > 1:
            raise UnsupportedError("--hosts: the numpy backend simulates its replicas in one process")
        if opts.dropout == "native" and model.has("dropout"):
            raise UnsupportedError("--dropout native: the numpy backend has no RNG of its own; it uses the harness masks")
        self.dtype = np.dtype(opts.dtype)
        self.blas_threads = _limit_blas_threads(opts.threads)
        self.trainable = [q.name for q in model.trainable]
        self.p: dict[str, np.ndarray] = {}
        self.opt: ReferenceOptimizer | None = None

    # ---- environment
    def versions(self) -> dict[str, str]:
        return {"numpy": np.__version__, "python": platform.python_version()}

    def devices(self) -> list[str]:
        cpu = f"cpu ({platform.processor() or platform.machine()})"
        return [f"replica {r} (simulated): {cpu}" for r in range(self.replicas)] if self.replicas > 1 else [cpu]

    def determinism(self) -> dict[str, Any]:
        return {"dtype": str(self.dtype), "blas_threads": self.blas_threads,
                "deterministic": "no RNG; BLAS results depend on the BLAS build and its thread count"}

    def declared_differences(self) -> list[str]:
        if self.replicas > 1 and self.model.has("batchnorm2d") and not self.sync_bn:
            return ["per_replica_batchnorm"]
        return []

    # ---- state
    def load_params(self, params: dict[str, np.ndarray]) -> None:
        self.p = {q.name: np.array(params[q.name], self.dtype) for q in self.model.params}
        self.opt = ReferenceOptimizer(self.hp, {n: self.p[n] for n in self.trainable}, self.dtype)

    def export_params(self) -> dict[str, np.ndarray]:
        return {n: a.copy() for n, a in self.p.items()}

    def export_opt_state(self) -> dict[str, np.ndarray]:
        return self.opt.export()

    def load_opt_state(self, state: dict[str, np.ndarray], step: int) -> None:
        self.opt.load(state)

    # ---- computation
    def _train_forward(self, xs: list[np.ndarray], masks: list[Masks], update_running: bool = False,
                       record: list[dict[str, np.ndarray]] | None = None):
        """The training-mode forward over the replicas' shards, one for the step and the forward probes."""
        return forward(self.model, self.p, xs, train=True, masks=masks, sync_bn=self.sync_bn,
                       update_running=update_running, record=record)

    def _eval_forward(self, x: np.ndarray, record: dict[str, np.ndarray] | None = None):
        """The inference forward, one for `evaluate` and the evaluation probes."""
        return forward(self.model, self.p, [np.asarray(x, self.dtype)], train=False, masks=[{}],
                       record=None if record is None else [record])

    def _grads(self, x: np.ndarray, y: np.ndarray, masks: Masks,
               update_running: bool) -> tuple[float, list[float], float, dict[str, np.ndarray]]:
        """(mean loss, replica losses, accuracy, all-reduced gradient): every replica's forward and
        backward on its shard, then the explicit reduction (mean; sum under grad_sum_replicas)."""
        bounds, xs, ms = shards(x, masks, self.replicas, self.opts.fault, self.dtype)
        p = self.p                   # update_running=False (a probe): the running buffers are left alone
        logits, caches = self._train_forward(xs, ms, update_running)
        losses, dlogits, correct = [], [], 0
        for (lo, hi), z in zip(bounds, logits):
            loss, dz, pred = softmax_xent(z, y[lo:hi])
            losses.append(loss)
            dlogits.append(dz)
            correct += int((pred == y[lo:hi]).sum())
        per_replica = backward(self.model, p, caches, dlogits, sync_bn=self.sync_bn)
        grads = all_reduce(per_replica, self.trainable, self.opts.fault, self.dtype)
        return float(np.mean(losses)), losses, correct / len(x), grads

    def train_step(self, step: int, x: np.ndarray, y: np.ndarray, masks: Masks) -> StepStats:
        loss, losses, acc, grads = self._grads(x, y, masks, update_running=True)
        before = {n: self.p[n] for n in self.trainable}
        after = self.opt.step(self.lr_for(step), before, grads)
        self.p.update(after)

        def norm(arrays: list[np.ndarray]) -> float:
            return float(np.sqrt(sum(float(np.sum(np.square(a, dtype=np.float64))) for a in arrays)))
        return StepStats(loss, acc, norm(list(grads.values())), norm([after[n] - before[n] for n in self.trainable]),
                         norm(list(after.values())), losses if self.replicas > 1 else None)

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        logits, _ = self._eval_forward(x)
        loss, _, pred = softmax_xent(logits[0], y)
        return loss, float(np.mean(pred == y))

    def forward_layers(self, x: np.ndarray, masks: Masks) -> dict[str, np.ndarray]:
        """Training mode, every replica's shard, concatenated in replica order; running buffers untouched."""
        _, xs, ms = shards(x, masks, self.replicas, self.opts.fault, self.dtype)
        recs: list[dict[str, np.ndarray]] = [{} for _ in xs]
        self._train_forward(xs, ms, record=recs)
        return {k: np.concatenate([r[k] for r in recs]) for k in recs[0]}

    def eval_layers(self, x: np.ndarray) -> dict[str, np.ndarray]:
        rec: dict[str, np.ndarray] = {}
        self._eval_forward(x, rec)
        return rec

    def gradients(self, x: np.ndarray, y: np.ndarray, masks: Masks) -> tuple[float, dict[str, np.ndarray]]:
        loss, _, _, grads = self._grads(x, y, masks, update_running=False)
        return loss, grads


BACKEND = NumpyBackend
