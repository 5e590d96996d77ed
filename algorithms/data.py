"""Data: the embedded default (scikit-learn digits), CSV and .npz loaders, a synthetic generator,
and the one data order every backend follows.

The harness prepares a `Dataset` once (float32 NHWC images, int32 labels, recorded
normalisation) and the global batch of each step as sample indices; wrappers only gather.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .data_files import DataError, file_hash, read_csv_rows, read_npz_arrays
from .params import load_npz, save_npz


@dataclass
class Dataset:
    x_train: np.ndarray   # (N, H, W, C) float32, normalised
    y_train: np.ndarray   # (N,) int32
    x_test: np.ndarray
    y_test: np.ndarray
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.x_train.shape[1:])  # type: ignore[return-value]

    def hash(self) -> str:
        h = hashlib.sha256()
        for a in (self.x_train, self.y_train, self.x_test, self.y_test):
            h.update(f"{a.dtype.str}{a.shape}".encode())
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()[:16]

    def arrays(self) -> dict[str, np.ndarray]:
        return {"x_train": self.x_train, "y_train": self.y_train, "x_test": self.x_test, "y_test": self.y_test}


SPLIT_SEED = 20240601      # the fixed train/test split of every source without its own split
TEST_FRACTION = 0.2


def _split(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, ...]:
    perm = np.random.default_rng(SPLIT_SEED).permutation(len(x))
    n_test = max(1, int(round(len(x) * TEST_FRACTION)))
    te, tr = perm[:n_test], perm[n_test:]
    return x[tr], y[tr], x[te], y[te]


def _finish(x_tr, y_tr, x_te, y_te, source: str, raw_max: float, meta: dict[str, Any]) -> Dataset:
    """Scale to [0, 1] by the raw maximum, then standardise by the train set's mean and std."""
    for part, x, y in (("train", x_tr, y_tr), ("test", x_te, y_te)):
        if len(x) == 0:
            raise DataError(f"{source}: the {part} set is empty")
        if not np.all(np.isfinite(x)):
            raise DataError(f"{source}: the {part} images contain NaN or Inf")
        if np.any(y < 0) or np.any(y != np.floor(y)):
            bad = y[(y < 0) | (y != np.floor(y))][0]
            raise DataError(f"{source}: label {float(bad):g} in the {part} set is not a non-negative integer")
        if np.any(y.astype(np.float64) > np.iinfo(np.int32).max):     # int32 below would wrap it onto a valid class
            raise DataError(f"{source}: label {y.max()} in the {part} set is beyond int32")
    x_tr = x_tr.astype(np.float64) / raw_max
    x_te = x_te.astype(np.float64) / raw_max
    mean, std = float(x_tr.mean()), float(x_tr.std())
    std = std if std > 0 else 1.0
    ds = Dataset(((x_tr - mean) / std).astype(np.float32), y_tr.astype(np.int32),
                 ((x_te - mean) / std).astype(np.float32), y_te.astype(np.int32))
    ds.meta = {"source": source, "n_train": len(x_tr), "n_test": len(x_te),
               "image_shape": list(ds.image_shape), "num_classes_seen": int(max(y_tr.max(), y_te.max())) + 1,
               "normalisation": {"formula": "((x / raw_max) - mean) / std, statistics of the train set",
                                 "raw_max": raw_max, "mean": mean, "std": std},
               **meta}
    ds.meta["hash"] = ds.hash()
    return ds


def _cached(cache_dir: Path, pattern: str, build) -> Dataset:
    """A built-in data set kept as prepared arrays per scikit-learn version (importing scikit-learn costs
    seconds; a cached matrix rerun should not). `pattern` has one {} for that version."""
    import importlib.metadata as md
    cache = cache_dir / pattern.format(md.version("scikit-learn"))
    if cache.exists():
        z = load_npz(cache)
        meta = json.loads(str(z.pop("meta")))
        return Dataset(z["x_train"], z["y_train"], z["x_test"], z["y_test"], meta)
    ds = build()
    save_npz(cache, {**ds.arrays(), "meta": np.array(json.dumps(ds.meta))})
    return ds


def load_digits(cache_dir: str | Path | None = None) -> Dataset:
    """scikit-learn's 1797 real 8x8 handwritten digits (they ship in the wheel), pixels 0..16.

    With a cache folder the prepared arrays are kept per scikit-learn version (importing
    scikit-learn costs seconds; a cached matrix rerun should not)."""
    if cache_dir is not None:
        return _cached(Path(cache_dir), "digits-sklearn-{}.npz", load_digits)
    from sklearn.datasets import load_digits as _ld
    d = _ld()
    x = d.images.astype(np.float64)[..., None]
    y = d.target.astype(np.int64)
    return _finish(*_split(x, y), "digits", 16.0,
                   {"split": f"seeded permutation (seed {SPLIT_SEED}), {TEST_FRACTION:.0%} test"})


DIGITS32_SEED = 20261130   # the fixed colour jitter and shifts of digits32
DIGITS32_SHAPE = (32, 32, 3)


def _upsample_matrix(n_in: int, n_out: int) -> np.ndarray:
    """(n_out, n_in) linear interpolation between pixel centres (align_corners=False, edges clamped)."""
    pos = (np.arange(n_out) + 0.5) * n_in / n_out - 0.5
    lo = np.clip(np.floor(pos).astype(int), 0, n_in - 1)
    hi = np.clip(lo + 1, 0, n_in - 1)
    frac = np.clip(pos - np.floor(pos), 0.0, 1.0)
    frac = np.where(pos < 0, 0.0, frac)
    m = np.zeros((n_out, n_in))
    m[np.arange(n_out), lo] += 1.0 - frac
    m[np.arange(n_out), hi] += frac
    return m


def digits32(cache_dir: str | Path | None = None) -> Dataset:
    """32x32x3 colour digits, no download: scikit-learn's 1797 8x8 digits, bilinearly upsampled to 32x32,
    shifted by up to 3 pixels and painted with a random foreground and background colour plus pixel noise,
    all from one fixed seed (DIGITS32_SEED), so every machine builds the same bytes (float64 NumPy maths).
    For the 32x32x3 models (resnet_tiny, mobilenet_tiny, convnext_tiny): real labels, a learnable task."""
    if cache_dir is not None:
        return _cached(Path(cache_dir), f"digits32-sklearn-{{}}-{DIGITS32_SEED}.npz", digits32)
    from sklearn.datasets import load_digits as _ld
    d = _ld()
    up = _upsample_matrix(8, 32)
    ink = np.einsum("ij,njk,lk->nil", up, d.images.astype(np.float64) / 16.0, up)        # (N, 32, 32) in [0, 1]
    rng = np.random.default_rng(DIGITS32_SEED)
    n = len(ink)
    shifts = rng.integers(-3, 4, (n, 2))
    for i, (dy, dx) in enumerate(shifts):                  # shift with zero fill (ink leaves, nothing wraps)
        ink[i] = np.roll(ink[i], (dy, dx), axis=(0, 1))
        if dy > 0: ink[i, :dy] = 0
        if dy < 0: ink[i, dy:] = 0
        if dx > 0: ink[i, :, :dx] = 0
        if dx < 0: ink[i, :, dx:] = 0
    fg = rng.uniform(0.35, 1.0, (n, 1, 1, 3))
    bg = rng.uniform(0.0, 0.45, (n, 1, 1, 3))
    x = np.clip(bg + (fg - bg) * ink[..., None] + rng.normal(0.0, 0.04, (n, 32, 32, 3)), 0.0, 1.0)
    return _finish(*_split(x, d.target.astype(np.int64)), "digits32", 1.0,
                   {"split": f"seeded permutation (seed {SPLIT_SEED}), {TEST_FRACTION:.0%} test",
                    "construction": f"sklearn digits 8x8 -> bilinear 32x32, shift +-3 px, colour jitter and noise "
                                    f"(seed {DIGITS32_SEED})"})


def synthetic(n: int = 1200, shape: tuple[int, int, int] = (8, 8, 1), classes: int = 10, seed: int = 0) -> Dataset:
    """Learnable random data: each class is a random prototype image plus noise."""
    rng = np.random.default_rng(seed)
    protos = rng.uniform(0, 1, (classes, *shape))
    y = rng.integers(0, classes, n)
    x = np.clip(protos[y] + rng.normal(0, 0.35, (n, *shape)), 0, 1)
    return _finish(*_split(x, y), f"synthetic(n={n}, shape={list(shape)}, classes={classes}, seed={seed})",
                   1.0, {"split": f"seeded permutation (seed {SPLIT_SEED}), {TEST_FRACTION:.0%} test"})


def _recorded(path: Path) -> str:
    """The data file as the manifest records it: absolute, so that a run can be regenerated (envelope,
    localization) from any working directory, not only the one it was started in."""
    return os.path.abspath(path)


def load_csv(train: str | Path, test: str | Path | None = None, *, raw_max: float = 255.0,
             image_shape: tuple[int, ...] | None = None, cache_dir: str | Path | None = None) -> Dataset:
    """MNIST-style CSV (label + pixel columns, pixels in (H, W, C) order). Parsed once; later loads read a
    cached .npz. `image_shape` (the model's input shape) says how to fold the pixel columns; without it
    they must be a square single-channel image."""
    paths = [Path(train)] + ([Path(test)] if test else [])
    for p in paths:
        if not p.is_file():
            raise DataError(f"{p}: no such data file")
    key = "-".join(file_hash(p) for p in paths)
    folded = "x".join(map(str, image_shape)) if image_shape else "square"
    cache = Path(cache_dir) / f"csv-{key}-{folded}.npz" if cache_dir else None
    if cache and cache.exists():
        arrs = load_npz(cache)
    else:
        x, y = read_csv_rows(paths[0], image_shape)
        if test:
            xt, yt = read_csv_rows(paths[1], image_shape)
            if xt.shape[1:] != x.shape[1:]:
                raise DataError(f"{paths[1]}: images of shape {xt.shape[1:]} differ from the train file's {x.shape[1:]}")
            arrs = {"x_train": x, "y_train": y, "x_test": xt, "y_test": yt}
        else:
            a = _split(x, y)
            arrs = dict(zip(("x_train", "y_train", "x_test", "y_test"), a))
        if cache:
            save_npz(cache, arrs)
    src = "csv:" + ",".join(_recorded(p) for p in paths)
    return _finish(arrs["x_train"], arrs["y_train"], arrs["x_test"], arrs["y_test"], src, raw_max,
                   {"file_hash": key, "split": "given" if test else f"seeded permutation (seed {SPLIT_SEED})"})


def load_npz_data(path: str | Path, *, raw_max: float | None = None,
                  image_shape: tuple[int, int, int] | None = None) -> Dataset:
    """An .npz with x_train, y_train, x_test, y_test (or x, y, split here); images (N,H,W[,C]), or flat
    (N, H*W*C) rows in (H, W, C) order folded to `image_shape` (the model's input shape)."""
    p = Path(path)
    names, arrays = read_npz_arrays(p)
    parts = [arrays[n] for n in names] if len(names) == 4 else list(_split(arrays["x"], arrays["y"]))
    for i in (0, 2):
        x = parts[i]
        if x.ndim == 2 and image_shape is not None:
            if x.shape[1] != math.prod(image_shape):
                raise DataError(f"{p}: flat images of {x.shape[1]} values do not fit the image shape {list(image_shape)}")
            parts[i] = x = x.reshape(len(x), *image_shape)
        if x.ndim == 3:
            parts[i] = x[..., None]
        elif x.ndim != 4:
            raise DataError(f"{p}: images must be (N, H, W) or (N, H, W, C), got shape {x.shape}")
    rm = raw_max if raw_max is not None else float(max(np.abs(parts[0]).max(), 1e-12))
    return _finish(*parts, f"npz:{_recorded(p)}", rm, {"file_hash": file_hash(p)})


def load_data(spec: str, *, cache_dir: str | Path | None = None,
              image_shape: tuple[int, int, int] | None = None, classes: int = 10) -> Dataset:
    """`digits` (the built-in digits at the model's shape: 8x8x1, or digits32 for a 32x32x3 model) |
    `digits32` (32x32x3) | `synthetic[:N]` | `path.csv[,test.csv]` | `path.npz`.
    `image_shape` (the model's input shape) shapes synthetic data and folds flat CSV/npz pixel rows."""
    if spec == "digits":   # the default data source: a 32x32x3 model gets the digits built at its shape
        return digits32(cache_dir) if image_shape is not None and tuple(image_shape) == DIGITS32_SHAPE \
            else load_digits(cache_dir)
    if spec == "digits32":
        return digits32(cache_dir)
    if spec.startswith("synthetic"):
        count = spec.split(":", 1)[1] if ":" in spec else "1200"
        if spec.split(":", 1)[0] != "synthetic" or not count.isdigit():
            raise DataError(f"data {spec!r}: synthetic takes a sample count, e.g. 'synthetic:2000'")
        n = int(count)
        return synthetic(n, image_shape or (8, 8, 1), classes)
    parts = spec.split(",")
    if parts[0].endswith(".csv"):
        return load_csv(parts[0], parts[1] if len(parts) > 1 else None, cache_dir=cache_dir, image_shape=image_shape)
    if spec.endswith(".npz"):
        return load_npz_data(spec, image_shape=image_shape)
    raise DataError(f"data {spec!r}: unknown source; use 'digits', 'digits32', 'synthetic[:N]', a .csv (train[,test]) "
                    "or an .npz")


def check_fits(ds: Dataset, input_shape: tuple[int, ...], num_classes: int, model_name: str) -> None:
    src = ds.meta.get("source", "data")
    if ds.image_shape != tuple(input_shape):
        hint = " (built in at that shape: --data digits32)" if tuple(input_shape) == DIGITS32_SHAPE else ""
        raise DataError(f"{src}: images are {list(ds.image_shape)} but model '{model_name}' expects {list(input_shape)}"
                        f"{hint}; --data synthetic takes the model's shape")
    top = int(max(ds.y_train.max(), ds.y_test.max()))
    if top >= num_classes:
        raise DataError(f"{src}: label {top} is out of range for model '{model_name}' ({num_classes} classes)")


# --------------------------------------------------------------------------- order and masks
def batch_order(n_train: int, batch_size: int, steps: int, seed: int) -> np.ndarray:
    """(steps, batch_size) sample indices: per-epoch shuffles from `seed`, last partial batch dropped."""
    if batch_size > n_train:
        raise DataError(f"batch size {batch_size} is larger than the train set ({n_train} samples)")
    per_epoch = n_train // batch_size
    rng = np.random.default_rng(seed)
    out = np.empty((steps, batch_size), np.int64)
    s = 0
    while s < steps:
        perm = rng.permutation(n_train)
        for b in range(min(per_epoch, steps - s)):
            out[s] = perm[b * batch_size:(b + 1) * batch_size]
            s += 1
    return out


def epoch_of(step: int, n_train: int, batch_size: int) -> int:
    return step // (n_train // batch_size)


def dropout_keep_mask(seed: int, step: int, layer_index: int, shape: tuple[int, ...], rate: float) -> np.ndarray:
    """The harness's dropout mask for one layer at one step (True = keep). Same bits for every backend."""
    rng = np.random.default_rng([seed, step, layer_index])
    return rng.random(shape) >= rate


def batch_checksum(x: np.ndarray, y: np.ndarray) -> str:
    """A short digest of the exact batch fed (images and labels), so data-order bugs show."""
    h = hashlib.blake2b(digest_size=6)
    h.update(np.ascontiguousarray(x, np.float32).tobytes())
    h.update(np.ascontiguousarray(y, np.int32).tobytes())
    return h.hexdigest()
