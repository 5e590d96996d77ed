"""Results files a user may have edited, truncated or copied half-way: `duipai report` and `duipai compare` say which
file in one line and exit 2, and write nothing over what is there."""
from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import duipai_in_process


def _entry(args: list[str], capsys, monkeypatch) -> tuple[int, str]:
    code, _, err = duipai_in_process(args, monkeypatch, capsys)
    return code, err


@pytest.mark.parametrize("text, needle", [
    ("{not json", "comparison.json: not valid JSON: "),
    ('{"pairs": 3}', "comparison.json: not a duipai comparison (needs 'reference.run', 'runs' and 'pairs')"),
])
def test_report_of_a_broken_comparison_is_one_line_and_keeps_the_old_report(tmp_path, text, needle, capsys,
                                                                            monkeypatch):
    (tmp_path / "comparison.json").write_text(text)
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "index.html").write_text("the previous report")
    code, err = _entry(["report", str(tmp_path)], capsys, monkeypatch)
    assert code == 2 and err.startswith(f"duipai: error: {tmp_path / 'comparison.json'}"), err
    assert needle in err and len(err.strip().splitlines()) == 1, err
    assert (tmp_path / "report" / "index.html").read_text() == "the previous report"
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == ["index.html"]


def test_compare_says_which_run_it_left_out_for_an_unreadable_manifest(tmp_path: Path, capsys, monkeypatch):
    run = tmp_path / "cnn2d_2conv_2fc__torch__momentum-constant__s0"
    run.mkdir()
    (run / "steps.csv").write_text("step,loss\n")
    (run / "manifest.json").write_text('{"backend": "torch", ')
    code, err = _entry(["compare", str(tmp_path)], capsys, monkeypatch)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{tmp_path}: no complete run folders in it; {run.name}: left out, its manifest.json cannot be read" in err


@pytest.mark.parametrize("args, needle", [
    # a margin of 0 or less makes every step exceed the envelope: a BUG for any pair
    (["--margin", "-1"], "--margin must be a finite number > 0, got -1.0"),
    (["--margin", "nan"], "--margin must be a finite number > 0, got nan"),
    (["--resync-every", "-1"], "--resync-every must be >= 0 (0: off), got -1"),
    (["--stat", "--alpha", "2"], "--alpha must be between 0 and 1, got 2.0"),
    # 0 s or less killed every envelope job at its start and said "timed out"
    (["--timeout", "0"], "Invalid value for '--timeout': 0.0 is not in the range x>0."),
    (["--timeout", "nan"], "Invalid value for '--timeout': 'nan' is not a finite number of seconds"),
    (["--timeout", "inf"], "Invalid value for '--timeout': 'inf' is not a finite number of seconds"),   # was a traceback
    (["--timeout", "5s"], "Invalid value for '--timeout': '5s' is not a number of seconds"),
])
def test_compare_options_out_of_range_are_one_line(tmp_path, args, needle, capsys, monkeypatch):
    """Refused before any folder is read or anything trained (the folder here holds no run)."""
    code, err = _entry(["compare", str(tmp_path), *args], capsys, monkeypatch)
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_is_one_line_not_a_traceback(capsys, monkeypatch):
    """A disk filled up under a long self-test (this VM, 2026-12-05) ended it with a traceback: one line now, exit
    3, naming the file; any other OSError is still raised (a bug to trace)."""
    import errno

    from harness import cli

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "/results/runs/x/steps.csv")
    monkeypatch.setattr(cli.main, "main", full)
    code, out, err = duipai_in_process(["models"], monkeypatch, capsys)
    assert code == 3 and err.count("\n") == 1
    assert "no space left on the device writing /results/runs/x/steps.csv: free some space" in err

    def denied(*args, **kwargs):
        raise OSError(errno.EACCES, "Permission denied", "/results")
    monkeypatch.setattr(cli.main, "main", denied)
    with pytest.raises(PermissionError):
        duipai_in_process(["models"], monkeypatch, capsys)


def test_a_results_folder_without_the_reference_backend_says_how_to_compare_it(tmp_path, capsys, monkeypatch):
    """A user whose torch run was refused (torch --sync-bn on a CPU) compared the rest: the one line names the
    backends that are there and the option that picks one as the reference."""
    from .synthetic import base_eval, base_series, write_run
    for b in ("jax", "tensorflow"):
        write_run(tmp_path, f"toy__{b}__momentum-constant__s0", base_series(20), base_eval(20), backend=b)
    code, err = _entry(["compare", str(tmp_path)], capsys, monkeypatch)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "have no torch run: not compared" in err and "`-r jax` compares them against jax (backends there: jax, " \
                                                        "tensorflow)" in err, err


def test_a_matrix_results_folder_is_compared_as_duipai_all_printed_it(tmp_path, capsys, monkeypatch):
    """`duipai all` prints 'results: <out>/<matrix>', whose runs sit in runs/: `duipai compare` on that folder (with
    another -r, say) scans runs/ and writes beside them, as `all` does; it said 'no complete run folders in it'."""
    import numpy as np

    from .synthetic import base_eval, base_series, family, jitter, write_run
    ref, members = family(tmp_path / "runs", 30)
    rng = np.random.default_rng(1)
    write_run(tmp_path / "runs", "cand", jitter(base_series(30), rng, 1e-7), base_eval(30), backend="jax")
    (tmp_path / "matrix.json").write_text("{}")
    envelope = [a for m in members for a in ("--envelope", str(m))]
    code, out, err = duipai_in_process(["compare", str(tmp_path), "--no-localize", *envelope], monkeypatch, capsys)
    assert code == 0 and (tmp_path / "comparison.json").is_file(), (code, out, err)
    assert not (tmp_path / "runs" / "comparison.json").exists()
