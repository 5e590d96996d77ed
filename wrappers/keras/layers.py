"""The spec's layers lowered to Keras 3 layers (one functional model, any Keras backend), and the
canonical <-> Keras layouts.

The spec is a DAG: every layer is applied to the outputs of its `inputs` (by name; `input` is the
keras.Input), and every layer's output is kept by name (what the probes record).

Keras' own layouts are the canonical ones (NHWC activations, conv kernel (kH, kW, I/groups, O) of a
grouped Conv2D, dense kernel (in, out), a Flatten that reads (H, W, C), Concatenate on the last axis),
so parameters load as they are, with two exceptions: a depthwise convolution (groups == input
channels > 1) is a DepthwiseConv2D, whose kernel (kH, kW, C, M) with output channel c*M + m is the
canonical (kH, kW, 1, C*M) reshaped (algorithms/layout.py's KERAS layout); and the load-order faults:
`flatten_no_permute` (the first dense kernel after a flatten loaded as if its rows were in torch's
(C, H, W) order) and `depthwise_multiplier_order` (a multiplied depthwise kernel loaded multiplier-major),
both algorithms/layout.py's. The graph's other two lowering faults are seams of `lower`:
`concat_wrong_axis` (Concatenate on the width, Seams.concat_axis) and `projection_without_bn`
(BypassedBatchNorm: the shortcut's BatchNorm variables kept, its input passed through).

float64: where a Keras backend's own op is not float64 in Keras 3.15 (runtimes/<backend>.py
FLOAT64_FORMULA: on keras-jax BatchNormalization, LayerNormalization, GlobalAveragePooling2D and tanh
compute in float32, keras-tensorflow's gelu and leaky_relu round a constant to float32) the layer computes the spec's
formula with keras.ops instead, said in the lowering notes; float32 always runs Keras' own layers
(the same Keras layers as before for the straight-line kinds).

Everything here is backend-neutral Keras (keras.layers, keras.ops, keras.random); the training
step per Keras backend lives in runtimes/<backend>.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import keras
from keras import ops


from algorithms.faults import Seams
from algorithms.layout import KERAS, ceil_pool_pad, converters, depthwise_multiplier, is_asymmetric
from algorithms.spec import INPUT, LayerInfo, ModelSpec


# ----------------------------------------------------------------------------- layouts (algorithms/layout.py)
LAYOUT = KERAS          # channels last; a depthwise kernel as DepthwiseConv2D's (kH, kW, C, M)
to_native, from_native = converters(LAYOUT)


def is_depthwise(layer: LayerInfo) -> bool:
    """A conv2d lowered to DepthwiseConv2D: groups == input channels > 1 (filters = channels * multiplier)."""
    return depthwise_multiplier(layer) > 0


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


class Gelu(keras.layers.Layer):
    """gelu with the spec's `approximate` always passed (Keras' activations default to exact, ops.gelu to
    tanh). formula=True: the spec's formula in keras.ops, in the input's dtype (float64 where Keras' own op
    is not: tf.nn.gelu casts its constant 1/sqrt(2) (exact) or 0.044715 (tanh) through float32)."""

    def __init__(self, approximate: str, formula: bool = False, **kw: Any) -> None:
        super().__init__(**kw)
        self.approximate, self.formula = approximate, formula

    def call(self, x):
        tanh = self.approximate == "tanh"
        if not self.formula:
            return keras.activations.gelu(x, approximate=tanh)
        if tanh:
            return 0.5 * x * (1.0 + ops.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
        return 0.5 * x * (1.0 + ops.erf(x * 0.7071067811865476))

    def compute_output_shape(self, input_shape):
        return input_shape


class LeakyRelu(keras.layers.Layer):
    """`x if x > 0 else alpha * x` (the gradient at 0 is alpha, as torch's): keras.layers.LeakyReLU with the
    spec's alpha always passed (its default is 0.3), or with formula=True keras.ops in the input's dtype
    (tf.nn.leaky_relu holds alpha in a float32 attribute: 0.2 becomes 0.200000003 in a float64 network)."""

    def __init__(self, alpha: float, formula: bool = False, **kw: Any) -> None:
        super().__init__(**kw)
        self.alpha, self.formula = float(alpha), formula
        self.own = keras.layers.LeakyReLU(negative_slope=self.alpha, name=f"{self.name}_keras")

    def call(self, x):
        if not self.formula:
            return self.own(x)
        return ops.where(x > 0, x, x * self.alpha)

    def compute_output_shape(self, input_shape):
        return input_shape


class ChannelLayerNorm(keras.layers.LayerNormalization):
    """LayerNormalization(axis=-1, epsilon=spec eps): (x - mean) / sqrt(var + eps) * gamma + beta over the
    channel (last) axis, biased variance, no rms scaling. formula=True: that formula in keras.ops in the
    input's dtype (Keras 3.15's ops.layer_normalization computes in result_type(x, float32), which is
    float32 for a float64 x on keras-jax)."""

    def __init__(self, epsilon: float, formula: bool = False, **kw: Any) -> None:
        super().__init__(axis=-1, epsilon=epsilon, center=True, scale=True, rms_scaling=False, **kw)
        self.formula = formula

    def call(self, x):
        if not self.formula:
            return super().call(x)
        # ops.moments: jnp.mean / jnp.var, tf.nn.moments (biased) in x's dtype; ops.mean would compute a float64 x
        # in result_type(x, float32), float32 on keras-jax
        mean, var = ops.moments(x, axes=[-1], keepdims=True)
        return (x - mean) * ops.rsqrt(var + self.epsilon) * self.gamma + self.beta


class GlobalAvgPool(keras.layers.GlobalAveragePooling2D):
    """GlobalAveragePooling2D (ops.mean over H, W); formula=True: the mean of ops.moments, in the input's dtype
    (ops.mean computes a float64 x in result_type(x, float32), float32 on keras-jax: 5e-8 relative, measured)."""

    def __init__(self, formula: bool = False, **kw: Any) -> None:
        super().__init__(**kw)
        self.formula = formula

    def call(self, x):
        if not self.formula:
            return super().call(x)
        return ops.moments(x, axes=[1, 2])[0]


class BatchNorm64(keras.layers.BatchNormalization):
    """BatchNormalization computing in the input's dtype: Keras' own call upcasts to result_type(x, float32), which
    is float32 for a float64 x on keras-jax (measured: 1e-7 relative). The same statistics and update (biased
    moving variance, Keras' momentum convention), without that cast."""

    def call(self, inputs, training=None, mask=None):
        if training and self.trainable:
            mean, variance = ops.moments(inputs, axes=self._reduction_axes, synchronized=self.synchronized)
            self.moving_mean.assign(self.moving_mean * self.momentum + mean * (1.0 - self.momentum))
            self.moving_variance.assign(self.moving_variance * self.momentum + variance * (1.0 - self.momentum))
        else:
            mean, variance = self.moving_mean, self.moving_variance
        return ops.batch_normalization(inputs, mean, variance, axis=self.axis, offset=self.beta, scale=self.gamma,
                                       epsilon=self.epsilon)


class BypassedBatchNorm(keras.layers.BatchNormalization):
    """Fault projection_without_bn: the port has no BatchNorm here, but the canonical gamma, beta and running
    statistics still exist as parameters (as in the torch reference: loaded, exported, decayed, a zero
    gradient, running statistics unmoved). It holds those variables and passes its input through unchanged."""

    def call(self, inputs, training=None, mask=None):
        return inputs


class Tanh(keras.layers.Layer):
    """keras.activations.tanh; formula=True: 2 sigmoid(2x) - 1 (keras-jax's ops.tanh computes float64 in
    float32: 1.8e-7 relative, measured; its sigmoid is jax.nn.sigmoid in the input's dtype)."""

    def __init__(self, formula: bool = False, **kw: Any) -> None:
        super().__init__(**kw)
        self.formula = formula

    def call(self, x):
        if not self.formula:
            return keras.activations.tanh(x)
        return 2.0 * keras.activations.sigmoid(2.0 * x) - 1.0

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
          seed: int, synchronized_bn: bool = False, formula_kinds: frozenset[str] = frozenset()) -> Lowered:
    """The spec as Keras layers applied to a keras.Input (a functional graph: each layer applied to the
    outputs of its `inputs`); returns the symbolic graph and the canonical-name -> keras.Variable map (filled
    once the layers are built, i.e. here).
    synchronized_bn: BatchNormalization(synchronized=True) (keras-tensorflow --sync-bn under a strategy).
    formula_kinds: the kinds computed by the spec's formula in keras.ops instead of Keras' own layer (float64
    where this Keras backend's own op is not float64: runtimes/<backend>.py FLOAT64_FORMULA)."""
    L = keras.layers
    inputs = keras.Input(shape=model.input_shape, name="duipai_input")
    x = inputs
    outs: dict[str, Any] = {}
    edges: dict[str, Any] = {INPUT: inputs}          # every output by name, the input included: the graph's edges
    var_src: dict[str, tuple[Any, str]] = {}
    dropouts: dict[str, HarnessDropout] = {}
    notes: list[str] = []
    seams = Seams(fault)
    no_bias = seams.dropped_bias(model)
    no_norm = seams.bypassed_norms(model)
    cat_axis = seams.concat_axis(channels_first=False)
    if cat_axis != 3 and model.has("concat"):
        notes.append(f"concat on axis {cat_axis} (the width) instead of the channels (fault)")
    for kind in sorted(formula_kinds & {l.kind for l in model.layers}):
        notes.append(f"{kind}: the spec's formula in keras.ops (Keras' own op is not float64 on this backend)")
    for layer in model.layers:
        o, k, n = layer.spec.options, layer.kind, layer.name
        x = edges[layer.inputs[0]]
        if k == "add":
            x = L.Add(name=n)([edges[src] for src in layer.inputs])
        elif k == "concat":
            # NHWC: channels last (concat_wrong_axis: the width, axis 2)
            x = L.Concatenate(axis=cat_axis, name=n)([edges[src] for src in layer.inputs])
        elif k in ("conv2d", "dense"):
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
                common = dict(strides=o["stride"], padding=padding, dilation_rate=o["dilation"],
                              use_bias=use_bias and not drop_bias, name=n)
                if is_depthwise(layer):     # kernel (kH, kW, C, M), output channel c*M + m (to_native reshapes)
                    kl = L.DepthwiseConv2D(o["kernel"], depth_multiplier=o["filters"] // o["groups"],
                                           depthwise_initializer="zeros", **common)
                else:                       # groups == 1, or grouped: kernel (kH, kW, C/groups, O), the canonical
                    kl = L.Conv2D(o["filters"], o["kernel"], groups=o["groups"], kernel_initializer="zeros", **common)
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
        elif k == "tanh" and k in formula_kinds:
            x = Tanh(formula=True, name=n)(x)
        elif k in ("relu", "tanh", "silu", "sigmoid", "relu6"):
            x = L.Activation(k, name=n)(x)            # keras.activations.<kind>
        elif k == "leaky_relu":                       # the spec's alpha, always (Keras' LeakyReLU default: 0.3)
            x = LeakyRelu(o["alpha"], formula=k in formula_kinds, name=n)(x)
        elif k == "gelu":                             # the spec's approximation, always
            x = Gelu(o["approximate"], formula=k in formula_kinds, name=n)(x)
        elif k == "layernorm":                        # over the channel (last) axis, the spec's eps
            ll = ChannelLayerNorm(o["eps"], formula=k in formula_kinds, name=n)
            x = ll(x)
            var_src[f"{n}.gamma"], var_src[f"{n}.beta"] = (ll, "gamma"), (ll, "beta")
        elif k == "batchnorm2d":
            keras_mom, eps = seams.bn_params(o, "keras")   # Keras: r = M r + (1-M) x
            bn_class = BatchNorm64 if k in formula_kinds else L.BatchNormalization
            if n in no_norm:                           # projection_without_bn: its parameters kept, unused
                bn_class = BypassedBatchNorm
                notes.append(f"{n}: BatchNorm left out of the projection shortcut (fault); its parameters are unused")
            bl = bn_class(axis=-1, momentum=keras_mom, epsilon=eps, synchronized=synchronized_bn, name=n)
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
            x = (GlobalAvgPool(formula=True, name=n) if k in formula_kinds else L.GlobalAveragePooling2D(name=n))(x)
        else:  # pragma: no cover - the spec validates kinds
            raise NotImplementedError(k)
        outs[n] = edges[n] = x
    variables = {name: getattr(obj, attr) for name, (obj, attr) in var_src.items()}
    missing = [q.name for q in model.params if q.name not in variables]
    assert not missing, f"parameters without a Keras variable: {missing}"
    return Lowered(inputs, x, outs, variables, dropouts, notes)


__all__ = ["lower", "Lowered", "torch_avgpool_replicates", "HarnessDropout", "ConstantPad2D", "OrphanBias", "Gelu",
           "LeakyRelu", "ChannelLayerNorm", "GlobalAvgPool", "Tanh",
           "BatchNorm64", "BypassedBatchNorm", "is_depthwise", "to_native", "from_native", "LAYOUT"]
