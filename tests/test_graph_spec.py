"""The graph spec: `inputs`, merges, grouped/dilated convolutions and the new kinds; validator errors in one
line naming model, layer and field; shape inference of the graph models; straight-line models unchanged."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from algorithms.params import init_params, params_hash
from algorithms.spec import BASE_LAYER_KINDS, LAYER_FIELDS, SpecError, build_model, load_model

GRAPH_MODELS = ("resnet_tiny", "mobilenet_tiny", "convnext_tiny")
TAIL = [{"type": "flatten", "name": "flat"}, {"type": "dense", "name": "logits", "units": 10}]


def decl(*layers, shape=(8, 8, 4)):
    return {"name": "g", "input_shape": list(shape), "num_classes": 10, "layers": [*layers, *TAIL]}


def conv(name, filters=4, kernel=3, **kw):
    return {"type": "conv2d", "name": name, "filters": filters, "kernel": kernel, "padding": "same", **kw}


# the straight-line models' spec hashes and canonical weights (seed 0) from before graphs existed (commit fe8c1a3)
BEFORE_GRAPHS = {"cnn2d_2conv_2fc": ("f7479707ea797381", "26d13c3caf16c85c"),
                 "cnn2d_3conv_3fc": ("60c1d36d8f2656e1", "6ea6940a4c55f4c5"),
                 "cnn2d_hard": ("814b43480bb7d867", "676aa2544017a5eb")}


@pytest.mark.parametrize("name", sorted(BEFORE_GRAPHS))
def test_straight_line_models_keep_spec_hash_and_weights(name):
    m = load_model(name)
    assert (m.hash(), params_hash(init_params(m, 0))) == BEFORE_GRAPHS[name]
    assert not m.is_graph and m.required_features() <= BASE_LAYER_KINDS
    assert all("inputs" not in l and "groups" not in l for l in m.to_dict()["layers"])


@pytest.mark.parametrize("layers,needle", [
    ([conv("a", inputs=["b"]), {"type": "relu", "name": "b", "inputs": ["a"]}],
     "layer 0 'a' (conv2d): field 'inputs': cycle: a -> b -> a"),
    ([{"type": "relu", "name": "a", "inputs": ["a"]}], "layer 0 'a' (relu): field 'inputs': cycle: 'a' reads its own output"),
    ([{"type": "relu", "name": "a", "inputs": ["c"]}, {"type": "relu", "name": "b"}, {"type": "relu", "name": "c"}],
     "layer 0 'a' (relu): field 'inputs': cycle: a -> c -> b -> a"),      # through the default edges
    ([{"type": "relu", "name": "a", "inputs": ["c"]}, {"type": "relu", "name": "c", "inputs": ["input"]},
      {"type": "add", "name": "s", "inputs": ["a", "c"]}],
     "layer 0 'a' (relu): field 'inputs': 'c' is declared after this layer"),
    ([{"type": "relu", "name": "a"}, {"type": "add", "name": "s", "inputs": ["a", "nope"]}],
     "layer 1 's' (add): field 'inputs': unknown name 'nope'"),
    ([conv("a", filters=8), {"type": "add", "name": "s", "inputs": ["a", "input"]}],
     "layer 1 's' (add): field 'inputs': add needs equal shapes; 'a' gives (8, 8, 8) but 'input' gives (8, 8, 4)"),
    ([conv("a", stride=2), {"type": "concat", "name": "c", "inputs": ["a", "input"]}],
     "layer 1 'c' (concat): field 'inputs': concat needs equal height and width"),
    ([conv("a", filters=6, groups=3)], "layer 0 'a' (conv2d): field 'groups': 3 groups do not divide the 4 input channels"),
    ([conv("a", filters=6, groups=4)], "layer 0 'a' (conv2d): field 'groups': 4 groups do not divide the 6 filters"),
    ([{"type": "relu", "name": "a"}, {"type": "relu", "name": "b", "inputs": ["input"]}],
     "layer 0 'a' (relu): field 'name': its output is read by no layer"),
    ([{"type": "add", "name": "s", "inputs": ["input"]}], "layer 0 's' (add): field 'inputs': add merges two or more inputs"),
    ([{"type": "relu", "name": "a"}, {"type": "relu", "name": "b", "inputs": ["a", "input"]}],
     "layer 1 'b' (relu): field 'inputs': relu reads one input, got 2"),
    ([{"type": "relu", "name": "input"}], "field 'name': 'input' is reserved"),
    ([{"type": "relu", "name": "a", "inputs": "input"}], "field 'inputs': must be a non-empty list"),
    ([{"type": "leaky_relu", "name": "a"}], "layer 0 'a' (leaky_relu): field 'alpha': is required"),
    ([{"type": "gelu", "name": "a", "approximate": "erf"}], "field 'approximate': must be one of none, tanh"),
    ([{"type": "layernorm", "name": "a"}], "layer 0 'a' (layernorm): field 'eps': is required"),
    ([conv("a", kernel=5, dilation=2, padding="valid")], "field 'kernel': window 9 (dilated) is larger than the input 8x8"),
    ([conv("a", dilation=2, stride=2)], "layer 0 'a' (conv2d): field 'dilation': dilation > 1 with stride > 1"),
])
def test_graph_validation_one_line_naming_model_layer_field(layers, needle):
    with pytest.raises(SpecError) as e:
        build_model(decl(*layers))
    msg = str(e.value)
    assert needle in msg and msg.startswith("model 'g'") and "\n" not in msg


def test_bad_graph_spec_exits_2_with_one_line(tmp_path):
    bad = tmp_path / "cyclic.toml"
    bad.write_text('name = "cyclic"\ninput_shape = [8, 8, 1]\nnum_classes = 10\n'
                   '[[layers]]\ntype = "relu"\nname = "a"\ninputs = ["b"]\n'
                   '[[layers]]\ntype = "relu"\nname = "b"\ninputs = ["a"]\n'
                   '[[layers]]\ntype = "flatten"\n[[layers]]\ntype = "dense"\nunits = 10\n')
    r = subprocess.run([sys.executable, "-m", "harness", "run", "-m", str(bad), "-b", "numpy", "--steps", "1",
                        "--out", str(tmp_path / "out")], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "model 'cyclic'" in lines[0] and "layer 0 'a' (relu): field 'inputs': cycle" in lines[0]


def test_merges_grouped_dilated_shapes_and_params():
    m = build_model(decl(conv("a", filters=8, groups=2, use_bias=False),
                         conv("dw", filters=8, groups=8, dilation=2, inputs=["a"]),
                         {"type": "concat", "name": "cat", "inputs": ["a", "dw", "input"]},
                         {"type": "layernorm", "name": "ln", "eps": 1e-6},
                         {"type": "gelu", "name": "ge", "approximate": "tanh"},
                         {"type": "leaky_relu", "name": "lr", "alpha": 0.2, "inputs": ["ge"]},
                         {"type": "add", "name": "s", "inputs": ["lr", "ge"]}))
    assert m.layer("a").params[0].shape == (3, 3, 2, 8)           # (kH, kW, C_in / groups, C_out)
    assert m.layer("a").params[0].fan_in == 9 * 2 and m.layer("a").params[0].fan_out == 9 * 8
    dw = m.layer("dw")
    assert dw.params[0].shape == (3, 3, 1, 8) and dw.padding == ((2, 2), (2, 2)) and dw.out_shape == (8, 8, 8)
    cat = m.layer("cat")
    assert cat.inputs == ("a", "dw", "input") and cat.in_shapes == ((8, 8, 8), (8, 8, 8), (8, 8, 4))
    assert cat.out_shape == (8, 8, 20)
    assert [p.role for p in m.layer("ln").params] == ["gamma", "beta"] and m.layer("ln").params[0].shape == (20,)
    assert m.layer("logits").flattened_from == (8, 8, 20)
    assert m.is_graph and {"concat", "add", "layernorm", "conv2d:groups", "conv2d:dilation"} <= m.required_features()
    # the normalised declaration round-trips (the job file rebuilds the spec from it) with the same hash
    again = build_model(m.to_dict())
    assert again.hash() == m.hash() and [l.inputs for l in again.layers] == [l.inputs for l in m.layers]
    assert "inputs" not in m.to_dict()["layers"][0] and "inputs" not in m.to_dict()["layers"][1]  # ["a"] is the default
    assert m.to_dict()["layers"][2]["inputs"] == ["a", "dw", "input"]


def test_flattened_vectors_track_order_through_the_graph():
    m = build_model({"name": "f", "input_shape": [4, 4, 2], "num_classes": 10, "layers": [
        {"type": "flatten", "name": "flat"}, {"type": "relu", "name": "r"},
        {"type": "add", "name": "s", "inputs": ["r", "flat"]}, {"type": "dense", "name": "fc", "units": 10}]})
    assert m.layer("fc").flattened_from == (4, 4, 2) and m.layer("s").flat_of == (4, 4, 2)
    with pytest.raises(SpecError, match="layer 3 'bad' \\(add\\): field 'inputs': adds flat vectors in different"):
        build_model({"name": "f", "input_shape": [4, 4, 2], "num_classes": 32, "layers": [
            {"type": "flatten", "name": "flat"}, {"type": "dense", "name": "d", "units": 32},
            {"type": "relu", "name": "r", "inputs": ["flat"]},
            {"type": "add", "name": "bad", "inputs": ["r", "d"]}, {"type": "dense", "name": "fc", "units": 32}]})


@pytest.mark.parametrize("name,shapes", [
    ("resnet_tiny", {"stem": (32, 32, 16), "block1_add": (32, 32, 16), "block2_proj_bn": (16, 16, 32),
                     "block2_add": (16, 16, 32), "block3_add": (8, 8, 64), "gap": (64,), "fc": (10,)}),
    ("mobilenet_tiny", {"stem": (16, 16, 16), "ir1_expand": (16, 16, 64), "ir1_dw": (8, 8, 64),
                        "ir2_add": (8, 8, 24), "ir3_dw": (4, 4, 96), "fc": (10,)}),
    ("convnext_tiny", {"stem": (16, 16, 24), "stage1_pw1": (16, 16, 96), "stage1_add": (16, 16, 24),
                       "down": (8, 8, 48), "stage2_add": (8, 8, 48), "head_ln": (48,), "fc": (10,)}),
])
def test_graph_models_shapes(name, shapes):
    m = load_model(name)
    assert m.input_shape == (32, 32, 3) and m.num_classes == 10 and m.is_graph
    for layer, shape in shapes.items():
        assert m.layer(layer).out_shape == shape, layer
    if name == "resnet_tiny":      # the stride-2 projection reads the block input, TF SAME pads bottom/right
        assert m.layer("block2_proj").inputs == ("block1_out",)
        assert m.layer("block2_conv1").padding == ((0, 1), (0, 1))
        assert m.layer("block2_add").inputs == ("block2_bn2", "block2_proj_bn")
    if name == "mobilenet_tiny":
        dw = m.layer("ir1_dw")
        assert dw.spec["groups"] == 64 and dw.params[0].shape == (3, 3, 1, 64)
        assert not any(l.kind == "add" for l in m.layers if l.name.startswith(("ir1", "ir3")))
    if name == "convnext_tiny":
        assert m.layer("stage1_dw").params[0].shape == (7, 7, 1, 24)
        assert m.layer("stage1_add").inputs == ("stem_ln", "stage1_pw2")


@pytest.mark.parametrize("name", GRAPH_MODELS)
def test_graph_model_weights_deterministic_in_spec_order(name):
    m = load_model(name)
    a, b = init_params(m, 0), init_params(m, 0)
    assert params_hash(a) == params_hash(b) and list(a) == [p.name for p in m.params]
    assert all(np.all(a[p.name] == 1) for p in m.params if p.role in ("gamma", "running_var"))
    assert build_model(m.to_dict(), m.source).hash() == m.hash()


def test_every_kind_has_fields_declared():
    assert {"add", "concat", "leaky_relu", "gelu", "silu", "sigmoid", "relu6", "layernorm"} <= set(LAYER_FIELDS)
    assert {"groups", "dilation"} <= set(LAYER_FIELDS["conv2d"])


def test_harness_refuses_a_kind_a_backend_does_not_declare(monkeypatch, tmp_path):
    """Before any process starts: one line naming backend, kind, model and the backends that can."""
    from harness import runner
    from harness.errors import BackendFailed, BadInput, CannotLower
    fake = {"old": {"layer_kinds": sorted(BASE_LAYER_KINDS)},
            "new": {"layer_kinds": sorted(BASE_LAYER_KINDS | {"add", "conv2d:groups", "relu6"})}}
    monkeypatch.setattr(runner, "backend_info", lambda: fake)
    m = load_model("mobilenet_tiny")
    runner.check_lowers("new", m)
    with pytest.raises(CannotLower) as e:
        runner.check_lowers("old", m)
    assert str(e.value) == ("old: cannot lower layer kind 'add', 'conv2d:groups', 'relu6' (model mobilenet_tiny); "
                            "supported by: new")
    assert isinstance(e.value, BadInput) and isinstance(e.value, BackendFailed) and e.value.unsupported
