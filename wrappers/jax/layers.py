"""The spec's layers lowered to jax.lax / jax.nn in NHWC / HWIO, as pure functions.

JAX works in the canonical layout (NHWC activations, (kH, kW, I/groups, O) conv kernels = HWIO with
`feature_group_count`, (in, out) dense kernels, flatten in (H, W, C) order, concat on the last axis),
so parameters load without conversion. The model is a graph: every layer's output is kept by name. The one exception
is the `flatten_no_permute` fault, which loads the first dense kernel after a flatten with its
rows in (C, H, W) order while the activations are flattened (H, W, C): the classic port bug,
the same computation the torch backend's fault performs.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from algorithms.faults import Seams
from algorithms.layout import CHANNELS_LAST, ceil_pool_pad, converters, window_counts
from algorithms.spec import INPUT, ModelSpec, keep_output, layer_input

Params = dict[str, jax.Array]
DN = ("NHWC", "HWIO", "NHWC")


# ----------------------------------------------------------------------------- layouts (algorithms/layout.py)
LAYOUT = CHANNELS_LAST
to_native, from_native = converters(LAYOUT)


# ----------------------------------------------------------------------------- helpers
def _window(x: jax.Array, init: float, op, k: int, s: int, pads) -> jax.Array:
    """A pooling window; `init` is a Python scalar so that JAX sees a monoid (sum / max) and can differentiate."""
    (t, b), (l, r) = pads
    return lax.reduce_window(x, init, op, (1, k, k, 1), (1, s, s, 1), ((0, 0), (t, b), (l, r), (0, 0)))


def _window_counts(h: int, w: int, k: int, s: int, pads) -> np.ndarray:
    """How many real (unpadded) pixels each pooling window covers, as a (1, OH, OW, 1) constant."""
    return window_counts(h, w, k, s, pads)[None, :, :, None]


def _dropout_native(x: jax.Array, rate: float, key: jax.Array) -> jax.Array:
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros((), x.dtype))


# ----------------------------------------------------------------------------- forward
def forward(model: ModelSpec, p: Params, buffers: Params, x: jax.Array, *, train: bool,
            masks: dict[str, jax.Array] | None, fault: str | None, key: jax.Array | None = None,
            native_dropout: bool = False, record: dict[str, jax.Array] | None = None, bn_groups: int = 1
            ) -> tuple[jax.Array, Params]:
    """Logits for NHWC input `x`, and the buffers after this pass (updated running statistics in
    training mode; `buffers` itself is never modified). `p` holds the trainable parameters.
    `bn_groups` > 1: training-mode BatchNorm statistics per contiguous group of B/bn_groups samples
    (data-parallel replicas without synchronised BatchNorm); the running statistics are folded from
    group 0's (replica 0's, as DDP's buffer broadcast leaves them)."""
    new_buffers = dict(buffers)
    seams = Seams(fault)
    no_bias = seams.dropped_bias(model)
    no_norm = seams.bypassed_norms(model)
    cat_axis = seams.concat_axis(channels_first=False)
    outs: dict[str, jax.Array] = {INPUT: x}      # every layer's output by name: the graph's edges
    for layer in model.layers:
        o = layer.spec.options
        k = layer.kind
        x = layer_input(layer, outs)        # an `add` is its inputs' sum, in `inputs` order
        if k == "concat":
            x = jnp.concatenate([outs[src] for src in layer.inputs], axis=cat_axis)     # NHWC: channels last
        elif k == "conv2d":
            pads = seams.same_pads(layer) if o["padding"] == "same" else ((0, 0), (0, 0))
            x = lax.conv_general_dilated(x, p[f"{layer.name}.kernel"], (o["stride"], o["stride"]), pads,
                                         rhs_dilation=(o["dilation"], o["dilation"]), dimension_numbers=DN,
                                         feature_group_count=o["groups"])
            bias = None if layer.name == no_bias else p.get(f"{layer.name}.bias")
            if bias is not None:
                x = x + bias
        elif k == "maxpool2d":
            if o["padding"] == "same":
                pads = layer.padding
            elif seams.maxpool_ceil:
                h, w = x.shape[1], x.shape[2]
                pads = ((0, ceil_pool_pad(h, o["pool"], o["stride"])), (0, ceil_pool_pad(w, o["pool"], o["stride"])))
            else:
                pads = ((0, 0), (0, 0))
            x = _window(x, -np.inf, lax.max, o["pool"], o["stride"], pads)
        elif k == "avgpool2d":
            if o["padding"] == "same":
                # TF 'SAME' average: the padding is excluded from the count
                pads = layer.padding
                num = _window(x, 0.0, lax.add, o["pool"], o["stride"], pads)
                den = _window_counts(x.shape[1], x.shape[2], o["pool"], o["stride"], pads)
                x = num / jnp.asarray(den, x.dtype)
            else:
                x = _window(x, 0.0, lax.add, o["pool"], o["stride"], ((0, 0), (0, 0)))
                x = x / float(o["pool"] * o["pool"])
        elif k == "relu":
            x = jax.nn.relu(x)
        elif k == "tanh":
            x = jnp.tanh(x)
        elif k == "leaky_relu":
            x = jax.nn.leaky_relu(x, negative_slope=o["alpha"])
        elif k == "gelu":            # jax.nn.gelu's own default is the tanh approximation: always pass it
            x = jax.nn.gelu(x, approximate=o["approximate"] == "tanh")
        elif k == "silu":
            x = jax.nn.silu(x)
        elif k == "sigmoid":
            x = jax.nn.sigmoid(x)
        elif k == "relu6":
            x = jax.nn.relu6(x)
        elif k == "layernorm":       # over the channel (last) axis, biased variance
            mean = jnp.mean(x, axis=-1, keepdims=True)
            var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
            x = (x - mean) * lax.rsqrt(var + o["eps"]) * p[f"{layer.name}.gamma"] + p[f"{layer.name}.beta"]
        elif k == "batchnorm2d" and layer.name in no_norm:
            pass                         # projection_without_bn: the port has no BatchNorm here
        elif k == "batchnorm2d":
            mom, eps = seams.bn_params(o)
            gamma, beta = p[f"{layer.name}.gamma"], p[f"{layer.name}.beta"]
            rm_key, rv_key = f"{layer.name}.running_mean", f"{layer.name}.running_var"
            if train and bn_groups > 1:
                xs = x.reshape(bn_groups, x.shape[0] // bn_groups, *x.shape[1:])
                n = xs.shape[1] * xs.shape[2] * xs.shape[3]
                mean = jnp.mean(xs, axis=(1, 2, 3), keepdims=True)                 # (G, 1, 1, 1, C)
                var = jnp.mean(jnp.square(xs - mean), axis=(1, 2, 3), keepdims=True)
                x = ((xs - mean) * lax.rsqrt(var + eps) * gamma + beta).reshape(x.shape)
                mean_sg, var_sg = lax.stop_gradient(mean[0, 0, 0, 0]), lax.stop_gradient(var[0, 0, 0, 0])
                unbiased = var_sg * (n / (n - 1)) if n > 1 and not seams.biased_running_var else var_sg
                new_buffers[rm_key] = (1.0 - mom) * buffers[rm_key] + mom * mean_sg
                new_buffers[rv_key] = (1.0 - mom) * buffers[rv_key] + mom * unbiased
            elif train:
                n = x.shape[0] * x.shape[1] * x.shape[2]
                mean = jnp.mean(x, axis=(0, 1, 2))
                var = jnp.mean(jnp.square(x - mean), axis=(0, 1, 2))          # biased: normalisation
                x = (x - mean) * lax.rsqrt(var + eps) * gamma + beta
                mean_sg, var_sg = lax.stop_gradient(mean), lax.stop_gradient(var)
                unbiased = var_sg * (n / (n - 1)) if n > 1 and not seams.biased_running_var else var_sg   # torch's
                new_buffers[rm_key] = (1.0 - mom) * buffers[rm_key] + mom * mean_sg
                new_buffers[rv_key] = (1.0 - mom) * buffers[rv_key] + mom * unbiased
            else:
                x = (x - buffers[rm_key]) * lax.rsqrt(buffers[rv_key] + eps) * gamma + beta
        elif k == "dropout":
            rate = o["rate"]
            if train and not native_dropout and masks is not None:
                x = x * masks[layer.name].astype(x.dtype) / (1.0 - rate)
            elif (train or seams.eval_dropout) and rate > 0:
                x = _dropout_native(x, rate, jax.random.fold_in(key, layer.index))
        elif k == "flatten":
            x = x.reshape(x.shape[0], -1)       # (H, W, C) order: the canonical one
        elif k == "global_avgpool2d":
            x = jnp.mean(x, axis=(1, 2))
        elif k == "dense":
            x = x @ p[f"{layer.name}.kernel"]
            bias = None if layer.name == no_bias else p.get(f"{layer.name}.bias")
            if bias is not None:
                x = x + bias
        elif k != "add":  # pragma: no cover - the spec validates kinds
            raise NotImplementedError(k)
        keep_output(outs, record, layer.name, x)
    return x, new_buffers


def cross_entropy(logits: jax.Array, y: jax.Array, label_smoothing: float = 0.0) -> jax.Array:
    """Mean softmax cross-entropy from logits (torch F.cross_entropy semantics, incl. label smoothing)."""
    return jnp.mean(per_example_cross_entropy(logits, y, label_smoothing))


def per_example_cross_entropy(logits: jax.Array, y: jax.Array, label_smoothing: float = 0.0) -> jax.Array:
    """The (B,) per-sample losses whose mean is `cross_entropy` (for per-replica means)."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, y[:, None].astype(jnp.int32), axis=-1)[:, 0]
    if label_smoothing:
        return (1.0 - label_smoothing) * nll + label_smoothing * (-jnp.mean(logp, axis=-1))
    return nll


__all__ = ["forward", "cross_entropy", "per_example_cross_entropy", "to_native", "from_native", "LAYOUT"]
