"""Layouts and window maths every wrapper shares, once: the canonical <-> native parameter layouts, the
(H, W, C) <-> (C, H, W) flatten permutation, 'same' padding (and the symmetric-padding fault's k//2), and
torch's ceil_mode pooled size. Framework-free (NumPy only): wrappers call these with their own `Layout`.

The canonical layout (docs/canonical-layout.md): NHWC activations, conv kernels (kH, kW, I/groups, O),
dense kernels (in, out), a flatten in (H, W, C) order. A channels-first framework (torch) holds conv
kernels as (O, I/groups, kH, kW), dense kernels as (out, in) and flattens in (C, H, W) order, so the rows
of a dense kernel fed by a flatten are permuted. The fault `flatten_no_permute` (permute=False) is the
port that forgets that permutation: a channels-first framework loads the rows unpermuted; a channels-last
one loads them in the (C, H, W) order such a port would have left them in.

A depthwise kernel with channel multiplier m holds its C*m outputs channel-major (output c*m + j reads input
channel c) in every framework here. The fault `depthwise_multiplier_order` (channel_major=False) is the
port that reorders them as if the source were multiplier-major (j*C + c): each output gets the filter
written for another one, in every layout alike.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from .spec import LayerInfo, ModelSpec

Pads = tuple[tuple[int, int], tuple[int, int]]   # ((top, bottom), (left, right))


@dataclass(frozen=True)
class Layout:
    """A framework's parameter and activation layout."""
    name: str
    channels_first: bool      # NCHW activations, OIHW conv kernels, (out, in) dense kernels, CHW flatten
    # a depthwise conv2d's kernel as (kH, kW, C, M), output channel c*M + m (Keras' DepthwiseConv2D): the
    # canonical (kH, kW, 1, C*M) reshaped
    depthwise_by_channel: bool = False


CHANNELS_LAST = Layout("channels_last", False)    # the canonical layout (jax, tensorflow, numpy)
CHANNELS_FIRST = Layout("channels_first", True)   # torch
KERAS = Layout("keras", False, depthwise_by_channel=True)   # channels last, DepthwiseConv2D kernels


# ----------------------------------------------------------------------------- the flatten permutation
def flatten_perm(h: int, w: int, c: int) -> np.ndarray:
    """perm[j] = the canonical (H, W, C) position of a (C, H, W) flatten's position j."""
    return np.arange(h * w * c).reshape(h, w, c).transpose(2, 0, 1).ravel()


def layer_of(model: ModelSpec, pname: str) -> tuple[LayerInfo, str]:
    """(the layer, the role) of a canonical parameter name '<layer>.<role>'."""
    lname, role = pname.rsplit(".", 1)
    return next(l for l in model.layers if l.name == lname), role


def _rows_in_chw(a: np.ndarray, src: tuple[int, int, int]) -> np.ndarray:
    """Rows in (H, W, C) order -> (C, H, W) order."""
    return a[flatten_perm(*src)]


def _rows_in_hwc(a: np.ndarray, src: tuple[int, int, int]) -> np.ndarray:
    """Rows in (C, H, W) order -> (H, W, C) order."""
    out = np.empty_like(a)
    out[flatten_perm(*src)] = a
    return out


# ----------------------------------------------------------------------------- the depthwise output order
def multiplier_major_perm(channels: int, multiplier: int) -> np.ndarray:
    """perm[c*m + j] = j*C + c: the canonical output a multiplier-major reading puts at channel-major place
    c*m + j (the identity when m == 1 or C == 1)."""
    return np.arange(channels * multiplier).reshape(multiplier, channels).T.ravel()


def depthwise_multiplier(layer: LayerInfo) -> int:
    """The channel multiplier filters / groups of a depthwise conv2d (groups = input channels > 1); 0 for
    any other layer."""
    if layer.kind != "conv2d" or layer.spec["groups"] <= 1 or layer.spec["groups"] != layer.in_shape[-1]:
        return 0
    return layer.spec["filters"] // layer.spec["groups"]


def _depthwise_perm(layer: LayerInfo) -> np.ndarray | None:
    """The fault's output permutation of a multiplied depthwise kernel (None where it changes nothing)."""
    m = depthwise_multiplier(layer)
    return multiplier_major_perm(layer.spec["groups"], m) if m > 1 else None


# ----------------------------------------------------------------------------- parameters
def to_native(model: ModelSpec, name: str, a: np.ndarray, layout: Layout, permute: bool = True,
              channel_major: bool = True) -> np.ndarray:
    """A canonical parameter -> the framework's array (`permute=False`: the flatten_no_permute fault;
    `channel_major=False`: the depthwise_multiplier_order fault)."""
    layer, role = layer_of(model, name)
    if role != "kernel":
        return a
    perm = None if channel_major else _depthwise_perm(layer)
    if perm is not None:                         # output o gets canonical output perm[o]'s filter
        a = a[..., perm]
    if layout.depthwise_by_channel and depthwise_multiplier(layer):   # (kH, kW, 1, C*M) -> (kH, kW, C, M)
        return a.reshape(a.shape[0], a.shape[1], layer.in_shape[-1], a.shape[3] // layer.in_shape[-1])
    if layout.channels_first:
        if layer.kind == "conv2d":               # (kH, kW, I/groups, O) -> (O, I/groups, kH, kW)
            return a.transpose(3, 2, 0, 1)
        if layer.flattened_from and permute:     # rows in HWC order -> CHW order, then (out, in)
            a = _rows_in_chw(a, layer.flattened_from)
        return a.T
    if permute or layer.kind != "dense" or not layer.flattened_from:
        return a
    return _rows_in_hwc(a, layer.flattened_from)   # the fault: canonical row j where a CHW flatten puts j


def from_native(model: ModelSpec, name: str, a: np.ndarray, layout: Layout, permute: bool = True,
                channel_major: bool = True) -> np.ndarray:
    """The inverse of `to_native`."""
    layer, role = layer_of(model, name)
    if role != "kernel":
        return a
    if layout.depthwise_by_channel and depthwise_multiplier(layer) and a.shape[2] != 1:   # (kH, kW, C, M) back
        a = a.reshape(a.shape[0], a.shape[1], 1, a.shape[2] * a.shape[3])
    perm = None if channel_major else _depthwise_perm(layer)
    if perm is not None:
        canonical = from_native(model, name, a, layout, permute)
        out = np.empty_like(canonical)
        out[..., perm] = canonical
        return out
    if layout.channels_first:
        if layer.kind == "conv2d":
            return a.transpose(2, 3, 1, 0)
        a = a.T
        if layer.flattened_from and permute:
            return _rows_in_hwc(a, layer.flattened_from)
        return a
    if permute or layer.kind != "dense" or not layer.flattened_from:
        return a
    return _rows_in_chw(a, layer.flattened_from)


def converters(layout: Layout) -> tuple[Callable[..., np.ndarray], Callable[..., np.ndarray]]:
    """(to_native, from_native) bound to one layout: f(model, name, array, permute=True, channel_major=True)."""
    def to(model: ModelSpec, name: str, a: np.ndarray, permute: bool = True, channel_major: bool = True) -> np.ndarray:
        return to_native(model, name, a, layout, permute, channel_major)

    def back(model: ModelSpec, name: str, a: np.ndarray, permute: bool = True,
             channel_major: bool = True) -> np.ndarray:
        return from_native(model, name, a, layout, permute, channel_major)
    return to, back


# ----------------------------------------------------------------------------- flattened activations
def flat_sources(model: ModelSpec) -> dict[str, tuple[int, int, int]]:
    """Layers whose output is a flattened (H, W, C) map (the flatten and element-wise layers and sums after it,
    `LayerInfo.flat_of`): a channels-first framework holds these features in (C, H, W) order."""
    return {layer.name: layer.flat_of for layer in model.layers if layer.flat_of is not None}


def flat_to_canonical(a: np.ndarray, src: tuple[int, int, int]) -> np.ndarray:
    """(B, C*H*W) features in (C, H, W) order -> (H, W, C) order."""
    c = np.empty_like(a)
    c[:, flatten_perm(*src)] = a
    return c


def flat_from_canonical(a: np.ndarray, src: tuple[int, int, int]) -> np.ndarray:
    """(B, H*W*C) features in (H, W, C) order -> (C, H, W) order."""
    return a[:, flatten_perm(*src)]


# ----------------------------------------------------------------------------- windows
def same_pads(layer: LayerInfo, symmetric: bool = False) -> Pads:
    """The layer's 'same' padding ((top, bottom), (left, right)); `symmetric` (the fault
    symmetric_same_padding): k//2 on every side, torch-style, where TF 'SAME' pads asymmetrically."""
    (t, b), (l, r) = layer.padding
    if symmetric and (t != b or l != r):
        k = layer.spec.options.get("kernel", layer.spec.options.get("pool"))
        t = b = l = r = k // 2
    return (t, b), (l, r)


def is_asymmetric(pads: Pads) -> bool:
    (t, b), (l, r) = pads
    return t != b or l != r


def ceil_pool_out(size: int, k: int, s: int) -> int:
    """PyTorch's pooled size with ceil_mode=True and no padding (the last window must start inside)."""
    out = math.ceil((size - k) / s) + 1
    if (out - 1) * s >= size:
        out -= 1
    return out


def ceil_pool_pad(size: int, k: int, s: int) -> int:
    """Extra bottom/right pixels a padding-0 pool must read to give torch's ceil_mode output size (the
    fault maxpool_ceil, emulated by -inf padding in frameworks without ceil_mode)."""
    return max((ceil_pool_out(size, k, s) - 1) * s + k - size, 0)


def window_counts(h: int, w: int, k: int, s: int, pads: Pads) -> np.ndarray:
    """How many real (unpadded) pixels each k x k window of stride s covers, as an (OH, OW) float64 array."""
    def axis(size: int, lo: int, hi: int) -> np.ndarray:
        n = (size + lo + hi - k) // s + 1
        start = np.arange(n) * s - lo
        return (np.minimum(start + k, size) - np.maximum(start, 0)).astype(np.float64)
    (t, b), (l, r) = pads
    return np.outer(axis(h, t, b), axis(w, l, r))


# ----------------------------------------------------------------------------- NumPy windows (the arbiter's im2col)
def pad_hw(x: np.ndarray, layer: LayerInfo, value: float) -> np.ndarray:
    """An NHWC map padded by the layer's explicit padding with `value`."""
    (t, b), (l, r) = layer.padding
    if t == b == l == r == 0:
        return x
    return np.pad(x, ((0, 0), (t, b), (l, r), (0, 0)), constant_values=value)


def windows(xp: np.ndarray, k: int, s: int, oh: int, ow: int) -> np.ndarray:
    """(N, OH, OW, C, k, k) view of the k x k windows at stride s of a padded NHWC map."""
    return sliding_window_view(xp, (k, k), axis=(1, 2))[:, ::s, ::s][:, :oh, :ow]


def pool_windows(layer: LayerInfo, xp: np.ndarray) -> np.ndarray:
    """(N, OH, OW, C, k*k): each pooling window of the layer's padded NHWC map `xp` (pad_hw), its k x k inputs
    row-major (the order in which every framework's max pool picks the first maximum)."""
    k, s = layer.spec["pool"], layer.spec["stride"]
    oh, ow, _ = layer.out_shape
    win = windows(xp, k, s, oh, ow)
    return win.reshape(*win.shape[:4], k * k)


def dilated_windows(xp: np.ndarray, k: int, s: int, d: int, oh: int, ow: int) -> np.ndarray:
    """(N, OH, OW, C, k, k): the k x k taps, `d` pixels apart, of each window at stride s."""
    if d == 1:
        return windows(xp, k, s, oh, ow)
    return windows(xp, (k - 1) * d + 1, s, oh, ow)[..., ::d, ::d]


def scatter_windows(d: np.ndarray, k: int, s: int, padded_shape: tuple[int, ...], dilation: int = 1) -> np.ndarray:
    """Adjoint of `windows` (`dilated_windows`): d (N, OH, OW, C, k, k) summed back into a zero padded map."""
    out = np.zeros(padded_shape, d.dtype)
    oh, ow = d.shape[1], d.shape[2]
    for i in range(k):
        for j in range(k):
            a, b = i * dilation, j * dilation
            out[:, a:a + s * (oh - 1) + 1:s, b:b + s * (ow - 1) + 1:s, :] += d[..., i, j]
    return out


def crop_padding(dxp: np.ndarray, layer: LayerInfo) -> np.ndarray:
    """The adjoint of `pad_hw`: the layer's padding cropped off."""
    (t, b), (l, r) = layer.padding
    h, w = dxp.shape[1] - t - b, dxp.shape[2] - l - r
    return dxp[:, t:t + h, l:l + w, :]
