"""Canonical parameters: generated once by NumPy from a seed, saved with a content hash.

Every wrapper loads these (converting to its own layout) so that all backends start from the
same bits. The 1-ULP perturbation used by the drift envelope lives here too.
"""
from __future__ import annotations

import hashlib
import io
import os
import tempfile
from pathlib import Path

import numpy as np

from .spec import ModelSpec, ParamInfo

Params = dict[str, np.ndarray]


def _init_one(p: ParamInfo, rng: np.random.Generator) -> np.ndarray:
    if p.init == "zeros":
        return np.zeros(p.shape, np.float32)
    if p.init == "ones":
        return np.ones(p.shape, np.float32)
    if p.init == "he_normal":        # N(0, 2 / fan_in)
        w = rng.normal(0.0, np.sqrt(2.0 / p.fan_in), p.shape)
    elif p.init == "he_uniform":     # U(-a, a), a = sqrt(6 / fan_in)
        a = np.sqrt(6.0 / p.fan_in)
        w = rng.uniform(-a, a, p.shape)
    elif p.init == "glorot_uniform":  # U(-a, a), a = sqrt(6 / (fan_in + fan_out))
        a = np.sqrt(6.0 / (p.fan_in + p.fan_out))
        w = rng.uniform(-a, a, p.shape)
    elif p.init == "glorot_normal":
        w = rng.normal(0.0, np.sqrt(2.0 / (p.fan_in + p.fan_out)), p.shape)
    else:
        raise ValueError(f"{p.name}: unknown init {p.init!r}")
    return w.astype(np.float32)


def init_params(model: ModelSpec, seed: int) -> Params:
    """All parameters and buffers, in canonical layout, float32. One RNG stream in layer order."""
    rng = np.random.default_rng(seed)
    return {p.name: _init_one(p, rng) for p in model.params}


def params_hash(params: Params) -> str:
    h = hashlib.sha256()
    for name in sorted(params):
        a = np.ascontiguousarray(params[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def perturb_ulp(params: Params, seed: int) -> Params:
    """Move every non-zero element of every trainable tensor by one ULP, in a seeded random direction."""
    rng = np.random.default_rng(seed)
    out = {}
    for name in sorted(params):
        a = params[name]
        if name.endswith(("running_mean", "running_var")):
            out[name] = a.copy()
            continue
        sign = rng.choice(np.array([-np.inf, np.inf], dtype=a.dtype), size=a.shape)
        moved = np.nextafter(a, sign).astype(a.dtype)
        out[name] = np.where(a != 0, moved, a)
    return out


def save_npz(path: str | Path, arrays: dict[str, np.ndarray]) -> None:
    """Atomic .npz write: a reader never sees a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(buf.getvalue())
    os.replace(tmp, path)


def load_npz(path: str | Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def check_params(model: ModelSpec, params: Params, source: str = "params") -> None:
    """Every parameter present with the spec's shape and float32 dtype."""
    want = {p.name: p.shape for p in model.params}
    missing = sorted(set(want) - set(params))
    extra = sorted(set(params) - set(want))
    if missing or extra:
        raise ValueError(f"{source}: parameters do not match model '{model.name}'"
                         f" (missing: {missing or 'none'}; unexpected: {extra or 'none'})")
    for name, shape in want.items():
        if tuple(params[name].shape) != tuple(shape):
            raise ValueError(f"{source}: {name} has shape {params[name].shape}, the spec says {shape}")


# the per-layer activations a replay keeps per probe: a strided sample of the batch's rows (every replica's
# shard is in it), not all of them. A 32x32x3 graph model's full probe is ~75 MB (150 MB in float64) and a
# comparison writes one per resync point per job: 30 GB for one configuration of 22 runs (measured,
# mobilenet_tiny); the sample keeps every layer's error and the first layer that disagrees
REPLAY_ACTIVATION_ROWS = 8
# an every-sample replay's keys from Backend.layers_and_gradients (one program's activations, loss and gradients):
# JOINT + "forward/<layer>", + "grad/<param>", + "loss", beside the probe's own
JOINT = "joint/"


def thin_activations(probes: dict[str, np.ndarray], rows: int = REPLAY_ACTIVATION_ROWS) -> dict[str, np.ndarray]:
    """`forward/` and `eval/` feature maps (batch, H, W, C) of more than `rows` samples: every
    (batch // rows)-th sample; `rows` 0: every sample (a kink witness reads every ReLU input and max-pool
    window of the batch). Everything else (dense activations, logits, loss, gradients, updates, buffers,
    optimizer state) is kept whole: the loss's tolerance reads the whole logits."""
    out = {}
    for k, v in probes.items():
        v = np.asarray(v)
        if rows > 0 and k.startswith(("forward/", "eval/")) and v.ndim >= 4 and v.shape[0] > rows:
            v = np.ascontiguousarray(v[:: v.shape[0] // rows][:rows])
        out[k] = v
    return out
