"""The step-0 probes must FAIL when a lowering is wrong: each catalogued porting bug, injected into
torch or into JAX, is detected against the other (clean) backend, at the right probe."""
from __future__ import annotations

import pytest

from harness.probes import compare, first_failure, standard_cases

from .conftest import probes_for

CASES = [  # fault, model, optimizer case, the first probe that must disagree
    ("flatten_no_permute", "cnn2d_2conv_2fc", "sgd", "forward/fc1"),
    ("symmetric_same_padding", "cnn2d_hard", "sgd", "forward/conv2"),
    ("bn_momentum_flipped", "cnn2d_hard", "sgd", "buffer0/bn1.running_"),
    ("keras_momentum_schedule", "cnn2d_2conv_2fc", "momentum_step", "update1/"),
    # training agrees; the inference-mode forward from the same state does not, from the dropout layer on
    ("dropout_in_eval", "cnn2d_hard", "sgd", "eval/drop1"),
]


@pytest.mark.parametrize("faulty,clean", [("torch", "jax"), ("jax", "torch")])
@pytest.mark.parametrize("fault,model,case,where", CASES)
def test_wrong_lowering_is_detected_where_it_is(fault, model, case, where, faulty, clean, results_root):
    cases = {case: standard_cases()[case]}
    ref = probes_for(clean, model, results_root, cases=cases)[case]
    bad = probes_for(faulty, model, results_root, fault=fault, cases=cases)[case]
    diffs = compare(bad.arrays, ref.arrays)
    first = first_failure(diffs)
    assert first is not None, f"{fault} in {faulty} was not detected against {clean}"
    assert first.key.startswith(where), f"{fault}: first disagreement at {first.key}, expected {where}"
    # and the clean pair agrees on the same probes, so the detection is the fault's doing
    clean_faulty_backend = probes_for(faulty, model, results_root, cases=cases)[case]
    assert first_failure(compare(clean_faulty_backend.arrays, ref.arrays)) is None
