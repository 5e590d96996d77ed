"""Kinks a step's forward pass crossed: where a candidate's own activations put a ReLU (ReLU6, LeakyReLU)
input or a max-pool window's pick on the other side from the float64 reference's, from one resynced step's
full forward probes (every sample of the batch). Framework-free: the spec's layer semantics, NumPy.

Why: a kink is continuous in its input, so when rounding moves an input across it every activation and the
loss still agree, while the derivative there changes, and with it the gradients of every parameter upstream
of that layer (and what follows from them: the updates, the optimizer state). Two float32 programs that sum
in different orders cross different kinks now and then (cnn2d_hard adamw, resynced step 23: a max-pool
window of `pool2` whose two largest inputs are 1.3e-7 apart in float64, picked one way by the reference and
the other by three candidates; conv1, bn1 and conv2's gradients 4-5e-3 off, the reference's own eight
1-ULP-nudged steps all on its side; docs/verdict.md). Seeing the crossing in the candidate's own activations
is evidence that the backward disagreement is that flip, not another computation (harness.resync.judge).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from algorithms.layout import pad_hw, pool_windows
from algorithms.model import INPUT, LayerInfo, ModelSpec

# the layer kinds whose derivative jumps at some input value (a kink), and what decides the branch
KINK_KINDS = ("relu", "relu6", "leaky_relu", "maxpool2d")


def decisions(layer: LayerInfo, x: np.ndarray) -> np.ndarray:
    """The branch each output of a kink layer takes on its (N, ...) input `x`: the side of 0 (and of 6 for
    ReLU6), or the first maximum's position in each max-pool window (row-major, as every framework picks)."""
    if layer.kind in ("relu", "leaky_relu"):
        return x > 0
    if layer.kind == "relu6":
        return (x > 0).astype(np.int8) + (x >= 6)
    return pool_windows(layer, pad_hw(np.asarray(x, np.float64), layer, -np.inf)).argmax(axis=-1)


def margins(layer: LayerInfo, x: np.ndarray) -> np.ndarray:
    """How far each output's input is from its kink in `x` (the float64 reference's): |x| (ReLU), the
    distance to 0 or 6 (ReLU6), the gap between a window's two largest inputs (max pool)."""
    if layer.kind in ("relu", "leaky_relu"):
        return np.abs(x)
    if layer.kind == "relu6":
        return np.minimum(np.abs(x), np.abs(x - 6))
    top = np.sort(pool_windows(layer, pad_hw(np.asarray(x, np.float64), layer, -np.inf)), axis=-1)[..., -2:]
    return top[..., 1] - top[..., 0]


def upstream(model: ModelSpec, name: str) -> set[str]:
    """The layers whose outputs reach layer `name` (its ancestors in the graph, itself excluded)."""
    by_name = {l.name: l for l in model.layers}
    seen: set[str] = set()
    todo = [i for i in by_name[name].inputs if i != INPUT]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += [i for i in by_name[n].inputs if i != INPUT]
    return seen


def crossed(model: ModelSpec, cand: dict[str, np.ndarray], ref64: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """Every kink layer whose branch differs somewhere between the candidate's forward probes and the float64
    reference's (both with every sample: `forward/<layer>`, the layer's output, is the next one's input):
    the layer, its kind, how many outputs crossed of how many, the float64 margin of the nearest and the
    farthest crossing, and the layers upstream of it (whose parameters' gradients the crossing moves)."""
    out = []
    for layer in model.layers:
        if layer.kind not in KINK_KINDS or len(layer.inputs) != 1 or layer.inputs[0] == INPUT:
            continue
        key = f"forward/{layer.inputs[0]}"
        if key not in cand or key not in ref64 or cand[key].shape != ref64[key].shape:
            continue
        x64 = np.asarray(ref64[key], np.float64)
        diff = decisions(layer, np.asarray(cand[key], np.float64)) != decisions(layer, x64)
        if diff.any():
            m = margins(layer, x64)[diff]
            out.append({"layer": layer.name, "kind": layer.kind, "crossed": int(diff.sum()), "of": int(diff.size),
                        "margin_min": float(m.min()), "margin_max": float(m.max()),
                        "upstream": sorted(upstream(model, layer.name))})
    return out


__all__ = ["KINK_KINDS", "crossed", "decisions", "margins", "upstream"]
