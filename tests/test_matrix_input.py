"""Bad matrix input (issue 7): an unknown model, backend or optimizer, duplicate entries, an impossible
device count -> one clear error naming the entry, exit 2, nothing run -- for `duipai matrix`,
`duipai all`, `duipai check` and `duipai baseline save`."""
from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import ROOT, duipai_in_process

HEAD = 'models = ["cnn2d_2conv_2fc"]\nbackends = ["torch"]\nsteps = 5\n'
MODEL_FILE = ROOT / "algorithms" / "models" / "cnn2d_2conv_2fc.toml"

CASES = {
    "unknown_model": ('models = ["cnn2d_nope"]\nbackends = ["torch"]\n', "models: 'cnn2d_nope': unknown model"),
    "unknown_backend": ('models = ["cnn2d_2conv_2fc"]\nbackends = ["torch", "mxnet"]\n',
                        "backends: unknown backend 'mxnet'"),
    "unknown_reference": (HEAD + 'reference = "caffe"\n', "reference: unknown backend 'caffe'"),
    "unknown_optimizer": (HEAD + 'optimizers = ["momentum", "adamax"]\n', "optimizers: unknown optimizer 'adamax'"),
    "duplicate_backend": ('models = ["cnn2d_2conv_2fc"]\nbackends = ["torch", "jax", "torch"]\n',
                          "field 'backends': duplicate entries ['torch']"),
    "duplicate_device": (HEAD + "devices = [1, 2, 1]\n", "field 'devices': duplicate entries [1]"),
    "duplicate_model_by_path": (f'models = ["cnn2d_2conv_2fc", "{MODEL_FILE}"]\nbackends = ["torch"]\n',
                                "are both model 'cnn2d_2conv_2fc' (duplicate entries)"),
    "devices_not_dividing_batch": (HEAD + "devices = [1, 3]\n", "devices: 3 is impossible with batch_size 64"),
    "devices_over_batch": (HEAD + "batch_size = 8\ndevices = [16]\n", "devices: 16 is impossible with batch_size 8"),
    "devices_zero": (HEAD + "devices = [0]\n", "devices: 0 is impossible"),
    "empty_devices": (HEAD + "devices = []\n", "field 'devices' must not be empty"),
    "unknown_fault": (HEAD + 'faults = ["off_by_two"]\n', "faults: unknown fault 'off_by_two'"),
    "bad_steps": ('models = ["cnn2d_2conv_2fc"]\nbackends = ["torch"]\nsteps = 0\n', "field 'steps' must be >= 1"),
    "negative_envelope": (HEAD + "envelope_k = -1\n", "field 'envelope_k' must be >= 0"),
    "timeout_nan": (HEAD + "timeout_s = nan\n", "field 'timeout_s' must be a finite number > 0, got nan"),
    "timeout_inf": (HEAD + "timeout_s = inf\n", "field 'timeout_s' must be a finite number > 0, got inf"),
    "hparam_set_by_field": (HEAD + "[hparams]\nseed = 3\n", "[hparams]: 'seed' is set by the matrix field 'seeds'"),
    "unknown_hparam": (HEAD + "[hparams]\nlearning_rate = 0.1\n", "[hparams]: unknown hyper-parameter 'learning_rate'"),
    "unknown_field": (HEAD + "backend = 'torch'\n", "unknown field(s) backend"),
    "wrong_type": ('models = "cnn2d_2conv_2fc"\nbackends = ["torch"]\n', "field 'models' must be a list of str"),
    "not_toml": (HEAD + "devices = [1,\n", "not valid TOML"),
    "name_out_of_the_results": ('name = "../../escaped"\n' + HEAD,
                                "field 'name' must be a plain folder name (no '/', not '.' or '..'), got '../../escaped'"),
}

# valid matrices that one command cannot use: `duipai all` compares against the envelope (check's bitwise mode needs none)
COMMAND_CASES = {"no_envelope_for_all": (HEAD + "envelope_k = 0\n", "field 'envelope_k' must be >= 1 for `duipai all`"),
                 # found only when the runs are prepared: still the matrix file first, then the data file
                 "missing_data_file": (HEAD + 'data = "no_such_train.csv"\n', "no_such_train.csv: no such data file")}


@pytest.mark.parametrize("case", sorted(CASES))
def test_load_matrix_names_the_entry(case, tmp_path):
    from harness.matrix import load_matrix
    from harness.errors import BadInput
    text, message = CASES[case]
    p = tmp_path / f"{case}.toml"
    p.write_text(text)
    with pytest.raises(BadInput) as e:
        load_matrix(p)
    assert str(e.value).startswith(f"matrix {p}: ") and message in str(e.value)


@pytest.mark.parametrize("command, case", [
    (["matrix"], "unknown_model"), (["all", "--matrix"], "devices_not_dividing_batch"),
    (["check", "--matrix"], "unknown_backend"), (["check", "--matrix"], "duplicate_backend"),
    (["baseline", "save", "--matrix"], "unknown_optimizer"), (["all", "--matrix"], "no_envelope_for_all"),
    (["matrix"], "missing_data_file"), (["all", "--matrix"], "missing_data_file"),
])
def test_commands_exit_2_and_run_nothing(command, case, tmp_path, monkeypatch, capsys):
    """In the test process (the matrix is refused before any backend would start); tests/test_user_paths.py
    runs the matrix commands as real processes."""
    text, message = {**CASES, **COMMAND_CASES}[case]
    p = tmp_path / f"{case}.toml"
    p.write_text(text)
    out = tmp_path / "results"
    extra = ["--baselines", str(tmp_path / "bl")] if command[0] in ("check", "baseline") else []
    code, stdout, stderr = duipai_in_process([*command, str(p), "--out", str(out), *extra], monkeypatch, capsys)
    assert code == 2, stdout + stderr
    line = stderr.strip().splitlines()
    assert len(line) == 1 and line[0].startswith(f"duipai: error: matrix {p}: ") and message in line[0]
    assert not out.exists() and not (tmp_path / "bl").exists()


def test_ci_matrix_is_valid():
    from harness.matrix import expand, load_matrix
    m = load_matrix("ci")
    # small enough for CI (one run per backend configuration, 30 steps), and covering all six
    assert m.name == "ci" and m.steps <= 50 and len(expand(m)) <= 12
    from harness.runner import backend_info
    assert sorted(m.backends) == sorted(backend_info())


def test_graph_matrix_covers_the_graph_models_at_their_shape():
    """`duipai all --matrix graph`: every graph model, every framework backend (the arbiter probes, it does not
    train), dp 1 and 2, each on its own built-in data."""
    from algorithms.data import load_data
    from algorithms.spec import load_model
    from harness.matrix import expand, load_matrix
    from harness.runner import backend_info
    m = load_matrix("graph")
    assert m.arbiter and sorted(m.backends) == sorted(set(backend_info()) - {m.arbiter}) and m.devices == [1, 2]
    graph = ["resnet_tiny", "mobilenet_tiny", "convnext_tiny"]
    assert m.models == graph
    for name in m.models:                      # 'digits' resolves to the model's own 32x32x3 digits
        shape = load_model(name).input_shape
        assert load_data(m.data, image_shape=shape).image_shape == tuple(shape)
    runs = [e for e in expand(m) if e.role == "run"]
    assert {(e.cfg.model, e.cfg.devices) for e in runs} == {(n, d) for n in graph for d in (1, 2)}


def test_residual_matrix_is_one_short_residual_model_in_every_framework_backend():
    """`duipai all --matrix residual`: resnet_tiny (the residual model) short enough for a quick look, every framework
    backend at dp 1 with the reference's envelope, on its own 32x32x3 digits."""
    from algorithms.spec import load_model
    from harness.matrix import expand, load_matrix
    from harness.runner import backend_info
    m = load_matrix("residual")
    assert m.models == ["resnet_tiny"] and m.devices == [1] and m.envelope_k >= 3
    assert m.arbiter and sorted(m.backends) == sorted(set(backend_info()) - {m.arbiter})
    assert any(l.kind == "add" for l in load_model("resnet_tiny").layers)
    roles = [e.role for e in expand(m)]
    assert roles.count("run") == len(m.backends) and roles.count("envelope") == m.envelope_k + m.envelope_fp64


def test_missing_baselines_are_bad_input(tmp_path):
    p = tmp_path / "m.toml"
    p.write_text('name = "nobase"\n' + HEAD)
    r = subprocess.run([sys.executable, "-m", "harness.cli", "check", "--matrix", str(p), "--out",
                        str(tmp_path / "results"), "--baselines", str(tmp_path / "bl")],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2
    assert f"{tmp_path / 'bl' / 'nobase' / 'index.json'}: missing" in r.stderr
    assert "duipai baseline save --matrix nobase" in r.stderr
    assert not (tmp_path / "results").exists()


def test_files_named_in_a_matrix_are_found_beside_it_from_any_folder(tmp_path, monkeypatch):
    """A user's project (matrix, model file, data files) used from its parent folder: the relative paths in the
    file are the matrix file's, as in any project file; a path found only from the working directory stays as
    written (where it was looked up before)."""
    from harness.matrix import expand, load_matrix
    proj = tmp_path / "proj"
    (proj / "models").mkdir(parents=True)
    (proj / "data").mkdir()
    (proj / "models" / "mine.toml").write_text(MODEL_FILE.read_text().replace('name = "cnn2d_2conv_2fc"',
                                                                             'name = "mine"'))
    for f in ("train.csv", "test.csv"):
        (proj / "data" / f).write_text("label,p0\n1,0\n")
    (proj / "m.toml").write_text('models = ["models/mine.toml", "cnn2d_2conv_2fc"]\nbackends = ["torch"]\n'
                                 'data = "data/train.csv,data/test.csv"\nsteps = 5\n')
    monkeypatch.chdir(tmp_path)                      # the parent: "models/mine.toml" is not there
    m = load_matrix("proj/m.toml")
    cfgs = [e.cfg for e in expand(m)]
    assert {c.model for c in cfgs} == {str(proj / "models" / "mine.toml"), "cnn2d_2conv_2fc"}
    assert {c.data for c in cfgs} == {f"{proj / 'data' / 'train.csv'},{proj / 'data' / 'test.csv'}"}
    (tmp_path / "elsewhere.npz").write_bytes(b"")
    m.data = "elsewhere.npz"                         # only from the working directory: as written
    assert m.data_spec() == "elsewhere.npz"
