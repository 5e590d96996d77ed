"""The spec's layers lowered to native TensorFlow (tf.nn, NHWC), and canonical <-> TF layouts.

The canonical layout IS TensorFlow's (NHWC activations, conv kernel (kH, kW, I, O), dense kernel
(in, out), flatten in (H, W, C) order), so the layout functions are the identity, except under the
fault `flatten_no_permute`, which reproduces the PyTorch port mistake in this framework: the rows of
the first dense kernel after a flatten are loaded in the (C, H, W) order of an NCHW flatten.

`forward` is a pure function of its inputs: in training mode it returns the new BatchNorm running
statistics in `new_buffers` instead of assigning them, so the caller decides whether state changes.
"""
from __future__ import annotations

import math

import numpy as np
import tensorflow as tf

from algorithms.spec import LayerInfo, ModelSpec

BUFFER_ROLES = ("running_mean", "running_var")
LABEL_SMOOTHING = 0.1       # the `label_smoothing` fault
KERAS_BN_EPS = 1e-3         # the `bn_eps_keras` fault


# ----------------------------------------------------------------------------- layouts
def flatten_perm(h: int, w: int, c: int) -> np.ndarray:
    """perm[j] = the canonical (H, W, C) row of an NCHW (C, H, W) flatten position j."""
    return np.arange(h * w * c).reshape(h, w, c).transpose(2, 0, 1).ravel()


def _layer_of(model: ModelSpec, pname: str) -> tuple[LayerInfo, str]:
    lname, role = pname.rsplit(".", 1)
    return next(l for l in model.layers if l.name == lname), role


def to_tf_layout(model: ModelSpec, name: str, a: np.ndarray, permute: bool = True) -> np.ndarray:
    """Canonical -> the array held by the tf.Variable. Identity unless `permute` is False (the fault):
    then the first dense kernel after a flatten gets canonical row j at the HWC position that an NCHW
    flatten puts at position j, so the network reads the weights as a port without the permutation."""
    layer, role = _layer_of(model, name)
    if permute or role != "kernel" or layer.kind != "dense" or not layer.flattened_from:
        return a
    out = np.empty_like(a)
    out[flatten_perm(*layer.flattened_from)] = a
    return out


def from_tf_layout(model: ModelSpec, name: str, a: np.ndarray, permute: bool = True) -> np.ndarray:
    layer, role = _layer_of(model, name)
    if permute or role != "kernel" or layer.kind != "dense" or not layer.flattened_from:
        return a
    return a[flatten_perm(*layer.flattened_from)]


# ----------------------------------------------------------------------------- padding helpers
def _explicit(t: int, b: int, l: int, r: int) -> list[list[int]]:
    return [[0, 0], [t, b], [l, r], [0, 0]]


def conv_padding(layer: LayerInfo, symmetric: bool):
    """The `padding` argument of tf.nn.conv2d: TF 'SAME' (the spec's 'same'), 'VALID', or, under the
    fault `symmetric_same_padding`, k//2 on every side where TF 'SAME' pads asymmetrically."""
    o = layer.spec.options
    if o["padding"] != "same":
        return "VALID"
    (t, b), (l, r) = layer.padding
    if symmetric and (t != b or l != r):
        k = o["kernel"] // 2
        return _explicit(k, k, k, k)
    return "SAME"


def torch_ceil_pool_out(size: int, k: int, s: int) -> int:
    """PyTorch's pooled size with ceil_mode=True and no padding (the last window must start inside)."""
    out = math.ceil((size - k) / s) + 1
    if (out - 1) * s >= size:
        out -= 1
    return out


# ----------------------------------------------------------------------------- forward
def forward(model: ModelSpec, p: dict[str, tf.Tensor], x: tf.Tensor, *, train: bool,
            masks: dict[str, tf.Tensor] | None, fault: str | None, record: dict[str, tf.Tensor] | None = None,
            new_buffers: dict[str, tf.Tensor] | None = None, native_dropout: bool = False,
            dropout_seed=None, moments=None) -> tf.Tensor:
    """Logits for NHWC input `x` (parameters `p` in TF layout: tensors or variables).

    In training mode BatchNorm normalises with the batch statistics and, if `new_buffers` is given,
    stores there the updated running statistics (PyTorch convention: running = (1-m) running + m stat,
    running_var from the unbiased batch variance). `dropout_seed` is a shape-(2,) int tensor for the
    framework's own dropout (--dropout native, or the fault dropout_in_eval).

    `moments` (data parallel, synchronized BatchNorm) replaces tf.nn.moments: x -> (mean, biased var, n),
    n the number of values per channel the statistics are taken over (all replicas together)."""
    skipped_bias = False
    n_native = 0
    for layer in model.layers:
        o = layer.spec.options
        k = layer.kind
        if k == "conv2d":
            x = tf.nn.conv2d(x, p[f"{layer.name}.kernel"], strides=o["stride"],
                             padding=conv_padding(layer, fault == "symmetric_same_padding"))
            bias = p.get(f"{layer.name}.bias")
            if bias is not None and fault == "missing_bias" and not skipped_bias:
                bias, skipped_bias = None, True
            if bias is not None:
                x = tf.nn.bias_add(x, bias)
        elif k == "maxpool2d":
            if o["padding"] == "same":
                x = tf.nn.max_pool2d(x, o["pool"], o["stride"], "SAME")
            else:
                if fault == "maxpool_ceil":
                    h, w = layer.in_shape[0], layer.in_shape[1]
                    ph = (torch_ceil_pool_out(h, o["pool"], o["stride"]) - 1) * o["stride"] + o["pool"] - h
                    pw = (torch_ceil_pool_out(w, o["pool"], o["stride"]) - 1) * o["stride"] + o["pool"] - w
                    if ph > 0 or pw > 0:
                        x = tf.pad(x, _explicit(0, max(ph, 0), 0, max(pw, 0)), constant_values=float("-inf"))
                x = tf.nn.max_pool2d(x, o["pool"], o["stride"], "VALID")
        elif k == "avgpool2d":
            # TF 'SAME' average pooling excludes the padded pixels from the count: the reference
            x = tf.nn.avg_pool2d(x, o["pool"], o["stride"], "SAME" if o["padding"] == "same" else "VALID")
        elif k == "relu":
            x = tf.nn.relu(x)
        elif k == "tanh":
            x = tf.math.tanh(x)
        elif k == "batchnorm2d":
            mom = o["momentum"]
            if fault == "bn_momentum_flipped":
                mom = 1.0 - mom
            eps = KERAS_BN_EPS if fault == "bn_eps_keras" else o["eps"]
            gamma, beta = p[f"{layer.name}.gamma"], p[f"{layer.name}.beta"]
            rm, rv = p[f"{layer.name}.running_mean"], p[f"{layer.name}.running_var"]
            if train:
                if moments is None:
                    mean, var = tf.nn.moments(x, axes=[0, 1, 2])
                    n = math.prod(int(d) for d in x.shape[:3])
                else:
                    mean, var, n = moments(x)
                x = tf.nn.batch_normalization(x, mean, var, beta, gamma, eps)
                if new_buffers is not None:
                    unbiased = var * (n / (n - 1))
                    mean_s, var_s = tf.stop_gradient(mean), tf.stop_gradient(unbiased)
                    new_buffers[f"{layer.name}.running_mean"] = (1.0 - mom) * rm + mom * mean_s
                    new_buffers[f"{layer.name}.running_var"] = (1.0 - mom) * rv + mom * var_s
            else:
                x = tf.nn.batch_normalization(x, rm, rv, beta, gamma, eps)
        elif k == "dropout":
            if train and not native_dropout and masks is not None and layer.name in masks:
                x = x * tf.cast(masks[layer.name], x.dtype) / (1.0 - o["rate"])
            elif train or fault == "dropout_in_eval":
                seed = dropout_seed if dropout_seed is not None else tf.constant([0, 0], tf.int64)
                x = tf.nn.experimental.stateless_dropout(x, o["rate"], seed=seed + n_native)
                n_native += 1
        elif k == "flatten":
            x = tf.reshape(x, [-1, math.prod(layer.out_shape)])   # (H, W, C) order: canonical
        elif k == "global_avgpool2d":
            x = tf.reduce_mean(x, axis=[1, 2])
        elif k == "dense":
            x = tf.linalg.matmul(x, p[f"{layer.name}.kernel"])
            bias = p.get(f"{layer.name}.bias")
            if bias is not None and fault == "missing_bias" and not skipped_bias:
                bias, skipped_bias = None, True
            if bias is not None:
                x = tf.nn.bias_add(x, bias)
        else:  # pragma: no cover - the spec validates kinds
            raise NotImplementedError(k)
        if record is not None:
            record[layer.name] = x
    return x


def per_example_cross_entropy(logits: tf.Tensor, y: tf.Tensor, label_smoothing: float = 0.0) -> tf.Tensor:
    """Softmax cross-entropy per sample from logits; with smoothing, targets (1 - ls) onehot + ls / K (torch's)."""
    if not label_smoothing:
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
    k = logits.shape[-1]
    target = tf.one_hot(y, k, dtype=logits.dtype) * (1.0 - label_smoothing) + label_smoothing / k
    return tf.nn.softmax_cross_entropy_with_logits(labels=target, logits=logits)


def cross_entropy(logits: tf.Tensor, y: tf.Tensor, label_smoothing: float = 0.0) -> tf.Tensor:
    """Mean softmax cross-entropy from logits (see per_example_cross_entropy)."""
    return tf.reduce_mean(per_example_cross_entropy(logits, y, label_smoothing))


__all__ = ["forward", "cross_entropy", "per_example_cross_entropy", "to_tf_layout", "from_tf_layout", "flatten_perm", "conv_padding",
           "torch_ceil_pool_out", "BUFFER_ROLES"]
