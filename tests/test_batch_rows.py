"""The same samples in another row order are matched before activations are compared (harness.batch_rows), and
nothing else is: a permutation that changes the computation still disagrees where it does."""
from __future__ import annotations

import numpy as np
import pytest

from harness.batch_rows import ROW_TOL, align, matching
from harness.probe_analysis import analyse
from harness.probes import compare

LAYERS = ["conv1", "bn1", "fc"]
N = 16


def reference(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    conv = rng.normal(size=(N, 4, 4, 3)).astype(np.float32)
    bn = (conv - conv.mean(axis=(0, 1, 2))) / conv.std(axis=(0, 1, 2))
    fc = rng.normal(size=(N, 10)).astype(np.float32)
    out = {"forward/conv1": conv, "forward/bn1": bn, "forward/fc": fc,
           "eval/conv1": conv, "eval/bn1": 0.9 * conv, "eval/fc": fc, "loss": np.asarray(2.3),
           "grad/fc.kernel": rng.normal(size=(5, 10)), "update0/fc.kernel": rng.normal(size=(5, 10))}
    return {k: np.asarray(v, np.float64) for k, v in out.items()}


def rolled(p: dict[str, np.ndarray], shift: int = N // 2, prefixes: tuple[str, ...] = ("forward/", "eval/")):
    """The second half of the batch first, as a port that hands replica 0 the other shard holds it."""
    return {k: (np.roll(v, shift, 0) if k.startswith(prefixes) else v) for k, v in p.items()}


def test_the_same_samples_in_another_order_agree_and_say_so():
    ref = reference()
    res = analyse(rolled(ref), ref, LAYERS)
    assert res["stage"] is None and res["disagreeing_keys"] == []
    assert res["rows_matched"] == {"forward": N, "eval": N}
    # compared row by row, every activation disagrees from the first layer on
    off = {d.key for d in compare(rolled(ref), ref) if not d.ok}
    assert off == {k for k in ref if k.startswith(("forward/", "eval/"))}
    assert matching(np.roll(ref["forward/conv1"], 3, 0), ref["forward/conv1"]) is not None


def test_the_reference_order_is_left_alone():
    ref = reference()
    res = analyse(dict(ref), ref, LAYERS)
    assert "rows_matched" not in res and res["disagreeing_keys"] == []
    assert align(ref, ref, LAYERS)[1] == {}


def test_statistics_over_other_samples_still_disagree_at_their_layer():
    """Per-replica BatchNorm over the other half: the matched rows agree at conv1 and not at bn1."""
    ref = reference()
    cand = rolled(ref)
    conv = cand["forward/conv1"]
    half = N // 2
    cand["forward/bn1"] = np.concatenate([(s - s.mean(axis=(0, 1, 2))) / s.std(axis=(0, 1, 2))
                                          for s in (conv[:half], conv[half:])])
    res = analyse(cand, ref, LAYERS)
    assert (res["stage"], res["layer"]) == ("forward", "bn1")
    assert res["rows_matched"]["forward"] == N


def test_a_label_that_did_not_move_with_its_sample_shows_in_the_loss():
    ref = reference()
    cand = rolled(ref)
    cand["loss"] = np.asarray(2.9)
    res = analyse(cand, ref, LAYERS)
    assert res["stage"] == "loss"


def test_duplicated_samples_are_no_permutation():
    """Overlapping shards (replica 1 trains on replica 0's half again) are not a reordering of the batch."""
    ref = reference()
    cand = dict(ref)
    for k in ("forward/conv1", "forward/bn1", "forward/fc"):
        cand[k] = np.concatenate([ref[k][:N // 2]] * 2)
    res = analyse(cand, ref, LAYERS)
    assert "rows_matched" not in res
    assert (res["stage"], res["layer"]) == ("forward", "conv1")


@pytest.mark.parametrize("off, matched", [(10 * ROW_TOL, {"eval": N}), (0.1 * ROW_TOL, {"forward": N, "eval": N})])
def test_a_first_layer_error_is_seen_at_the_first_layer_matched_or_not(off, matched):
    """Beyond the row tolerance the training rows are compared as they came (the evaluation's, untouched, still
    match); within it they are matched, and the per-key tolerance still sees the error at conv1."""
    ref = reference()
    cand = rolled(ref)
    cand["forward/conv1"] = cand["forward/conv1"] * (1 + off)
    res = analyse(cand, ref, LAYERS)
    assert res["rows_matched"] == matched
    assert (res["stage"], res["layer"]) == ("forward", "conv1")


def test_a_few_rows_of_a_large_layer_and_every_row_of_a_small_one_are_matched_apart():
    """Replayed probes keep 8 rows of a spatial layer and all 64 of a dense one: each row count has its own order."""
    rng = np.random.default_rng(3)
    ref = {"forward/conv1": rng.normal(size=(8, 4, 4, 3)), "forward/bn1": rng.normal(size=(8, 4, 4, 3)),
           "forward/fc": rng.normal(size=(64, 10)), "loss": np.asarray(1.0)}
    cand = {"forward/conv1": np.roll(ref["forward/conv1"], 4, 0), "forward/bn1": np.roll(ref["forward/bn1"], 4, 0),
            "forward/fc": np.roll(ref["forward/fc"], 32, 0), "loss": np.asarray(1.0)}
    res = analyse(cand, ref, LAYERS)
    assert res["disagreeing_keys"] == [] and res["rows_matched"] == {"forward": 64}
    cand["forward/fc"] = cand["forward/fc"][::-1].copy()   # the dense rows in an order of their own: matched too
    assert analyse(cand, ref, LAYERS)["disagreeing_keys"] == []
    cand["forward/fc"][0] += 1.0                             # and a row that is no row of the reference is not
    res = analyse(cand, ref, LAYERS)
    assert (res["stage"], res["layer"]) == ("forward", "fc")


def test_the_resync_compares_matched_rows_and_says_so():
    """The shared-state steps: a candidate holding the batch in another row order agrees at every point, its
    sequential test sees no bias, and the judgement names the points where rows were matched."""
    from harness import resync as R
    pts = []
    for t in (0, 10, 20):
        ref = reference(t)
        pts.append((t, rolled(ref), ref, ref, None))
    got = R.judge({"at": [0, 10, 20], "probes": pts, "reproduced": None, "jobs": 2}, LAYERS, analyse)
    assert got["agree"] and got["sequential"]["bias"] is None
    assert got["rows_matched"] == {0: N, 10: N, 20: N}


def test_equal_rows_are_told_apart_by_the_later_layers():
    """Two samples equal at the first layer (a duplicated image) with different dropout masks after it: the
    assignment takes the pairing the later layers agree with, whatever order the solver meets the tie in."""
    for seed in range(40):
        ref = reference(seed)
        for k in ("forward/conv1", "eval/conv1"):
            ref[k][5] = ref[k][2]
        ref["forward/bn1"][5] = 0.0   # the duplicate's own mask drops what the original keeps
        perm = np.random.default_rng(seed).permutation(N)
        cand = {k: (v[perm] if k.startswith(("forward/", "eval/")) else v) for k, v in ref.items()}
        res = analyse(cand, ref, LAYERS)
        assert res["disagreeing_keys"] == [], seed


def test_the_evaluation_takes_the_training_forwards_order_and_the_recorded_step_too():
    ref = reference()
    cand = rolled(ref)
    cand["joint/forward/bn1"] = cand["forward/bn1"]   # the candidate's step with its activations recorded
    out, moved = align(cand, ref, LAYERS)
    assert moved == {"forward": N, "eval": N}
    for k in ("forward/conv1", "eval/fc", "joint/forward/bn1"):
        np.testing.assert_array_equal(out[k], ref[k.removeprefix("joint/")])


def test_kept_rows_are_matched_when_the_order_keeps_them_together():
    """A replay keeps every 8th sample of a spatial layer: shards moved as blocks keep the kept samples on both
    sides the same, and the kept rows are matched among themselves."""
    rng = np.random.default_rng(4)
    full = {"forward/conv1": rng.normal(size=(64, 2, 2, 3)), "forward/fc": rng.normal(size=(64, 10))}
    order = np.roll(np.arange(64), 16)            # cand[order] == ref: four shards of 16, moved as blocks
    cand_full = {k: np.empty_like(v) for k, v in full.items()}
    for k, v in full.items():
        cand_full[k][order] = v
    thin = {k: (v[::8] if v.ndim == 4 else v) for k, v in full.items()}
    cand = {k: (v[::8] if v.ndim == 4 else v) for k, v in cand_full.items()}
    out, moved = align(cand, thin, LAYERS)
    np.testing.assert_array_equal(out["forward/conv1"], thin["forward/conv1"])
    np.testing.assert_array_equal(out["forward/fc"], thin["forward/fc"])


def test_kept_rows_of_a_batch_the_row_count_does_not_divide_are_matched_too():
    """60 samples, 8 kept: every 7th of the first 50 (algorithms.params.thin_activations); blocks of 14 moved keep
    the same samples on both sides."""
    from algorithms.params import thin_activations
    rng = np.random.default_rng(5)
    full = {"forward/conv1": rng.normal(size=(60, 2, 2, 3)), "forward/fc": rng.normal(size=(60, 10))}
    order = np.arange(60)
    order[:56] = np.roll(np.arange(56), 14)     # cand[order] == ref: blocks of 14 moved, the last 4 samples in place
    cand_full = {k: np.empty_like(v) for k, v in full.items()}
    for k, v in full.items():
        cand_full[k][order] = v
    thin, cand = thin_activations(full), thin_activations(cand_full)
    assert thin["forward/conv1"].shape[0] == 8
    out, _ = align(cand, thin, LAYERS)
    np.testing.assert_array_equal(out["forward/conv1"], thin["forward/conv1"])
    np.testing.assert_array_equal(out["forward/fc"], thin["forward/fc"])
