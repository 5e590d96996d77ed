"""Native TensorFlow: tf.Module / tf.Variable, tf.nn ops in NHWC, GradientTape, tf.function, raw training kernels."""
from algorithms.spec import BASE_LAYER_KINDS

from ..base import DP_FAULTS, GRAPH_LOWERING_FAULTS, LOWERING_FAULTS, Entry, onednn_env


class TensorflowEntry(Entry):
    name = "tensorflow"
    requires = ("tensorflow",)
    module = "wrappers.tensorflow.backend"
    description = "native TensorFlow (not Keras): tf.nn, GradientTape, tf.function, tf.raw_ops.ResourceApply*"
    capabilities = frozenset({"data_parallel", "hosts", "sync_bn", "float64", "eager", "xla", "onednn", "threads"})
    faults = LOWERING_FAULTS | DP_FAULTS | GRAPH_LOWERING_FAULTS
    emulations = frozenset({"bn_running_var_biased"})   # Keras' running variance, as a reference
    replica_running_stats = "mean"   # tf.distribute's MEAN aggregation of the replicas' moving statistics
    # the graph kinds (layers.py): grouped and dilated convolutions through exact formulations, since TF's
    # CPU Conv2D has no gradient for either
    layer_kinds = BASE_LAYER_KINDS | {"add", "concat", "conv2d:groups", "conv2d:dilation", "leaky_relu", "gelu",
                                      "silu", "sigmoid", "relu6", "layernorm"}

    _ports: dict[tuple[str, int], list[int]] = {}   # (job file, launcher port) -> the workers' ports

    @classmethod
    def processes(cls, job):
        """--hosts H: H MultiWorkerMirroredStrategy workers (processes on 127.0.0.1); else this process."""
        return job.options.hosts

    @classmethod
    def worker_ports(cls, job, job_path: str, port: int) -> list[int]:
        """The workers' gRPC ports: port, port+1, ... (port is the launcher's, checked free). With an explicit
        --port a taken neighbour is refused loudly; with a chosen port a taken neighbour is replaced by a
        free one. Computed once per job in the launcher, so every worker gets the same cluster."""
        import socket
        import sys
        key = (job_path, port)
        if key in cls._ports:
            return cls._ports[key]
        explicit = bool(job.options.extra.get("port"))
        ports = [port]
        for i in range(1, cls.processes(job)):
            want = port + i
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", want))
                    ports.append(want)
                    continue
                except OSError:
                    if explicit:
                        print(f"port {want} on 127.0.0.1 (--port {port} + {i}, TensorFlow worker {i}) is already in "
                              "use; choose another --port", file=sys.stderr)
                        sys.exit(2)
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                ports.append(s.getsockname()[1])
        cls._ports[key] = ports
        return ports

    @classmethod
    def process_command(cls, job, job_path, index, port):
        """Worker `index` of a MultiWorkerMirroredStrategy job: TF_CONFIG names every worker and this one."""
        import json
        cmd, env = super().process_command(job, job_path, index, port)
        workers = [f"127.0.0.1:{p}" for p in cls.worker_ports(job, job_path, port)]
        env["TF_CONFIG"] = json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}})
        return cmd, env

    @classmethod
    def job_env(cls, opts):
        return onednn_env(opts)
