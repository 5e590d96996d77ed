"""The spec's layers in NumPy, canonical NHWC, each a forward that keeps what its hand-written backward needs.

Written from the spec's definitions (algorithms/spec.py, docs/canonical-layout.md), not from a framework:
convolutions as im2col (sliding_window_view) + one matrix product, 'same' = TF/XLA SAME (the odd pixel
bottom/right), max pooling pads with -inf and sends the gradient to the first maximum of its window
(row-major), 'same' average pooling divides by the number of real pixels in the window, BatchNorm uses
the biased batch variance to normalise and folds the unbiased one into running_var (torch's momentum).

Every function works on one replica's shard; the model loop (`forward`/`backward`) runs all replicas
layer by layer so that a synchronized BatchNorm can all-reduce its sums in the middle of the pass.
The model is a graph in topological order: `forward` keeps every layer's output by name, `backward`
walks the layers in reverse and sums the gradients of an output read by several layers (a residual).
Grouped convolutions are batched matrix products per group (output channel o in group o // (C_out/groups));
dilated windows take every dilation-th pixel of the dilated window. Subgradients as torch's autograd:
relu/leaky_relu use the x > 0 branch, relu6 passes the gradient for 0 < x < 6 only.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from algorithms.layout import crop_padding, dilated_windows, pad_hw, pool_windows, scatter_windows, windows
from algorithms.spec import INPUT, LayerInfo, ModelSpec

from .parallel import bn_backward, bn_moments, channel_sum

Params = dict[str, np.ndarray]


# ----------------------------------------------------------------------------- conv2d
def conv2d_forward(layer: LayerInfo, p: Params, x: np.ndarray) -> tuple[np.ndarray, Any]:
    o = layer.spec.options
    if o["groups"] != 1 or o["dilation"] != 1:
        return grouped_conv2d_forward(layer, p, x)
    k, s = o["kernel"], o["stride"]
    oh, ow, co = layer.out_shape
    xp = pad_hw(x, layer, 0.0)
    kern = p[f"{layer.name}.kernel"]                            # (k, k, C, O)
    # im2col: rows (n, oh, ow), columns (i, j, c) to match the kernel's (kH, kW, C) flattening
    cols = windows(xp, k, s, oh, ow).transpose(0, 1, 2, 4, 5, 3).reshape(-1, k * k * x.shape[3])
    y = (cols @ kern.reshape(-1, co)).reshape(x.shape[0], oh, ow, co)
    if f"{layer.name}.bias" in p:
        y = y + p[f"{layer.name}.bias"]
    return y, (cols, xp.shape)


def conv2d_backward(layer: LayerInfo, p: Params, cache: Any, dy: np.ndarray) -> tuple[np.ndarray, Params]:
    o = layer.spec.options
    if o["groups"] != 1 or o["dilation"] != 1:
        return grouped_conv2d_backward(layer, p, cache, dy)
    cols, padded = cache
    k, s = o["kernel"], o["stride"]
    kern = p[f"{layer.name}.kernel"]
    c, co = kern.shape[2], kern.shape[3]
    d2 = dy.reshape(-1, co)
    grads = {f"{layer.name}.kernel": (cols.T @ d2).reshape(kern.shape)}
    if f"{layer.name}.bias" in p:
        grads[f"{layer.name}.bias"] = channel_sum(d2)
    dcols = (d2 @ kern.reshape(-1, co).T).reshape(*dy.shape[:3], k, k, c).transpose(0, 1, 2, 5, 3, 4)
    return crop_padding(scatter_windows(dcols, k, s, padded), layer), grads


def _group_kernels(kern: np.ndarray, g: int) -> np.ndarray:
    """(kH, kW, C_in/g, C_out) -> (g, kH*kW*C_in/g, C_out/g): group i's kernel, its output channels i*C_out/g + j."""
    k1, k2, cg, co = kern.shape
    return kern.reshape(k1 * k2 * cg, g, co // g).transpose(1, 0, 2)


def grouped_conv2d_forward(layer: LayerInfo, p: Params, x: np.ndarray) -> tuple[np.ndarray, Any]:
    """Grouped and/or dilated convolution: per group, im2col of its input channels times its kernel slice."""
    o = layer.spec.options
    k, s, d, g = o["kernel"], o["stride"], o["dilation"], o["groups"]
    n, _, _, c = x.shape
    oh, ow, co = layer.out_shape
    cg = c // g
    xp = pad_hw(x, layer, 0.0)
    win = dilated_windows(xp, k, s, d, oh, ow).reshape(n, oh, ow, g, cg, k, k)
    cols = win.transpose(3, 0, 1, 2, 5, 6, 4).reshape(g, n * oh * ow, k * k * cg)     # columns (i, j, c)
    kg = _group_kernels(p[f"{layer.name}.kernel"], g)
    y = np.matmul(cols, kg).transpose(1, 0, 2).reshape(n, oh, ow, co)
    if f"{layer.name}.bias" in p:
        y = y + p[f"{layer.name}.bias"]
    return y, (cols, xp.shape)


def grouped_conv2d_backward(layer: LayerInfo, p: Params, cache: Any, dy: np.ndarray) -> tuple[np.ndarray, Params]:
    cols, padded = cache
    o = layer.spec.options
    k, s, d, g = o["kernel"], o["stride"], o["dilation"], o["groups"]
    kern = p[f"{layer.name}.kernel"]
    cg, co = kern.shape[2], kern.shape[3]
    n, oh, ow, _ = dy.shape
    d2 = dy.reshape(n * oh * ow, g, co // g).transpose(1, 0, 2)                  # (g, M, C_out/g)
    dk = np.matmul(cols.transpose(0, 2, 1), d2)                                   # (g, k*k*cg, C_out/g)
    grads = {f"{layer.name}.kernel": dk.transpose(1, 0, 2).reshape(kern.shape)}
    if f"{layer.name}.bias" in p:
        grads[f"{layer.name}.bias"] = channel_sum(dy)
    dcols = np.matmul(d2, _group_kernels(kern, g).transpose(0, 2, 1))             # (g, M, k*k*cg)
    dwin = dcols.reshape(g, n, oh, ow, k, k, cg).transpose(1, 2, 3, 0, 6, 4, 5).reshape(n, oh, ow, g * cg, k, k)
    return crop_padding(scatter_windows(dwin, k, s, padded, d), layer), grads


# ----------------------------------------------------------------------------- element-wise and layernorm
_SQRT_2_OVER_PI = np.sqrt(2.0 / np.pi)


def _erf(x: np.ndarray) -> np.ndarray:
    """erf element-wise: scipy's (scikit-learn, a base dependency, brings it), else math.erf per element."""
    try:
        from scipy.special import erf
    except ImportError:                                          # pragma: no cover - scipy comes with sklearn
        import math
        return np.frompyfunc(math.erf, 1, 1)(x).astype(x.dtype)
    return erf(x)


def activation_forward(layer: LayerInfo, x: np.ndarray) -> tuple[np.ndarray, Any]:
    """The parameter-free activations; the cache is what the derivative needs."""
    k = layer.kind
    if k == "leaky_relu":
        return np.where(x > 0, x, layer.spec["alpha"] * x), x > 0
    if k == "relu6":
        return np.minimum(np.maximum(x, 0), 6), (x > 0) & (x < 6)
    if k == "sigmoid":
        y = np.exp(-np.logaddexp(0, -x))
        return y, y
    if k == "silu":
        sig = np.exp(-np.logaddexp(0, -x))
        return x * sig, (x, sig)
    if k == "gelu" and layer.spec["approximate"] == "none":        # x * Phi(x)
        cdf = 0.5 * (1.0 + _erf(x / np.sqrt(2.0)))
        return x * cdf, (x, cdf)
    if k == "gelu":                                                 # the tanh approximation
        t = np.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x ** 3))
        return 0.5 * x * (1.0 + t), (x, t)
    raise NotImplementedError(k)  # pragma: no cover


def activation_backward(layer: LayerInfo, cache: Any, dy: np.ndarray) -> np.ndarray:
    k = layer.kind
    if k == "leaky_relu":
        return np.where(cache, dy, dy * layer.spec["alpha"])
    if k == "relu6":
        return dy * cache
    if k == "sigmoid":
        return dy * cache * (1.0 - cache)
    if k == "silu":
        x, sig = cache
        return dy * sig * (1.0 + x * (1.0 - sig))
    if k == "gelu" and layer.spec["approximate"] == "none":
        x, cdf = cache
        return dy * (cdf + x * np.exp(-0.5 * x * x) / np.sqrt(2.0 * np.pi))
    if k == "gelu":
        x, t = cache
        du = _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x * x)
        return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du)
    raise NotImplementedError(k)  # pragma: no cover


def layernorm_forward(layer: LayerInfo, p: Params, x: np.ndarray) -> tuple[np.ndarray, Any]:
    """Over the last (channel) axis, per sample and position, with the biased variance."""
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    inv = 1.0 / np.sqrt(var + layer.spec["eps"])
    xhat = (x - mean) * inv
    return xhat * p[f"{layer.name}.gamma"] + p[f"{layer.name}.beta"], (xhat, inv)


def layernorm_backward(layer: LayerInfo, p: Params, cache: Any, dy: np.ndarray) -> tuple[np.ndarray, Params]:
    """dx = inv (dxhat - mean(dxhat) - xhat mean(dxhat xhat)), the means over the channel axis."""
    xhat, inv = cache
    dxhat = dy * p[f"{layer.name}.gamma"]
    dx = inv * (dxhat - dxhat.mean(axis=-1, keepdims=True) - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    return dx, {f"{layer.name}.gamma": channel_sum(dy * xhat), f"{layer.name}.beta": channel_sum(dy)}


# ----------------------------------------------------------------------------- merges
def merge_forward(layer: LayerInfo, xs: list[np.ndarray]) -> np.ndarray:
    if layer.kind == "add":
        y = xs[0]
        for x in xs[1:]:
            y = y + x
        return y
    return np.concatenate(xs, axis=-1)                          # concat: the canonical channel axis


def merge_backward(layer: LayerInfo, dy: np.ndarray) -> list[np.ndarray]:
    """The gradient of each input: the whole dy for a sum, its channel slice for a concatenation."""
    if layer.kind == "add":
        return [dy] * len(layer.inputs)
    bounds = np.cumsum([sh[-1] for sh in layer.in_shapes])[:-1]
    return np.split(dy, bounds, axis=-1)


# ----------------------------------------------------------------------------- pooling
def maxpool_forward(layer: LayerInfo, x: np.ndarray) -> tuple[np.ndarray, Any]:
    xp = pad_hw(x, layer, -np.inf)
    win = pool_windows(layer, xp)
    arg = win.argmax(axis=-1)                                   # the first maximum, row-major in the window
    y = np.take_along_axis(win, arg[..., None], axis=-1)[..., 0]
    return y, (arg, xp.shape)


def maxpool_backward(layer: LayerInfo, cache: Any, dy: np.ndarray) -> np.ndarray:
    arg, padded = cache
    k, s = layer.spec["pool"], layer.spec["stride"]
    hit = (arg[..., None] == np.arange(k * k)).reshape(*arg.shape, k, k)
    return crop_padding(scatter_windows(hit * dy[..., None, None], k, s, padded), layer)


def _avg_count(layer: LayerInfo, x_shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Real (unpadded) pixels per window, (1, OH, OW, 1): 'same' average pooling excludes the padding."""
    k, s = layer.spec["pool"], layer.spec["stride"]
    oh, ow, _ = layer.out_shape
    ones = pad_hw(np.ones((1, x_shape[1], x_shape[2], 1), dtype), layer, 0.0)
    return windows(ones, k, s, oh, ow).sum(axis=(-2, -1))


def avgpool_forward(layer: LayerInfo, x: np.ndarray) -> tuple[np.ndarray, Any]:
    k, s = layer.spec["pool"], layer.spec["stride"]
    oh, ow, _ = layer.out_shape
    xp = pad_hw(x, layer, 0.0)
    count = _avg_count(layer, x.shape, x.dtype)
    return windows(xp, k, s, oh, ow).sum(axis=(-2, -1)) / count, (count, xp.shape)


def avgpool_backward(layer: LayerInfo, cache: Any, dy: np.ndarray) -> np.ndarray:
    count, padded = cache
    k, s = layer.spec["pool"], layer.spec["stride"]
    d = np.broadcast_to((dy / count)[..., None, None], (*dy.shape, k, k))
    return crop_padding(scatter_windows(d, k, s, padded), layer)


# ----------------------------------------------------------------------------- batchnorm
def bn_apply(layer: LayerInfo, p: Params, x: np.ndarray, mean: np.ndarray, var: np.ndarray) -> tuple[np.ndarray, Any]:
    eps = layer.spec["eps"]
    inv = 1.0 / np.sqrt(var + eps)
    xhat = (x - mean) * inv
    return xhat * p[f"{layer.name}.gamma"] + p[f"{layer.name}.beta"], (xhat, inv)


def bn_running(layer: LayerInfo, p: Params, mean: np.ndarray, var: np.ndarray, n: int) -> None:
    """torch's convention: running = (1 - m) running + m stat, running_var from the unbiased variance."""
    m = layer.spec["momentum"]
    rm, rv = f"{layer.name}.running_mean", f"{layer.name}.running_var"
    p[rm] = (1 - m) * p[rm] + m * mean
    p[rv] = (1 - m) * p[rv] + m * var * (n / (n - 1) if n > 1 else 1.0)


# ----------------------------------------------------------------------------- the model
def forward(model: ModelSpec, p: Params, xs: list[np.ndarray], *, train: bool, masks: list[dict[str, np.ndarray]],
            sync_bn: bool = False, update_running: bool = False,
            record: list[dict[str, np.ndarray]] | None = None) -> tuple[list[np.ndarray], list[list[Any]]]:
    """Logits of every replica's shard; caches[layer index][replica] for `backward`.

    Training mode: BatchNorm normalises with the batch statistics (per replica, or over all of them with
    sync_bn); with update_running, replica 0's statistics (sync: the global ones) are folded into p's
    running buffers, the buffers the run exports. Inference mode: running statistics, no dropout."""
    caches: list[list[Any]] = []
    outs: dict[str, list[np.ndarray]] = {INPUT: xs}     # every layer's per-replica outputs, by name
    for layer in model.layers:
        k = layer.kind
        xs = outs[layer.inputs[0]]
        if k in ("add", "concat"):
            xs = [merge_forward(layer, list(ins)) for ins in zip(*(outs[src] for src in layer.inputs))]
            caches.append([None] * len(xs))
        elif k == "batchnorm2d":
            if train:
                moments = bn_moments(xs, sync_bn)
                outs_bn = [bn_apply(layer, p, x, m, v) for x, (m, v, _) in zip(xs, moments)]
                if update_running:
                    bn_running(layer, p, *moments[0])
                caches.append([(c, n) for (_, c), (_, _, n) in zip(outs_bn, moments)])
            else:
                outs_bn = [bn_apply(layer, p, x, p[f"{layer.name}.running_mean"], p[f"{layer.name}.running_var"])
                           for x in xs]
                caches.append([c for _, c in outs_bn])
            xs = [y for y, _ in outs_bn]
        else:
            pairs = [_one_forward(layer, p, x, m if train else None) for x, m in zip(xs, masks)]
            xs = [y for y, _ in pairs]
            caches.append([c for _, c in pairs])
        outs[layer.name] = xs
        if record is not None:
            for r, x in zip(record, xs):
                r[layer.name] = x
    return xs, caches


def _one_forward(layer: LayerInfo, p: Params, x: np.ndarray, masks: dict[str, np.ndarray] | None) -> tuple[np.ndarray, Any]:
    k = layer.kind
    if k == "conv2d":
        return conv2d_forward(layer, p, x)
    if k == "maxpool2d":
        return maxpool_forward(layer, x)
    if k == "avgpool2d":
        return avgpool_forward(layer, x)
    if k == "relu":
        return np.maximum(x, 0), x > 0
    if k == "tanh":
        y = np.tanh(x)
        return y, y
    if k in ("leaky_relu", "relu6", "sigmoid", "silu", "gelu"):
        return activation_forward(layer, x)
    if k == "layernorm":
        return layernorm_forward(layer, p, x)
    if k == "dropout":
        if masks is None:                                       # inference: identity
            return x, None
        keep = masks[layer.name]
        return x * keep / (1.0 - layer.spec["rate"]), keep
    if k == "flatten":
        return x.reshape(x.shape[0], -1), x.shape               # NHWC reshape: (H, W, C) order
    if k == "global_avgpool2d":
        n, h, w, c = x.shape   # per sample, the H x W sum innermost (channel_sum's reason)
        return np.ascontiguousarray(x.reshape(n, h * w, c).transpose(0, 2, 1)).sum(axis=2) / (h * w), x.shape
    if k == "dense":
        y = x @ p[f"{layer.name}.kernel"]
        if f"{layer.name}.bias" in p:
            y = y + p[f"{layer.name}.bias"]
        return y, x
    raise NotImplementedError(k)  # pragma: no cover - the spec validates kinds


def _one_backward(layer: LayerInfo, p: Params, cache: Any, dy: np.ndarray) -> tuple[np.ndarray, Params]:
    k = layer.kind
    if k == "conv2d":
        return conv2d_backward(layer, p, cache, dy)
    if k == "maxpool2d":
        return maxpool_backward(layer, cache, dy), {}
    if k == "avgpool2d":
        return avgpool_backward(layer, cache, dy), {}
    if k == "relu":
        return dy * cache, {}
    if k == "tanh":
        return dy * (1.0 - cache * cache), {}
    if k in ("leaky_relu", "relu6", "sigmoid", "silu", "gelu"):
        return activation_backward(layer, cache, dy), {}
    if k == "layernorm":
        return layernorm_backward(layer, p, cache, dy)
    if k == "dropout":
        return dy * cache / (1.0 - layer.spec["rate"]), {}
    if k == "flatten":
        return dy.reshape(cache), {}
    if k == "global_avgpool2d":
        n, h, w, c = cache
        return np.broadcast_to(dy[:, None, None, :] / (h * w), cache).copy(), {}
    if k == "dense":
        grads = {f"{layer.name}.kernel": cache.T @ dy}
        if f"{layer.name}.bias" in p:
            grads[f"{layer.name}.bias"] = dy.sum(axis=0)
        return dy @ p[f"{layer.name}.kernel"].T, grads
    raise NotImplementedError(k)  # pragma: no cover


def backward(model: ModelSpec, p: Params, caches: list[list[Any]], dlogits: list[np.ndarray],
             sync_bn: bool = False) -> list[Params]:
    """Per replica: d objective / d trainable parameter, from the training-mode caches of `forward`."""
    grads: list[Params] = [{} for _ in dlogits]
    # per layer name: d objective / d its output, per replica; summed over the layers that read it
    pending: dict[str, list[np.ndarray]] = {model.layers[-1].name: dlogits}
    for layer, cache in zip(reversed(model.layers), reversed(caches)):
        dys = pending.pop(layer.name)
        if layer.kind in ("add", "concat"):
            per_input = list(zip(*(merge_backward(layer, dy) for dy in dys)))   # [input][replica]
            gs: list[Params] = [{} for _ in dys]
        elif layer.kind == "batchnorm2d":
            dxs, gs = bn_backward(layer, p, [c for c, _ in cache], dys, [n for _, n in cache], sync_bn)
            per_input = [dxs]
        else:
            pairs = [_one_backward(layer, p, c, dy) for c, dy in zip(cache, dys)]
            per_input, gs = [[d for d, _ in pairs]], [g for _, g in pairs]
        for acc, g in zip(grads, gs):
            acc.update(g)
        for src, ds in zip(layer.inputs, per_input):
            if src == INPUT:
                continue
            have = pending.get(src)
            pending[src] = list(ds) if have is None else [a + b for a, b in zip(have, ds)]
    return grads


def softmax_xent(logits: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """(mean cross-entropy of the logits, d loss / d logits, predictions): log-sum-exp with the max shifted out."""
    z = logits - logits.max(axis=1, keepdims=True)
    lse = np.log(np.exp(z).sum(axis=1))
    n = len(y)
    loss = float(np.mean(lse - z[np.arange(n), y]))
    soft = np.exp(z - lse[:, None])
    soft[np.arange(n), y] -= 1.0
    return loss, soft / n, logits.argmax(axis=1)
