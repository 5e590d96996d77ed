"""A backend's process imports the framework it names and no other (wrappers.worker.keep_to_own_framework).

Keras' set_random_seed imports TensorFlow whatever Keras' backend, TensorFlow loads Keras eagerly, Keras
loads JAX and scikit-learn: without the block, a keras-jax process held three frameworks, and every
process start paid 2-4 s for them (bench/process_start.py)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import INFO, ROOT, need

# the backend's process as `python -m wrappers run` sets it up, up to a built Backend (whose construction
# seeds the framework: Keras' set_random_seed is where TensorFlow came in)
SCRIPT = """
import json, sys
from algorithms.contract import RunOptions
from algorithms.optim import HParams
from algorithms.spec import load_model
from wrappers.__main__ import set_backend_env
from wrappers.registry import REGISTRY
from wrappers.worker import backend_class, imported_frameworks, keep_to_own_framework
entry = REGISTRY[sys.argv[1]]
opts = RunOptions(threads=1)
set_backend_env(entry, opts)
blocked = keep_to_own_framework(entry)
cls = entry.load()
backend_class(cls, opts)(load_model("cnn2d_2conv_2fc"), HParams(), opts)
print(json.dumps({"imported": imported_frameworks(), "blocked": blocked}))
"""


@pytest.mark.parametrize("backend", sorted(INFO))
def test_a_backends_process_imports_only_what_it_requires(backend):
    need(backend)
    out = subprocess.run([sys.executable, "-c", SCRIPT, backend], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    requires = set(INFO[backend]["requires"])
    assert set(got["imported"]) <= requires, f"{backend} imported {got['imported']}, requires {sorted(requires)}"
    assert not set(got["blocked"]) & requires
    if "keras" in requires:   # the trap this guards: Keras brought TensorFlow, JAX and scikit-learn along
        assert "sklearn" in got["blocked"] and "keras" in got["imported"]
