"""The shared-state step comparison (resync, harness/resync.py; its bias test, harness/bias_test.py) and its part of the verdict: the sequential
bias test on synthetic deviations (power below one step's tolerance, false alarms on noise), the per-point
judgement on synthetic probes, and the verdict on synthetic runs (the resync jobs replaced by arrays)."""
from __future__ import annotations

import numpy as np
import pytest

from algorithms.params import load_npz
from harness import bias_test as B
from harness import resync as R
from harness.compare import BUG, DECLARED, DRIFT, INCONCLUSIVE, compare
from harness.probe_analysis import analyse, describe
from harness.resync_text import resync_what
from harness.runs import load_run

from .synthetic import SPEC, base_eval, base_series, write_run

N = 100
LAYERS = [l["name"] for l in SPEC["layers"]]
PARAMS = ["conv1.kernel", "conv1.bias", "fc1.kernel", "fc1.bias"]
UPDATE_KEYS = [f"update0/p{i}" for i in range(10)]


# --------------------------------------------------------------------------- pieces
def test_resync_points_every_k_steps_plus_the_divergent_steps():
    assert R.resync_points(300, 25) == list(range(0, 300, 25))          # step 300 has no batch
    assert R.resync_points(900, 100) == list(range(0, 900, 100))
    assert R.resync_points(900, 100, extra=[63, 64]) == [0, 63, 64, 100, 200, 300, 400, 500, 600, 700, 800]
    # fewer than MIN_POINTS at the asked cadence: MIN_POINTS (the replay re-trains one pass whatever their number)
    assert R.resync_points(300, 100) == list(range(0, 300, 37))
    assert R.resync_points(300, 0, extra=[5, 6]) == [5, 6]
    # a short run still gets MIN_POINTS points (the sequential test needs several)
    assert R.resync_points(40, 25) == list(range(0, 40, 5)) and len(R.resync_points(40, 25)) == R.MIN_POINTS
    assert R.resync_points(5, 25) == [0, 1, 2, 3, 4]
    assert R.resync_points(60, 25) == list(range(0, 60, 7)) and len(R.resync_points(60, 25)) >= R.MIN_POINTS
    assert R.resync_points(200, 25) == list(range(0, 200, 25))     # 8 at the asked cadence: kept


def test_projection_is_the_relative_scale_of_the_deviation_whatever_the_sign():
    b = np.array([1.0, -2.0, 3.0])
    assert B.projection(1.001 * b, b) == pytest.approx(1e-3)
    assert B.projection(-b * 0.0 + b, b) == 0.0
    assert B.projection(b + np.array([1.0, 0.5, 0.0]), b) == pytest.approx(0.0)   # orthogonal noise
    assert np.isnan(B.projection(np.zeros(2), b))


def _points(rng, n_points: int, bias_ulp: float, noise_ulp: float, keys=UPDATE_KEYS) -> list[dict[str, float]]:
    return [{k: bias_ulp + noise_ulp * rng.standard_normal() for k in keys} for _ in range(n_points)]


# --------------------------------------------------------------------------- the sequential test
def test_sequential_test_catches_a_bias_far_below_one_steps_tolerance():
    """lr x (1 + 3e-6): every update 25 float32 ULPs larger, 1/12 of the per-step floor (3e-5 = 252 ULPs),
    under rounding noise of 20 ULPs per key; 12 resynced points (300 steps, every 25)."""
    assert 3e-6 <= R.FLOOR / 10
    rng = np.random.default_rng(0)
    bias = 3e-6 / B.EPS32
    st = B.sequential_test(_points(rng, 12, bias, 20.0))
    assert st["bias"] == "update" and st["kinds"]["update"]["p"] < st["threshold"]
    assert st["kinds"]["update"]["positive"] == 12
    # the same bias of the opposite sign (lr x (1 - 3e-6)) too
    assert B.sequential_test(_points(rng, 12, -bias, 20.0))["bias"] == "update"


def test_a_bias_is_placed_where_it_starts_not_where_it_is_strongest():
    """BatchNorm eps + 1e-5 (cnn2d_hard, measured in the self-test): the training forward is biased from bn1 on
    (~46 ULPs), and the inference path more strongly (~72 ULPs, smaller p); the bias starts in the forward
    pass, at bn1: what follows inherits it. The per-key tests name bn1, not conv1 (unbiased) nor a later layer."""
    from harness.resync_verdict import bias_localization
    rng = np.random.default_rng(1)
    layers = ["conv1", "bn1", "relu_1", "fc1"]
    pts = [{"forward/conv1": 3 * rng.standard_normal(), "forward/bn1": 46 + 6 * rng.standard_normal(),
            "forward/relu_1": 46 + 6 * rng.standard_normal(), "forward/fc1": 30 + 20 * rng.standard_normal(),
            "eval/conv1": 3 * rng.standard_normal(), "eval/bn1": 72 + 2 * rng.standard_normal(),
            "eval/fc1": 72 + 2 * rng.standard_normal(), "update0/fc1.kernel": 2 * rng.standard_normal()}
           for _ in range(16)]
    st = B.sequential_test(pts, layers=layers)
    assert st["kinds"]["eval"]["p"] < st["kinds"]["forward"]["p"] < st["threshold"]
    assert st["bias"] == "forward" and st["where"]["first"] == "forward/bn1"
    assert not st["where"]["keys"]["forward/conv1"]["significant"]
    loc = bias_localization(st)
    assert (loc["stage"], loc["layer"], loc["parameter"]) == ("forward", "bn1", None)
    assert "first in forward/bn1" in loc["lines"][0] and "biased after it too: eval" in loc["lines"][0]
    from harness.resync_verdict import upstream_of
    assert upstream_of("forward", {"stage": "optimizer"}) and upstream_of("forward", None)
    assert not upstream_of("forward", {"stage": "forward"}) and not upstream_of("backward", {"stage": "loss"})
    # a data or reduction finding (grads x 2 from a SUM all-reduce biases every gradient) is its own, and stays
    assert not upstream_of("backward", {"stage": "reduction"}) and not upstream_of("forward", {"stage": "data"})
    # an optimizer bias (lr x (1 + 1e-5)): every update, nothing upstream; the first parameter is named
    upd = B.sequential_test(_points(rng, 12, 3e-6 / B.EPS32, 20.0), layers=["conv1", "fc1"])
    assert upd["bias"] == "update" and bias_localization(upd)["stage"] == "optimizer"


def test_sequential_test_false_alarms_on_noise_and_on_a_rounding_sized_bias_stay_below_alpha():
    """400 pairs of pure noise, and 400 with a systematic deviation of 4 ULPs (the size measured on clean
    jax / tensorflow vs torch pairs): the fraction called a bias is at most SEQ_ALPHA."""
    rng = np.random.default_rng(1)
    for offset in (0.0, 4.0):
        hits = sum(B.sequential_test(_points(rng, 12, offset, 20.0, UPDATE_KEYS[:3]) + [])["bias"] is not None
                   for _ in range(400))
        assert hits / 400 <= B.SEQ_ALPHA, (offset, hits)


def test_sequential_test_needs_three_points_and_tolerates_zero_spread():
    st = B.sequential_test([{"loss": 1e3}, {"loss": 1e3}])
    assert st["kinds_tested"] == 0 and st["bias"] is None and st["untested"] == ["loss"]
    same = B.sequential_test([{"loss": 0.0}] * 5)          # bitwise equal steps (same code path)
    assert same["bias"] is None and same["kinds"]["loss"]["p"] == 1.0
    off = B.sequential_test([{"loss": 50.0}] * 5)          # the same deviation at every step, beyond delta
    assert off["bias"] == "loss"


def _buffer_points(rng, n_points: int, var_bias: dict[str, float]) -> list[dict[str, float]]:
    """BatchNorm buffers: the running means unbiased (rounding, 1 ULP), each layer's running variance off by
    var_bias[layer] ULPs (plus 2 ULPs of noise)."""
    return [{**{f"buffer0/{l}.running_mean": rng.standard_normal() for l in var_bias},
             **{f"buffer0/{l}.running_var": b + 2 * rng.standard_normal() for l, b in var_bias.items()}}
            for _ in range(n_points)]


def test_a_bias_in_some_keys_of_a_kind_is_found_per_key_where_the_kinds_median_hides_it():
    """Synchronized BatchNorm whose running variance is unbiased with the replica's count (bench/source_bugs.py
    tf_sync_bn_running_var_local_count, resnet_tiny): every running variance off, by 13 to 220 ULPs as the
    layer's count shrinks, every running mean unbiased; the buffer kind's median over both is ~6 ULPs, not
    significant; the per-key family is, and names the first BatchNorm in layer order."""
    from harness.resync_verdict import bias_localization
    rng = np.random.default_rng(3)
    layers = ["conv1", "bn1", "conv2", "bn2", "conv3", "bn3"]
    pts = _buffer_points(rng, 10, {"bn1": 13.0, "bn2": 55.0, "bn3": 220.0})
    owns = [{k: 1.0 for k in p} for p in pts]
    kind_only = B.sequential_test(pts, layers=layers)
    assert kind_only["bias"] is None                              # what the kind test alone said: DRIFT
    st = B.sequential_test(pts, layers=layers, owns=owns)
    assert st["by_key"] and st["bias"] == "buffer" and st["where"]["first"] == "buffer0/bn1.running_var"
    assert set(st["where"]["keys"]) == {f"buffer0/bn{i}.running_var" for i in (1, 2, 3)}
    loc = bias_localization(st)
    assert (loc["stage"], loc["parameter"]) == ("forward", "bn1.running_var")
    assert "Bonferroni over 6 keys" in loc["lines"][0] and "buffer0/bn3.running_var" in loc["lines"][0]
    # without the reference's own deviations (no float64 step at any point) no key is tested
    assert B.sequential_test(pts, layers=layers, owns=[{}] * len(pts))["per_key"]["tested"] == 0


def test_a_key_biased_earlier_in_the_step_than_the_biased_kind_places_the_bias():
    """keras-tensorflow resnet_tiny with one BatchNorm's eps 2e-5 for 1e-5 (bench/source_bugs.py
    keras_last_block_bn_eps_typo, 2026-12-06): that layer's forward output -49 ULPs at every point, the forward
    kind's median over 40 layers unmoved; the gradients of the layers before it -30..-50 ULPs, the grad kind's
    median biased too. The bias starts in the forward pass at that layer, not in the backward pass."""
    from harness.resync_verdict import bias_localization
    rng = np.random.default_rng(5)
    layers = ["conv1", "bn1", "conv2", "bn2", "fc"]
    fwd = [f"forward/{l}" for l in layers]
    grads = ["grad/conv1.kernel", "grad/bn1.gamma", "grad/conv2.kernel", "grad/bn2.gamma", "grad/fc.kernel"]
    pts = [{**{k: rng.standard_normal() for k in fwd}, "forward/bn2": -49.0 + rng.standard_normal(),
            **{k: -40.0 + 3 * rng.standard_normal() for k in grads}} for _ in range(10)]
    owns = [{k: 1.0 for k in p} for p in pts]
    kinds = B.sequential_test(pts, layers=layers)
    assert kinds["bias"] == "grad" and not kinds["kinds"]["forward"]["significant"]
    st = B.sequential_test(pts, layers=layers, owns=owns)
    assert st["by_key"] and st["bias"] == "forward" and st["where"]["first"] == "forward/bn2"
    assert (bias_localization(st)["stage"], bias_localization(st)["layer"]) == ("forward", "bn2")
    # a key biased only after the biased kind does not move the place
    later = [{**p, "forward/bn2": rng.standard_normal(), "update0/fc.kernel": 60.0 + rng.standard_normal()}
             for p in pts]
    st = B.sequential_test(later, layers=layers, owns=[{k: 1.0 for k in p} for p in later])
    assert not st["by_key"] and st["bias"] == "grad"


def test_the_per_key_null_is_widened_by_the_keys_own_rounding():
    """A key whose own float32 projection moves by 500 ULPs (a decay term through 1 - lr x wd rounded to
    float32) may differ consistently by as much between two correct implementations: held to 3 x 500; the
    same deviation on a key rounding moves by 1 ULP is a bias."""
    rng = np.random.default_rng(4)
    others = [f"update0/p{i}" for i in range(4)]
    pts = [{"update0/fc1.bias": 600.0 + 5 * rng.standard_normal(), **{k: rng.standard_normal() for k in others}}
           for _ in range(12)]
    loose = B.sequential_test(pts, owns=[{"update0/fc1.bias": 500.0, **{k: 1.0 for k in others}}] * 12)
    assert loose["bias"] is None and loose["per_key"]["tested"] == 5
    tight = B.sequential_test(pts, owns=[{"update0/fc1.bias": 1.0, **{k: 1.0 for k in others}}] * 12)
    assert tight["by_key"] and tight["where"]["first"] == "update0/fc1.bias"


def _decay_replay(tmp_path, e: float, n: int = 14, seed: int = 6) -> dict:
    """A replay of momentum SGD without weight decay on weights followed by a BatchNorm: each update u = -lr g
    with g orthogonal to its weight p (the loss does not change with the weight's scale); the float32 reference
    and the candidate round u (1e-7, 2e-7 relative), the candidate adds the decay error -lr e p. The states are
    written where a replay writes them (rep["states"])."""
    from algorithms.params import save_npz
    rng = np.random.default_rng(seed)
    lr, out, states = 0.05, [], {}
    names = ["conv1.kernel", "conv2.kernel", "fc1.kernel", "fc1.bias"]
    for t in range(0, 25 * n, 25):
        params = {q: rng.standard_normal(200) * 0.1 for q in names}
        p64 = {}
        for q, w in params.items():
            g = rng.standard_normal(200) * 0.01
            g -= (g @ w) / (w @ w) * w                      # orthogonal to the weight
            p64[f"update0/{q}"] = -lr * g
        ref, cand = _noisy(p64, 1e-7, rng), _noisy(p64, 2e-7, rng)
        cand = {k: v - lr * e * params[k.split("/", 1)[1]] for k, v in cand.items()}
        states[str(t)] = str(tmp_path / f"state_{t}.npz")
        save_npz(states[str(t)], {f"param/{q}": w for q, w in params.items()})
        out.append((t, cand, ref, p64, None))
    return {"at": [t for t, *_ in out], "probes": out, "states": states, "reproduced": None, "jobs": 3}


def test_a_weight_decay_error_before_a_batchnorm_is_found_along_the_parameter(tmp_path):
    """cnn2d_hard, weight decay + 1e-6 (bench/results/mde.md, bench/update_projection.py): the decay error moves
    each update along its parameter, which for a weight before a BatchNorm is orthogonal to the update; the
    update's projection on itself saw 1-19 ULPs (p 1), its projection on the parameter 54-213 ULPs (p 2e-8).
    The per-key test now projects every update on its parameter too (`~param` keys) and finds it; the same
    replay with a correct candidate (e 0) has no bias, and without the states nothing is projected."""
    from harness.bias_test import ALONG_PARAMETER
    from harness.resync_verdict import bias_localization
    layers = ["conv1", "bn1", "conv2", "bn2", "fc1"]
    bad = R.judge(_decay_replay(tmp_path, 1e-6), layers, analyse)
    assert bad["agree"]                                          # every step inside its tolerance
    seq = bad["sequential"]
    assert seq["by_key"] and seq["where"]["first"].endswith(ALONG_PARAMETER)
    assert seq["kinds"]["update"]["p"] > seq["threshold"]       # the kind's median: nothing
    loc = bias_localization(seq)
    assert loc["stage"] == "optimizer" and loc["parameter"] == "conv1.kernel" and ALONG_PARAMETER in loc["lines"][0]
    clean = R.judge(_decay_replay(tmp_path, 0.0), layers, analyse)
    assert clean["sequential"]["bias"] is None and clean["sequential"]["per_key"]["tested"] == 8
    blind = _decay_replay(tmp_path, 1e-6)
    blind.pop("states")
    assert R.judge(blind, layers, analyse)["sequential"]["bias"] is None


def test_per_key_false_alarms_on_noise_and_on_a_rounding_sized_bias_stay_below_alpha():
    """400 clean pairs of 40 keys each (pure noise, and a systematic 4 ULPs on every key): the per-key family
    (Bonferroni over the 40 keys) calls a bias in at most SEQ_ALPHA of them."""
    rng = np.random.default_rng(5)
    keys = [f"grad/p{i}" for i in range(20)] + [f"buffer0/bn{i}.running_var" for i in range(20)]
    for offset in (0.0, 4.0):
        hits = 0
        for _ in range(400):
            pts = _points(rng, 10, offset, 20.0, keys)
            hits += B.sequential_test(pts, owns=[{k: 1.0 for k in keys}] * 10)["bias"] is not None
        assert hits / 400 <= B.SEQ_ALPHA, (offset, hits)


# --------------------------------------------------------------------------- per point
def probes(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    p = {f"forward/{l}": rng.standard_normal((4, 8)) for l in LAYERS}
    p.update({f"eval/{l}": rng.standard_normal((4, 8)) for l in LAYERS})
    p["loss"] = np.asarray(2.3)
    p.update({f"grad/{q}": rng.standard_normal(6) for q in PARAMS})
    p.update({f"update0/{q}": rng.standard_normal(6) * 1e-2 for q in PARAMS})
    return p


def _noisy(p: dict[str, np.ndarray], rel: float, rng) -> dict[str, np.ndarray]:
    return {k: v * (1 + rel * rng.standard_normal(np.shape(v))) for k, v in p.items()}


def replay_of(points: list[int], late_fault_from: int | None = None, fault=lambda p: p, seed: int = 0) -> dict:
    """A replay result: the float32 reference 1e-7 (relative) from float64, the candidate 2e-7 from it,
    and from `late_fault_from` on the candidate computes `fault` of the step."""
    rng = np.random.default_rng(seed)
    out = []
    for t in points:
        p64 = probes(t)
        ref, cand = _noisy(p64, 1e-7, rng), _noisy(p64, 2e-7, rng)
        if late_fault_from is not None and t >= late_fault_from:
            cand = fault(cand)
        out.append((t, cand, ref, p64, None))
    return {"at": points, "probes": out, "reproduced": None, "jobs": 3}


def _lr_scale(e: float):
    return lambda p: {k: v * (1 + e) if k.startswith("update0/") else v for k, v in p.items()}


def test_judge_agrees_on_rounding_and_names_the_late_fault_step_and_stage():
    pts = [0, 25, 50, 75]
    ok = R.judge(replay_of(pts), LAYERS, analyse)
    assert ok["agree"] and ok["n"] == 4 and ok["calibrated"] and ok["sequential"]["bias"] is None
    assert ok["worst"]["worst_factor"] < 1
    bad = R.judge(replay_of(pts, 50, _lr_scale(1e-3)), LAYERS, analyse)
    assert not bad["agree"] and [p["agree"] for p in bad["per_point"]] == [True, True, False, False]
    fb = bad["first_disagreement"]
    assert fb["step"] == 50 and fb["stage"] == "optimizer" and fb["probe"].startswith("update0/")


def _drop_a_parameter(p: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A model that lost a parameter (a bias a port left out): its gradient and update probes are not there."""
    gone = PARAMS[-1]
    return {k: v for k, v in p.items() if k not in (f"grad/{gone}", f"update0/{gone}")}


def test_a_probe_one_side_lacks_never_agrees_at_a_resynced_step():
    """Every key that both sides have agrees; one parameter's probes are missing in the candidate: the point is
    a disagreement (stage probe-keys), not explained by anything that explains disagreeing keys."""
    pts = [0, 25, 50]
    bad = R.judge(replay_of(pts, 25, _drop_a_parameter), LAYERS, analyse)
    assert [p["agree"] for p in bad["per_point"]] == [True, False, False]
    fb = bad["first_disagreement"]
    assert fb["step"] == 25 and fb["stage"] == "probe-keys" and fb["missing_keys"] == [f"grad/{PARAMS[-1]}",
                                                                                        f"update0/{PARAMS[-1]}"]


def kinked_rep(points: list[int], ref_jumps: list[int], cand_jumps: list[int], size: float = 1e-4) -> dict:
    """A replay where one step is discontinuous in grad/conv1.kernel and update0/conv1.kernel (a ReLU input at
    its kink): the float32 reference's own step jumps by `size` (relative) at `ref_jumps`, the candidate's at
    `cand_jumps`; elsewhere both are rounding (1e-7, 2e-7)."""
    rng = np.random.default_rng(1)
    keys = ("grad/conv1.kernel", "update0/conv1.kernel")
    out = []
    for t in points:
        p64 = probes(t)
        ref, cand = _noisy(p64, 1e-7, rng), _noisy(p64, 2e-7, rng)
        for side, jumps in ((ref, ref_jumps), (cand, cand_jumps)):
            if t in jumps:
                for k in keys:
                    side[k] = side[k] + size * np.abs(p64[k]).max() * rng.standard_normal(p64[k].shape)
        out.append((t, cand, ref, p64, None))
    return {"at": points, "probes": out, "reproduced": None, "jobs": 3}


def test_a_discontinuity_the_reference_shows_at_other_steps_agrees_but_not_at_every_step():
    """Measured on a clean 32x32 resnet_tiny tensorflow run (docs/verdict.md): its BatchNorm beta gradients
    were 1.9x their tolerance at one of 12 resynced steps, where torch's own float32 step had jumped by up to
    7e-4 at 5 other steps (a ReLU kink flipped by rounding). The candidate's isolated jump agrees; the same
    jump at more steps than the reference jumped at is a computation that differs."""
    pts = list(range(0, 300, 25))
    one = R.judge(kinked_rep(pts, ref_jumps=[0, 100, 150], cand_jumps=[75]), LAYERS, analyse)
    assert one["agree"], one["first_disagreement"]
    assert one["discontinuities"]["flipped"] == [75] and one["discontinuities"]["reference_jumps"] == [0, 100, 150]
    assert "agree by discontinuity" in resync_what(one)
    assert next(p for p in one["per_point"] if p["step"] == 75)["discontinuity"] == ["grad/conv1.kernel",
                                                                                     "update0/conv1.kernel"]
    # without the reference's own jumps the same candidate disagrees at step 75
    alone = R.judge(kinked_rep(pts, ref_jumps=[], cand_jumps=[75]), LAYERS, analyse)
    assert not alone["agree"] and alone["first_disagreement"]["step"] == 75
    # jumps at more steps than the reference's own: not a flip of chance
    many = R.judge(kinked_rep(pts, ref_jumps=[0, 100], cand_jumps=[25, 50, 75]), LAYERS, analyse)
    assert not many["agree"] and many["first_disagreement"]["step"] == 25
    # a jump far beyond margin x the reference's own largest one disagrees
    rep = kinked_rep(pts, ref_jumps=[0, 100, 150], cand_jumps=[])
    t, cand, ref, p64, _ = rep["probes"][3]
    cand = dict(cand, **{"grad/conv1.kernel": cand["grad/conv1.kernel"] + 1e-2 * np.abs(p64["grad/conv1.kernel"]).max()})
    rep["probes"][3] = (t, cand, ref, p64, None)
    far = R.judge(rep, LAYERS, analyse)
    assert not far["agree"] and far["first_disagreement"]["step"] == 75


def test_discontinuities_are_the_reference_s_own_jumps_of_backward_kinds():
    diffs = {t: [{"key": "grad/a", "kind": "grad", "own": 1e-7 if t != 2 else 1e-4},
                 {"key": "update0/a", "kind": "update", "own": 1e-7 if t != 4 else 3e-5},
                 {"key": "forward/b", "kind": "forward", "own": 1e-7 if t != 3 else 1e-3}] for t in range(6)}
    d = R.discontinuities(diffs)
    assert d["points"] == [2, 4] and d["largest"] == {"grad": 1e-4, "update": 3e-5} and list(d["keys"]) == ["grad/a", "update0/a"]


def test_a_flip_on_another_key_than_the_reference_s_jumps_agrees_but_not_a_forward_disagreement():
    """mobilenet_tiny tensorflow (momentum, 300 steps, 2026-12-01): torch's own steps jumped on stem_bn's
    gradients (1e-4 relative) at 4 of 14 points; tensorflow's flipped a ReLU6 deeper, ir3_dw_bn.beta 3.2e-4
    at step 2, where the reference's own never jumped. The forward agreeing, that is a discontinuity too.
    A disagreeing activation is not."""
    pts = list(range(0, 300, 25))
    rep = kinked_rep(pts, ref_jumps=[0, 100, 150], cand_jumps=[])
    t, cand, ref, p64, _ = rep["probes"][3]
    for k in ("grad/fc1.kernel", "update0/fc1.kernel"):
        cand = dict(cand, **{k: cand[k] + 1e-4 * np.abs(p64[k]).max() * np.sign(p64[k])})
    rep["probes"][3] = (t, cand, ref, p64, None)
    assert R.judge(rep, LAYERS, analyse)["agree"]
    # the update alone off by as much, every gradient agreeing: the optimizer's doing (a late lr bug), not a flip
    only_update = dict(cand, **{"grad/fc1.kernel": ref["grad/fc1.kernel"]})
    rep2 = dict(rep, probes=list(rep["probes"]))
    rep2["probes"][3] = (t, only_update, ref, p64, None)
    late = R.judge(rep2, LAYERS, analyse)
    assert not late["agree"] and late["first_disagreement"]["step"] == 75
    assert late["first_disagreement"]["stage"] == "optimizer"
    fw = f"forward/{LAYERS[1]}"
    rep["probes"][3] = (t, dict(cand, **{fw: cand[fw] * (1 + 1e-4)}), ref, p64, None)
    bad = R.judge(rep, LAYERS, analyse)
    assert not bad["agree"] and bad["first_disagreement"]["step"] == 75


def test_an_evaluation_bug_beside_a_flipped_kink_is_the_evaluation_s_and_the_flip_stays_explained():
    """resnet_tiny, eval_input_rel_1e-04 (bench/results/selftest-default-resnet_tiny-part2-2026-12-04.md): in jax
    and tensorflow the resynced step 1 flipped a kink (BatchNorm gradients 40x their tolerance, every activation
    agreeing) and, beside it, the faulted evaluation disagreed. The flip went unexplained because the eval keys
    were counted among its keys, and the bug was placed at backward / block2_proj_bn. The training step and the
    inference-mode forward are separate computations: the flip explains the first, the second is the bug."""
    pts = list(range(0, 300, 25))
    rep = kinked_rep(pts, ref_jumps=[0, 100, 150], cand_jumps=[75])
    rep["probes"] = [(t, {k: v * (1 + 1e-4) if k.startswith("eval/") else v for k, v in cand.items()}, ref, p64, x)
                     for t, cand, ref, p64, x in rep["probes"]]
    out = R.judge(rep, LAYERS, analyse)
    assert not out["agree"]
    fb = out["first_disagreement"]
    assert fb["step"] == 0 and fb["stage"] == "eval" and fb["layer"] == LAYERS[0]
    at75 = R.judge(dict(rep, probes=rep["probes"][3:]), LAYERS, analyse)["first_disagreement"]
    assert at75["step"] == 75 and at75["stage"] == "eval", at75["stage"]
    assert at75["training_set_aside"] == ["grad/conv1.kernel", "update0/conv1.kernel"]
    assert all(k.startswith("eval/") for k in at75["disagreeing_keys"])
    assert next(p for p in out["per_point"] if p["step"] == 75)["worst_key"].startswith("eval/")
    assert not R.wants_more_sensitivity(out)
    summary, lines = describe(at75, "resync of step 75")
    assert summary == f"eval: {LAYERS[0]}" and any("set aside" in l for l in lines)
    assert not any("gradients that disagree" in l for l in lines)
    # the same flip with a correct evaluation: the run agrees, as without the eval keys
    clean = R.judge(kinked_rep(pts, ref_jumps=[0, 100, 150], cand_jumps=[75]), LAYERS, analyse)
    assert clean["agree"]
    # an unexplained backward-only step beside a disagreeing evaluation still asks the reference for more nudges
    alone = kinked_rep(pts, ref_jumps=[], cand_jumps=[75])
    alone["probes"] = [(t, {k: v * (1 + 1e-4) if k.startswith("eval/") and t == 75 else v for k, v in cand.items()},
                        ref, p64, x) for t, cand, ref, p64, x in alone["probes"]]
    got = R.judge(alone, LAYERS, analyse)
    assert got["first_disagreement"]["step"] == 75 and got["first_disagreement"]["stage"] == "backward"
    assert R.wants_more_sensitivity(got)


# --------------------------------------------------------------------------- the verdict
def saturating_family(root):
    """A reference whose envelope saturates at step 30 (its members' loss moves O(1) from there)."""
    s, e = base_series(N), base_eval(N)
    ref = load_run(write_run(root, "ref", s, e))
    members = []
    for j in (1, 2, 3):
        m = {k: v.copy() for k, v in s.items()}
        m["loss"][30:] *= 1 + 0.8 * j
        members.append(load_run(write_run(root, f"m{j}", m, e, perturb=j)))
    return ref, members, s, e


def chaotic_candidate(root, s, e, name="cand", **man):
    c = {k: v.copy() for k, v in s.items()}
    c["loss"][40:] *= 2.5                               # far off, but only where the envelope is O(1)
    return load_run(write_run(root, name, c, e, **man))


def test_clean_chaotic_pair_is_drift_when_every_resynced_step_agrees(tmp_path):
    from harness.envelope import compute
    ref, members, s, e = saturating_family(tmp_path)
    cand = chaotic_candidate(tmp_path, s, e)
    env = compute(ref, members)
    nothing = lambda pair: {"stage": None, "disagreeing_keys": []}
    p = compare(ref, [cand], env, members, localize=nothing,
                resync=lambda pair, extra: R.judge(replay_of([0, 25, 50, 75]), LAYERS, analyse)).pairs[0]
    assert p.verdict == DRIFT, p.notes
    assert "trajectories diverged by accumulated rounding; every step agrees from a shared state (4 resynced" in p.notes[-1]
    assert p.to_dict()["resync"]["points"] == [0, 25, 50, 75]
    # without the shared-state comparison the same pair stays INCONCLUSIVE and says what was not compared
    q = compare(ref, [cand], env, members, localize=nothing).pairs[0]
    assert q.verdict == INCONCLUSIVE and "no shared-state step comparison" in q.notes[0]
    # a failed resync job never makes it DRIFT
    r = compare(ref, [cand], env, members, localize=nothing,
                resync=lambda pair, extra: {"error": "replay torch: exit 1", "points": [0, 25]}).pairs[0]
    assert r.verdict == INCONCLUSIVE and any("a resync job failed" in n for n in r.notes)


def test_late_fault_inside_the_envelope_is_a_bug_from_the_resynced_step(tmp_path):
    """Free-running curves identical to the reference's (inside the envelope); from step 50 on the
    candidate's update is x 1.001: BUG, optimizer, step 50."""
    from harness.envelope import compute
    ref, members, s, e = saturating_family(tmp_path)
    cand = load_run(write_run(tmp_path, "late", {k: v.copy() for k, v in s.items()}, e, backend="jax"))
    p = compare(ref, [cand], compute(ref, members), members, localize=lambda pair: None,
                resync=lambda pair, extra: R.judge(replay_of([0, 25, 50, 75], 50, _lr_scale(1e-3)), LAYERS, analyse)).pairs[0]
    assert p.verdict == BUG, p.notes
    assert p.first["series"] == "resync" and p.first["step"] == 50
    assert p.localization["stage"] == "optimizer" and p.localization["step"] == 50
    assert "resync of step 50" in p.localization["method"]
    assert "resynced step 50 disagrees" in p.notes[-1]


def test_subtle_bias_inside_every_steps_tolerance_is_a_bug_by_the_sequential_test(tmp_path):
    """lr x (1 + 5e-6) at every one of 12 points: each step is inside its tolerance, the sequence is not."""
    from harness.envelope import compute
    ref, members, s, e = saturating_family(tmp_path)
    cand = chaotic_candidate(tmp_path, s, e, "subtle")
    pts = list(range(0, 300, 25))
    rs = R.judge(replay_of(pts, 0, _lr_scale(5e-6), seed=3), LAYERS, analyse)
    assert all(x["agree"] for x in rs["per_point"])
    p = compare(ref, [cand], compute(ref, members), members, localize=lambda pair: {"stage": None, "disagreeing_keys": []},
                resync=lambda pair, extra: rs).pairs[0]
    assert p.verdict == BUG and p.localization["stage"] == "optimizer", p.notes
    assert "keep one sign" in p.notes[-1] and rs["sequential"]["kinds"]["update"]["p"] < rs["sequential"]["threshold"]


def test_dropout_native_resync_is_skipped_and_stays_inconclusive(tmp_path):
    from harness.envelope import compute
    from harness.localize import Localizer
    ref, members, s, e = saturating_family(tmp_path)
    cand = chaotic_candidate(tmp_path, s, e, "native", declared=[{"id": "native_dropout_masks"}],
                              options={"threads": 1, "dtype": "float32", "fault": None, "devices": 1,
                                       "dropout": "native"})
    loc = Localizer(tmp_path, log=lambda m: None)
    p = compare(ref, [cand], compute(ref, members), members, localize=lambda pair: {"stage": None, "disagreeing_keys": []},
                resync=lambda pair, extra: loc.resync(pair, 25)).pairs[0]
    assert p.verdict == INCONCLUSIVE and "skipped" in p.resync
    assert any("framework-RNG dropout" in n for n in p.notes)
    assert DECLARED != p.verdict


@pytest.mark.parametrize("shift,want", [(0.0, DRIFT), (3.0, BUG)])
def test_a_dropout_pair_is_decided_over_seeds_automatically(tmp_path, monkeypatch, shift, want):
    """framework-RNG dropout: INCONCLUSIVE in lock-step, then decided by Welch's t-test over five data-order
    seeds per side (harness/autostat.py; the seeds' training replaced by synthetic runs whose last
    evaluation scatters by seed, the candidate's shifted by `shift`)."""
    from harness import autostat, stats
    from harness.envelope import compute
    ref, members, s, e = saturating_family(tmp_path)
    native = {"threads": 1, "dtype": "float32", "fault": None, "devices": 1, "dropout": "native"}
    cand = chaotic_candidate(tmp_path, s, e, "native", declared=[{"id": "native_dropout_masks"}], options=native)
    p = compare(ref, [cand], compute(ref, members), members, localize=lambda pair: {"stage": None, "disagreeing_keys": []},
                resync=lambda pair, extra: {"skipped": "framework-RNG dropout"}).pairs[0]
    assert p.verdict == INCONCLUSIVE and autostat.needs_stat(p)
    rng = np.random.default_rng(3)
    asked = {}

    def seeds(runs, wanted, root, timeout, log):
        asked["seeds"] = wanted
        out = list(runs)
        for seed in wanted[1:]:
            for r, extra in ((ref, 0.0), (cand, shift)):
                ev = {k: v * (1 + 0.05 * rng.standard_normal()) + extra for k, v in e.items()}
                man = {"declared": [{"id": "native_dropout_masks"}], "options": native} if r is cand else {}
                tr = {k: v * (1 + 0.01 * rng.standard_normal()) for k, v in s.items()}
                out.append(load_run(write_run(tmp_path, f"{r.name}__s{seed}", tr, ev, seed=seed, **man)))
        return out

    monkeypatch.setattr(stats, "ensure_seeds", seeds)
    autostat.decide(p)
    assert asked["seeds"] == [0, 1, 2, 3, 4]
    assert p.verdict == want and p.stat["verdict"] == want, p.notes
    assert "decided statistically over 5 data-order seeds" in p.notes[-1]


def test_a_step0_localization_on_backward_kinds_is_superseded_by_the_resynced_steps():
    """resnet_tiny adam tensorflow dp2 (2026-12-01): the step-0 probes against the emulating reference put
    grad/block3_bn1.beta 1.05e-4 off (the fixed 1e-4 floor, no nudged steps there) where the resync's step 0,
    the same step calibrated, agreed; mobilenet_tiny tensorflow dp2: update1/stem.kernel, the probes' own
    second step; resnet_tiny adam at lr 0.05, tensorflow and keras-tensorflow dp2 (2026-12-04): the same step-0
    gradients 1.6e-3 off, and after the probes' first update (Adam, lr 0.05, from the candidate's own state)
    the running statistics of their second and third steps too, where the resync's steps 0-2 agreed.
    Activations, the loss, the first step's buffers, or a step the resync did not compute: not superseded."""
    from harness.resync_verdict import superseded_by_resync
    rs = {"points": [0, 1, 2, 25, 50]}
    loc = {"disagreeing_keys": ["update1/stem.kernel", "opt1/momentum/stem.kernel"], "rel": 2.2e-4,
           "method": "step-0 probes"}
    assert "2 key(s) such as update1/stem.kernel" in superseded_by_resync(loc, rs)
    assert superseded_by_resync(dict(loc, disagreeing_keys=["grad/block3_bn1.beta", "update0/block3_bn1.beta"]), rs)
    for k in ("forward/stem", "loss", "buffer0/bn.running_mean", "eval/fc"):
        assert superseded_by_resync(dict(loc, disagreeing_keys=loc["disagreeing_keys"] + [k]), rs) is None
    later = ["grad/block3_bn1.beta", "update1/stem.kernel", "buffer1/bn.running_mean", "buffer2/bn.running_var"]
    assert "4 key(s) such as grad/block3_bn1.beta" in superseded_by_resync(dict(loc, disagreeing_keys=later), rs)
    assert superseded_by_resync(dict(loc, disagreeing_keys=later), {"points": [0, 1, 25]}) is None
    assert superseded_by_resync(dict(loc, disagreeing_keys=["update2/stem.kernel"]), {"points": [0, 1, 25]}) is None
    assert superseded_by_resync(dict(loc, disagreeing_keys=["grad/stem.kernel"]), {"points": [25, 50]}) is None
    assert superseded_by_resync(dict(loc, method="resync of step 25 from the reference's state"), rs) is None


def test_a_diverging_pair_resyncs_the_steps_its_step0_probes_hold():
    """The step-0 probes run PROBE_STEPS optimizer steps from step 0 (the later ones from the candidate's own
    state): a diverging pair's resync computes those steps from the reference's state too, wherever the curves
    first diverge, so that a step-0 finding on them can be checked (mobilenet_tiny Nesterov cosine, tensorflow
    dp 2: `update2/stem.kernel` disagreed, the curves diverged at step 24, the resync's points were 0, 12, 23-26,
    ...: the finding stood against 25 agreeing steps)."""
    from types import SimpleNamespace
    from harness import runner
    from harness.localize import divergent_steps
    from harness.resync_verdict import superseded_by_resync
    check = SimpleNamespace(diverged_step=24)
    pair = SimpleNamespace(first={"step": 24, "series": "param_norm"}, checks={"param_norm": check})
    steps = divergent_steps(pair)
    assert set(range(runner.PROBE_STEPS)) <= set(steps) and {23, 24} <= set(steps)
    loc = {"stage": "reduction", "method": "step-0 probes", "disagreeing_keys": ["update2/stem.kernel"], "rel": 1e-3}
    assert superseded_by_resync(loc, {"points": R.resync_points(300, 25, steps)})
    assert divergent_steps(SimpleNamespace(first=None, checks={})) == []


def test_a_superseded_localization_takes_its_conclusion_with_it():
    """mobilenet_tiny numpy dp2 (2026-12-01): the verdict was DECLARED by the resynced steps, yet the notes still
    led with the superseded step-0 localization's 'declared difference(s) ... do not explain probe
    grad/ir2_expand_bn.beta', contradicting it. The localization's own note goes when it is superseded (kept
    under localization.superseded); the resync's reason stays."""
    from harness.pair import Pair
    from harness.resync_verdict import apply_resync
    note = "declared difference(s) per_replica_batchnorm do not explain probe grad/ir2_expand_bn.beta: it disagrees"
    p = Pair(a=None, b=None, with_reference=True, checks={}, checksum_step=None, steps={}, verdict="BUG",
             localization={"stage": "backward", "probe": "grad/ir2_expand_bn.beta", "rel": 3e-4, "method": "step-0 probes",
                           "disagreeing_keys": ["grad/ir2_expand_bn.beta"], "note": note},
             notes=["step 0 loss: ...", note])
    rs = {"points": [0, 1, 2, 25], "agree": True, "n": 4, "sequential": {"min_p": 0.9, "threshold": 0.002},
          "worst": {"worst_key": "grad/stem.kernel", "step": 0, "worst_factor": 0.3}}
    p.resync = rs
    apply_resync(p, requested=True)
    assert p.verdict == "DRIFT" and note not in p.notes, p.notes
    assert p.localization["superseded"]["note"] == note and "discontinuity" in p.notes[-2]



def test_a_superseded_kink_leaves_what_step_0_shows_besides_its_probes():
    """resnet_tiny keras-jax, its evaluation run with BatchNorm in training mode (bench/source_bugs.py
    keras_jax_eval_in_training_mode, 2026-12-07): the step-0 probes disagreed on a gradient by a ReLU kink, the
    resync found that a discontinuity, and the pair became DRIFT, although eval_loss was 3.9e5x off at step 0, the
    same initial state evaluated. The localizer keeps what step 0 shows besides its probes (`fallback`: a report
    slip, the evaluation from the start); a superseded localization gives way to it and the verdict stays BUG."""
    from harness.pair import Pair
    from harness.resync_verdict import apply_resync
    fallback = {"stage": "eval", "method": "series", "step": 0, "summary": "eval: evaluation path",
                "lines": ["localized by series: eval: eval_loss diverge from step 0, ..."], "disagreeing_keys": []}
    p = Pair(a=None, b=None, with_reference=True, checks={}, checksum_step=None, steps={}, verdict="BUG",
             localization={"stage": "backward", "probe": "grad/b1_conv1.kernel", "rel": 3e-4, "method": "step-0 probes",
                           "disagreeing_keys": ["grad/b1_conv1.kernel"], "fallback": fallback}, notes=[])
    p.resync = {"points": [0, 1, 2, 25], "agree": True, "n": 4, "sequential": {"min_p": 0.9, "threshold": 0.002},
                "worst": {"worst_key": "grad/stem.kernel", "step": 0, "worst_factor": 0.3}}
    apply_resync(p, requested=True)
    assert p.verdict == "BUG" and p.localization["stage"] == "eval", p.notes
    assert p.localization["superseded"]["probe"] == "grad/b1_conv1.kernel"
    assert "discontinuity" in p.notes[-2] and "but step 0 shows one besides its probes: eval: evaluation path" in p.notes[-2]
    assert "the resynced steps agree" in p.notes[-1] and "the verdict above stands" in p.notes[-1]

def test_updates_off_with_every_gradient_agreeing_are_no_flip():
    """mobilenet_tiny keras-jax (momentum, 300 steps, 2026-12-01): at resynced step 275 the momentum of every
    parameter from stem to ir2_dw was ~1e-4 off, every gradient probe agreeing: the gradient probes ran another
    program (stateless_call under an eager jax.value_and_grad) than the training step, whose ReLU6 kink flipped.
    A rule excused updates off below a layer whose updates agreed (dcbc6d2); since every backend's gradient
    probe is its training step's own gradient, bit for bit (tests/test_probe_is_the_step.py,
    tests/test_keras_backend.py), a flip shows in the gradients, and updates off with every gradient agreeing
    are the optimizer's doing: BUG, in the first layers alone as in every layer (a bug confined to some
    layers' updates -- a frozen or differently scheduled backbone -- is a real porting bug)."""
    pts = list(range(0, 300, 25))
    rep = kinked_rep(pts, ref_jumps=[0, 100, 150], cand_jumps=[])
    t, cand, ref, p64, _ = rep["probes"][3]
    first = dict(cand, **{"update0/conv1.kernel": cand["update0/conv1.kernel"] + 1e-4 * np.abs(p64["update0/conv1.kernel"]).max()})
    for probe in (first, dict(first, **{"update0/fc1.kernel": first["update0/fc1.kernel"]
                                        + 1e-4 * np.abs(p64["update0/fc1.kernel"]).max()})):
        rep["probes"][3] = (t, probe, ref, p64, None)
        got = R.judge(rep, LAYERS, analyse)
        assert not got["agree"] and got["first_disagreement"]["step"] == 75


def test_a_backward_only_disagreement_asks_the_reference_for_more_nudges(tmp_path):
    """cnn2d_3conv_3fc sgd constant (2026-12-01): the tensorflow and keras-tensorflow runs (dp 1 and 2) were BUG at
    resynced step 63, conv1-conv3 gradients 1.4e-4 off, every activation and the neighbouring steps agreeing,
    the reference's own two 1-ULP nudges jumping nowhere. A step that disagrees in the backward pass only
    (some gradient among the keys) asks for MORE_SENSITIVITY_SEEDS more nudged reference steps at every point
    alike; with 8 the reference's own steps jumped at 63 and 115 (5.5e-4) and every pair was DRIFT."""
    import harness.probe_jobs as PJ
    pts = list(range(0, 300, 25))
    alone = R.judge(kinked_rep(pts, ref_jumps=[], cand_jumps=[75]), LAYERS, analyse)
    assert R.wants_more_sensitivity(alone)
    assert not R.wants_more_sensitivity(R.judge(kinked_rep(pts, ref_jumps=[0, 100], cand_jumps=[75]), LAYERS, analyse))
    for keys in (["forward/conv1", "grad/conv1.kernel"], ["update0/conv1.kernel"], ["loss"]):
        assert not R.wants_more_sensitivity(dict(alone, first_disagreement=dict(alone["first_disagreement"],
                                                                                disagreeing_keys=keys)))
    # the extra nudged replays cover every point, and are added to each point's own sensitivity
    asked = []

    def fake_nudged(ref, at, states, seeds):
        asked.append((tuple(at), tuple(seeds)))
        return {t: [_saved(tmp_path / f"nudge{s}-{t}.npz", loss=np.float64(s)) for s in seeds] for t in at}
    jobs = PJ.ProbeJobs(tmp_path, log=lambda m: None, parallel=2)
    jobs._nudged = fake_nudged
    rep = jobs.more_sensitivity(None, {"at": pts, "states": {}, "sensitivity": PJ.LazyProbeMap({})})
    # every seed asked once, in as many jobs as run at once (a process start costs more than a probe)
    assert sorted(s for _, seeds in asked for s in seeds) == list(PJ.MORE_SENSITIVITY_SEEDS)
    assert len(asked) == 2 and {a for a, _ in asked} == {tuple(pts)}
    assert rep["sensitivity_seeds"] == len(PJ.SENSITIVITY_SEEDS) + len(PJ.MORE_SENSITIVITY_SEEDS)
    assert sorted(float(p["loss"]) for p in rep["sensitivity"].get(75)) == [float(s) for s in PJ.MORE_SENSITIVITY_SEEDS]


def test_one_job_probes_every_nudge_seed_as_separate_jobs_would(tmp_path):
    """The reference's 1-ULP-nudged replays: one worker process probes every seed it is given (a process start
    costs more than the probes), bit for bit what a job of that seed alone writes; a nudge moves the probe. The
    first seeds are probed by the reference's own replay job, from the states it re-trained to: the same bits."""
    import harness.probe_jobs as PJ
    from algorithms.contract import Replay
    from algorithms.optim import HParams
    from harness import runner
    hp = HParams(optimizer="momentum", lr=0.05, steps=6, batch_size=16, eval_every=2, checkpoint_every=2)
    ref = load_run(runner.execute(runner.RunConfig(model="cnn2d_2conv_2fc", backend="numpy", hparams=hp), tmp_path))
    states = {str(t): str(f) for t, f in PJ.checkpoints(ref).items() if t in (2, 4)}
    jobs = PJ.ProbeJobs(tmp_path, log=lambda m: None)
    both, alone = jobs._nudged(ref, [2, 4], states, (1, 2)), jobs._nudged(ref, [2, 4], states, (2,))
    plain = jobs._job(ref, "plain", "replay", Replay([2, 4], states={int(t): p for t, p in states.items()}))
    for i, t in enumerate((2, 4)):
        assert [f.name for f in both[t]] == [f"probe-{i}-ulp1.npz", f"probe-{i}-ulp2.npz"]
        one, two, two_alone = (load_npz(f) for f in (*both[t], *alone[t]))
        assert all(np.array_equal(two[k], two_alone[k]) for k in two_alone)
        unmoved = load_npz(plain / f"probe-{i}.npz")
        assert not np.array_equal(one["grad/fc1.kernel"], unmoved["grad/fc1.kernel"])
        assert not np.array_equal(one["grad/fc1.kernel"], two["grad/fc1.kernel"])
    before = {p.name for p in (tmp_path / ".localize").iterdir()}
    rep = jobs.replay(ref, ref, [2, 4])
    made = {p.name for p in (tmp_path / ".localize").iterdir()} - before
    assert len(made) == 2 and not [m for m in made if "nudge" in m], made    # the reference's and the candidate's
    for t in (2, 4):
        for got, want in zip(rep["sensitivity"].get(t), (load_npz(f) for f in both[t])):
            assert all(np.array_equal(got[k], want[k]) for k in want)


def test_an_emulating_replay_is_held_to_its_own_nudged_steps(tmp_path):
    """With a declared formula to emulate, the side compared is the reference computing it: its sensitivity is
    that configuration's own 1-ULP-nudged steps, probed by the emulating job itself (the plain reference's
    nudged steps differ from the emulated probes by the declared formula: a tolerance grown by the very
    difference undone), and the plain reference's nudged steps stay the yardstick of the plain comparison."""
    import json

    import harness.probe_jobs as PJ
    from algorithms.optim import HParams
    from harness import runner
    from harness.compare_output import jsonable
    hp = HParams(optimizer="momentum", lr=0.05, steps=6, batch_size=16, eval_every=2, checkpoint_every=2)
    ref = load_run(runner.execute(runner.RunConfig(model="cnn2d_2conv_2fc", backend="numpy", hparams=hp), tmp_path))
    jobs = PJ.ProbeJobs(tmp_path, log=lambda m: None)
    change = {"fault": "lr_scale_1.001"}
    rep = jobs.replay(ref, ref, [2, 4], change)
    made = {p.name for p in (tmp_path / ".localize").iterdir()}
    own = jobs._nudged(ref, [2, 4], rep["states"], PJ.SENSITIVITY_SEEDS, **change)
    plain = jobs._nudged(ref, [2, 4], rep["states"], PJ.SENSITIVITY_SEEDS)
    key = "update0/fc1.kernel"
    for t in (2, 4):
        got, mine, theirs = (list(m) for m in (rep["sensitivity"].get(t), map(load_npz, own[t]), map(load_npz, plain[t])))
        assert all(np.array_equal(g[key], m[key]) for g, m in zip(got, mine))
        assert not any(np.array_equal(g[key], p[key]) for g, p in zip(got, theirs))
        assert all(np.array_equal(g[key], p[key]) for g, p in zip(rep["plain_sensitivity"].get(t), theirs))
    # the emulating job probed its own nudges, the plain reference's job its: no job of nudged steps alone
    assert not [m for m in made if f"nudge{PJ.SENSITIVITY_SEEDS[0]}" in m], made
    # what a localization keeps of a replay (all but its probe maps) is written as JSON with the comparison
    kept = {k: v for k, v in rep.items() if k not in PJ.PROBE_KEYS}
    assert json.loads(json.dumps(jsonable(kept)))["nudged_with"] == change


def _saved(path, **arrays):
    np.savez(path, **arrays)
    return path


def test_the_optimizer_state_of_a_flipped_gradient_follows_from_it():
    """cnn2d_hard adamw warmup (2026-12-01): at a resynced step where conv1's gradient flipped within 3x the
    reference's own largest gradient jump, Adam's moments of conv1 moved too, by more than the reference's own
    largest jump on the optimizer state (taken at other steps, from other gradients). An update or optimizer
    state of a parameter whose gradient disagrees within the flip allowance follows from that gradient; one of
    a parameter whose gradient agrees does not."""
    pts = list(range(0, 300, 25))

    def with_moments(jumping: str | None) -> dict:
        rep = kinked_rep(pts, ref_jumps=[0, 100, 150], cand_jumps=[75])
        rng = np.random.default_rng(3)
        out = []
        for t, cand, ref, p64, plain in rep["probes"]:
            moments = {f"opt0/exp_avg/{q}": rng.standard_normal(6) * 1e-3 for q in PARAMS}
            p64, ref, cand = dict(p64, **moments), dict(ref, **_noisy(moments, 1e-7, rng)), dict(cand, **_noisy(moments, 2e-7, rng))
            if t == 75 and jumping:
                k = f"opt0/exp_avg/{jumping}"
                cand[k] = cand[k] + 1e-2 * np.abs(p64[k]).max()
            out.append((t, cand, ref, p64, plain))
        return dict(rep, probes=out)
    follows = R.judge(with_moments("conv1.kernel"), LAYERS, analyse)
    assert follows["agree"] and "opt0/exp_avg/conv1.kernel" in follows["discontinuities"]["keys"], follows["first_disagreement"]
    other = R.judge(with_moments("fc1.kernel"), LAYERS, analyse)
    assert not other["agree"] and other["first_disagreement"]["step"] == 75


def _bug_with_resync_disagreeing_at(t: int, first_step: int, was: str = "BUG"):
    from harness.pair import Pair
    from harness.resync_verdict import apply_resync
    first = {"step": first_step, "series": "update_norm", "factor": 17.7, "reason": "sustained"}
    p = Pair(a=None, b=None, with_reference=True, checks={}, checksum_step=None, steps={}, verdict=was,
             localization=None, notes=[], first=first)
    fb = {"step": t, "stage": "forward", "layer": "bn1", "probe": f"buffer{t}/bn1.running_var", "rel": 4e-5,
          "disagreeing_keys": [f"buffer{t}/bn1.running_var"]}
    points = sorted({0, 25, 50, t})
    p.resync = {"points": points, "agree": False, "n": len(points), "first_disagreement": fb,
                "per_point": [{"step": s, "worst_key": f"buffer{s}/bn2.running_var", "worst_factor": 2.5}
                              for s in points],
                "sequential": {"min_p": 1e-12, "threshold": 0.002}}
    apply_resync(p, requested=True)
    return p


def test_a_resynced_step_that_disagrees_before_the_curves_part_is_the_bugs_first_step():
    """jax with its running variance biased (bench/source_bugs.py jax_bn_running_var_biased): training is unchanged,
    so the free-running curves part at step 13 exactly as the clean jax run's do (rounding, DRIFT there), while the
    resynced step 0 disagrees in buffer0/bn1.running_var. The BUG's first step is the evidence, step 0, with the
    curves' parting said beside it; a resynced step that disagrees only after the curves part leaves their step."""
    p = _bug_with_resync_disagreeing_at(0, 13)
    assert p.verdict == "BUG" and p.first["step"] == 0 and p.first["series"] == "resync"
    assert p.first["parted"] == {"step": 13, "series": "update_norm", "factor": 17.7}
    later = _bug_with_resync_disagreeing_at(25, 13)
    assert later.first["step"] == 13 and later.first["series"] == "update_norm" and "parted" not in later.first


def test_a_late_bug_is_seen_at_its_resynced_step_when_the_curves_parted_earlier_by_rounding():
    """lr_rel_1e-04_from_100 on a user's graph model, tensorflow (2026-12-05): the free-running curves part at step 6
    as the clean tensorflow run's do, an excess no one-step probe reproduces (INCONCLUSIVE by the curves alone);
    resynced step 100 disagrees. The BUG is seen first at step 100, not at step 6, and the output says the
    curves parted before it, where no one-step comparison found another computation."""
    from harness.compare_output import parted_text
    for was in ("INCONCLUSIVE", "DRIFT", "DECLARED"):
        p = _bug_with_resync_disagreeing_at(100, 6, was=was)
        assert p.verdict == "BUG" and p.first["step"] == 100 and p.first["series"] == "resync", was
        assert p.first["parted"] == {"step": 6, "series": "update_norm", "factor": 17.7}
        assert "part before it, from step 6" in parted_text(p.first)
    assert "part later, from step 13" in parted_text(_bug_with_resync_disagreeing_at(0, 13).first)


def test_a_step_inherits_an_upstream_bias_only_where_the_bias_is_there():
    """missing_bias on cnn2d_3conv_3fc at default settings (duipai selftest --models cnn2d_3conv_3fc, 2026-12-03):
    resynced step 0 disagrees at grad/conv1.bias (the gradient of a bias the port dropped), its forward equal to
    rounding (the bias is zero at initialisation), and the sequential test finds the forward keys after conv1
    biased by ~4e4 ULP over the later steps (the missing trained bias). The forward bias is not there at step 0:
    step 0 keeps its own place (backward, conv1.bias). A bias present at the step (a BatchNorm eps) is inherited."""
    from harness.resync_verdict import bias_present_at
    seq = {"where": {"first": "forward/relu_1", "keys": {"forward/relu_1": {"mean_ulp": 3.76e4, "p": 3e-5}}}}
    at_step0 = {"diffs": [{"key": "forward/relu_1", "rel": 1.3e-8}, {"key": "grad/conv1.bias", "rel": 0.416}]}
    assert not bias_present_at(seq, at_step0)
    there = {"diffs": [{"key": "forward/relu_1", "rel": 3.76e4 / 2.0 ** 23}]}
    assert bias_present_at(seq, there)
    assert bias_present_at(seq, {"diffs": []}) and bias_present_at({"where": None}, at_step0)   # nothing to look at
