"""Keras 3: the spec as a keras.Sequential of Keras layers, keras.optimizers; one entry per Keras backend."""
from ..base import Entry


class _KerasEntry(Entry):
    module = "wrappers.keras.backend"


class KerasTensorflowEntry(_KerasEntry):
    name = "keras-tensorflow"
    requires = ("keras", "tensorflow")
    env = {"KERAS_BACKEND": "tensorflow"}
    description = "Keras 3 on its TensorFlow backend"


class KerasJaxEntry(_KerasEntry):
    name = "keras-jax"
    requires = ("keras", "jax")
    env = {"KERAS_BACKEND": "jax"}
    description = "Keras 3 on its JAX backend"

    @classmethod
    def job_env(cls, job):
        n = job.get("options", {}).get("devices", 1)
        return {"XLA_FLAGS": f"--xla_force_host_platform_device_count={n}", "JAX_PLATFORMS": "cpu"}


class KerasTorchEntry(_KerasEntry):
    name = "keras-torch"
    requires = ("keras", "torch")
    env = {"KERAS_BACKEND": "torch"}
    description = "Keras 3 on its torch backend"
