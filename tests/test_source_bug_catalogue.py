"""bench/source_bugs.py's mutations are exact text replacements in the wrappers: a refactor of a wrapper can make
one stop matching (torch_zero_grad_forgotten did when the gradients came to be zeroed by one kernel), and the
bench then refuses it instead of measuring it. Every mutation must still apply to HEAD's files and compile."""
import dataclasses
import shutil

import pytest

from bench.source_bugs import MUTATIONS, problems


@pytest.mark.skipif(shutil.which("git") is None, reason="reads the wrappers as HEAD holds them (git show)")
@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name)
def test_every_mutation_still_applies(mutation):
    assert problems(mutation) == []


def test_a_mutation_whose_text_is_gone_is_refused():
    m = MUTATIONS[0]
    gone = dataclasses.replace(m, old=m.old + "# a line no wrapper holds\n")
    assert any("0 copies" in p for p in problems(gone))
