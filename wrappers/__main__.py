"""Entry point of a backend process.

    python -m wrappers info            availability of every backend, as JSON (imports no framework)
    python -m wrappers run JOB.json    run one job (train or probe) in this process

The backend's environment (KERAS_BACKEND, XLA_FLAGS, thread counts) is set here, before its
framework is imported: that is why every backend gets a process of its own.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .registry import REGISTRY


def _set_env(entry, job: dict) -> None:
    opts = job.get("options", {})
    threads = str(opts.get("threads", 1))
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "TF_NUM_INTRAOP_THREADS",
                "TF_NUM_INTEROP_THREADS"):
        os.environ[var] = threads
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.update(entry.env)
    for k, v in entry.job_env(job).items():
        os.environ[k] = v


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("info", "run"):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "info":
        print(json.dumps({name: {"missing": e.missing(), "requires": list(e.requires), "versions": e.versions(),
                                 "sources": e.sources(), "description": e.description}
                          for name, e in REGISTRY.items()}))
        return 0
    job = json.loads(Path(argv[1]).read_text())
    entry = REGISTRY.get(job["backend"])
    if entry is None:
        print(f"unknown backend {job['backend']!r}; known: {', '.join(REGISTRY)}", file=sys.stderr)
        return 2
    missing = entry.missing()
    if missing:
        print(f"backend {entry.name}: package(s) not installed: {', '.join(missing)}", file=sys.stderr)
        return 4
    _set_env(entry, job)
    from .worker import main as run
    return run(argv[1])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
