"""The spec: validation errors name model, layer and field; shapes inferred without a framework."""
from __future__ import annotations

import subprocess
import sys

import pytest

from algorithms.spec import SpecError, build_model, load_model, model_names, same_padding


def decl(*layers, **top):
    d = {"name": "m", "input_shape": [8, 8, 1], "num_classes": 10, "layers": list(layers)}
    d.update(top)
    return d


DENSE10 = {"type": "dense", "units": 10}


def test_builtin_models_load_and_shapes():
    assert {"cnn2d_2conv_2fc", "cnn2d_3conv_3fc", "cnn2d_hard"} <= set(model_names())
    m = load_model("cnn2d_2conv_2fc")
    fc1 = next(l for l in m.layers if l.name == "fc1")
    assert fc1.flattened_from == (4, 4, 32)
    assert fc1.params[0].shape == (512, 64)
    hard = load_model("cnn2d_hard")
    conv2 = next(l for l in hard.layers if l.name == "conv2")
    assert conv2.out_shape == (4, 4, 32) and conv2.padding == ((0, 1), (0, 1))   # TF SAME: odd pixel after
    pool3 = next(l for l in hard.layers if l.name == "pool3")
    assert pool3.in_shape == (3, 3, 64) and pool3.out_shape == (1, 1, 64)   # floor, where ceil would give 2x2
    assert hard.has("batchnorm2d") and hard.has("dropout") and hard.has("avgpool2d")


def test_same_padding_is_tf_same():
    assert same_padding(8, 3, 2) == (4, 0, 1)
    assert same_padding(8, 3, 1) == (8, 1, 1)
    assert same_padding(5, 2, 2) == (3, 0, 1)
    assert same_padding(4, 1, 2) == (2, 0, 0)


@pytest.mark.parametrize("layers,needle", [
    ([{"type": "conv3d"}, DENSE10], "layer 0 (conv3d): field 'type': unknown layer type"),
    ([{"type": "conv2d", "kernel": 3}, {"type": "flatten"}, DENSE10], "layer 0 (conv2d): field 'filters': is required"),
    ([{"type": "conv2d", "filters": -3, "kernel": 3}, DENSE10], "field 'filters': must be positive"),
    ([{"type": "conv2d", "filters": 4, "kernel": 9}, {"type": "flatten"}, DENSE10],
     "layer 0 (conv2d): field 'kernel': window 9 is larger than the input 8x8"),
    ([{"type": "conv2d", "filters": 4, "kernel": 3, "padding": "full"}, DENSE10], "field 'padding': must be one of"),
    ([{"type": "conv2d", "filters": 4, "kernel": 3, "colour": 1}, DENSE10], "field 'colour': not a field of conv2d"),
    ([{"type": "dense", "units": 10}], "layer 0 (dense): field 'type': needs a flat input"),
    ([{"type": "flatten"}, {"type": "batchnorm2d"}, DENSE10], "layer 1 (batchnorm2d): field 'type': needs an (H, W, C)"),
    ([{"type": "flatten"}, {"type": "dropout", "rate": 1.5}, DENSE10], "layer 1 (dropout): field 'rate'"),
    ([{"type": "flatten"}, {"type": "dense", "units": 7}], "the last layer must be a dense layer with units = num_classes = 10"),
    ([{"type": "flatten", "name": "a"}, {"type": "dense", "units": 10, "name": "a"}], "duplicate layer name"),
])
def test_validation_names_model_layer_field(layers, needle):
    with pytest.raises(SpecError) as e:
        build_model(decl(*layers))
    assert needle in str(e.value)
    assert str(e.value).startswith("model 'm'")


def test_bad_toplevel_fields():
    with pytest.raises(SpecError, match="input_shape"):
        build_model(decl({"type": "flatten"}, DENSE10, input_shape=[8, 8]))
    with pytest.raises(SpecError, match="num_classes"):
        build_model(decl({"type": "flatten"}, DENSE10, num_classes=1))
    with pytest.raises(SpecError, match="unknown top-level"):
        build_model(decl({"type": "flatten"}, DENSE10, optimizer="adam"))


def test_malformed_and_unknown_files(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("name = 'x'\n[[layers]\n")
    with pytest.raises(SpecError, match="not valid TOML"):
        load_model(bad)
    with pytest.raises(SpecError, match="no such file"):
        load_model(tmp_path / "nope.toml")
    with pytest.raises(SpecError, match="unknown model 'nope'"):
        load_model("nope")


def test_hash_is_stable_and_sensitive():
    a = load_model("cnn2d_2conv_2fc")
    assert a.hash() == load_model("cnn2d_2conv_2fc").hash()
    d = a.to_dict()
    d["layers"][0]["filters"] = 17
    assert build_model(d).hash() != a.hash()


def test_spec_imports_no_framework():
    code = ("import sys, algorithms.spec, algorithms.params, algorithms.data, algorithms.optim, harness.runner, "
            "harness.cli, harness.probes\n"
            "bad = [m for m in ('torch', 'jax', 'tensorflow', 'keras') if m in sys.modules]\n"
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
