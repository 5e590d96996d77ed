"""The spec's layers lowered to native TensorFlow (tf.nn, NHWC), and canonical <-> TF layouts.

The canonical layout IS TensorFlow's (NHWC activations, conv kernel (kH, kW, I, O), dense kernel
(in, out), flatten in (H, W, C) order), so the layout functions are the identity, except under the
fault `flatten_no_permute`, which reproduces the PyTorch port mistake in this framework: the rows of
the first dense kernel after a flatten are loaded in the (C, H, W) order of an NCHW flatten.

The model is a graph (a DAG in spec order): every layer reads its `inputs` from `outs`, the outputs kept
by name (`input` is the batch). Convolutions with `groups` / `dilation` (see `conv2d`): TensorFlow's CPU
kernels have no gradient for a grouped Conv2D nor for a dilated one (Conv2DBackpropInput refuses both;
the forward runs and the backward fails, checked on tensorflow-cpu 2.21), so they are lowered to exact
formulations that every path (eager, tf.function, XLA, MirroredStrategy, float32 and float64) runs:
depthwise (groups == C_in) is tf.nn.depthwise_conv2d, whose kernel (kH, kW, C_in, M) with output channel
c*M + m is the canonical (kH, kW, 1, C_in*M) reshaped; other groups are one convolution per group on
tf.split channel slices, concatenated in group order; dilation is tf.nn.convolution's space-to-batch
(TF's own atrous convolution) on the input padded explicitly by the spec's 'same' pads.

`forward` is a pure function of its inputs: in training mode it returns the new BatchNorm running
statistics in `new_buffers` instead of assigning them, so the caller decides whether state changes.
"""
from __future__ import annotations

import math

import tensorflow as tf

from algorithms.faults import Seams
from algorithms.layout import CHANNELS_LAST, ceil_pool_pad, converters, is_asymmetric
from algorithms.spec import INPUT, LayerInfo, ModelSpec, keep_output, layer_input

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


def _plain_conv(x: tf.Tensor, kernel: tf.Tensor, stride: int, dilation: int, padding) -> tf.Tensor:
    """One ungrouped convolution. dilation == 1: tf.nn.conv2d with `padding` (as before graphs, bit for bit).
    dilation > 1 (stride 1: the spec refuses both): `x` arrives padded, tf.nn.convolution 'VALID', which
    lowers a dilated window to space_to_batch / conv2d / batch_to_space (TF's CPU Conv2D has no dilated
    gradient)."""
    if dilation == 1:
        return tf.nn.conv2d(x, kernel, strides=stride, padding=padding)
    return tf.nn.convolution(x, kernel, strides=stride, padding="VALID", dilations=dilation)


def conv2d(layer: LayerInfo, seams: Seams, x: tf.Tensor, kernel: tf.Tensor) -> tf.Tensor:
    """The spec's conv2d on NHWC `x` with the canonical kernel (kH, kW, C_in/groups, C_out), bias not added.

    groups == 1, dilation == 1: tf.nn.conv2d, unchanged. Otherwise (see the module docstring) the input is
    padded explicitly by the spec's 'same' pads (seams.same_pads: the fault symmetric_same_padding too), then:
    depthwise (groups == C_in): tf.nn.depthwise_conv2d with the kernel reshaped to (kH, kW, C_in, M), M =
    C_out / C_in (output channel c*M + m = canonical o: the canonical order, not the mult-major m*C_in + c);
    other groups: a convolution per group on contiguous channel slices, outputs concatenated in group order."""
    o = layer.spec.options
    groups, dilation, stride = o["groups"], o["dilation"], o["stride"]
    if groups == 1 and dilation == 1:
        return _plain_conv(x, kernel, stride, 1, conv_padding(layer, seams))
    if o["padding"] == "same":
        (t, b), (l, r) = seams.same_pads(layer)
        if t or b or l or r:
            x = tf.pad(x, _explicit(t, b, l, r))
    c_in = int(x.shape[-1])
    if groups == c_in:
        kh, kw, _, c_out = (int(d) for d in kernel.shape)
        dw = tf.reshape(kernel, [kh, kw, c_in, c_out // c_in])
        return tf.nn.depthwise_conv2d(x, dw, strides=[1, stride, stride, 1], padding="VALID",
                                      dilations=[dilation, dilation])
    if groups == 1:
        return _plain_conv(x, kernel, stride, dilation, "VALID")
    xs = tf.split(x, groups, axis=-1)
    ks = tf.split(kernel, groups, axis=-1)
    return tf.concat([_plain_conv(a, k, stride, dilation, "VALID") for a, k in zip(xs, ks)], axis=-1)


def gelu(x: tf.Tensor, approximate: str) -> tf.Tensor:
    """The spec's gelu, `approximate` always explicit: "none" x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2)), "tanh"
    0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), torch's formulas. Not tf.nn.gelu: it builds its
    constants with math_ops.cast(python float, dtype), which goes through a float32 tensor, so in float64
    1/sqrt(2) becomes 0.7071067690849304 and 0.044715 becomes 0.044714998453855515 (5e-9 absolute on the
    exact form; measured). Here every constant is made in x's dtype."""
    def c(v: float) -> tf.Tensor:
        return tf.constant(v, x.dtype)
    if approximate == "tanh":
        return 0.5 * x * (1.0 + tf.math.tanh(c(math.sqrt(2.0 / math.pi)) * (x + c(0.044715) * (x * x * x))))
    return 0.5 * x * (1.0 + tf.math.erf(x * c(math.sqrt(0.5))))


def layer_norm(x: tf.Tensor, gamma: tf.Tensor, beta: tf.Tensor, eps: float) -> tf.Tensor:
    """The spec's layernorm: over the last (channel) axis per sample and position, biased variance, the
    spec's eps (torch's F.layer_norm; Keras' LayerNormalization has its own default). Written out, not
    tf.nn.moments (which stops the gradient through the mean inside the variance)."""
    mean = tf.reduce_mean(x, axis=-1, keepdims=True)
    var = tf.reduce_mean(tf.math.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * tf.math.rsqrt(var + eps) * gamma + beta


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
    no_norm = seams.bypassed_norms(model)
    cat_axis = seams.concat_axis(channels_first=False)
    n_native = 0
    outs: dict[str, tf.Tensor] = {INPUT: x}      # every layer's output by name: the graph's edges
    for layer in model.layers:
        o = layer.spec.options
        k = layer.kind
        x = layer_input(layer, outs)        # an `add` is its inputs' sum, in `inputs` order
        if k == "concat":
            x = tf.concat([outs[src] for src in layer.inputs], axis=cat_axis)   # NHWC: channels last (3)
        elif k == "conv2d":
            x = conv2d(layer, seams, x, p[f"{layer.name}.kernel"])
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
        elif k == "leaky_relu":
            # not tf.nn.leaky_relu: its alpha is a float32 attribute of the LeakyRelu op, so a float64 model
            # would get the slope float32(alpha) (0.2 -> 0.20000000298, 1.5e-8 relative; measured). In x's
            # dtype, the spec's alpha (never TF's default 0.2); derivative alpha at 0, as torch's
            x = tf.where(x > 0, x, x * tf.constant(o["alpha"], x.dtype))
        elif k == "gelu":
            x = gelu(x, o["approximate"])
        elif k == "silu":
            x = tf.nn.silu(x)
        elif k == "sigmoid":
            x = tf.math.sigmoid(x)
        elif k == "relu6":
            x = tf.nn.relu6(x)
        elif k == "layernorm":
            x = layer_norm(x, p[f"{layer.name}.gamma"], p[f"{layer.name}.beta"], o["eps"])
        elif k == "batchnorm2d" and layer.name in no_norm:
            pass                                 # projection_without_bn: the port has no BatchNorm here
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
                    unbiased = var if seams.biased_running_var else var * (n / (n - 1))
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
        elif k != "add":  # pragma: no cover - the spec validates kinds
            raise NotImplementedError(k)
        keep_output(outs, record, layer.name, x)
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
           "conv_padding", "conv2d", "gelu", "layer_norm", "BUFFER_ROLES"]
