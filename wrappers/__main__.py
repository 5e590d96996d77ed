"""Entry point of a backend process.

    python -m wrappers info            availability of every backend, as JSON (imports no framework)
    python -m wrappers run JOB.json    run one job (train, probe, replay); a multi-process job (DDP ranks,
                                       host agents) is launched from here and watched: one process that
                                       dies stops all of them, so nothing hangs
    python -m wrappers rank JOB.json I process I of a multi-process job (started by `run`)
    python -m wrappers serve           run jobs one after another, each as `run` would: a line
                                       {"job": JOB.json, "log": FILE} on stdin in, its progress lines and
                                       {"exit": CODE} on stdout out (the harness's warm processes)

The backend's environment (KERAS_BACKEND, XLA_FLAGS, thread counts) is set here, before its
framework is imported: that is why every backend gets a process of its own.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import traceback

from algorithms.contract import Job, RunOptions

from .registry import ORIGINS, REGISTRY


def set_backend_env(entry, opts: RunOptions) -> None:
    """The environment a backend's framework reads when it is imported: thread counts, the Entry's own
    variables and those of these options. Call before the framework is imported."""
    threads = str(opts.threads)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TF_NUM_INTRAOP_THREADS",
                "TF_NUM_INTEROP_THREADS"):
        os.environ[var] = threads
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.update(entry.env)
    for k, v in entry.job_env(opts).items():
        os.environ[k] = v


def _port(job: Job) -> int:
    """The rendezvous port: the one asked for (refused loudly if taken) or a free one."""
    import socket
    want = int(job.options.extra.get("port", 0) or 0)
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", want))
        except OSError:
            print(f"port {want} on 127.0.0.1 is already in use; choose another with --port", file=sys.stderr)
            sys.exit(2)
        return s.getsockname()[1]


def launch(entry, job_path: str, job: Job) -> int:
    """Start every process of a multi-process job, relay process 0's progress, fail fast."""
    import subprocess
    import threading
    import time
    n = entry.processes(job)
    port = _port(job)
    procs = []
    for i in range(n):
        cmd, env = entry.process_command(job, job_path, i, port)
        procs.append(subprocess.Popen(cmd, env={**os.environ, **env}, text=True,
                                      stdout=subprocess.PIPE if i == 0 else subprocess.DEVNULL))

    def relay() -> None:
        for line in procs[0].stdout:
            sys.stdout.write(line)
            sys.stdout.flush()

    t = threading.Thread(target=relay, daemon=True)
    t.start()
    while True:
        codes = [p.poll() for p in procs]
        bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            i, c = bad[0]
            if c == 3 and i != 0:   # a refusal: let process 0 say why (its reason goes to the harness) first
                try:
                    procs[0].wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            print(f"process {i} of {n} exited with code {c}; stopping the others", file=sys.stderr)
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
            return 3 if c == 3 else 1
        if all(c == 0 for c in codes):
            t.join(timeout=5)
            return 0
        time.sleep(0.05)


def _relative_paths(job: Job) -> list[tuple[str, str]]:
    """The job's file paths that are not absolute (field, value): they would be read against whatever
    folder the process was started in."""
    return [(k, v) for k, v in job.paths() if not os.path.isabs(v)]


def _configuration(job_path: str) -> tuple[str, str] | None:
    """A job's backend and options (what a warm process must share with every job it runs), None if unreadable."""
    try:
        job = Job.read(job_path)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return job.backend, json.dumps(job.options.to_dict(), sort_keys=True)


def serve() -> int:
    """Run the jobs named on stdin one after another in this process, each exactly as `run` runs it, so that
    the framework is imported once for all of them. Every job must have the first one's backend and options:
    what a framework fixes at its first use (environment, device count, precision) is the same for all.
    A job's stderr goes to its own log; a job that fails ends the process (its framework may be left in any
    state), and so does one that survived a failure (wrappers.worker.LEFT_IN_DOUBT), and the end of stdin."""
    base_stderr = os.dup(2)
    first: tuple[str, str] | None = None
    for line in sys.stdin:
        request = json.loads(line)
        sys.stderr.flush()
        with open(request["log"], "a") as log:
            os.dup2(log.fileno(), 2)
        try:
            key = _configuration(request["job"])
            if first is not None and key is not None and key != first:
                print(f"job {request['job']}: backend {key[0]} with options {key[1]} in a process that runs "
                      f"{first[0]} with {first[1]}; a warm process serves one configuration", file=sys.stderr)
                rc = 2
            else:
                first = first or key
                rc = main(["run", request["job"]])   # an unreadable job: `run` says why
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except Exception:     # noqa: BLE001 -- as an uncaught exception in `run`: its traceback, exit code 1
            traceback.print_exc()
            rc = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(base_stderr, 2)
        gc.unfreeze()    # the training loop froze what it held (wrappers.worker.run_train): let it go
        gc.collect()
        print(json.dumps({"exit": rc}), flush=True)
        if rc != 0:
            return rc
        if sys.modules.get("wrappers.worker") is not None and sys.modules["wrappers.worker"].LEFT_IN_DOUBT:
            return 0     # a failure the job survived (a replay's report step): no further job in this process
    return 0


def main(argv: list[str]) -> int:
    if argv == ["serve"]:
        return serve()
    if not argv or argv[0] not in ("info", "run", "rank"):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "info":
        print(json.dumps({name: {"missing": e.missing(), "requires": list(e.requires), "versions": e.versions(),
                                 "sources": e.sources(), "description": e.description,
                                 "no_data_parallel": e.no_data_parallel, "capabilities": sorted(e.capabilities),
                                 "layer_kinds": sorted(e.layer_kinds),
                                 "faults": sorted(e.implemented_faults()), "emulations": sorted(e.emulations),
                                 "replica_running_stats": e.replica_running_stats,
                                 **ORIGINS[name]}
                          for name, e in REGISTRY.items()}))
        return 0
    job_path = os.path.abspath(argv[1])     # handed on to the other processes of a multi-process job
    try:
        job = Job.read(job_path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"job {job_path}: not a valid job file: {e}", file=sys.stderr)
        return 2
    relative = _relative_paths(job)
    if relative:
        print(f"job {job_path}: field {relative[0][0]!r} is a relative path ({relative[0][1]!r}); a worker does not "
              "depend on its working directory, so the harness writes absolute paths", file=sys.stderr)
        return 2
    entry = REGISTRY.get(job.backend)
    if entry is None:
        print(f"unknown backend {job.backend!r}; known: {', '.join(REGISTRY)}", file=sys.stderr)
        return 2
    missing = entry.missing()
    if missing:
        print(f"backend {entry.name}: package(s) not installed: {', '.join(missing)}", file=sys.stderr)
        return 4
    set_backend_env(entry, job.options)
    if argv[0] == "run" and entry.processes(job) > 1:
        return launch(entry, job_path, job)
    if argv[0] == "rank":
        os.environ["DUIPAI_PROCESS_INDEX"] = argv[2]
    from .worker import keep_to_own_framework, main as run
    keep_to_own_framework(entry)
    return run(job_path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
