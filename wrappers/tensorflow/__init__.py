"""Native TensorFlow: tf.Module / tf.Variable, tf.nn in NHWC, GradientTape, tf.function, raw training kernels."""
from ..base import Entry


class TensorflowEntry(Entry):
    name = "tensorflow"
    requires = ("tensorflow",)
    module = "wrappers.tensorflow.backend"
    description = "native TensorFlow (not Keras): tf.nn, GradientTape, tf.function, tf.raw_ops.ResourceApply*"
