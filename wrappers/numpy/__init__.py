"""NumPy: the spec's formulas with hand-written gradients and the reference optimizer maths, no framework.

The one backend whose every operation is written in this repository from algorithms/ (spec.py, optim.py,
docs/canonical-layout.md): an arbiter that shares no kernel library or convention with the frameworks.
Precision follows --dtype like every backend (ask for float64 to get the exact computation; float32
stores parameters, activations and optimizer state in float32). Data parallel (`--devices N`): the N
replicas run in this one process, layer by layer, with an explicit all-reduce (mean of the replicas'
gradients; BatchNorm statistics per replica, or all-reduced sums with --sync-bn).
Registered through the `duipai.backends` entry point like any third-party backend (see docs/backend-api.md).
"""
from __future__ import annotations

from algorithms.spec import BASE_LAYER_KINDS

from ..base import DP_FAULTS, Entry


class NumpyEntry(Entry):
    name = "numpy"
    requires = ("numpy",)
    module = "wrappers.numpy.backend"
    description = "NumPy, the spec's formulas with hand-written backward, reference optimizer maths (the arbiter)"
    # no hosts: one process by design; threads: the BLAS pool limited at run time (threadpoolctl)
    capabilities = frozenset({"data_parallel", "sync_bn", "float64", "threads"})
    # no lowering fault yet: a clean arbiter; the data-parallel faults live in its explicit all-reduce
    faults = DP_FAULTS
    layer_kinds = BASE_LAYER_KINDS | {"add", "concat", "conv2d:groups", "conv2d:dilation", "leaky_relu", "gelu",
                                      "silu", "sigmoid", "relu6", "layernorm"}
