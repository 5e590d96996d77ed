"""The checks every in-process backend passes the same way (wrappers/base.py's Backend contract): exact state
round trips and replay from a checkpoint, statistics computed from the step, probes and evaluation that leave
the state alone, the layer semantics the spec fixes (TF 'SAME', padding-excluded average, torch-convention
BatchNorm, an (H, W, C) flatten, the harness's dropout masks), the catalogued faults a wrapper injects, and two
lowering faults the step-0 probes must catch against torch.

A backend's test module subclasses BackendContract as `Test<Backend>Contract`, giving `backend`, `make` and
`stored`; pytest collects the subclass, never this module (its name does not start with test_). The module
imports no framework: the subclass's module has set up the backend's environment and imported it.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from algorithms.optim import HParams
from algorithms.params import init_params
from algorithms.spec import ModelSpec, build_model, load_model
from wrappers.base import Backend
from wrappers.worker import masks_for

HP = {
    "sgd_l2": HParams(optimizer="sgd", lr=0.1, weight_decay=1e-2, steps=4),
    "momentum_step": HParams(optimizer="momentum", lr=0.1, schedule="step", step_size=1, gamma=0.5, steps=4),
    "nesterov_step": HParams(optimizer="nesterov", lr=0.1, schedule="step", step_size=1, gamma=0.5, steps=4),
    "adam": HParams(optimizer="adam", lr=1e-3, weight_decay=1e-3, steps=4),
    "adamw": HParams(optimizer="adamw", lr=1e-3, weight_decay=1e-2, schedule="cosine", steps=4),
}

# (fault, model, the first probe that must disagree with clean torch)
LOWERING_FAULTS = [("flatten_no_permute", "cnn2d_2conv_2fc", "forward/fc1"),
                   ("symmetric_same_padding", "cnn2d_hard", "forward/conv2")]


def batch(model: ModelSpec, n: int = 32, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (n, *model.input_shape)).astype(np.float32)
    y = rng.integers(0, model.num_classes, n).astype(np.int32)
    return x, y


def run_steps(b: Backend, x: np.ndarray, y: np.ndarray, steps: int, start: int = 0) -> list:
    return [b.train_step(s, x, y, masks_for(b.model, b.hp.seed, s, len(x), b.opts.dropout))
            for s in range(start, start + steps)]


def assert_same(a: dict, b: dict, exact: bool = True, rtol: float = 0.0) -> None:
    assert set(a) == set(b)
    for k in a:
        if exact:
            assert np.array_equal(a[k], b[k]), k
        else:
            scale = max(float(np.max(np.abs(b[k]))), 1e-6)
            assert float(np.max(np.abs(a[k].astype(np.float64) - b[k]))) <= rtol * scale, k


def layers_model(layers: list[dict[str, Any]], shape: tuple[int, ...] = (6, 6, 2)) -> ModelSpec:
    """A test model: `layers`, then a flatten and a two-unit dense head."""
    return build_model({"name": "t", "input_shape": list(shape), "num_classes": 2,
                        "layers": layers + [{"type": "flatten"}, {"type": "dense", "name": "out", "units": 2}]})


class BackendContract:
    backend: str = ""                               # its registry name (the probes against torch run it)
    opt_state_empty_before_first_step: bool = False  # torch's convention; some frameworks hold zeros
    joint_program: bool = False                     # Backend.layers_and_gradients records (not None)

    def make(self, model: ModelSpec, hp: HParams, params: dict | None = None, **opts: Any) -> Backend:
        """The backend on `model`, with `params` (default: the canonical initial weights of seed 0) loaded."""
        raise NotImplementedError

    def stored(self, b: Backend, name: str) -> np.ndarray:
        """The framework's own copy of a parameter, in its own layout: what load_params really stored (a fault
        that loads a kernel in another order stores another array than the clean backend)."""
        raise NotImplementedError

    # ----------------------------------------------------------------------- the step's statistics
    def test_step_stats_are_computed_from_the_step(self):
        m = load_model("cnn2d_2conv_2fc")
        x, y = batch(m)
        b = self.make(m, HParams(optimizer="sgd", lr=0.1))
        before = b.export_params()
        logits = b.forward_layers(x, {})["fc2"]
        loss, grads = b.gradients(x, y, {})
        st = b.train_step(0, x, y, {})
        after = b.export_params()
        assert st.loss == pytest.approx(loss, rel=1e-6)
        gn = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in grads.values()))
        un = np.sqrt(sum(np.sum((after[k].astype(np.float64) - before[k]) ** 2) for k in before))
        pn = np.sqrt(sum(np.sum(after[k].astype(np.float64) ** 2) for k in before))
        assert st.grad_norm == pytest.approx(gn, rel=1e-5)
        assert st.update_norm == pytest.approx(un, rel=1e-4)
        assert st.update_norm == pytest.approx(0.1 * gn, rel=1e-4)        # plain sgd: update = lr * grad
        assert st.param_norm == pytest.approx(pn, rel=1e-6)
        assert st.accuracy == float(np.mean(np.argmax(logits, 1) == y))   # of the step's own (pre-update) logits

    # ----------------------------------------------------------------------- state
    @pytest.mark.parametrize("fault", [None, "flatten_no_permute"])
    def test_params_round_trip_bit_exact_and_inputs_untouched(self, fault):
        m = load_model("cnn2d_2conv_2fc")
        p = init_params(m, 3)
        keep = {k: v.copy() for k, v in p.items()}
        b = self.make(m, HP["adam"], params=p, fault=fault)
        out = b.export_params()
        assert list(out) == [q.name for q in m.params]
        assert all(out[k].dtype == np.float32 for k in out)
        assert_same(out, p)
        if fault:   # the fault really loads the first dense kernel's rows in another order
            clean = self.make(m, HP["adam"], params=p)
            assert not np.array_equal(self.stored(b, "fc1.kernel"), self.stored(clean, "fc1.kernel"))
        x, y = batch(m)
        run_steps(b, x, y, 2)
        assert_same(p, keep)                                  # training never writes into the caller's arrays
        exported = b.export_params()
        for v in p.values():                                  # nor reads them again: it holds copies
            v += 1.0
        assert_same(b.export_params(), exported)
        snapshot = {k: v.copy() for k, v in exported.items()}
        run_steps(b, x, y, 1, start=2)                        # an export is a snapshot: it does not move
        assert not np.array_equal(exported["fc2.bias"], b.export_params()["fc2.bias"])
        assert_same(exported, snapshot)

    @pytest.mark.parametrize("case", ["momentum_step", "nesterov_step", "adam", "adamw"])
    def test_opt_state_round_trip_and_replay(self, case):
        """Train 3 steps; separately train 2, export params and optimizer state, load them into a fresh
        backend and take step 2 there: bit-identical to continuing."""
        m = load_model("cnn2d_hard")
        x, y = batch(m)
        full = self.make(m, HP[case])
        run_steps(full, x, y, 3)
        part = self.make(m, HP[case])
        if self.opt_state_empty_before_first_step:
            assert part.export_opt_state() == {}
        run_steps(part, x, y, 2)
        params, state = part.export_params(), part.export_opt_state()
        if case in ("momentum_step", "nesterov_step"):
            assert set(state) == {f"momentum/{n}" for n in part.trainable}
        else:
            assert set(state) == {f"{k}/{n}" for k in ("exp_avg", "exp_avg_sq") for n in part.trainable} | {"step"}
            assert float(state["step"]) == 2.0
        replay = self.make(m, HP[case])
        replay.load_params(params)
        replay.load_opt_state(state, 2)
        assert_same(replay.export_params(), params)
        assert_same(replay.export_opt_state(), state)
        run_steps(replay, x, y, 1, start=2)
        assert_same(replay.export_params(), full.export_params())
        assert_same(replay.export_opt_state(), full.export_opt_state())

    def test_replay_keeps_the_keras_momentum_fault_lr_history(self):
        m = load_model("cnn2d_2conv_2fc")
        x, y = batch(m)
        hp = HP["momentum_step"]
        full = self.make(m, hp, fault="keras_momentum_schedule")
        run_steps(full, x, y, 3)
        part = self.make(m, hp, fault="keras_momentum_schedule")
        run_steps(part, x, y, 2)
        replay = self.make(m, hp, fault="keras_momentum_schedule")
        replay.load_params(part.export_params())
        replay.load_opt_state(part.export_opt_state(), 2)
        run_steps(replay, x, y, 1, start=2)
        assert_same(replay.export_params(), full.export_params())
        clean = self.make(m, hp)
        run_steps(clean, x, y, 3)
        assert not np.allclose(clean.export_params()["fc2.kernel"], full.export_params()["fc2.kernel"],
                               rtol=0, atol=1e-6)

    def test_probes_and_eval_do_not_move_state(self):
        m = load_model("cnn2d_hard")
        x, y = batch(m)
        b = self.make(m, HP["adam"])
        run_steps(b, x, y, 1)
        p0, s0 = b.export_params(), b.export_opt_state()
        masks = masks_for(m, 0, 5, len(x), "harness")
        b.forward_layers(x, masks)
        b.eval_layers(x)
        b.gradients(x, y, masks)
        b.evaluate(x, y)
        assert_same(b.export_params(), p0)          # a probe that moved them would shift the run it probes
        assert_same(b.export_opt_state(), s0)

    def test_layers_and_gradients_are_the_forward_probes_and_gradients_from_one_program(self):
        """Backend.layers_and_gradients (the activations its gradients saw, for harness.kinks.same_when_recorded):
        where the backend records them (`joint_program`), every layer's output and gradient is its
        forward_layers' and gradients' up to the rounding of another compiled program, its state untouched;
        None from a backend whose probes are one program already."""
        m = load_model("cnn2d_hard")
        x, y = batch(m)
        b = self.make(m, HP["adam"])
        run_steps(b, x, y, 1)
        p0, masks = b.export_params(), masks_for(m, 0, 1, len(x), "harness")
        got = b.layers_and_gradients(x, y, masks)
        assert (got is not None) == self.joint_program
        if got is None:
            return
        layers, loss, grads = got
        _, plain = b.gradients(x, y, masks)
        assert_same(layers, b.forward_layers(x, masks), exact=False, rtol=1e-5)
        assert_same(grads, plain, exact=False, rtol=1e-4)
        assert np.isfinite(loss)
        assert_same(b.export_params(), p0)

    def test_dropout_uses_the_harness_masks(self):
        m = load_model("cnn2d_hard")
        x, _ = batch(m)
        b = self.make(m, HP["adam"])
        masks = masks_for(m, 0, 0, len(x), "harness")
        out = b.forward_layers(x, masks)
        assert list(out) == [l.name for l in m.layers]                 # in layer order
        np.testing.assert_allclose(out["drop1"], np.where(masks["drop1"], out["gap"] / 0.75, 0.0), rtol=1e-6)
        other = masks_for(m, 0, 1, len(x), "harness")
        assert not np.array_equal(b.forward_layers(x, other)["drop1"], out["drop1"])

    # ----------------------------------------------------------------------- layer semantics
    def test_same_avgpool_excludes_padding_and_same_conv_pads_bottom_right(self):
        m = layers_model([{"type": "avgpool2d", "name": "ap", "pool": 3, "stride": 2, "padding": "same"},
                          {"type": "conv2d", "name": "cv", "filters": 1, "kernel": 2, "stride": 2,
                           "padding": "same", "use_bias": False}])
        p = init_params(m, 0)
        p["cv.kernel"] = np.ones_like(p["cv.kernel"])
        x = np.ones((2, 6, 6, 2), np.float32)
        out = self.make(m, HP["adam"], params=p).forward_layers(x, {})
        np.testing.assert_array_equal(out["ap"], np.ones((2, 3, 3, 2)))          # padding not counted
        # 3x3 input, kernel 2, stride 2: TF 'SAME' pads one row/column at the bottom/right only, so the
        # top-left window sees 4 pixels x 2 channels, the bottom-right one 1 pixel x 2 channels
        np.testing.assert_array_equal(out["cv"][0, :, :, 0], [[8, 4], [4, 2]])
        sym = self.make(m, HP["adam"], params=p, fault="symmetric_same_padding").forward_layers(x, {})
        np.testing.assert_array_equal(sym["cv"][0, :, :, 0], [[2, 4], [4, 8]])   # k//2 = 1 on every side

    def test_maxpool_same_and_ceil_fault(self):
        x = -np.arange(50, dtype=np.float32).reshape(2, 5, 5, 1)    # all negative: -inf padding must never win
        ms = layers_model([{"type": "maxpool2d", "name": "mp", "pool": 2, "stride": 2, "padding": "same"}],
                          shape=(5, 5, 1))
        same = self.make(ms, HP["adam"]).forward_layers(x, {})["mp"]
        np.testing.assert_array_equal(same[0, :, :, 0], [[0, -2, -4], [-10, -12, -14], [-20, -22, -24]])
        # a 'valid' pool on an odd size floors the output; the fault (torch ceil_mode) keeps the partial windows
        mv = build_model({"name": "t", "input_shape": [5, 5, 1], "num_classes": 2, "layers": [
            {"type": "maxpool2d", "name": "mp", "pool": 2}, {"type": "global_avgpool2d", "name": "gap"},
            {"type": "dense", "name": "out", "units": 2}]})
        valid = self.make(mv, HP["adam"]).forward_layers(x, {})["mp"]
        np.testing.assert_array_equal(valid[0, :, :, 0], [[0, -2], [-10, -12]])
        ceil = self.make(mv, HP["adam"], fault="maxpool_ceil").forward_layers(x, {})["mp"]
        np.testing.assert_array_equal(ceil[0, :, :, 0], [[0, -2, -4], [-10, -12, -14], [-20, -22, -24]])

    def test_batchnorm_torch_convention_and_its_faults(self):
        m = load_model("cnn2d_hard")
        x, y = batch(m, n=8)
        masks = masks_for(m, 0, 0, 8, "harness")
        sgd = HParams(optimizer="sgd", lr=0.1)
        b = self.make(m, sgd)
        rec = b.forward_layers(x, masks)
        a = rec["conv1"].astype(np.float64)
        mean, var = a.mean((0, 1, 2)), a.var((0, 1, 2))
        np.testing.assert_allclose(rec["bn1"], (a - mean) / np.sqrt(var + 1e-5), rtol=1e-4, atol=1e-5)
        b.train_step(0, x, y, masks)
        p = b.export_params()
        n = a.shape[0] * a.shape[1] * a.shape[2]
        np.testing.assert_allclose(p["bn1.running_mean"], 0.1 * mean, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(p["bn1.running_var"], 0.9 + 0.1 * var * n / (n - 1), rtol=1e-5)  # unbiased
        f = self.make(m, sgd, fault="bn_momentum_flipped")
        f.train_step(0, x, y, masks)
        np.testing.assert_allclose(f.export_params()["bn1.running_mean"], 0.9 * mean, rtol=1e-5, atol=1e-7)
        e = self.make(m, sgd, fault="bn_eps_keras").forward_layers(x, masks)["bn1"]
        np.testing.assert_allclose(e, (a - mean) / np.sqrt(var + 1e-3), rtol=1e-4, atol=1e-5)
        # evaluation normalises with the running statistics, not the batch's
        loss, acc = self.make(m, sgd, params=p).evaluate(x, y)
        assert loss != pytest.approx(b.gradients(x, y, masks)[0], rel=1e-3) and 0.0 <= acc <= 1.0

    def test_flatten_is_hwc_and_the_fault_reads_chw(self):
        m = load_model("cnn2d_2conv_2fc")
        x, _ = batch(m)
        out = self.make(m, HP["adam"]).forward_layers(x, {})
        np.testing.assert_array_equal(out["flatten_1"], out["relu_2"].reshape(len(x), -1))
        p = init_params(m, 0)
        np.testing.assert_allclose(out["fc1"], out["flatten_1"] @ p["fc1.kernel"] + p["fc1.bias"],
                                   rtol=1e-5, atol=1e-5)
        f = self.make(m, HP["adam"], fault="flatten_no_permute")
        chw = out["relu_2"].transpose(0, 3, 1, 2).reshape(len(x), -1)          # torch's flatten order
        np.testing.assert_allclose(f.forward_layers(x, {})["fc1"], chw @ p["fc1.kernel"] + p["fc1.bias"],
                                   rtol=1e-5, atol=1e-5)

    # ----------------------------------------------------------------------- the other faults
    def test_grad_double_and_label_smoothing(self):
        m = load_model("cnn2d_2conv_2fc")
        x, y = batch(m)
        clean = self.make(m, HP["adam"])
        l0, g0 = clean.gradients(x, y, {})
        l1, g1 = self.make(m, HP["adam"], fault="grad_double").gradients(x, y, {})
        assert l1 == pytest.approx(l0, rel=1e-7)
        for k in g0:
            np.testing.assert_allclose(g1[k], 2 * g0[k], rtol=1e-6, atol=1e-12)
        ls, _ = self.make(m, HP["adam"], fault="label_smoothing").gradients(x, y, {})
        logits = clean.forward_layers(x, {})["fc2"].astype(np.float64)
        z = logits - logits.max(1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(1, keepdims=True))
        want = np.mean(-0.9 * logp[np.arange(len(y)), y] - 0.1 * logp.mean(1))
        assert ls == pytest.approx(want, rel=1e-5)

    def test_dropout_in_eval_changes_eval_only(self):
        m = load_model("cnn2d_hard")
        x, y = batch(m, n=64)
        clean, faulty = self.make(m, HP["adam"]), self.make(m, HP["adam"], fault="dropout_in_eval")
        assert clean.evaluate(x, y) == clean.evaluate(x, y)
        e1, e2 = faulty.evaluate(x, y), faulty.evaluate(x, y)
        assert e1 != clean.evaluate(x, y) and e1 != e2            # a fresh native mask per evaluation
        masks = masks_for(m, 0, 0, len(x), "harness")
        assert clean.gradients(x, y, masks)[0] == faulty.gradients(x, y, masks)[0]

    def test_missing_bias_drops_the_first_bias_only(self):
        m = load_model("cnn2d_hard")      # conv1 and conv2 have no bias: the first one is conv3's
        x, _ = batch(m)
        p = init_params(m, 0)
        p["conv3.bias"] = np.full_like(p["conv3.bias"], 0.5)
        p["fc1.bias"] = np.full_like(p["fc1.bias"], 0.5)
        ones = {"drop1": np.ones((len(x), 64), bool)}
        a = self.make(m, HP["adam"], params=p).forward_layers(x, ones)
        faulty = self.make(m, HP["adam"], params=p, fault="missing_bias")
        b = faulty.forward_layers(x, ones)
        np.testing.assert_allclose(a["conv3"] - 0.5, b["conv3"], atol=1e-6)
        assert np.array_equal(a["conv2"], b["conv2"])
        _, g = faulty.gradients(x, np.zeros(len(x), np.int32), ones)
        assert not np.any(g["conv3.bias"]) and np.any(g["fc1.bias"])

    # ----------------------------------------------------------------------- against torch
    @pytest.mark.parametrize("fault,model,first", LOWERING_FAULTS)
    def test_lowering_faults_make_the_probe_disagree_with_torch(self, fault, model, first, results_root):
        """The faulty lowering disagrees with clean torch from the faulty layer on, while the clean one agrees
        there; and the backend with the fault computes what torch with the same fault computes."""
        from harness.probes import compare, standard_cases

        from .conftest import need, probes_for
        need("torch")
        need(self.backend)
        cases = {"sgd": standard_cases()["sgd"]}
        ref = probes_for("torch", model, results_root, cases=cases)["sgd"].arrays
        ref_f = probes_for("torch", model, results_root, fault=fault, cases=cases)["sgd"].arrays
        clean = probes_for(self.backend, model, results_root, cases=cases)["sgd"].arrays
        bad = probes_for(self.backend, model, results_root, fault=fault, cases=cases)["sgd"].arrays
        # forward, loss and gradients, leaving out the records of flat features (their order is a recorder's
        # layout convention, not the network's computation)
        keys = [k for k in ref if k.startswith(("forward/", "grad/", "loss")) and "flatten" not in k]
        by_key = {d.key: d for d in compare(bad, ref, keys=keys)}
        failing = [k for k in keys if not by_key[k].ok]
        assert failing and failing[0] == first, failing[:3]
        assert by_key[first].rel > 1e-2
        assert all(d.ok for d in compare(clean, ref, keys=keys)), f"clean {self.backend} must agree with torch"
        assert all(d.ok for d in compare(bad, ref_f, keys=keys)), f"{self.backend} and torch inject the same fault"
