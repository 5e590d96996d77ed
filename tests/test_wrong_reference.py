"""A wrong reference on a chaotic model, with real backends: the candidates' own curves part past the envelope's
saturation, so only their shared-state comparison from each other's states tells that they agree and the
reference is the odd one out (harness/candidate_pairs.py)."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from .conftest import need


@pytest.mark.slow
def test_a_wrong_reference_on_a_chaotic_model_is_named_the_odd_one_out(tmp_path):
    """torch with its learning rate 1e-3 off as the reference, numpy and a clean torch run as candidates, on
    cnn2d_3conv_3fc with momentum and a step schedule for 100 steps (the envelope saturates near step 31):
    both candidates BUG against it, and the pair of candidates, INCONCLUSIVE on its curves, is DRIFT from
    numpy's states; the reference is named the odd one out, first line."""
    from algorithms.contract import RunConfig
    from algorithms.optim import HParams
    from harness import runner
    from harness.cli import main
    need("torch")
    hp = HParams(steps=100, optimizer="momentum", schedule="step")
    ref = runner.execute(RunConfig(model="cnn2d_3conv_3fc", backend="torch", hparams=hp,
                                   fault="lr_rel_1e-03"), tmp_path)
    cands = [runner.execute(RunConfig(model="cnn2d_3conv_3fc", backend=b, hparams=hp), tmp_path)
             for b in ("numpy", "torch")]
    r = CliRunner().invoke(main, ["compare", str(ref), *map(str, cands), "-r", ref.name, "--out", str(tmp_path / "cmp"),
                                  "-j", "2"])
    assert r.exit_code == 1, r.output
    said = [x for x in r.output.splitlines() if not x.startswith(("envelope:", "localize:"))]   # past the progress
    assert said[0].startswith("The reference torch is the odd one out"), r.output
    doc = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    assert set(doc["verdicts"].values()) == {"BUG"}
    (between,) = [p for p in doc["pairs"] if not p["with_reference"]]
    assert between["verdict"] == "DRIFT" and between["resync"]["agree"] is True, between["notes"]
    assert any("every step agrees from" in n for n in between["notes"]), between["notes"]
