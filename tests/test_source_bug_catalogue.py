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


def test_a_bug_in_several_places_is_every_edit_applied_and_each_checked():
    """`also`: further edits of the same file (a bug whose pieces sit apart); each must match exactly once."""
    from bench.source_bugs import mutated
    m = dataclasses.replace(MUTATIONS[0], old="a = 1\n", new="a = 2\n", also=(("b = 1\n", "b = 3\n"),))
    assert mutated(m, "a = 1\nb = 1\n") == "a = 2\nb = 3\n"
    with pytest.raises(ValueError, match=r"0 copies .*\(edit 2\)"):
        mutated(m, "a = 1\nc = 1\n")
    with pytest.raises(ValueError, match=r"itself \(edit 2\)"):
        mutated(dataclasses.replace(m, also=(("b = 1\n", "b = 1\n"),)), "a = 1\nb = 1\n")


def test_the_reference_run_leaves_out_the_candidates_process_layout():
    """A one-device reference cannot take --hosts 2 (it must divide --devices): the candidate's layout stays the
    candidate's, every other option is both runs'."""
    from bench.source_bugs import run_args
    m = dataclasses.replace(MUTATIONS[0], devices=2, args=("--hosts", "2", "--optimizer", "adam", "--steps", "40"))
    assert run_args(m) == ["--hosts", "2", "--optimizer", "adam", "--steps", "40"]
    assert run_args(m, reference=True) == ["--optimizer", "adam", "--steps", "40"]
