"""The spec's layers lowered to Keras 3 layers (one functional model, any Keras backend), and the
canonical <-> Keras layouts.

Keras' own layouts are the canonical ones (NHWC activations, conv kernel (kH, kW, I, O), dense
kernel (in, out), a Flatten that reads (H, W, C)), so parameters load as they are. The only layout
change is the fault `flatten_no_permute`: the first dense kernel after a flatten is loaded as if its
rows were in torch's (C, H, W) order.

Everything here is backend-neutral Keras (keras.layers, keras.ops, keras.random); the training
step per Keras backend lives in runtimes/<backend>.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import keras
from keras import ops

from algorithms.faults import Seams
from algorithms.layout import CHANNELS_LAST, ceil_pool_pad, converters, is_asymmetric
from algorithms.spec import LayerInfo, ModelSpec


# ----------------------------------------------------------------------------- layouts (algorithms/layout.py)
LAYOUT = CHANNELS_LAST
to_native, from_native = converters(LAYOUT)


# ----------------------------------------------------------------------------- custom layers
class HarnessDropout(keras.layers.Layer):
    """Inverted dropout whose keep mask is a non-trainable variable, assigned by the harness before
    each step (`--dropout harness`): x * mask / (1 - rate), as the reference. With `native=True` it is
    keras.layers.Dropout (the framework's RNG). `eval_dropout=True` is the fault dropout_in_eval:
    Keras' own random dropout stays on in inference mode."""

    def __init__(self, rate: float, mask_shape: tuple[int, ...], native: bool = False,
                 eval_dropout: bool = False, seed: int | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.rate = float(rate)
        self.mask_shape = tuple(mask_shape)
        self.native = native
        self.eval_dropout = eval_dropout
        self.dropout = keras.layers.Dropout(rate, seed=seed, name=f"{self.name}_native")
        self.select = None      # data parallel (keras-tensorflow): a replica's rows of the global-batch mask

    def build(self, input_shape) -> None:
        self.keep_mask = self.add_weight(shape=self.mask_shape, initializer="ones", trainable=False,
                                         name="keep_mask")
        self.dropout.build(input_shape)

    def call(self, x, training=None):
        if training and not self.native:
            mask = self.keep_mask if self.select is None else self.select(self.keep_mask)
            return x * mask / (1.0 - self.rate)
        if training or self.eval_dropout:
            return self.dropout(x, training=True)
        return x

    def compute_output_shape(self, input_shape):
        return input_shape


class ConstantPad2D(keras.layers.Layer):
    """Pad H and W with a constant (the -inf padding of a max pool; keras.layers.ZeroPadding2D pads 0)."""

    def __init__(self, padding: tuple[tuple[int, int], tuple[int, int]], value: float, **kw: Any) -> None:
        super().__init__(**kw)
        self.padding = tuple(tuple(p) for p in padding)
        self.value = float(value)

    def call(self, x):
        (t, b), (l, r) = self.padding
        return ops.pad(x, [[0, 0], [t, b], [l, r], [0, 0]], constant_values=self.value)

    def compute_output_shape(self, s):
        (t, b), (l, r) = self.padding
        return (s[0], None if s[1] is None else s[1] + t + b, None if s[2] is None else s[2] + l + r, s[3])


class OrphanBias(keras.layers.Layer):
    """Fault missing_bias: the port dropped use_bias, but the canonical bias still exists as a
    parameter (as in the torch reference, where it is loaded, exported, decayed, and gets a zero
    gradient). It holds that variable and passes its input through unchanged."""

    def __init__(self, units: int, **kw: Any) -> None:
        super().__init__(**kw)
        self.units = units

    def build(self, input_shape) -> None:
        self.bias = self.add_weight(shape=(self.units,), initializer="zeros", trainable=True, name="bias")

    def call(self, x):
        return x

    def compute_output_shape(self, input_shape):
        return input_shape


def torch_avgpool_replicates(layer: LayerInfo) -> bool:
    """Whether Keras-on-torch's 'same' average pooling gives other numbers than the reference here.

    keras-torch pads 'same' pooling by replication (F.pad mode='replicate', padded pixels counted)
    when the TF padding is asymmetric in some dimension (then in every dimension); a symmetric
    padding goes to avg_pool2d(count_include_pad=False), the reference. Replication is separable and
    repeats the edge pixel, so an overhanging window with a single real pixel along a dimension
    still averages to the reference; the numbers differ once an overhanging window holds >= 2 real
    pixels along some dimension."""
    if layer.kind != "avgpool2d" or layer.spec["padding"] != "same" or layer.padding is None:
        return False
    if all(lo == hi for lo, hi in layer.padding):
        return False
    k, s = layer.spec["pool"], layer.spec["stride"]
    for size, out, (lo, _hi) in zip(layer.in_shape[:2], layer.out_shape[:2], layer.padding):
        for i in range(out):
            start, end = i * s - lo, i * s - lo + k
            if (start < 0 or end > size) and min(end, size) - max(start, 0) >= 2:
                return True
    return False


# ----------------------------------------------------------------------------- the model
@dataclass
class Lowered:
    inputs: Any
    logits: Any
    outputs: dict[str, Any]                     # spec layer name -> its output tensor (symbolic)
    variables: dict[str, Any] = field(default_factory=dict)   # canonical param name -> keras.Variable
    dropouts: dict[str, HarnessDropout] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def lower(model: ModelSpec, *, batch_size: int, fault: str | None, native_dropout: bool,
          seed: int, synchronized_bn: bool = False) -> Lowered:
    """The spec as Keras layers applied to a keras.Input; returns the symbolic graph and the
    canonical-name -> keras.Variable map (filled once the layers are built, i.e. here).
    synchronized_bn: BatchNormalization(synchronized=True) (keras-tensorflow --sync-bn under a strategy)."""
    L = keras.layers
    inputs = keras.Input(shape=model.input_shape, name="duipai_input")
    x = inputs
    outs: dict[str, Any] = {}
    var_src: dict[str, tuple[Any, str]] = {}
    dropouts: dict[str, HarnessDropout] = {}
    notes: list[str] = []
    seams = Seams(fault)
    no_bias = seams.dropped_bias(model)
    for layer in model.layers:
        o, k, n = layer.spec.options, layer.kind, layer.name
        if k in ("conv2d", "dense"):
            use_bias = o["use_bias"]
            drop_bias = n == no_bias
            if k == "conv2d":
                padding = o["padding"]
                if seams.symmetric_padding and padding == "same" and is_asymmetric(layer.padding):
                    pads = seams.same_pads(layer)          # torch-style k//2 on every side
                    p = pads[0][0]
                    x = L.ZeroPadding2D(pads, name=f"{n}__sympad")(x)
                    padding = "valid"
                    notes.append(f"{n}: symmetric padding {p} + 'valid' (fault)")
                kl = L.Conv2D(o["filters"], o["kernel"], strides=o["stride"], padding=padding,
                              use_bias=use_bias and not drop_bias, kernel_initializer="zeros", name=n)
                units = o["filters"]
            else:
                kl = L.Dense(o["units"], use_bias=use_bias and not drop_bias, kernel_initializer="zeros", name=n)
                units = o["units"]
            x = kl(x)
            var_src[f"{n}.kernel"] = (kl, "kernel")
            if drop_bias:
                ob = OrphanBias(units, name=f"{n}__orphan_bias")
                x = ob(x)
                var_src[f"{n}.bias"] = (ob, "bias")
                notes.append(f"{n}: use_bias dropped (fault); its bias is an unused parameter")
            elif use_bias:
                var_src[f"{n}.bias"] = (kl, "bias")
        elif k == "maxpool2d":
            padding = o["padding"]
            if seams.maxpool_ceil and padding == "valid":
                h, w, _ = layer.in_shape
                ph, pw = ceil_pool_pad(h, o["pool"], o["stride"]), ceil_pool_pad(w, o["pool"], o["stride"])
                if ph or pw:
                    x = ConstantPad2D(((0, ph), (0, pw)), float("-inf"), name=f"{n}__ceilpad")(x)
                    notes.append(f"{n}: ceil_mode emulated by -inf padding ({ph}, {pw}) (fault)")
            x = L.MaxPooling2D(o["pool"], o["stride"], padding=padding, name=n)(x)
        elif k == "avgpool2d":
            x = L.AveragePooling2D(o["pool"], o["stride"], padding=o["padding"], name=n)(x)
        elif k == "relu":
            x = L.Activation("relu", name=n)(x)
        elif k == "tanh":
            x = L.Activation("tanh", name=n)(x)
        elif k == "batchnorm2d":
            keras_mom, eps = seams.bn_params(o, "keras")   # Keras: r = M r + (1-M) x
            bl = L.BatchNormalization(axis=-1, momentum=keras_mom, epsilon=eps, synchronized=synchronized_bn, name=n)
            x = bl(x)
            for role, attr in (("gamma", "gamma"), ("beta", "beta"), ("running_mean", "moving_mean"),
                               ("running_var", "moving_variance")):
                var_src[f"{n}.{role}"] = (bl, attr)
        elif k == "dropout":
            dl = HarnessDropout(o["rate"], (batch_size, *layer.out_shape), native=native_dropout,
                                eval_dropout=seams.eval_dropout, seed=seed, name=n)
            x = dl(x)
            dropouts[n] = dl
        elif k == "flatten":
            x = L.Flatten(name=n)(x)                  # (H, W, C) order: the canonical one
        elif k == "global_avgpool2d":
            x = L.GlobalAveragePooling2D(name=n)(x)
        else:  # pragma: no cover - the spec validates kinds
            raise NotImplementedError(k)
        outs[n] = x
    variables = {name: getattr(obj, attr) for name, (obj, attr) in var_src.items()}
    missing = [q.name for q in model.params if q.name not in variables]
    assert not missing, f"parameters without a Keras variable: {missing}"
    return Lowered(inputs, x, outs, variables, dropouts, notes)


__all__ = ["lower", "Lowered", "torch_avgpool_replicates", "HarnessDropout", "ConstantPad2D", "OrphanBias", "to_native",
           "from_native", "LAYOUT"]
