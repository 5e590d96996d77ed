"""The framework-neutral CNN spec: layers as plain data, validated on load, with shapes inferred.

Nothing here imports a deep-learning framework. Every wrapper lowers the same `ModelSpec`;
the canonical layout (see `docs/canonical-layout.md`) is:

* activations NHWC; a flatten reads features in (H, W, C) order;
* conv kernel (kH, kW, C_in, C_out); dense kernel (in, out); biases (out,);
* BatchNorm: gamma, beta, running_mean, running_var (running_var holds the *unbiased*
  batch variance, the PyTorch convention), momentum in the PyTorch convention:
  ``running = (1 - momentum) * running + momentum * batch_stat``.
* 'same' padding is TF/XLA 'SAME': out = ceil(in / stride), the odd pixel padded bottom/right.
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

LAYER_FIELDS: dict[str, dict[str, tuple[type, Any]]] = {
    "conv2d": {"filters": (int, REQUIRED), "kernel": (int, REQUIRED), "stride": (int, 1),
               "padding": (str, "valid"), "use_bias": (bool, True), "init": (str, "he_normal")},
    "maxpool2d": {"pool": (int, REQUIRED), "stride": (int, None), "padding": (str, "valid")},
    "avgpool2d": {"pool": (int, REQUIRED), "stride": (int, None), "padding": (str, "valid")},
    "relu": {},
    "tanh": {},
    "batchnorm2d": {"momentum": (float, 0.1), "eps": (float, 1e-5)},
    "dropout": {"rate": (float, REQUIRED)},
    "flatten": {},
    "dense": {"units": (int, REQUIRED), "use_bias": (bool, True), "init": (str, "he_normal")},
    "global_avgpool2d": {},
}
SPATIAL_KINDS = {"conv2d", "maxpool2d", "avgpool2d", "batchnorm2d", "global_avgpool2d"}


@dataclass(frozen=True)
class LayerSpec:
    """One layer as declared, with defaults filled in."""
    kind: str
    name: str
    options: dict[str, Any]

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

    def to_dict(self) -> dict[str, Any]:
        """The declaration, normalised (defaults filled): what the spec hash covers."""
        return {"name": self.name, "input_shape": list(self.input_shape),
                "num_classes": self.num_classes,
                "layers": [{"type": l.kind, "name": l.name, **l.spec.options} for l in self.layers]}

    def hash(self) -> str:
        blob = json.dumps(self.to_dict(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


# --------------------------------------------------------------------------- shape helpers
def same_padding(size: int, kernel: int, stride: int) -> tuple[int, int, int]:
    """TF/XLA 'SAME': returns (out, pad_before, pad_after); the odd pixel goes after."""
    out = math.ceil(size / stride)
    total = max((out - 1) * stride + kernel - size, 0)
    return out, total // 2, total - total // 2


def valid_size(size: int, kernel: int, stride: int) -> int:
    return (size - kernel) // stride + 1


def _window(layer: str, h: int, w: int, k: int, s: int, padding: str, fail):
    if padding == "same":
        oh, t, b = same_padding(h, k, s)
        ow, l_, r = same_padding(w, k, s)
        return oh, ow, ((t, b), (l_, r))
    if k > h or k > w:
        fail("kernel" if layer == "conv2d" else "pool",
             f"window {k} is larger than the input {h}x{w} with padding 'valid'")
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
        allowed = {"padding": PADDINGS, "init": INITS}.get(key)
        if allowed and value not in allowed:
            fail(key, f"must be one of {', '.join(allowed)}, got {value!r}")
        return value
    raise AssertionError(typ)


def build_model(decl: dict[str, Any], source: str = "<dict>") -> ModelSpec:
    """Validate a declaration (the parsed TOML) and infer every shape. Raises SpecError."""
    mname = decl.get("name", Path(source).stem if source != "<dict>" else "?")

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

    cur: tuple[int, ...] = tuple(shape)
    flat_src: tuple[int, int, int] | None = None
    infos: list[LayerInfo] = []
    names: set[str] = set()
    counters: dict[str, int] = {}
    for i, raw in enumerate(raw_layers):
        if not isinstance(raw, dict):
            top_fail(f"layer {i}: must be a table, got {raw!r}")
        kind = raw.get("type")
        lname = raw.get("name")

        def fail(fld: str, msg: str, i=i, kind=kind):
            raise SpecError(f"model '{mname}' ({source}): layer {i} ({kind}): field '{fld}': {msg}")

        if kind not in LAYER_FIELDS:
            fail("type", f"unknown layer type {kind!r}; known: {', '.join(LAYER_FIELDS)}")
        fields = LAYER_FIELDS[kind]
        for key in raw:
            if key not in fields and key not in ("type", "name"):
                fail(key, f"not a field of {kind}; its fields: {', '.join(fields) or '(none)'}")
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
        if lname is None:
            counters[kind] = counters.get(kind, 0) + 1
            lname = f"{kind}_{counters[kind]}"
        if not isinstance(lname, str) or not lname.replace("_", "").isalnum():
            fail("name", f"must be letters, digits and '_', got {lname!r}")
        if lname in names:
            fail("name", f"duplicate layer name {lname!r}")
        names.add(lname)
        spec = LayerSpec(kind, lname, opts)

        if kind in SPATIAL_KINDS and len(cur) != 3:
            fail("type", f"needs an (H, W, C) input but gets shape {cur}")
        params: list[ParamInfo] = []
        padding = None
        flattened_from = None
        if kind == "conv2d":
            h, w, c = cur
            oh, ow, padding = _window(kind, h, w, opts["kernel"], opts["stride"], opts["padding"], fail)
            k = opts["kernel"]
            out = (oh, ow, opts["filters"])
            params.append(ParamInfo(f"{lname}.kernel", lname, "kernel", (k, k, c, opts["filters"]), True,
                                    opts["init"], k * k * c, k * k * opts["filters"]))
            if opts["use_bias"]:
                params.append(ParamInfo(f"{lname}.bias", lname, "bias", (opts["filters"],), True, "zeros"))
        elif kind in ("maxpool2d", "avgpool2d"):
            h, w, c = cur
            oh, ow, padding = _window(kind, h, w, opts["pool"], opts["stride"], opts["padding"], fail)
            out = (oh, ow, c)
        elif kind == "batchnorm2d":
            c = cur[2]
            out = cur
            params += [ParamInfo(f"{lname}.gamma", lname, "gamma", (c,), True, "ones"),
                       ParamInfo(f"{lname}.beta", lname, "beta", (c,), True, "zeros"),
                       ParamInfo(f"{lname}.running_mean", lname, "running_mean", (c,), False, "zeros"),
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
            flattened_from = flat_src
        else:  # relu, tanh, dropout: element-wise
            out = cur
        if out and min(out) <= 0:
            fail("type", f"output shape {out} is empty")
        # track "this flat vector is a flatten of (H, W, C)" through element-wise layers
        if kind == "flatten":
            flat_src = cur if len(cur) == 3 else None  # type: ignore[assignment]
        elif kind not in ("relu", "tanh", "dropout"):
            flat_src = None
        infos.append(LayerInfo(i, spec, cur, out, tuple(params), flattened_from, padding))
        cur = out

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
        lines.append(f"  {l.index:2d} {l.name:<14} {l.kind:<16} {str(l.in_shape):<14} -> {str(l.out_shape):<14} {ps}")
    n = sum(math.prod(p.shape) for p in model.trainable)
    lines.append(f"  trainable parameters: {n}")
    return "\n".join(lines)


__all__ = ["SpecError", "ModelSpec", "LayerInfo", "LayerSpec", "ParamInfo", "load_model", "build_model",
           "model_names", "same_padding", "summary", "asdict", "field"]
