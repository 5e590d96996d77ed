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

import json
import math
import tomllib
from pathlib import Path
from typing import Any

from .documents import parse_document

# the data types (algorithms/model.py), re-exported: algorithms.spec is where every caller finds them
from .model import (BASE_LAYER_KINDS, ELEMENTWISE_KINDS, GELU_APPROXIMATIONS, INITS, INPUT,  # noqa: F401
                    LAYER_FIELDS, MERGE_KINDS, OMITTED_AT_DEFAULT, PADDINGS, REQUIRED, SPATIAL_KINDS, LayerInfo,
                    LayerSpec, ModelSpec, ParamInfo, SpecError, default_inputs, keep_output, layer_input)

MODELS_DIR = Path(__file__).parent / "models"


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
    """A built-in model by name, or a model file by path: TOML (what users write) or JSON (a declaration as
    ModelSpec.to_dict gives it, e.g. a run manifest's `spec`)."""
    p = Path(name_or_path)
    if p.suffix not in (".toml", ".json"):
        p = MODELS_DIR / f"{name_or_path}.toml"
        if not p.exists():
            raise SpecError(f"unknown model {str(name_or_path)!r}; built-in models: {', '.join(model_names())}"
                            " (or give the path of a .toml file)")
    if not p.exists():
        raise SpecError(f"model file {p}: no such file")
    fmt, parse = ("JSON", json.loads) if p.suffix == ".json" else ("TOML", tomllib.loads)
    decl = parse_document(p, parse, bad=lambda e: SpecError(f"model file {p}: not valid {fmt}: {e}"))
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
           "model_names", "same_padding", "summary", "LAYER_FIELDS", "REQUIRED", "default_inputs", "OMITTED_AT_DEFAULT"]
