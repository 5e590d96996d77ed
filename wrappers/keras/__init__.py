"""Keras 3: the spec as a functional keras.Model subclass of Keras layers, keras.optimizers; one entry per Keras backend."""
from algorithms.spec import BASE_LAYER_KINDS

from ..base import DP_FAULTS, GRAPH_LOWERING_FAULTS, Entry, jax_platform_env, onednn_env

# the lowering faults the Keras wrapper implements (no optimizer-convention faults: Keras' own optimizers run),
# the graph layers' three seams included (layers.py: the Concatenate axis, a BatchNormalization passed through,
# the depthwise kernel's load order); the declaration rewrites come with GRAPH_KINDS (wrappers.base.implemented_faults)
KERAS_FAULTS = frozenset({"flatten_no_permute", "symmetric_same_padding", "bn_momentum_flipped", "bn_eps_keras",
                          "label_smoothing", "dropout_in_eval", "missing_bias", "maxpool_ceil", "grad_double",
                          "l2_not_decoupled"}) | GRAPH_LOWERING_FAULTS


# the graph spec's kinds (issue 15), lowered through the functional API (layers.py); each Keras backend's step-0
# probes of every kind alone and of the graph models agree with torch's (tests/test_graph_backends.py)
GRAPH_KINDS = frozenset({"add", "concat", "conv2d:groups", "conv2d:dilation", "leaky_relu", "gelu", "silu", "sigmoid",
                         "relu6", "layernorm"})


class _KerasEntry(Entry):
    module = "wrappers.keras.backend"
    layer_kinds = BASE_LAYER_KINDS | GRAPH_KINDS


class KerasTensorflowEntry(_KerasEntry):
    name = "keras-tensorflow"
    requires = ("keras", "tensorflow")
    env = {"KERAS_BACKEND": "tensorflow"}
    description = "Keras 3 on its TensorFlow backend"
    capabilities = frozenset({"data_parallel", "sync_bn", "float64", "onednn", "threads"})
    faults = KERAS_FAULTS | DP_FAULTS

    @classmethod
    def job_env(cls, opts):
        return onednn_env(opts)


class KerasJaxEntry(_KerasEntry):
    name = "keras-jax"
    requires = ("keras", "jax")
    env = {"KERAS_BACKEND": "jax"}
    description = "Keras 3 on its JAX backend"
    # sync_bn: accepted; under GSPMD BatchNorm is always over the global batch (said in the manifest)
    capabilities = frozenset({"data_parallel", "sync_bn", "float64", "threads"})
    replica_running_stats = "global"   # so it cannot compute per-replica statistics for a candidate at dp N
    faults = KERAS_FAULTS | DP_FAULTS

    @classmethod
    def job_env(cls, opts):
        return jax_platform_env(opts)


class KerasTorchEntry(_KerasEntry):
    name = "keras-torch"
    requires = ("keras", "torch")
    env = {"KERAS_BACKEND": "torch"}
    description = "Keras 3 on its torch backend"
    # no float64: Keras 3.15 maps 64-bit result types to 32-bit on the torch backend (the wrapper refuses it)
    capabilities = frozenset({"threads"})
    faults = KERAS_FAULTS
    no_data_parallel = ("Keras has no data parallelism on the torch backend: keras.distribution is JAX-only and "
                        "tf.distribute is TensorFlow's; use keras-jax or keras-tensorflow, or torch for DDP")
