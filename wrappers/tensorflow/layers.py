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

import tensorflow as tf

from algorithms.faults import Seams
from algorithms.layout import CHANNELS_LAST, ceil_pool_pad, converters, is_asymmetric
from algorithms.spec import LayerInfo, ModelSpec

BUFFER_ROLES = ("running_mean", "running_var")


# ----------------------------------------------------------------------------- layouts (algorithms/layout.py)
LAYOUT = CHANNELS_LAST
to_native, from_native = converters(LAYOUT)


# ----------------------------------------------------------------------------- padding helpers
def _explicit(t: int, b: int, l: int, r: int) -> list[list[int]]:
    return [[0, 0], [t, b], [l, r], [0, 0]]


def conv_padding(layer: LayerInfo, seams: Seams):
    """The `padding` argument of tf.nn.conv2d: TF 'SAME' (the spec's 'same'), 'VALID', or, under the
    fault `symmetric_same_padding`, k//2 on every side where TF 'SAME' pads asymmetrically."""
    if layer.spec.options["padding"] != "same":
        return "VALID"
    if seams.symmetric_padding and is_asymmetric(layer.padding):
        (t, b), (l, r) = seams.same_pads(layer)
        return _explicit(t, b, l, r)
    return "SAME"


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
    seams = Seams(fault)
    no_bias = seams.dropped_bias(model)
    n_native = 0
    for layer in model.layers:
        o = layer.spec.options
        k = layer.kind
        if k == "conv2d":
            x = tf.nn.conv2d(x, p[f"{layer.name}.kernel"], strides=o["stride"],
                             padding=conv_padding(layer, seams))
            bias = None if layer.name == no_bias else p.get(f"{layer.name}.bias")
            if bias is not None:
                x = tf.nn.bias_add(x, bias)
        elif k == "maxpool2d":
            if o["padding"] == "same":
                x = tf.nn.max_pool2d(x, o["pool"], o["stride"], "SAME")
            else:
                if seams.maxpool_ceil:
                    ph = ceil_pool_pad(layer.in_shape[0], o["pool"], o["stride"])
                    pw = ceil_pool_pad(layer.in_shape[1], o["pool"], o["stride"])
                    if ph > 0 or pw > 0:
                        x = tf.pad(x, _explicit(0, ph, 0, pw), constant_values=float("-inf"))
                x = tf.nn.max_pool2d(x, o["pool"], o["stride"], "VALID")
        elif k == "avgpool2d":
            # TF 'SAME' average pooling excludes the padded pixels from the count: the reference
            x = tf.nn.avg_pool2d(x, o["pool"], o["stride"], "SAME" if o["padding"] == "same" else "VALID")
        elif k == "relu":
            x = tf.nn.relu(x)
        elif k == "tanh":
            x = tf.math.tanh(x)
        elif k == "batchnorm2d":
            mom, eps = seams.bn_params(o)
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
            elif train or seams.eval_dropout:
                seed = dropout_seed if dropout_seed is not None else tf.constant([0, 0], tf.int64)
                x = tf.nn.experimental.stateless_dropout(x, o["rate"], seed=seed + n_native)
                n_native += 1
        elif k == "flatten":
            x = tf.reshape(x, [-1, math.prod(layer.out_shape)])   # (H, W, C) order: canonical
        elif k == "global_avgpool2d":
            x = tf.reduce_mean(x, axis=[1, 2])
        elif k == "dense":
            x = tf.linalg.matmul(x, p[f"{layer.name}.kernel"])
            bias = None if layer.name == no_bias else p.get(f"{layer.name}.bias")
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


__all__ = ["forward", "cross_entropy", "per_example_cross_entropy", "to_native", "from_native", "LAYOUT",
           "conv_padding", "BUFFER_ROLES"]
