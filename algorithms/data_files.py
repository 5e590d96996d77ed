"""Reading a user's data files (MNIST-layout CSV, .npz) into arrays: every problem one line naming the file and,
where there is one, the line and the column (DataError). What a data set is made of them (the split, the
normalisation, the cache) is algorithms/data.py's."""
from __future__ import annotations

import csv
import hashlib
import math
from pathlib import Path

import numpy as np

from .params import load_npz


class DataError(ValueError):
    """Bad data: the message names the file (or source) and the problem."""


def image_shape_of(n_pixels: int, source: str, shape: tuple[int, ...] | None) -> tuple[int, int, int]:
    """(H, W, C) of `n_pixels` flat pixel columns: the model's input shape, or a square single-channel image."""
    if shape is not None:
        if math.prod(shape) != n_pixels:
            raise DataError(f"{source}: {n_pixels} pixel columns do not fit the image shape {list(shape)}")
        return tuple(shape) if len(shape) == 3 else (*shape, 1)  # type: ignore[return-value]
    side = math.isqrt(n_pixels)
    if side * side != n_pixels:
        raise DataError(f"{source}: {n_pixels} pixel columns are not a square image; give the image shape")
    return side, side, 1


def read_csv_rows(path: Path, shape) -> tuple[np.ndarray, np.ndarray]:
    """label column first (or a column named 'label'), then pixel columns; a header row is optional."""
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    rows = [r for r in rows if r and any(c.strip() for c in r)]
    if not rows:
        raise DataError(f"{path}: the file is empty")
    header = None
    try:
        float(rows[0][0])
    except ValueError:
        header, rows = rows[0], rows[1:]
    if not rows:
        raise DataError(f"{path}: the file has a header but no data rows")
    label_col = header.index("label") if header and "label" in header else 0
    width = len(header) if header else len(rows[0])
    data = np.empty((len(rows), width), np.float64)
    for i, r in enumerate(rows):
        line = i + (2 if header else 1)
        if len(r) != width:
            raise DataError(f"{path}: line {line} has {len(r)} columns, expected {width}")
        try:
            data[i] = [float(c) for c in r]
        except ValueError:
            col = next(j for j, c in enumerate(r) if not _is_number(c))
            name = header[col] if header else f"column {col + 1}"
            sep = next((c for c in ";\t|" if c in r[col]), None)
            if sep:   # one cell holding the whole row: another separator (the header's name would be the row too)
                raise DataError(f"{path}: line {line} is separated by {sep!r}, not by commas (the MNIST CSV layout: "
                                "a label column, then one column per pixel, comma-separated)") from None
            raise DataError(f"{path}: line {line}, {name}: {r[col]!r} is not a number") from None
    y = data[:, label_col]
    bad = np.flatnonzero((y < 0) | (y != np.floor(y)))
    if bad.size:
        line = bad[0] + (2 if header else 1)
        col = (f"column {header[label_col]!r}" + ("" if header[label_col] == "label" else
                                                   " (the header names no 'label' column: the first is taken)")
               if header else "column 1")
        raise DataError(f"{path}: line {line}, {col}: label {y[bad[0]]:g} is not a non-negative integer")
    x = np.delete(data, label_col, axis=1)
    if header and "label" not in header and shape is not None and math.prod(shape) == width:   # every column a pixel
        raise DataError(f"{path}: no label column: the header names no 'label' and its {width} columns are the "
                        f"image's {width} pixels {list(shape)}; put the label first (or in a column named 'label')")
    return x.reshape(len(x), *image_shape_of(x.shape[1], str(path), shape)), y


def _is_number(c: str) -> bool:
    try:
        return float(c) is not None
    except ValueError:
        return False


def file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def read_npz_arrays(p: Path) -> tuple[list[str], dict[str, np.ndarray]]:
    """The arrays of a user's .npz, checked one by one before any arithmetic on them: (the names present:
    x_train, y_train, x_test, y_test or x, y; name -> array, (N, 1) labels flattened)."""
    if not p.is_file():
        raise DataError(f"{p}: no such data file")
    with open(p, "rb") as f:
        if f.read(4) != b"PK\x03\x04":   # np.load would try it as a pickle and say so, which misleads
            raise DataError(f"{p}: not an .npz file (not a zip archive; write it with numpy.savez)")
    try:
        z = load_npz(p)
    except Exception as e:  # zipfile / pickle / format errors all mean "not a usable .npz"
        raise DataError(f"{p}: not a readable .npz file ({e})") from None
    if {"x_train", "y_train", "x_test", "y_test"} <= set(z):
        names = ["x_train", "y_train", "x_test", "y_test"]
    elif {"x", "y"} <= set(z):
        names = ["x", "y"]
    else:
        raise DataError(f"{p}: needs arrays x_train, y_train, x_test, y_test (or x, y); has {sorted(z)}")
    arrays = {}
    for name in names:    # before any arithmetic on them: a string or complex array, a scalar
        a = z[name]
        if not isinstance(a, np.ndarray):       # a zip member that is no .npy: NumPy hands back its bytes
            raise DataError(f"{p}: not a readable .npz file ({name} in it is not a NumPy array)")
        if a.ndim == 0:
            raise DataError(f"{p}: array {name} is a scalar, not one entry per sample")
        if a.dtype.kind not in "biuf":           # labels as floats must be whole numbers: checked with the values
            raise DataError(f"{p}: array {name} has dtype {a.dtype}; "
                            + ("labels must be integers" if name.startswith("y") else "images must be real numbers"))
        if name.startswith("y") and a.ndim == 2 and a.shape[1] == 1:
            a = a[:, 0]                          # (N, 1) labels, as Keras' own data sets give them
        arrays[name] = a
    for xn, yn in zip(names[::2], names[1::2]):  # one label per image, before the split pairs them up
        x, y = arrays[xn], arrays[yn]
        if x.ndim < 2:
            raise DataError(f"{p}: array {xn} has shape {x.shape}; images must be (N, H, W), (N, H, W, C) "
                            "or flat (N, H*W*C) rows")
        if y.ndim != 1:
            raise DataError(f"{p}: array {yn} has shape {y.shape}; labels must be one integer per image, shape (N,)")
        if len(y) != len(x):
            raise DataError(f"{p}: {xn} holds {len(x)} images but {yn} holds {len(y)} labels")
        if len(x) < (1 if len(names) == 4 else 2):   # x, y are split in two below
            raise DataError(f"{p}: array {xn} holds {len(x)} images, too few to train and test on")
    return names, arrays


__all__ = ["DataError", "read_csv_rows", "read_npz_arrays", "file_hash", "image_shape_of"]
