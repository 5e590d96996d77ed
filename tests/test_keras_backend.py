"""The Keras 3 backend (keras-tensorflow, keras-jax, keras-torch): its declared semantic differences are
exactly the declared formulas, its optimizer-state conversion is right, its faults do what the torch
reference's do, and its step statistics are the step's own.

Every Keras backend needs its own process (KERAS_BACKEND is read at import), so each test reads the
results of one collector per backend: `python -m tests.test_keras_backend BACKEND OUT.pkl PART` (PARTS)
(this file's __main__), which builds the backends in-process on small fixed inputs and records
what the assertions need. The torch reference for the fault checks is collected the same way.
"""
from __future__ import annotations

import math
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest

from algorithms.optim import HParams, lr_at, reference_init, reference_update

KERAS = ["keras-tensorflow", "keras-jax", "keras-torch"]
BASE = dict(steps=3, batch_size=16, eval_every=1, checkpoint_every=1)
HP = {
    "adam": HParams(optimizer="adam", lr=1e-3, **BASE),
    "adamw": HParams(optimizer="adamw", lr=1e-3, weight_decay=1e-2, **BASE),
    "momentum_step": HParams(optimizer="momentum", lr=0.1, schedule="step", step_size=1, gamma=0.5, **BASE),
    "nesterov_step": HParams(optimizer="nesterov", lr=0.1, schedule="step", step_size=1, gamma=0.5, **BASE),
    "sgd_l2": HParams(optimizer="sgd", lr=0.1, weight_decay=1e-2, **BASE),
    "momentum_const": HParams(optimizer="momentum", lr=0.05, **BASE),
}
FAULT_HP = HParams(optimizer="sgd", lr=0.1, **{**BASE, "steps": 2})
L2_HP = HParams(optimizer="adamw", lr=1e-3, weight_decay=0.1, **{**BASE, "steps": 2})

# A model where most catalogued faults bite: an asymmetric 'same' stride-2 conv with a bias, BatchNorm,
# a flatten of a 4x4 map into a dense layer, dropout.
FAULT_MODEL = {"name": "fault_probe", "input_shape": [8, 8, 1], "num_classes": 10, "layers": [
    {"type": "conv2d", "name": "conv1", "filters": 8, "kernel": 3, "stride": 2, "padding": "same"},
    {"type": "relu"},
    {"type": "conv2d", "name": "conv2", "filters": 8, "kernel": 3, "padding": "same", "use_bias": False},
    {"type": "batchnorm2d", "name": "bn1"},     # (a bias right before BatchNorm would get a zero gradient)
    {"type": "relu"},
    {"type": "flatten", "name": "flat"},
    {"type": "dense", "name": "fc1", "units": 16},
    {"type": "relu"},
    {"type": "dropout", "name": "drop1", "rate": 0.25},   # on a flat vector: no layout question for the masks
    {"type": "dense", "name": "fc2", "units": 10, "init": "glorot_uniform"}]}
# maxpool_ceil needs a 'valid' max pool on an odd size (and no flatten after it).
CEIL_MODEL = {"name": "ceil_probe", "input_shape": [9, 9, 1], "num_classes": 10, "layers": [
    {"type": "conv2d", "name": "conv1", "filters": 4, "kernel": 3, "padding": "same"},
    {"type": "tanh"},
    {"type": "maxpool2d", "name": "pool1", "pool": 2},
    {"type": "global_avgpool2d", "name": "gap"},
    {"type": "dense", "name": "fc", "units": 10}]}
FAULTS = {"flatten_no_permute": FAULT_MODEL, "symmetric_same_padding": FAULT_MODEL,
          "bn_momentum_flipped": FAULT_MODEL, "bn_eps_keras": FAULT_MODEL, "label_smoothing": FAULT_MODEL,
          "missing_bias": FAULT_MODEL, "grad_double": FAULT_MODEL, "maxpool_ceil": CEIL_MODEL}


# the graph spec's kinds alone (tests/test_gradcheck.py layer_model), and the straight-line kinds whose float64
# Keras computes in float32 on keras-jax (runtimes/jax.py FLOAT64_FORMULA)
KIND_CASES = ["conv2d_grouped", "conv2d_depthwise_multiplier2_s2", "conv2d_dilated_same", "conv2d_dilated_grouped_valid",
              "layernorm_spatial", "relu6_spatial", "add", "add_three", "concat", "leaky_relu", "gelu_none", "gelu_tanh",
              "silu", "sigmoid", "relu6", "layernorm", "tanh", "batchnorm2d", "global_avgpool2d"]


def avgpool_model(size: int, pool: int, stride: int) -> dict:
    return {"name": "avgpool_probe", "input_shape": [size, size, 1], "num_classes": 2, "layers": [
        {"type": "avgpool2d", "name": "pool", "pool": pool, "stride": stride, "padding": "same"},
        {"type": "flatten"}, {"type": "dense", "name": "fc", "units": 2}]}


AVG_ASYM = (6, 3, 2)   # 6x6, pool 3, stride 2, 'same': padding (0, 1) per dimension: overhangs, asymmetric
AVG_SYM = (6, 3, 1)    # stride 1: padding (1, 1): overhangs, symmetric
AVG_ONE = (4, 2, 1)    # padding (0, 1), asymmetric, but the overhanging window holds one real pixel (cnn2d_hard)


# ============================================================================ the collector (subprocess)
def _inputs(model, batch: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.random((batch, *model.input_shape)).astype(np.float32)
    y = rng.integers(0, model.num_classes, batch).astype(np.int32)
    return x, y


def _masks(model, hp, step):
    from wrappers.worker import masks_for
    return masks_for(model, hp.seed, step, hp.batch_size, "harness")


def _copy(d):
    return {k: np.array(v, copy=True) for k, v in d.items()}


def _trace(cls, model, hp, steps, fault=None, params=None):
    """Per step: the gradients (the probe primitive) at the current weights, the weights before and
    after train_step, the step statistics, the exported optimizer state and buffers."""
    from algorithms.params import init_params
    from algorithms.contract import RunOptions
    b = cls(model, hp, RunOptions(fault=fault))
    b.load_params(_copy(params if params is not None else init_params(model, 0)))
    x, y = _inputs(model, hp.batch_size)
    out = {"declared": b.declared_differences(), "steps": []}
    for t in range(steps):
        m = _masks(model, hp, t)
        loss, grads = b.gradients(x, y, m)
        before = _copy(b.export_params())
        st = b.train_step(t, x, y, m)
        out["steps"].append({"loss": loss, "grads": _copy(grads), "before": before,
                             "after": _copy(b.export_params()), "stats": vars(st), "opt": _copy(b.export_opt_state())})
    return b, out


def _probe(cls, model, hp, fault=None, steps=2):
    """Backend.probe's contents, with snapshot copies (no aliasing of live tensors)."""
    from algorithms.params import init_params
    from algorithms.contract import RunOptions
    b = cls(model, hp, RunOptions(fault=fault))
    b.load_params(_copy(init_params(model, 0)))
    x, y = _inputs(model, hp.batch_size)
    out = {f"forward/{k}": np.array(v) for k, v in b.forward_layers(x, _masks(model, hp, 0)).items()}
    loss, grads = b.gradients(x, y, _masks(model, hp, 0))
    out["loss"] = np.asarray(loss)
    out.update({f"grad/{k}": np.array(v) for k, v in grads.items()})
    for i in range(steps):
        before = _copy(b.export_params())
        b.train_step(i, x, y, _masks(model, hp, i))
        after = _copy(b.export_params())
        for k in before:
            tag = "buffer" if k.endswith(("running_mean", "running_var")) else "update"
            out[f"{tag}{i}/{k}"] = after[k] - before[k] if tag == "update" else after[k]
    return b, out


# The collector runs as two processes at once (PARTS), so that an xdist worker waiting for a collector another worker
# started lends its core to it (measured at 07d016c: the second worker waited 74 s for keras-jax's one process).
PARTS = ("faults", "steps")


def collect(backend: str, path: str, part: str) -> None:
    """Part 'faults': the catalogued faults' probes and the clean ones beside them (torch: also the graph kinds, the
    reference); part 'steps': everything else (keras backends only; float64 last, floatx is process-global)."""
    from algorithms.contract import RunOptions
    from wrappers.__main__ import set_backend_env
    from wrappers.registry import REGISTRY
    set_backend_env(REGISTRY[backend], RunOptions(threads=1))
    cls = REGISTRY[backend].load()
    res: dict = {}
    if part == "faults":
        res = _collect_faults(cls, backend)
    elif backend == "torch":      # the reference for the fault checks and the graph kinds (float32 and float64)
        res["kinds"] = {dtype: _kinds(cls, dtype) for dtype in ("float32", "float64")}
    else:
        res = _collect_steps(cls)
    with open(path, "wb") as f:
        pickle.dump(res, f)


def _collect_faults(cls, backend: str) -> dict:
    from algorithms.contract import RunOptions
    from algorithms.spec import build_model, load_model
    res: dict = {"faults": {}}
    fault_models = {"fault_probe": build_model(FAULT_MODEL), "ceil_probe": build_model(CEIL_MODEL)}
    for name, decl in FAULTS.items():
        m = fault_models[decl["name"]]
        res["faults"][name] = _probe(cls, m, FAULT_HP, fault=name)[1]
    if backend == "torch":
        return res
    for name in ("ceil_probe", "fault_probe"):
        b, res["faults"][f"clean:{name}"] = _probe(cls, fault_models[name], FAULT_HP)
    x, y = _inputs(fault_models["fault_probe"], 64, seed=1)
    res["eval_clean"] = [b.evaluate(x, y), b.evaluate(x, y)]
    bf = cls(fault_models["fault_probe"], FAULT_HP, RunOptions(fault="dropout_in_eval"))
    bf.load_params(_copy(b.export_params()))      # the clean backend's weights: only the fault differs
    res["eval_dropout_in_eval"] = [bf.evaluate(x, y), bf.evaluate(x, y)]
    res["l2_not_decoupled"] = _trace(cls, load_model("cnn2d_2conv_2fc"), L2_HP, 2, fault="l2_not_decoupled")[1]
    return res


def _collect_steps(cls) -> dict:
    from algorithms.contract import RunOptions
    from algorithms.spec import build_model, load_model
    res: dict = {}
    import keras
    from wrappers.keras.backend import KBACKEND  # noqa: F401  (the module under test)
    res["keras_backend"] = keras.backend.backend()
    m2 = load_model("cnn2d_2conv_2fc")
    for case in ("adam", "adamw", "momentum_step", "nesterov_step", "sgd_l2", "momentum_const"):
        bc, res[case] = _trace(cls, m2, HP[case], 3)
        res[case]["traces"] = bc.net.traces
    # BatchNorm: inputs of bn1/bn2 before the step, buffers after one step (batch 8: n/(n-1) shows)
    hard = load_model("cnn2d_hard")
    hp_bn = HParams(optimizer="sgd", lr=0.1, **{**BASE, "batch_size": 8})
    b, tr = _trace(cls, hard, hp_bn, 1)
    x, y = _inputs(hard, 8)
    from algorithms.params import init_params
    b2 = cls(hard, hp_bn, b.opts)
    b2.load_params(init_params(hard, 0))
    res["bn"] = {"forward": b2.forward_layers(x, _masks(hard, hp_bn, 0)), "trace": tr}
    res["joint"] = {"got": b2.layers_and_gradients(x, y, _masks(hard, hp_bn, 0)),
                    "grads": b2.gradients(x, y, _masks(hard, hp_bn, 0))[1]}
    res["step_forward"] = _step_forward_in_inference(b2, x, _masks(hard, hp_bn, 0))
    # 'same' average pooling, asymmetric and symmetric overhang
    res["avgpool"] = {}
    for key, (size, pool, stride) in {"asym": AVG_ASYM, "sym": AVG_SYM, "one": AVG_ONE}.items():
        m = build_model(avgpool_model(size, pool, stride))
        bb = cls(m, FAULT_HP, b.opts)
        bb.load_params(init_params(m, 0))
        xa = np.arange(size * size, dtype=np.float32).reshape(1, size, size, 1) ** 1.5 / 10.0
        xa = np.concatenate([xa, xa[:, ::-1]])
        res["avgpool"][key] = {"x": xa, "out": bb.forward_layers(xa, {})["pool"], "declared": bb.declared_differences()}
    # optimizer-state round trip: stop after 2 steps, export, resume in a fresh backend, step 3
    res["resume"] = {}
    for case in ("momentum_step", "adam"):
        hp = HP[case]
        x, y = _inputs(m2, hp.batch_size)
        full = cls(m2, hp, b.opts)
        full.load_params(init_params(m2, 0))
        for t in range(2):
            full.train_step(t, x, y, {})
        params, state = _copy(full.export_params()), _copy(full.export_opt_state())
        s_full = full.train_step(2, x, y, {})
        resumed = cls(m2, hp, b.opts)
        resumed.load_params(params)
        resumed.load_opt_state(state, 2)
        state_back = _copy(resumed.export_opt_state())
        s_res = resumed.train_step(2, x, y, {})
        res["resume"][case] = {"state": state, "state_back": state_back, "full": vars(s_full), "resumed": vars(s_res),
                               "p_full": _copy(full.export_params()), "p_res": _copy(resumed.export_params())}
    # determinism inside one process: two fresh backends, same steps; a third that exports and evaluates
    # between steps (keras-jax writes its state back into the Keras variables there)
    runs = []
    for synced in (False, False, True):
        bd = cls(hard, HP["momentum_const"].with_(batch_size=16), b.opts)
        bd.load_params(init_params(hard, 0))
        xs, ys = _inputs(hard, 16)
        steps = []
        for t in range(4):
            steps.append(vars(bd.train_step(t, xs, ys, _masks(hard, bd.hp, t))))
            if synced:
                bd.export_params(), bd.export_opt_state(), bd.evaluate(xs, ys)
                bd.forward_layers(xs, _masks(hard, bd.hp, t))
                bd.gradients(xs, ys, _masks(hard, bd.hp, t + 1))     # runs the step's body; its writes undone
        runs.append(steps)
    res["determinism"], res["determinism_synced"] = runs[:2], runs[2]
    # the gradient probe vs the step's own gradient: momentum SGD at lr 1 from a zero velocity makes the first
    # step's velocity exactly -g, exported as the momentum buffer b = -v / lr = g, bit for bit
    res["step_gradient"] = {}
    for name in ("cnn2d_hard",):
        m = load_model(name)
        hp = HParams(optimizer="momentum", lr=1.0, **{**BASE, "steps": 1})
        bg = cls(m, hp, b.opts)
        bg.load_params(init_params(m, 0))
        xg, yg = _inputs(m, hp.batch_size)
        _, probe = bg.gradients(xg, yg, _masks(m, hp, 0))
        bg.train_step(0, xg, yg, _masks(m, hp, 0))
        res["step_gradient"][name] = {"probe": _copy(probe), "opt": _copy(bg.export_opt_state())}
    # float64 (last: floatx is process-global): end to end on keras-tensorflow/keras-jax, refused on keras-torch
    from wrappers.base import UnsupportedError
    try:
        b64 = cls(m2, HP["momentum_const"], RunOptions(dtype="float64"))
    except UnsupportedError as e:
        res["float64"] = {"refused": str(e)}
    else:
        b64.load_params(init_params(m2, 0))
        x64 = _inputs(m2, 16)[0].astype(np.float64) + 1e-9       # not representable in float32
        res["float64"] = {"x": x64, "forward": b64.forward_layers(x64, {}), "params": init_params(m2, 0)}
    # the graph kinds alone (last: float64 where the backend has it)
    res["kinds"] = _kinds(cls, "float32" if "refused" in res["float64"] else "float64")
    return res


def _step_forward_in_inference(b, x, masks) -> dict:
    """The forward probe before and after the training step's model call loses its `training=True` (the source
    of this runtime's step function edited in place, as a porting slip would: Keras' default is inference), and
    the inference-mode probe for comparison."""
    import inspect
    import textwrap

    from wrappers.keras.backend import RT
    fn = RT.forward_loss if hasattr(RT, "forward_loss") else RT.step_with_gradients
    src = textwrap.dedent(inspect.getsource(fn))
    assert src.count("training=True") == 1, src
    out = {"clean": b.forward_layers(x, masks), "eval": b.eval_layers(x)}
    exec(compile(src.replace(", training=True", ""), inspect.getsourcefile(fn), "exec"), RT.__dict__)
    try:
        b.stepper.probe = b.stepper.layers_probe = None      # compiled again from the edited source
        out["slipped"] = b.forward_layers(x, masks)
    finally:
        setattr(RT, fn.__name__, fn)
        b.stepper.probe = b.stepper.layers_probe = None
    return out


def _kinds(cls, dtype: str) -> dict:
    """Every graph kind alone (tests/test_gradcheck.py layer_model: a conv before it, a dense head): the training-mode
    forward per layer, the loss and the gradients at the canonical initial weights, on a fixed batch."""
    from algorithms.params import init_params
    from algorithms.contract import RunOptions

    from .test_gradcheck import layer_model
    out = {"dtype": dtype}
    for case in KIND_CASES:
        m = layer_model(case)
        b = cls(m, FAULT_HP, RunOptions(dtype=dtype))
        b.load_params(init_params(m, 0))
        rng = np.random.default_rng(7)
        x = rng.normal(size=(FAULT_HP.batch_size, *m.input_shape)).astype(dtype)
        y = rng.integers(0, m.num_classes, FAULT_HP.batch_size).astype(np.int32)
        loss, grads = b.gradients(x, y, {})
        out[case] = {**{f"forward/{k}": np.asarray(v) for k, v in b.forward_layers(x, {}).items()},
                     **{f"grad/{k}": np.asarray(v) for k, v in grads.items()}, "loss": np.asarray(loss)}
    return out


# ============================================================================ fixtures
_CACHE: dict[str, dict] = {}


def collected(backend: str, shared: Path) -> dict:
    from .conftest import collected_in_subprocess
    return collected_in_subprocess("tests.test_keras_backend", backend, shared, _CACHE, timeout=1800, parts=PARTS)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    from .conftest import across_workers
    return across_workers(tmp_path_factory)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-12))


def _ref_updates(hp: HParams, steps: list[dict], adam_eps_hat: bool) -> list[dict[str, np.ndarray]]:
    """The reference optimizer applied to the backend's own weights and gradients, step by step."""
    trainable = list(steps[0]["grads"])
    state = reference_init(hp, {k: steps[0]["before"][k] for k in trainable})
    ups = []
    for t, s in enumerate(steps):
        p = {k: s["before"][k].astype(np.float64) for k in trainable}
        new, state = reference_update(hp, t, p, s["grads"], state, adam_eps_hat=adam_eps_hat)
        ups.append({k: new[k] - p[k] for k in trainable})
    return ups


def _updates(steps: list[dict]) -> list[dict[str, np.ndarray]]:
    return [{k: s["after"][k].astype(np.float64) - s["before"][k].astype(np.float64) for k in s["grads"]}
            for s in steps]


def _max_rel(got: list[dict], want: list[dict]) -> float:
    return max(float(np.max(np.abs(g[k] - w[k]))) / max(float(np.max(np.abs(w[k]))), 1e-12)
               for g, w in zip(got, want) for k in w)


# ============================================================================ declared differences
@pytest.mark.parametrize("backend", KERAS)
@pytest.mark.parametrize("case", ["adam", "adamw"])
def test_adam_is_the_epsilon_hat_formula(backend, case, root):
    """Keras Adam/AdamW at steps 0..2 = reference_update(adam_eps_hat=True) on the probe's gradients,
    and measurably not the reference (epsilon inside the bias correction)."""
    tr = collected(backend, root)[case]
    assert "adam_epsilon_hat" in tr["declared"]
    got = _updates(tr["steps"])
    hat = _ref_updates(HP[case], tr["steps"], adam_eps_hat=True)
    ref = _ref_updates(HP[case], tr["steps"], adam_eps_hat=False)
    err_hat, err_ref = _max_rel(got, hat), _max_rel(got, ref)
    assert err_hat < 2e-4, f"{backend} {case}: not the epsilon-hat update (rel {err_hat:.2e})"
    assert err_ref > 10 * err_hat, f"{backend} {case}: indistinguishable from the reference ({err_ref:.2e} vs {err_hat:.2e})"


@pytest.mark.parametrize("backend", KERAS)
@pytest.mark.parametrize("case", ["momentum_step", "nesterov_step"])
def test_momentum_under_halving_lr_is_the_keras_velocity(backend, case, root):
    """v_t = mu v_{t-1} - lr_t g_t; p += v_t (nesterov: p += mu v_t - lr_t g_t), and not torch's
    b_t = mu b_{t-1} + g_t; p -= lr_t b_t once the lr has changed. The export is b = -v_t / lr_t."""
    hp = HP[case]
    tr = collected(backend, root)[case]
    assert tr["declared"] == ["keras_momentum_velocity"]
    got = _updates(tr["steps"])
    v = {k: 0.0 for k in tr["steps"][0]["grads"]}
    keras_upd, keras_b = [], []
    for t, s in enumerate(tr["steps"]):
        lr, mu = lr_at(hp, t), hp.momentum
        u = {}
        for k, g in s["grads"].items():
            g = g.astype(np.float64)
            v[k] = mu * v[k] - lr * g
            u[k] = mu * v[k] - lr * g if hp.optimizer == "nesterov" else v[k]
        keras_upd.append(u)
        keras_b.append({k: -v[k] / lr for k in v})
    ref = _ref_updates(hp, tr["steps"], adam_eps_hat=False)
    assert _max_rel(got, keras_upd) < 1e-4
    assert _max_rel(got[:1], ref[:1]) < 1e-4                  # equal while the lr is unchanged
    assert _max_rel(got[1:], ref[1:]) > 1e-2                  # and not after it halves
    exported = [{k: s["opt"][f"momentum/{k}"] for k in s["grads"]} for s in tr["steps"]]
    assert _max_rel(exported, keras_b) < 1e-4


@pytest.mark.parametrize("backend", KERAS)
def test_constant_lr_momentum_is_the_reference(backend, root):
    tr = collected(backend, root)["momentum_const"]
    assert tr["declared"] == []
    got = _updates(tr["steps"])
    assert _max_rel(got, _ref_updates(HP["momentum_const"], tr["steps"], adam_eps_hat=False)) < 1e-4
    # the exported buffer is torch's b = sum mu^i g
    b = {k: 0.0 for k in tr["steps"][0]["grads"]}
    for s in tr["steps"]:
        for k, g in s["grads"].items():
            b[k] = HP["momentum_const"].momentum * b[k] + g.astype(np.float64)
        assert _max_rel([{k: s["opt"][f"momentum/{k}"] for k in b}], [b]) < 1e-4


@pytest.mark.parametrize("backend", KERAS)
def test_coupled_l2_goes_through_the_gradient_and_is_not_reported(backend, root):
    tr = collected(backend, root)["sgd_l2"]
    got = _updates(tr["steps"])
    assert _max_rel(got, _ref_updates(HP["sgd_l2"], tr["steps"], adam_eps_hat=False)) < 1e-4
    for s in tr["steps"]:   # grad_norm is the data gradient's, as torch reports it
        gn = math.sqrt(sum(float(np.sum(np.square(g.astype(np.float64)))) for g in s["grads"].values()))
        assert s["stats"]["grad_norm"] == pytest.approx(gn, rel=1e-5)


def _avgpool_reference(x: np.ndarray, pool: int, stride: int, mode: str) -> np.ndarray:
    """'same' average pooling, NHWC, TF padding; mode 'exclude' (the reference: padded pixels not
    counted) or 'replicate' (keras-torch: edge values repeated and counted)."""
    n, h, w, c = x.shape
    oh = math.ceil(h / stride)
    tot = max((oh - 1) * stride + pool - h, 0)
    lo, hi = tot // 2, tot - tot // 2
    if mode == "replicate":
        xp = np.pad(x.astype(np.float64), ((0, 0), (lo, hi), (lo, hi), (0, 0)), mode="edge")
        ones = np.ones_like(xp)
    else:
        xp = np.pad(x.astype(np.float64), ((0, 0), (lo, hi), (lo, hi), (0, 0)))
        ones = np.pad(np.ones_like(x, np.float64), ((0, 0), (lo, hi), (lo, hi), (0, 0)))
    out = np.empty((n, oh, oh, c))
    for i in range(oh):
        for j in range(oh):
            win = (slice(None), slice(i * stride, i * stride + pool), slice(j * stride, j * stride + pool))
            out[:, i, j] = xp[win].sum((1, 2)) / ones[win].sum((1, 2))
    return out


@pytest.mark.parametrize("backend", KERAS)
def test_same_avgpool_replicate_padding_only_on_keras_torch(backend, root):
    res = collected(backend, root)["avgpool"]
    asym = res["asym"]
    ref = _avgpool_reference(asym["x"], AVG_ASYM[1], AVG_ASYM[2], "exclude")
    rep = _avgpool_reference(asym["x"], AVG_ASYM[1], AVG_ASYM[2], "replicate")
    assert _rel(ref, rep) > 1e-2          # the input makes the two formulas differ
    if backend == "keras-torch":
        assert _rel(asym["out"], rep) < 1e-6
        assert asym["declared"] == ["keras_torch_avgpool_same"]
    else:
        assert _rel(asym["out"], ref) < 1e-6
        assert asym["declared"] == []
    # symmetric overhang: torch's own count_include_pad=False path, the reference on every backend;
    # asymmetric with one real pixel in the overhanging window: replication changes nothing
    for key, (_, pool, stride) in (("sym", AVG_SYM), ("one", AVG_ONE)):
        r = res[key]
        assert _rel(r["out"], _avgpool_reference(r["x"], pool, stride, "exclude")) < 1e-6, key
        assert r["declared"] == [], key
    one = res["one"]
    assert _rel(_avgpool_reference(one["x"], 2, 1, "replicate"), _avgpool_reference(one["x"], 2, 1, "exclude")) < 1e-12


@pytest.mark.parametrize("backend", KERAS)
def test_batchnorm_running_var_is_the_biased_variance(backend, root):
    res = collected(backend, root)["bn"]
    step = res["trace"]["steps"][0]
    assert "running_var_biased" in res["trace"]["declared"]
    for bn, src, m in (("bn1", "conv1", 0.1), ("bn2", "conv2", 0.1)):
        a = res["forward"][src].astype(np.float64)
        n = a.shape[0] * a.shape[1] * a.shape[2]
        var_b = a.var(axis=(0, 1, 2))
        r0m, r0v = step["before"][f"{bn}.running_mean"], step["before"][f"{bn}.running_var"]
        want_b = (1 - m) * r0v + m * var_b
        want_u = (1 - m) * r0v + m * var_b * n / (n - 1)
        got = step["after"][f"{bn}.running_var"]
        err = _rel(got, want_b)
        assert err < 1e-5, f"{bn}: running_var is not the biased update ({err:.2e})"
        assert _rel(got, want_u) > 10 * err
        assert _rel(step["after"][f"{bn}.running_mean"], (1 - m) * r0m + m * a.mean(axis=(0, 1, 2))) < 1e-5


# ============================================================================ state, statistics, determinism
@pytest.mark.parametrize("backend", KERAS)
def test_step_statistics_are_the_steps_own(backend, root):
    """loss = this batch's loss before the update; grad_norm from this step's gradients; update and
    parameter norms from the weights."""
    for case in ("momentum_step", "adam"):
        for s in collected(backend, root)[case]["steps"]:
            st = s["stats"]
            assert st["loss"] == pytest.approx(s["loss"], rel=1e-6)
            gn = math.sqrt(sum(float(np.sum(np.square(g.astype(np.float64)))) for g in s["grads"].values()))
            assert st["grad_norm"] == pytest.approx(gn, rel=1e-5)
            keys = list(s["grads"])
            un = math.sqrt(sum(float(np.sum(np.square(s["after"][k].astype(np.float64) - s["before"][k]))) for k in keys))
            pn = math.sqrt(sum(float(np.sum(np.square(s["after"][k].astype(np.float64)))) for k in keys))
            assert st["update_norm"] == pytest.approx(un, rel=1e-4)
            assert st["param_norm"] == pytest.approx(pn, rel=1e-5)


@pytest.mark.parametrize("backend", KERAS)
@pytest.mark.parametrize("case", ["momentum_step", "adam"])
def test_optimizer_state_round_trip(backend, case, root):
    r = collected(backend, root)["resume"][case]
    assert set(r["state"]) == set(r["state_back"])
    for k in r["state"]:
        assert _rel(r["state_back"][k], r["state"][k]) < 1e-6, k
    if case == "adam":
        assert float(r["state"]["step"]) == 2.0
    assert r["resumed"]["loss"] == r["full"]["loss"]
    assert r["resumed"]["update_norm"] == pytest.approx(r["full"]["update_norm"], rel=1e-5)
    for k in r["p_full"]:
        assert _rel(r["p_res"][k], r["p_full"][k]) < 1e-6, k


@pytest.mark.parametrize("backend", KERAS)
@pytest.mark.parametrize("model", ["cnn2d_hard"])
def test_the_gradient_probe_is_the_training_steps_gradient(backend, model, root):
    """The probe's gradient is the one the training step computes, bit for bit: the step's own body, compiled as
    the step is (Stepper.gradients). With momentum SGD at lr 1 the first velocity is exactly -g, so the exported
    momentum buffer after step 0 is the step's gradient. An eager re-derivation (GradientTape / jax.value_and_grad
    outside the step's program) matched 0 of 12 tensors on cnn2d_hard on keras-jax and keras-tensorflow (0 of 35
    on mobilenet_tiny, worst 1.2 relative: a ReLU6 kink flipped), so a flip in training was invisible to the probes."""
    r = collected(backend, root)["step_gradient"][model]
    assert r["probe"]
    for k, g in r["probe"].items():
        np.testing.assert_array_equal(g, r["opt"][f"momentum/{k}"], err_msg=k)


@pytest.mark.parametrize("backend", KERAS)
def test_the_forward_probe_runs_the_training_steps_forward(backend, root):
    """A slip in the training step's own model call (its `training=True` left out, Keras' default being inference)
    shows in the forward probes: they run the step's forward (Stepper.layer_outputs), not a recorder of their own
    in training mode. Before, the slipped step's forward probes were the clean ones and such a bug was localized
    to the loss (bench/source_bugs.py keras_jax_train_step_inference_mode)."""
    r = collected(backend, root)["step_forward"]
    assert _rel(r["clean"]["bn1"], r["eval"]["bn1"]) > 0.1          # training-mode BatchNorm is not inference's
    for k in r["eval"]:
        np.testing.assert_allclose(r["slipped"][k], r["eval"][k], rtol=1e-4, atol=1e-5, err_msg=k)


@pytest.mark.parametrize("backend", KERAS)
def test_two_fresh_backends_are_bit_identical(backend, root):
    a, b = collected(backend, root)["determinism"]
    assert a == b


@pytest.mark.parametrize("backend", KERAS)
def test_state_written_back_between_steps_changes_nothing(backend, root):
    """Exports, an evaluation and probes between steps (keras-jax keeps its training state outside the
    Keras variables between steps and writes it back there; the gradient probe runs the step's body and
    undoes its writes) leave every step statistic bit-identical."""
    res = collected(backend, root)
    assert res["determinism_synced"] == res["determinism"][0]


@pytest.mark.parametrize("backend", ["keras-tensorflow", "keras-jax"])
def test_the_step_is_traced_once_under_a_schedule(backend, root):
    """The learning rate is a value of the optimizer's variable (state): halving it each step retraces nothing."""
    assert collected(backend, root)["momentum_step"]["traces"] == 1


@pytest.mark.parametrize("backend", KERAS)
def test_float64_is_float64_or_refused(backend, root):
    r = collected(backend, root)["float64"]
    if backend == "keras-torch":     # Keras 3.15 computes float64 matmuls in float32 there: said, not hidden
        assert "float64" in r["refused"]
        return
    f, p = r["forward"], r["params"]
    assert all(v.dtype == np.float64 for v in f.values())
    want = f["flatten_1"] @ p["fc1.kernel"].astype(np.float64) + p["fc1.bias"]
    assert _rel(f["fc1"], want) < 1e-12


# ============================================================================ graph kinds
@pytest.mark.parametrize("backend", KERAS)
def test_graph_kinds_alone_match_torch(backend, root):
    """Each graph kind alone (grouped, depthwise with multiplier 2 and stride 2 -- DepthwiseConv2D's channel order --,
    dilated convolutions, add of two and three, concat, leaky_relu alpha 0.2, gelu exact and tanh, silu, sigmoid,
    relu6, layernorm over channels and on a vector), and tanh / batchnorm2d / global_avgpool2d: forward per layer,
    loss and every gradient against torch, float64 on keras-jax and keras-tensorflow (1e-10 relative), float32 on
    keras-torch (1e-4 relative, against torch float32)."""
    got = collected(backend, root)["kinds"]
    dtype = got["dtype"]
    assert dtype == ("float32" if backend == "keras-torch" else "float64")
    ref = collected("torch", root)["kinds"][dtype]
    tol = 1e-10 if dtype == "float64" else 1e-4
    for case in KIND_CASES:
        a, b = got[case], ref[case]
        assert set(a) == set(b) and any(k.startswith("grad/") for k in b), (case, sorted(set(a) ^ set(b)))
        for k in b:
            if k != "loss":       # a Python float
                assert a[k].dtype == np.dtype(dtype), f"{backend} {case} {k}: {a[k].dtype}"
            rel = float(np.max(np.abs(a[k].astype(np.float64) - b[k]))) / max(float(np.max(np.abs(b[k]))), 1e-6)
            assert rel < tol, f"{backend} {case} {k}: relative error {rel:.3g} >= {tol}"


# ============================================================================ faults
def _fault_keys(got: dict, ref: dict) -> list[str]:
    return [k for k in ref if k in got and not k.endswith("running_var")]   # running_var: declared (biased)


@pytest.mark.parametrize("backend", KERAS)
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_fault_matches_the_torch_fault(backend, fault, root):
    """The injected fault computes what the torch reference's injection computes (forward, loss,
    gradients, two SGD updates, running means), and it changes something relative to the clean run."""
    from harness.probes import compare, first_failure
    ref = collected("torch", root)["faults"]
    got = collected(backend, root)["faults"]
    diffs = compare(got[fault], ref[fault], keys=_fault_keys(got[fault], ref[fault]))
    bad = first_failure(diffs)
    assert bad is None, f"{backend} {fault}: {bad}"
    assert set(ref[fault]) <= set(got[fault])
    clean = got[f"clean:{FAULTS[fault]['name']}"]
    moved = first_failure(compare(got[fault], clean, keys=[k for k in _fault_keys(got[fault], clean)
                                                              if got[fault][k].shape == clean[k].shape]))
    assert moved is not None, f"{fault} changed nothing"


@pytest.mark.parametrize("backend", KERAS)
def test_fault_dropout_in_eval(backend, root):
    res = collected(backend, root)
    (l1, _), (l2, _) = res["eval_clean"]
    assert l1 == l2
    (f1, _), (f2, _) = res["eval_dropout_in_eval"]
    assert f1 != l1 and f1 != f2       # random dropout stays on in inference mode


@pytest.mark.parametrize("backend", KERAS)
def test_fault_l2_not_decoupled(backend, root):
    """adamw with the fault = Adam with L2 in the gradient (the Keras epsilon-hat Adam)."""
    tr = collected(backend, root)["l2_not_decoupled"]
    got = _updates(tr["steps"])
    coupled = _ref_updates(L2_HP.with_(optimizer="adam"), tr["steps"], adam_eps_hat=True)
    decoupled = _ref_updates(L2_HP, tr["steps"], adam_eps_hat=True)
    assert _max_rel(got, coupled) < 2e-4
    assert _max_rel(got, decoupled) > 1e-2


if __name__ == "__main__":
    collect(sys.argv[1], sys.argv[2], sys.argv[3])


@pytest.mark.parametrize("backend", KERAS)
def test_the_recorded_step_program_gives_the_forward_probes_and_its_gradients_on_the_compiling_runtimes(backend, root):
    """Backend.layers_and_gradients (the activations its gradients saw: harness.kinks.same_when_recorded): on
    keras-tensorflow and keras-jax the forward probes' recorded forward differentiated in one program, whose
    activations are `forward_layers`' and whose gradients are the gradient probe's up to the rounding of
    another compiled program; keras-torch records none (None: its probes run eagerly, one program already)."""
    r = collected(backend, root)
    if backend == "keras-torch":
        assert r["joint"]["got"] is None
        return
    layers, loss, grads = r["joint"]["got"]
    assert set(layers) == set(r["bn"]["forward"]) and np.isfinite(loss)
    for k, v in r["bn"]["forward"].items():
        np.testing.assert_allclose(layers[k], v, rtol=1e-5, atol=1e-5 * float(np.abs(v).max()))
    assert set(grads) == set(r["joint"]["grads"])
    for k, g in r["joint"]["grads"].items():
        np.testing.assert_allclose(grads[k], g, rtol=1e-4, atol=1e-4 * float(np.abs(g).max()))
