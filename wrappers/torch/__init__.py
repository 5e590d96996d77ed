"""PyTorch: torch.nn.functional ops in NCHW, torch.optim optimizers.

Data parallel (`--devices N`): DistributedDataParallel, one OS process per rank (gloo on CPU, NCCL
with one GPU per rank when CUDA is present), for train jobs and for the probe and replay jobs of a
one-host run too, so that the steps the verdict compares run the code that trained (DDP's all-reduce).
  hosts == 1   the wrappers launcher starts N `python -m wrappers rank JOB i` processes itself and
               gives each RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR=127.0.0.1 / MASTER_PORT=port
               (env:// rendezvous on rank 0's TCPStore);
  hosts == H   the launcher starts H torchrun node agents (c10d rendezvous on 127.0.0.1:port), each
               running N/H ranks: H local agents stand in for H hosts.
Probe and replay jobs of a multi-host run (--hosts > 1) stay in one process, the replicas emulated there
(see TorchBackend._grads_emulated); their notes say so.
"""
from __future__ import annotations

import sys

from algorithms.contract import Job, RunOptions
from algorithms.spec import BASE_LAYER_KINDS

from ..base import DP_FAULTS, GRAPH_LOWERING_FAULTS, LOWERING_FAULTS, Entry

# torchrun's c10d rendezvous ranks the node agents by sorted (address, pid): each local "host" gets
# its own loopback address, three digits so that the string order is the node order, so agent 0
# (whose stdout the launcher relays) always holds global rank 0.
HOST_ADDR = "127.0.0.{}"
HOST_ADDR_BASE = 101
RDZV_TIMEOUT_S = 60


def _dp(opts: RunOptions) -> tuple[int, int]:
    return opts.devices, opts.hosts


class TorchEntry(Entry):
    name = "torch"
    requires = ("torch",)
    module = "wrappers.torch.backend"
    description = "PyTorch eager, torch.nn.functional in NCHW, torch.optim; DistributedDataParallel for --devices N"
    # no sync_bn: torch.nn.SyncBatchNorm refuses CPU tensors (the wrapper refuses --sync-bn on CPU, saying so)
    capabilities = frozenset({"data_parallel", "hosts", "float64", "channels_last", "threads"})
    faults = LOWERING_FAULTS | DP_FAULTS | GRAPH_LOWERING_FAULTS
    emulations = frozenset({"adam_eps_hat", "adam_float32_betas", "keras_momentum_schedule", "bn_running_var_biased",
                            "avgpool_replicate_pad", "bn_replica_mean_running_stats"})
    layer_kinds = BASE_LAYER_KINDS | {"add", "concat", "conv2d:groups", "conv2d:dilation", "leaky_relu", "gelu",
                                      "silu", "sigmoid", "relu6", "layernorm"}

    @classmethod
    def job_env(cls, opts: RunOptions) -> dict[str, str]:
        # cuBLAS needs a fixed workspace for deterministic GEMMs on GPU; read when CUDA initialises,
        # so set before import. No effect on CPU.
        if opts.deterministic:
            return {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
        return {}

    @classmethod
    def processes(cls, job: Job) -> int:
        devices, hosts = _dp(job.options)
        if devices <= 1 or (hosts > 1 and job.mode != "train"):
            return 1                       # multi-host probes / replays: one process, replicas emulated
        return devices if hosts <= 1 else hosts

    @classmethod
    def process_command(cls, job: Job, job_path: str, index: int,
                        port: int) -> tuple[list[str], dict[str, str]]:
        devices, hosts = _dp(job.options)
        if hosts <= 1:                     # rank `index` itself, env:// rendezvous on rank 0
            return ([sys.executable, "-m", "wrappers", "rank", job_path, str(index)],
                    {"RANK": str(index), "WORLD_SIZE": str(devices), "LOCAL_RANK": str(index),
                     "LOCAL_WORLD_SIZE": str(devices), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(port)})
        # node agent `index` of `hosts`: torchrun, c10d rendezvous; agent 0 hosts the rendezvous store
        per_host = devices // hosts
        conf = (f"is_host={'true' if index == 0 else 'false'},join_timeout={RDZV_TIMEOUT_S},"
                f"read_timeout={RDZV_TIMEOUT_S}")
        return ([sys.executable, "-m", "torch.distributed.run", "--nnodes", str(hosts), "--node-rank", str(index),
                 "--nproc-per-node", str(per_host), "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"duipai-{port}", "--rdzv-conf", conf,
                 "--local-addr", HOST_ADDR.format(HOST_ADDR_BASE + index), "--max-restarts", "0",
                 "--monitor-interval", "0.1", "-m", "wrappers", "rank", job_path, str(index)],
                {})
