"""Keras data parallelism (`--devices N`), the backend-neutral part: what every Keras backend's strategy offers
the backend, the harness's sharding of the global batch, and the choice of strategy.

  keras-jax         keras.distribution.DataParallel: one GSPMD program over the global batch
                    (runtimes/jax.py `JaxDataParallel`)
  keras-tensorflow  tf.distribute.MirroredStrategy: one program per replica, on its shard
                    (runtimes/tensorflow.py `MirroredDataParallel`)
  keras-torch       none: Keras has no data parallelism on its torch backend (refused, runtimes/torch.py)

A strategy whose replicas run their own programs (`replica_programs`) reads, evaluates, records and
differentiates per replica (the gradient probe: the step itself, Stepper.gradients); one whose program spans
the global batch uses the single-device paths.
Each runtime's `make_parallel(replicas, hosts, sync_bn, fault, extra)` gives its strategy (None for one device).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..base import UnsupportedError, shard_bounds


class Parallel:
    """The interface KerasBackend uses; the defaults are a single global-batch program's."""
    replica_programs = False          # True: each replica runs its own program on its shard
    per_replica_batchnorm = False     # BatchNorm statistics over each replica's shard (a declared difference)
    backend = ""                      # the backend configuration's name (keras-<backend>), for its refusals
    hosts_missing = ""                # what a multi-process run of this strategy would need (--hosts is refused)

    def __init__(self, replicas: int, hosts: int, sync_bn: bool, fault: str | None) -> None:
        if hosts > 1:
            raise UnsupportedError(f"{self.backend}: --hosts is not implemented ({self.hosts_missing}); use "
                                   "--devices N in one process")
        self.replicas, self.sync_bn, self.fault = replicas, sync_bn, fault
        self.devices: list[str] = []

    def scope(self):
        raise NotImplementedError

    def arrange(self, x: np.ndarray, y: np.ndarray, masks: dict[str, np.ndarray]):
        """The global batch with the replicas' shards laid out contiguously in replica order (replica r
        holds rows [r B/N, (r+1) B/N) of it): as given, except under the fault overlapping_shards."""
        if self.fault != "overlapping_shards":
            return x, y, masks
        idx = np.concatenate([np.arange(a, b) for a, b in shard_bounds(len(x), self.replicas, self.fault)])
        return x[idx], y[idx], {k: v[idx] for k, v in masks.items()}

    def attach_dropouts(self, dropouts: dict[str, Any], batch: int) -> None:
        """Let the harness dropout layers take their replica's rows of the (B, ...) masks (if replicas run apart)."""

    def info(self, fault: str | None, has_bn: bool) -> dict[str, Any]:
        raise NotImplementedError

