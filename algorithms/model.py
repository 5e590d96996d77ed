"""The spec's data types: the layer kinds and their fields, a layer as declared (`LayerSpec`), a parameter
(`ParamInfo`), a layer with its inferred shapes (`LayerInfo`) and a model (`ModelSpec`), its normalised
declaration and hash. Built and validated by algorithms/spec.py (`build_model`, `load_model`), which
re-exports every name here; the canonical layout is described there.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any


class SpecError(ValueError):
    """A model file that cannot be a valid model; the message names model, layer and field."""


# --------------------------------------------------------------------------- layer kinds
# Each kind: its fields with (type, default or REQUIRED). The order is the order of the docs.
REQUIRED = object()
INITS = ("he_normal", "he_uniform", "glorot_uniform", "glorot_normal")
PADDINGS = ("valid", "same")
GELU_APPROXIMATIONS = ("none", "tanh")
INPUT = "input"            # the reserved name of the model input in `inputs`

LAYER_FIELDS: dict[str, dict[str, tuple[type, Any]]] = {
    "conv2d": {"filters": (int, REQUIRED), "kernel": (int, REQUIRED), "stride": (int, 1),
               "padding": (str, "valid"), "use_bias": (bool, True), "init": (str, "he_normal"),
               "groups": (int, 1), "dilation": (int, 1)},
    "maxpool2d": {"pool": (int, REQUIRED), "stride": (int, None), "padding": (str, "valid")},
    "avgpool2d": {"pool": (int, REQUIRED), "stride": (int, None), "padding": (str, "valid")},
    "relu": {},
    "tanh": {},
    "batchnorm2d": {"momentum": (float, 0.1), "eps": (float, 1e-5)},
    "dropout": {"rate": (float, REQUIRED)},
    "flatten": {},
    "dense": {"units": (int, REQUIRED), "use_bias": (bool, True), "init": (str, "he_normal")},
    "global_avgpool2d": {},
    # graph merges: element-wise sum of equal shapes; concatenation on the channel (last) axis
    "add": {},
    "concat": {},
    # activations; alpha, approximate and eps are required because the framework defaults differ
    "leaky_relu": {"alpha": (float, REQUIRED)},
    "gelu": {"approximate": (str, REQUIRED)},
    "silu": {},
    "sigmoid": {},
    "relu6": {},
    "layernorm": {"eps": (float, REQUIRED)},
}
SPATIAL_KINDS = {"conv2d", "maxpool2d", "avgpool2d", "batchnorm2d", "global_avgpool2d", "concat"}
MERGE_KINDS = {"add", "concat"}
# element-wise: output shape = input shape, and a flattened vector stays in its flatten order
ELEMENTWISE_KINDS = {"relu", "tanh", "dropout", "leaky_relu", "gelu", "silu", "sigmoid", "relu6"}
# the layer kinds of the first spec (straight lines on 8x8x1); every backend lowers these
BASE_LAYER_KINDS = frozenset({"conv2d", "maxpool2d", "avgpool2d", "relu", "tanh", "batchnorm2d", "dropout",
                              "flatten", "dense", "global_avgpool2d"})
# fields added after the first golden baselines: left out of the normalised declaration (`to_dict`, which
# the spec hash covers) at these values, so that a model written before them keeps its spec hash
OMITTED_AT_DEFAULT: dict[str, dict[str, Any]] = {"conv2d": {"groups": 1, "dilation": 1}}


@dataclass(frozen=True)
class LayerSpec:
    """One layer as declared, with defaults filled in."""
    kind: str
    name: str
    options: dict[str, Any]
    # the layers (or INPUT) this one reads, resolved; `inputs_declared`: named in the file, not the default
    inputs: tuple[str, ...] = ()
    inputs_declared: bool = False

    def __getitem__(self, key: str) -> Any:
        return self.options[key]


@dataclass(frozen=True)
class ParamInfo:
    name: str           # "<layer>.<role>", e.g. "conv1.kernel"
    layer: str
    role: str           # kernel | bias | gamma | beta | running_mean | running_var
    shape: tuple[int, ...]
    trainable: bool
    init: str           # he_normal | ... | zeros | ones
    fan_in: int = 0
    fan_out: int = 0


@dataclass(frozen=True)
class LayerInfo:
    """A layer with its inferred shapes (per sample, NHWC without N)."""
    index: int
    spec: LayerSpec
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    params: tuple[ParamInfo, ...]
    # For a dense layer fed (through element-wise layers) by a flatten of an (H, W, C) tensor:
    # that (H, W, C). Wrappers whose flatten order is not HWC must permute this kernel's rows.
    flattened_from: tuple[int, int, int] | None = None
    padding: tuple[tuple[int, int], tuple[int, int]] | None = None  # explicit (top,bottom),(left,right)
    # every input's shape, in `spec.inputs` order (in_shape is the first)
    in_shapes: tuple[tuple[int, ...], ...] = ()
    # this layer's output is a flatten of an (H, W, C) map (the flatten, and element-wise layers after it):
    # that (H, W, C); frameworks that flatten in (C, H, W) order hold these features permuted
    flat_of: tuple[int, int, int] | None = None

    @property
    def inputs(self) -> tuple[str, ...]:
        return self.spec.inputs

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def kind(self) -> str:
        return self.spec.kind


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    input_shape: tuple[int, int, int]   # H, W, C
    num_classes: int
    layers: tuple[LayerInfo, ...]
    source: str = ""

    @property
    def params(self) -> list[ParamInfo]:
        return [p for layer in self.layers for p in layer.params]

    @property
    def trainable(self) -> list[ParamInfo]:
        return [p for p in self.params if p.trainable]

    @property
    def buffers(self) -> list[ParamInfo]:
        return [p for p in self.params if not p.trainable]

    def has(self, kind: str) -> bool:
        return any(layer.kind == kind for layer in self.layers)

    def layer(self, name: str) -> LayerInfo:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(f"model '{self.name}' has no layer {name!r}")

    @property
    def is_graph(self) -> bool:
        """Whether some layer reads anything but the previous layer's output."""
        return any(l.spec.inputs_declared and l.spec.inputs != default_inputs(self.layers, l.index)
                   for l in self.layers)

    def required_features(self) -> set[str]:
        """What a backend must lower to run this model: its layer kinds, plus `conv2d:groups` and
        `conv2d:dilation` where a convolution uses them (see wrappers.base.Entry.layer_kinds)."""
        out = {l.kind for l in self.layers}
        for l in self.layers:
            if l.kind == "conv2d":
                if l.spec["groups"] != 1:
                    out.add("conv2d:groups")
                if l.spec["dilation"] != 1:
                    out.add("conv2d:dilation")
        return out

    def to_dict(self) -> dict[str, Any]:
        """The declaration, normalised (defaults filled): what the spec hash covers. `inputs` appears
        only where it differs from the previous layer, and the later fields of OMITTED_AT_DEFAULT only
        where they differ from their defaults: a straight-line model keeps the hash it had before graphs."""
        layers = []
        for l in self.layers:
            omit = OMITTED_AT_DEFAULT.get(l.kind, {})
            d = {"type": l.kind, "name": l.name,
                 **{k: v for k, v in l.spec.options.items() if not (k in omit and v == omit[k])}}
            if l.spec.inputs != default_inputs(self.layers, l.index):
                d["inputs"] = list(l.spec.inputs)
            layers.append(d)
        return {"name": self.name, "input_shape": list(self.input_shape),
                "num_classes": self.num_classes, "layers": layers}

    def hash(self) -> str:
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def default_inputs(layers: Any, index: int) -> tuple[str, ...]:
    """What layer `index` reads when it names no inputs: the previous layer (the model input for the first)."""
    return (INPUT,) if index == 0 else (layers[index - 1].name,)


# --------------------------------------------------------------------------- the graph's edges, in every lowering
def layer_input(layer: "LayerInfo", outs: dict[str, Any]) -> Any:
    """What a layer computes on, from the outputs so far (`outs`, by layer name; INPUT the model input): an `add`
    the sum of its inputs in `inputs` order, ((a + b) + c), so that every framework rounds the same sum; any other
    layer its first input. Framework-free: the arrays' own `+`."""
    x = outs[layer.inputs[0]]
    if layer.kind == "add":
        for src in layer.inputs[1:]:
            x = x + outs[src]
    return x


def keep_output(outs: dict[str, Any], record: dict[str, Any] | None, name: str, x: Any) -> None:
    """A layer's output kept for the layers after it, and in `record` (the per-layer probes) when one is given."""
    outs[name] = x
    if record is not None:
        record[name] = x
