"""JAX data parallelism: one jit-compiled step over a device mesh, and the multi-host processes.

Data parallel (`--devices N`): the same one jit-compiled step over a `jax.sharding.Mesh` of N
devices (N host devices on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N, set by
JaxEntry.job_env before jax is imported). The global batch, in the harness order, is placed with
NamedSharding(mesh, P('data')): N contiguous shards of B/N, replica r = shard_bounds(B, N)[r];
parameters, buffers and the optimizer state are replicated (NamedSharding(mesh, P())) and kept so by
sharding constraints on the step's outputs. The loss differentiated is the mean of the N
replicas' mean losses = the global-batch mean, so GSPMD's all-reduce yields the global mean
gradient, as on one device. Replica losses: the per-sample losses reshaped (N, B/N), mean over
axis 1. BatchNorm: per-replica statistics by default (each group of B/N samples, as the
frameworks' replicas do; declared difference per_replica_batchnorm), running statistics folded
from replica 0's statistics (what DDP's buffer broadcast leaves); `--sync-bn`: statistics over the
global batch, exactly the single-device math. Faults: grad_sum_replicas (the replicas' mean losses
summed, not averaged: N x the gradient), overlapping_shards (every replica gets shard 0).
`--hosts H` (train jobs; a probe or replay job runs in one process over all N devices): H processes
(wrappers launcher, jax.distributed.initialize on 127.0.0.1, gloo CPU collectives), N/H local devices
each, the same mesh over all N devices and the same program; inputs and state are built per process
with jax.make_array_from_callback, replicated outputs read from the local shard; process 0 writes the
results. Bitwise equal to one process.
"""
from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..base import Masks, UnsupportedError, shard_bounds


def host_value(a: Any) -> Any:
    """A replicated array's value on this host (another host's devices are not addressable here)."""
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        return np.asarray(a.addressable_data(0))
    return a


def global_array(tree: Any, sharding: NamedSharding) -> Any:
    """Multi-host: every process holds the whole value; each places the pieces its own devices hold."""
    def one(a):
        h = np.asarray(a)
        return jax.make_array_from_callback(h.shape, sharding, lambda idx: h[idx])
    return jax.tree.map(one, tree)


class DataParallel:
    """The data-parallel half of JaxBackend (a mixin): the processes, the mesh, what is placed where."""

    def _init_mesh(self) -> None:
        """--hosts H: join the other processes (jax.distributed); --devices N: the Mesh('data') of N devices."""
        self.process_id, self.coordinator = 0, None
        if self.hosts > 1 and self.replicas % self.hosts:
            raise UnsupportedError(f"--hosts {self.hosts} must divide --devices {self.replicas}")
        # a probe or replay job of a --hosts run is started as one process (JaxEntry.processes): the same
        # program over the same N-device mesh, bitwise equal to the H processes that trained
        self.hosts_in_one_process = self.hosts > 1 and "DUIPAI_JAX_COORDINATOR" not in os.environ
        if self.hosts > 1 and not self.hosts_in_one_process:
            self.coordinator = os.environ["DUIPAI_JAX_COORDINATOR"]
            self.process_id = int(os.environ["DUIPAI_JAX_PROCESS_ID"])
            jax.distributed.initialize(coordinator_address=self.coordinator,
                                       num_processes=int(os.environ["DUIPAI_JAX_NUM_PROCESSES"]),
                                       process_id=self.process_id, initialization_timeout=60)
        self.multi = self.hosts > 1 and not self.hosts_in_one_process
        self.mesh: Mesh | None = None
        if self.replicas > 1:
            have = jax.devices()
            if len(have) < self.replicas:
                raise UnsupportedError(
                    f"backend jax: --devices {self.replicas} but jax sees {len(have)} {jax.default_backend()} "
                    f"device(s) (XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r})")
            self.mesh = Mesh(np.array(have[:self.replicas]), ("data",))
            self.replicated = NamedSharding(self.mesh, P())
            self.data_sharded = NamedSharding(self.mesh, P("data"))

    def parallel_info(self) -> dict[str, Any]:
        if self.mesh is None:
            return super().parallel_info()
        bn = ("n/a (no BatchNorm)" if not self.model.has("batchnorm2d") else
              "synchronized: statistics over the global batch (the single-device math)" if self.sync_bn else
              "per replica, over each replica's B/N samples; running statistics from replica 0's")
        return {
            "strategy": "jit over Mesh('data')", "replicas": self.replicas,
            "processes": 1 if self.hosts_in_one_process else self.hosts, "hosts": self.hosts,
            **({"hosts_in_one_process": "a probe / replay job of a --hosts run: one process, the same program over "
                                        "the same N-device mesh (bitwise equal to the H processes)"}
               if self.hosts_in_one_process else {}),
            **({"launcher": "wrappers launcher, jax.distributed.initialize (gloo CPU collectives)",
                "coordinator": self.coordinator, "process_id": self.process_id,
                "local_devices": len(jax.local_devices()),
                "cpu_collectives": jax.config.jax_cpu_collectives_implementation} if self.multi else {}),
            "devices": [f"{d.platform}:{d.id}" for d in self.mesh.devices.flat],
            "sync_bn": self.sync_bn, "batchnorm_statistics": bn,
            "sharding": "NamedSharding(mesh, P('data')): contiguous, replica r takes samples [r*B/N, (r+1)*B/N)"
                        + (" (fault overlapping_shards: every replica takes [0, B/N))"
                           if self.opts.fault == "overlapping_shards" else ""),
            "params": "replicated, NamedSharding(mesh, P())",
            "gradient_reduction": ("the SUM of the replicas' mean losses differentiated: N x the mean gradient "
                                   "(fault grad_sum_replicas)" if self.opts.fault == "grad_sum_replicas" else
                                   "gradient of the mean of the replicas' mean losses (the global-batch mean); "
                                   "XLA GSPMD all-reduce"),
            "loss": "mean of the replicas' mean losses, accuracy over the global batch",
        }

    def _place(self, tree: Any) -> Any:
        """Data parallel: replicated over the mesh (params, buffers, optimizer state)."""
        if self.mesh is None:
            return tree
        return global_array(tree, self.replicated) if self.multi else jax.device_put(tree, self.replicated)

    def _batch(self, x: np.ndarray, y: np.ndarray, masks: Masks) -> tuple[Any, Any, Any]:
        """The step's inputs: as they are on one device; data parallel, the replicas' shards
        (shard_bounds, so the overlapping_shards fault gives every replica shard 0) laid out
        contiguously and placed with NamedSharding(mesh, P('data'))."""
        x, y, m = self._x(x), self._y(y), self._masks(masks)
        if self.mesh is None:
            return x, y, m
        if len(x) % self.replicas:
            raise UnsupportedError(f"global batch {len(x)} is not divisible by {self.replicas} replicas")
        if self.opts.fault == "overlapping_shards":
            idx = np.concatenate([np.arange(a, b) for a, b in shard_bounds(len(x), self.replicas, self.opts.fault)])
            x, y, m = x[idx], y[idx], {k: v[idx] for k, v in m.items()}
        if self.multi:
            return global_array((x, y, m), self.data_sharded)
        return jax.device_put((x, y, m), self.data_sharded)

