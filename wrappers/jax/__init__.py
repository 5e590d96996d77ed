"""JAX: jax.lax ops in NHWC/HWIO, optax optimizers, one jit-compiled step.

Data parallel (`--devices N`): one process, N host devices (XLA_FLAGS below), one jit step over
Mesh('data'). With `--hosts H` (train jobs): H processes on 127.0.0.1 stand in for H hosts, each
with N/H local devices, joined by jax.distributed.initialize (coordinator on process 0 at
127.0.0.1:port, gloo CPU collectives); the mesh spans all N devices, process 0 writes the results.
Probe and replay jobs of a --hosts run: one process, the same mesh over N local devices (the same
program, bitwise equal to the H processes; the manifest's `parallel` says so).
"""
import os
import sys

from algorithms.contract import RunOptions
from algorithms.spec import BASE_LAYER_KINDS

from ..base import DP_FAULTS, GRAPH_LOWERING_FAULTS, LOWERING_FAULTS, Entry, jax_platform_env


def _dp(opts: RunOptions) -> tuple[int, int]:
    return opts.devices, opts.hosts


class JaxEntry(Entry):
    name = "jax"
    requires = ("jax", "optax")
    module = "wrappers.jax.backend"
    description = "JAX jit, jax.lax in NHWC, optax"
    capabilities = frozenset({"data_parallel", "hosts", "sync_bn", "float64", "eager", "threads"})
    faults = LOWERING_FAULTS | DP_FAULTS | GRAPH_LOWERING_FAULTS
    emulations = frozenset({"bn_running_var_biased"})   # Keras' running variance, as a reference
    layer_kinds = BASE_LAYER_KINDS | {"add", "concat", "conv2d:groups", "conv2d:dilation", "leaky_relu", "gelu",
                                      "silu", "sigmoid", "relu6", "layernorm"}

    @classmethod
    def job_env(cls, opts):
        devices, hosts = _dp(opts)
        # per process: a rank of a multi-process (train) job holds N/H devices; a probe or replay job of a
        # --hosts run is one process over all N (the same program, bitwise equal: tests/test_dp_jax.py)
        rank = "DUIPAI_JAX_COORDINATOR" in os.environ
        local = devices // hosts if rank and hosts > 1 and devices % hosts == 0 else devices
        env = jax_platform_env(opts, local)
        if opts.dtype == "float64":
            env["JAX_ENABLE_X64"] = "1"
        return env

    @classmethod
    def processes(cls, job):
        devices, hosts = _dp(job.options)
        if devices <= 1 or hosts <= 1 or job.mode != "train":
            return 1
        return hosts

    @classmethod
    def process_command(cls, job, job_path, index, port):
        devices, hosts = _dp(job.options)
        return ([sys.executable, "-m", "wrappers", "rank", job_path, str(index)],
                {"DUIPAI_JAX_COORDINATOR": f"127.0.0.1:{port}", "DUIPAI_JAX_NUM_PROCESSES": str(hosts),
                 "DUIPAI_JAX_PROCESS_ID": str(index)})
