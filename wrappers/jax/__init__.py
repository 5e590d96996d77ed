"""JAX: jax.lax ops in NHWC/HWIO, optax optimizers, one jit-compiled step."""
from ..base import Entry


class JaxEntry(Entry):
    name = "jax"
    requires = ("jax", "optax")
    module = "wrappers.jax.backend"
    description = "JAX jit, jax.lax in NHWC, optax"

    @classmethod
    def job_env(cls, job):
        opts = job.get("options", {})
        flags = ["--xla_cpu_multi_thread_eigen=false" if opts.get("threads", 1) == 1 else "",
                 f"--xla_force_host_platform_device_count={opts.get('devices', 1)}"]
        env = {"XLA_FLAGS": " ".join(f for f in flags if f), "JAX_PLATFORMS": opts.get("extra", {}).get("platform", "cpu")}
        if opts.get("dtype") == "float64":
            env["JAX_ENABLE_X64"] = "1"
        return env
