"""Data parallelism of the numpy backend: the N replicas simulated in one process, layer by layer, with
explicit all-reduces: the contiguous shards of the global batch (base.shard_bounds), BatchNorm statistics
and gradient sums per replica or all-reduced (--sync-bn), and the mean of the replicas' gradients
(their sum under the fault grad_sum_replicas)."""
from __future__ import annotations

from typing import Any

import numpy as np

from algorithms.spec import LayerInfo

from ..base import Masks, shard_bounds

Params = dict[str, np.ndarray]


def channel_sum(x: np.ndarray) -> np.ndarray:
    """Sum over every axis but the last (channels), pairwise. NumPy sums pairwise only along a contiguous
    innermost axis; over N, H, W of an NHWC array it adds one row after another: ~1e-5 relative on a
    64x32x32 map, where a framework's blocked float32 sums err ~1e-7 (measured; it made clean graph-model
    runs BUG at resynced steps). The channels-first copy puts the summed axis innermost."""
    return np.ascontiguousarray(x.reshape(-1, x.shape[-1]).T).sum(axis=1)


def channel_mean(x: np.ndarray) -> np.ndarray:
    return channel_sum(x) / (x.size // x.shape[-1])


def bn_moments(xs: list[np.ndarray], sync: bool) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """(mean, biased var, count) per replica: over its own shard, or over every shard (sync: the
    explicit all-reduce of the per-replica sums, then of the squared deviations)."""
    if not sync:
        out = []
        for x in xs:
            m = channel_mean(x)
            out.append((m, channel_mean((x - m) ** 2), x.shape[0] * x.shape[1] * x.shape[2]))
        return out
    n = sum(x.shape[0] * x.shape[1] * x.shape[2] for x in xs)
    mean = sum(channel_sum(x) for x in xs) / n
    var = sum(channel_sum((x - mean) ** 2) for x in xs) / n
    return [(mean, var, n)] * len(xs)


def bn_backward(layer: LayerInfo, p: Params, caches: list[Any], dys: list[np.ndarray], ns: list[int],
                sync: bool) -> tuple[list[np.ndarray], list[Params]]:
    """Training-mode BatchNorm backward per replica: dx = inv/n (n dxhat - sum dxhat - xhat sum(dxhat xhat)),
    the sums over the replica's shard or (sync) all-reduced over every replica."""
    gamma = p[f"{layer.name}.gamma"]
    s1 = [channel_sum(dy * gamma) for dy in dys]
    s2 = [channel_sum(dy * gamma * c[0]) for dy, c in zip(dys, caches)]
    if sync:
        s1, s2 = [sum(s1)] * len(dys), [sum(s2)] * len(dys)
    dxs, grads = [], []
    for dy, (xhat, inv), a, b, n in zip(dys, caches, s1, s2, ns):
        dxs.append(inv / n * (n * dy * gamma - a - xhat * b))
        grads.append({f"{layer.name}.gamma": channel_sum(dy * xhat), f"{layer.name}.beta": channel_sum(dy)})
    return dxs, grads


def shards(x: np.ndarray, masks: Masks, replicas: int, fault: str | None,
           dtype: np.dtype) -> tuple[list[tuple[int, int]], list[np.ndarray], list[Masks]]:
    """(bounds, inputs, masks) of every replica's shard (one shard, the whole batch, without replicas)."""
    bounds = shard_bounds(len(x), replicas, fault) if replicas > 1 else [(0, len(x))]
    xs = [np.asarray(x[lo:hi], dtype) for lo, hi in bounds]
    return bounds, xs, [{k: v[lo:hi] for k, v in masks.items()} for lo, hi in bounds]


def all_reduce(per_replica: list[Params], names: list[str], fault: str | None, dtype: np.dtype) -> Params:
    """The replicas' gradients combined: their mean (the global-batch mean gradient), or their sum under
    grad_sum_replicas; one replica's as they are."""
    scale = 1.0 if fault == "grad_sum_replicas" else 1.0 / len(per_replica)
    return {n: (sum(g[n] for g in per_replica) * scale if len(per_replica) > 1 else per_replica[0][n]).astype(dtype)
            for n in names}


class DataParallel:
    """The data-parallel half of NumpyBackend (a mixin): what the manifest says about the replicas."""

    def parallel_info(self) -> dict[str, Any]:
        if self.replicas == 1:
            return super().parallel_info()
        fault = self.opts.fault
        shards = "every replica takes [0, B/N) (fault overlapping_shards)" if fault == "overlapping_shards" else \
            "contiguous: replica r takes samples [r*B/N, (r+1)*B/N) of the global batch"
        reduction = "sum of the replicas' mean-loss gradients (fault grad_sum_replicas)" if fault == "grad_sum_replicas" \
            else "explicit all-reduce: the mean of the replicas' mean-loss gradients"
        bn = "n/a (no BatchNorm)" if not self.model.has("batchnorm2d") else \
            "all-reduced sums over the global batch" if self.sync_bn else \
            "per replica; running statistics from replica 0's (as DDP's broadcast)"
        return {"strategy": "replicas simulated in one process, layer by layer", "replicas": self.replicas,
                "processes": 1, "sync_bn": self.sync_bn, "sharding": shards, "gradient_reduction": reduction,
                "batchnorm_statistics": bn}
