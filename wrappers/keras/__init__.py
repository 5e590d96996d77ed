"""Keras 3: the spec as a functional keras.Model subclass of Keras layers, keras.optimizers; one entry per Keras backend."""
from ..base import Entry, jax_platform_env


class _KerasEntry(Entry):
    module = "wrappers.keras.backend"


class KerasTensorflowEntry(_KerasEntry):
    name = "keras-tensorflow"
    requires = ("keras", "tensorflow")
    env = {"KERAS_BACKEND": "tensorflow"}
    description = "Keras 3 on its TensorFlow backend"

    @classmethod
    def job_env(cls, job):
        """--onednn on/off: TF_ENABLE_ONEDNN_OPTS must be set before TensorFlow is imported."""
        mode = job.get("options", {}).get("extra", {}).get("onednn")
        return {"TF_ENABLE_ONEDNN_OPTS": "1" if mode == "on" else "0"} if mode in ("on", "off") else {}


class KerasJaxEntry(_KerasEntry):
    name = "keras-jax"
    requires = ("keras", "jax")
    env = {"KERAS_BACKEND": "jax"}
    description = "Keras 3 on its JAX backend"

    @classmethod
    def job_env(cls, job):
        return jax_platform_env(job.get("options", {}))


class KerasTorchEntry(_KerasEntry):
    name = "keras-torch"
    requires = ("keras", "torch")
    env = {"KERAS_BACKEND": "torch"}
    description = "Keras 3 on its torch backend"
    no_data_parallel = ("Keras has no data parallelism on the torch backend: keras.distribution is JAX-only and "
                        "tf.distribute is TensorFlow's; use keras-jax or keras-tensorflow, or torch for DDP")
