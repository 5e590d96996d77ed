"""The framework-neutral CNN spec: layers as plain data, validated on load, with shapes inferred.

Nothing here imports a deep-learning framework. Every wrapper lowers the same `ModelSpec`;
the canonical layout (see `docs/canonical-layout.md`) is:

* activations NHWC; a flatten reads features in (H, W, C) order;
* conv kernel (kH, kW, C_in, C_out); dense kernel (in, out); biases (out,);
* BatchNorm: gamma, beta, running_mean, running_var (running_var holds the *unbiased*
  batch variance, the PyTorch convention), momentum in the PyTorch convention:
  ``running = (1 - momentum) * running + momentum * batch_stat``.
* 'same' padding is TF/XLA 'SAME': out = ceil(in / stride), the odd pixel padded bottom/right.

A model is a DAG written in topological order: a layer reads the previous layer's output unless it
names its `inputs` (layer names, or `input` for the model input). Merges (`add`, `concat`) read two
or more. Every layer's output must be read by a later layer, except the last (the logits).
"""
from __future__ import annotations

import hashlib
import json
import math
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MODELS_DIR = Path(__file__).parent / "models"


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
        return any(l.spec.inputs_declared and l.spec.inputs != _default_inputs(self.layers, l.index)
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
            if l.spec.inputs != _default_inputs(self.layers, l.index):
                d["inputs"] = list(l.spec.inputs)
            layers.append(d)
        return {"name": self.name, "input_shape": list(self.input_shape),
                "num_classes": self.num_classes, "layers": layers}

    def hash(self) -> str:
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def _default_inputs(layers: Any, index: int) -> tuple[str, ...]:
    """What layer `index` reads when it names no inputs: the previous layer (the model input for the first)."""
    return (INPUT,) if index == 0 else (layers[index - 1].name,)


# --------------------------------------------------------------------------- shape helpers
def same_padding(size: int, kernel: int, stride: int) -> tuple[int, int, int]:
    """TF/XLA 'SAME': returns (out, pad_before, pad_after); the odd pixel goes after."""
    out = math.ceil(size / stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return out, total // 2, total - total // 2


def valid_size(size: int, kernel: int, stride: int) -> int:
    return (size - kernel) // stride + 1


def _window(layer: str, h: int, w: int, k: int, s: int, padding: str, fail, dilation: int = 1):
    """(out_h, out_w, explicit padding) of a k x k window (dilated: it spans (k - 1) * dilation + 1)."""
    k = (k - 1) * dilation + 1
    if padding == "same":
        oh, t, b = same_padding(h, k, s)
        ow, l_, r = same_padding(w, k, s)
        return oh, ow, ((t, b), (l_, r))
    if k > h or k > w:
        fail("kernel" if layer == "conv2d" else "pool",
             f"window {k}{' (dilated)' if dilation > 1 else ''} is larger than the input {h}x{w} with padding 'valid'")
    return valid_size(h, k, s), valid_size(w, k, s), ((0, 0), (0, 0))


# --------------------------------------------------------------------------- loading
def _check_field(kind: str, key: str, value: Any, typ: type, fail) -> Any:
    if typ is bool:
        if not isinstance(value, bool):
            fail(key, f"must be true or false, got {value!r}")
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail(key, f"must be an integer, got {value!r}")
        if value <= 0:
            fail(key, f"must be positive, got {value}")
        return value
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            fail(key, f"must be a number, got {value!r}")
        return float(value)
    if typ is str:
        if not isinstance(value, str):
            fail(key, f"must be a string, got {value!r}")
        allowed = {"padding": PADDINGS, "init": INITS, "approximate": GELU_APPROXIMATIONS}.get(key)
        if allowed and value not in allowed:
            fail(key, f"must be one of {', '.join(allowed)}, got {value!r}")
        return value
    raise AssertionError(typ)


def _layer_names(raw_layers: list[Any]) -> list[str]:
    """Every layer's name (declared, or `<type>_<n>`), in order: a first pass, so that `inputs` can tell a
    forward reference from an unknown name. Type and name errors are left to the full pass."""
    names, counters = [], {}
    for raw in raw_layers:
        kind = raw.get("type") if isinstance(raw, dict) else None
        lname = raw.get("name") if isinstance(raw, dict) else None
        if lname is None:
            counters[kind] = counters.get(kind, 0) + 1
            lname = f"{kind}_{counters[kind]}"
        names.append(lname)
    return names


def _cycle_through(target: str, start: str, raw_inputs: dict[str, list[str]]) -> list[str] | None:
    """A path start -> ... -> target along the declared inputs (readers to what they read), if any."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        if node == target:
            return path
        if node in seen:
            continue
        seen.add(node)
        for src in raw_inputs.get(node, []):
            stack.append((src, path + [src]))
    return None


def _merge_shape(kind: str, names: tuple[str, ...], shapes: list[tuple[int, ...]], fail) -> tuple[int, ...]:
    if kind == "add":
        for n, sh in zip(names[1:], shapes[1:]):
            if sh != shapes[0]:
                fail("inputs", f"add needs equal shapes; {names[0]!r} gives {shapes[0]} but {n!r} gives {sh}")
        return shapes[0]
    for n, sh in zip(names, shapes):          # concat: (H, W, C) maps of one size, channels stacked
        if len(sh) != 3:
            fail("inputs", f"concat needs (H, W, C) inputs; {n!r} gives {sh}")
        if sh[:2] != shapes[0][:2]:
            fail("inputs", f"concat needs equal height and width; {names[0]!r} gives {shapes[0]} but {n!r} gives {sh}")
    return (*shapes[0][:2], sum(sh[2] for sh in shapes))


def build_model(decl: dict[str, Any], source: str = "<dict>") -> ModelSpec:
    """Validate a declaration (the parsed TOML) and infer every shape. Raises SpecError."""
    mname = decl.get("name", Path(source).stem if source != "<dict>" else "?") if isinstance(decl, dict) else "?"

    def top_fail(msg: str):
        raise SpecError(f"model '{mname}' ({source}): {msg}")

    if not isinstance(decl, dict):
        top_fail("the file must hold a table")
    unknown = set(decl) - {"name", "description", "input_shape", "num_classes", "layers"}
    if unknown:
        top_fail(f"unknown top-level field(s): {', '.join(sorted(unknown))}")
    if not isinstance(mname, str) or not mname:
        top_fail("field 'name' must be a non-empty string")
    shape = decl.get("input_shape")
    if (not isinstance(shape, list) or len(shape) != 3
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in shape)):
        top_fail(f"field 'input_shape' must be [height, width, channels] of positive integers, got {shape!r}")
    ncls = decl.get("num_classes")
    if not isinstance(ncls, int) or isinstance(ncls, bool) or ncls < 2:
        top_fail(f"field 'num_classes' must be an integer >= 2, got {ncls!r}")
    raw_layers = decl.get("layers")
    if not isinstance(raw_layers, list) or not raw_layers:
        top_fail("field 'layers' must be a non-empty array of tables ([[layers]])")

    all_names = _layer_names(raw_layers)
    position = {n: i for i, n in enumerate(all_names)}
    # what each layer reads as written (declared, or the previous layer): the edges a cycle report follows
    raw_inputs = {all_names[i]: (list(r["inputs"]) if isinstance(r, dict) and isinstance(r.get("inputs"), list)
                                 and all(isinstance(v, str) for v in r["inputs"])
                                 else [INPUT if i == 0 else all_names[i - 1]])
                  for i, r in enumerate(raw_layers)}
    shapes: dict[str, tuple[int, ...]] = {INPUT: tuple(shape)}
    flat_of: dict[str, tuple[int, int, int] | None] = {INPUT: None}
    readers: dict[str, list[str]] = {INPUT: []}
    infos: list[LayerInfo] = []
    names: set[str] = set()
    for i, raw in enumerate(raw_layers):
        if not isinstance(raw, dict):
            top_fail(f"layer {i}: must be a table, got {raw!r}")
        kind = raw.get("type")
        lname = raw.get("name")

        def fail(fld: str, msg: str, i=i, kind=kind, lname=lname):
            where = f"layer {i} ({kind})" if lname is None else f"layer {i} '{lname}' ({kind})"
            raise SpecError(f"model '{mname}' ({source}): {where}: field '{fld}': {msg}")

        if kind not in LAYER_FIELDS:
            fail("type", f"unknown layer type {kind!r}; known: {', '.join(LAYER_FIELDS)}")
        fields = LAYER_FIELDS[kind]
        for key in raw:
            if key not in fields and key not in ("type", "name", "inputs"):
                fail(key, f"not a field of {kind}; its fields: {', '.join(fields) or '(none)'}, inputs")
        opts: dict[str, Any] = {}
        for key, (typ, default) in fields.items():
            if key in raw:
                opts[key] = _check_field(kind, key, raw[key], typ, fail)
            elif default is REQUIRED:
                fail(key, "is required")
            else:
                opts[key] = default
        if kind in ("maxpool2d", "avgpool2d") and opts["stride"] is None:
            opts["stride"] = opts["pool"]
        if kind == "dropout" and not 0.0 <= opts["rate"] < 1.0:
            fail("rate", f"must be in [0, 1), got {opts['rate']}")
        if kind == "batchnorm2d":
            if not 0.0 < opts["momentum"] < 1.0:
                fail("momentum", f"must be in (0, 1) (PyTorch convention), got {opts['momentum']}")
            if opts["eps"] <= 0:
                fail("eps", f"must be positive, got {opts['eps']}")
        if kind == "layernorm" and opts["eps"] <= 0:
            fail("eps", f"must be positive, got {opts['eps']}")
        if kind == "leaky_relu" and opts["alpha"] < 0:
            fail("alpha", f"must be >= 0, got {opts['alpha']}")
        lname = all_names[i]
        if not isinstance(lname, str) or not lname.replace("_", "").isalnum():
            fail("name", f"must be letters, digits and '_', got {lname!r}")
        if lname == INPUT:
            fail("name", f"{INPUT!r} is reserved for the model input")
        if lname in names:
            fail("name", f"duplicate layer name {lname!r}")
        names.add(lname)

        # ---- inputs: names of earlier layers (or INPUT); merges read two or more, the rest one
        declared = "inputs" in raw
        if declared:
            ins = raw["inputs"]
            if not isinstance(ins, list) or not ins or not all(isinstance(v, str) for v in ins):
                fail("inputs", f"must be a non-empty list of layer names (or {INPUT!r}), got {ins!r}")
            for src in ins:
                if src == lname:
                    fail("inputs", f"cycle: {lname!r} reads its own output")
                if src in position and position[src] > i:
                    loop = _cycle_through(lname, src, raw_inputs)
                    if loop:
                        fail("inputs", "cycle: " + " -> ".join([lname, *loop]) + " (each reads the next)")
                    fail("inputs", f"{src!r} is declared after this layer (layer {position[src]}); "
                                   "layers are listed in topological order: move it before its readers")
                if src not in shapes:
                    known = [INPUT, *all_names[:i]]
                    fail("inputs", f"unknown name {src!r}; earlier layers: {', '.join(known)}")
            if len(set(ins)) != len(ins):
                fail("inputs", f"names an input twice: {ins}")
            inputs = tuple(ins)
        else:
            inputs = (INPUT,) if i == 0 else (all_names[i - 1],)
        if kind in MERGE_KINDS and len(inputs) < 2:
            fail("inputs", f"{kind} merges two or more inputs; name them, e.g. inputs = [\"a\", \"b\"]")
        if kind not in MERGE_KINDS and len(inputs) != 1:
            fail("inputs", f"{kind} reads one input, got {len(inputs)}: {list(inputs)}")
        for src in inputs:
            readers.setdefault(src, []).append(lname)
        in_shapes = [shapes[src] for src in inputs]
        cur = in_shapes[0]
        spec = LayerSpec(kind, lname, opts, inputs, declared)

        if kind in SPATIAL_KINDS and len(cur) != 3:
            fail("type", f"needs an (H, W, C) input but gets shape {cur}")
        params: list[ParamInfo] = []
        padding = None
        flattened_from = None
        if kind == "conv2d":
            h, w, c = cur
            g, k, f = opts["groups"], opts["kernel"], opts["filters"]
            if c % g:
                fail("groups", f"{g} groups do not divide the {c} input channels")
            if f % g:
                fail("groups", f"{g} groups do not divide the {f} filters")
            if opts["dilation"] > 1 and opts["stride"] > 1:
                fail("dilation", "dilation > 1 with stride > 1: TensorFlow and Keras refuse the combination")
            oh, ow, padding = _window(kind, h, w, k, opts["stride"], opts["padding"], fail, opts["dilation"])
            out = (oh, ow, f)
            # grouped kernel (kH, kW, C_in / groups, C_out); fans as torch and Keras compute them
            params.append(ParamInfo(f"{lname}.kernel", lname, "kernel", (k, k, c // g, f), True,
                                    opts["init"], k * k * (c // g), k * k * f))
            if opts["use_bias"]:
                params.append(ParamInfo(f"{lname}.bias", lname, "bias", (f,), True, "zeros"))
        elif kind in ("maxpool2d", "avgpool2d"):
            h, w, c = cur
            oh, ow, padding = _window(kind, h, w, opts["pool"], opts["stride"], opts["padding"], fail)
            out = (oh, ow, c)
        elif kind in ("batchnorm2d", "layernorm"):
            if flat_of[inputs[0]] is not None:
                fail("inputs", f"{kind} of a flattened map: its per-feature gamma would depend on the framework's "
                               "flatten order; normalise before the flatten")
            c = cur[-1]
            out = cur
            params += [ParamInfo(f"{lname}.gamma", lname, "gamma", (c,), True, "ones"),
                       ParamInfo(f"{lname}.beta", lname, "beta", (c,), True, "zeros")]
            if kind == "batchnorm2d":
                params += [ParamInfo(f"{lname}.running_mean", lname, "running_mean", (c,), False, "zeros"),
                           ParamInfo(f"{lname}.running_var", lname, "running_var", (c,), False, "ones")]
        elif kind == "global_avgpool2d":
            out = (cur[2],)
        elif kind == "flatten":
            out = (math.prod(cur),)
        elif kind == "dense":
            if len(cur) != 1:
                fail("type", f"needs a flat input but gets shape {cur}; add a flatten layer before it")
            n_in = cur[0]
            out = (opts["units"],)
            params.append(ParamInfo(f"{lname}.kernel", lname, "kernel", (n_in, opts["units"]), True,
                                    opts["init"], n_in, opts["units"]))
            if opts["use_bias"]:
                params.append(ParamInfo(f"{lname}.bias", lname, "bias", (opts["units"],), True, "zeros"))
            flattened_from = flat_of[inputs[0]]
        elif kind in MERGE_KINDS:
            out = _merge_shape(kind, inputs, in_shapes, fail)
        else:  # element-wise
            out = cur
        if out and min(out) <= 0:
            fail("type", f"output shape {out} is empty")
        # "this flat vector is a flatten of (H, W, C)", carried through element-wise layers and sums
        if kind == "flatten":
            flat_of[lname] = cur if len(cur) == 3 else None  # type: ignore[assignment]
        elif kind in ELEMENTWISE_KINDS:
            flat_of[lname] = flat_of[inputs[0]]
        elif kind == "add":
            orders = {flat_of[src] for src in inputs}
            if len(orders) > 1:
                fail("inputs", "adds flat vectors in different feature orders (a flatten of "
                               f"{[flat_of[src] for src in inputs]}); frameworks flatten (H, W, C) differently")
            flat_of[lname] = orders.pop()
        else:
            flat_of[lname] = None
        shapes[lname] = out
        infos.append(LayerInfo(i, spec, cur, out, tuple(params), flattened_from, padding,
                               tuple(in_shapes), flat_of[lname]))

    for info in infos[:-1]:
        if not readers.get(info.name):
            raise SpecError(f"model '{mname}' ({source}): layer {info.index} '{info.name}' ({info.kind}): "
                            "field 'name': its output is read by no layer (only the last layer may be unread)")
    if not readers[INPUT]:
        top_fail(f"no layer reads {INPUT!r} (the model input)")
    last = infos[-1]
    if last.kind != "dense" or last.out_shape != (ncls,):
        top_fail(f"layer {len(infos) - 1} ({last.kind}): the last layer must be a dense layer with "
                 f"units = num_classes = {ncls} (the logits), got output shape {last.out_shape}")
    return ModelSpec(mname, str(decl.get("description", "")), tuple(shape), ncls, tuple(infos), source)


def model_names() -> list[str]:
    return sorted(p.stem for p in MODELS_DIR.glob("*.toml"))


def load_model(name_or_path: str | Path) -> ModelSpec:
    """A built-in model by name, or a TOML file by path."""
    p = Path(name_or_path)
    if p.suffix != ".toml":
        p = MODELS_DIR / f"{name_or_path}.toml"
        if not p.exists():
            raise SpecError(f"unknown model {str(name_or_path)!r}; built-in models: {', '.join(model_names())}"
                            " (or give the path of a .toml file)")
    if not p.exists():
        raise SpecError(f"model file {p}: no such file")
    try:
        decl = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise SpecError(f"model file {p}: not valid TOML: {e}") from None
    return build_model(decl, str(p))


def summary(model: ModelSpec) -> str:
    lines = [f"{model.name}: input {model.input_shape} -> {model.num_classes} classes"]
    for l in model.layers:
        ps = ", ".join(f"{p.role}{list(p.shape)}" for p in l.params)
        src = f" <- {', '.join(l.inputs)}" if model.is_graph else ""
        lines.append(f"  {l.index:2d} {l.name:<14} {l.kind:<16} {str(l.in_shape):<14} -> {str(l.out_shape):<14} {ps}{src}")
    n = sum(math.prod(p.shape) for p in model.trainable)
    lines.append(f"  trainable parameters: {n}")
    return "\n".join(lines)


__all__ = ["SpecError", "ModelSpec", "INPUT", "BASE_LAYER_KINDS", "MERGE_KINDS", "LayerInfo", "LayerSpec", "ParamInfo", "load_model", "build_model",
           "model_names", "same_padding", "summary", "asdict", "field"]
