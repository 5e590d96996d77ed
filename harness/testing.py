"""Assert in your own test suite that a training run matches its golden baseline.

    from harness.testing import assert_matches_baseline, train

    def test_my_port_still_trains_the_same(tmp_path):
        run = train(backend=NAME, steps=20, out=tmp_path)        # or any duipai run folder
        assert_matches_baseline(run, "tests/baselines/my_port_20.json")

or, with the pytest plugin (`pytest_plugins = ["harness.testing"]` in your root conftest.py), the
`duipai_baseline` fixture keeps one baseline per test under `tests/baselines/` (ini option
`duipai_baselines`) and `pytest --duipai-update-baselines` writes or rewrites them:

    def test_reference_20_steps(tmp_path, duipai_baseline):
        duipai_baseline(train(backend=REFERENCE, steps=20, out=tmp_path))

The comparison is `duipai check`'s (harness/baseline_file.py, harness/exact_series.py): bitwise when the platform fingerprint and
the run's framework versions, determinism switches and devices equal the baseline's, else the
calibrated envelope (harness/envelope.py) with the baseline as the reference. Envelope mode needs
an envelope: `envelope=[folders of 1-ULP-perturbed runs]`, one stored in the baseline file
(`save_baseline(..., envelope=...)`), or the envelope baselines of the set the file belongs to.
A mismatch raises BaselineMismatch (an AssertionError) whose message names the first difference.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from .baseline_file import Baseline, BaselineError, BaselineMismatch, config_mismatches, load_baseline, \
    save_baseline, spread_envelope
from .baseline_set import INDEX, load_set
from .defaults import REFERENCE
from .exact_series import describe_diff, load_current, series_diff
from .fingerprint import platform_fingerprint, same_platform
from .config_diff import COMPARABILITY


@dataclass
class Match:
    """What assert_matches_baseline found (returned when the run matches)."""
    mode: str            # bitwise | envelope
    reason: str          # why this mode
    verdict: str         # IDENTICAL | DRIFT | INCONCLUSIVE
    detail: str


def train(*, model: str = "cnn2d_2conv_2fc", backend: str = REFERENCE, steps: int = 20, out: str | Path = "results",
          optimizer: str = "momentum", lr: float | None = None, batch_size: int = 64, seed: int = 0,
          data: str = "digits", devices: int = 1, fault: str | None = None, perturb_ulp: int | None = None,
          timeout: float | None = 600, **hparams: Any) -> Path:
    """One duipai run in its own process (runner.execute); returns its published folder."""
    from algorithms.optim import HParams
    from . import runner
    hp = HParams(optimizer=optimizer, lr=lr if lr is not None else (0.05 if optimizer in ("sgd", "momentum", "nesterov")
                                                                    else 1e-3),
                 steps=steps, batch_size=batch_size, seed=seed, eval_every=min(50, steps),
                 checkpoint_every=min(50, steps), **hparams)
    cfg = runner.RunConfig(model=model, backend=backend, hparams=hp, data=data, devices=devices, fault=fault,
                           perturb_ulp=perturb_ulp)
    return runner.execute(cfg, Path(out), timeout=timeout)


def _set_envelope(b: Baseline):
    """The envelope of the set `b` belongs to: its configuration's reference and 1-ULP baselines."""
    from .envelope import compute
    if not (b.path.parent / INDEX).is_file():
        return None
    bs, _ = load_set(b.path.parent)
    same = [x for x in bs.runs.values() if all(x.manifest.get(k) == b.manifest.get(k) for k in COMPARABILITY)]
    members = [x for x in same if x.doc.get("role") == "envelope"]
    if not members:
        return None
    ref_backend = members[0].backend
    refs = [x for x in same if x.doc.get("role") == "run" and x.backend == ref_backend
            and (x.manifest.get("init") or {}).get("perturb_ulp_seed") is None
            and (x.manifest.get("options") or {}).get("devices", 1) == 1]
    if not refs:
        return None
    return compute(refs[0].run(), [m.run() for m in members])


def _envelope(b: Baseline, current, envelope: Iterable[str | Path] | None):
    from .envelope import compute
    if envelope:
        members = [load_current(Path(p))[0] for p in envelope]
        return compute(current, members), f"{len(members)} given envelope run(s)"
    if b.doc.get("envelope"):
        return spread_envelope(b.run(), b.doc["envelope"]["spread"]), "the envelope stored in the baseline"
    env = _set_envelope(b)
    if env is not None:
        return env, f"the envelope baselines of {b.path.parent}"
    return None, ""


def assert_matches_baseline(run_dir: str | Path, baseline: str | Path, *, mode: str = "auto",
                            envelope: Iterable[str | Path] | None = None) -> Match:
    """Raise BaselineMismatch unless the run in `run_dir` matches the baseline file `baseline`.

    mode: 'auto' (bitwise when the fingerprint and versions match, else envelope), 'bitwise' or
    'envelope'. envelope: folders of 1-ULP-perturbed runs of this configuration (optional; see the
    module docstring). A missing or corrupt baseline raises BaselineError (not an AssertionError:
    the test is broken, not the run)."""
    from .compare import check_pair
    if mode not in ("auto", "bitwise", "envelope"):
        raise ValueError(f"mode must be auto, bitwise or envelope, not {mode!r}")
    b = load_baseline(baseline)
    cur, series = load_current(Path(run_dir))
    head = f"{cur.name} vs baseline {b.path}"
    cfg = config_mismatches(b.manifest, cur.manifest)
    if cfg:
        raise BaselineMismatch(f"{head}: not the same configuration: {', '.join(cfg)}")
    if b.backend != cur.backend:
        raise BaselineMismatch(f"{head}: backend {cur.backend}, the baseline's is {b.backend}")
    why = same_platform(b.fingerprint, cur.manifest, platform_fingerprint())
    use = mode if mode != "auto" else ("envelope" if why else "bitwise")
    reason = "; ".join(why) if why else "fingerprint and versions equal the baseline's"
    env, env_from = _envelope(b, cur, envelope)
    pair = check_pair(env, b.run(), cur) if env is not None else None
    if use == "bitwise":
        d = series_diff(b.series, series)
        if d is None:
            return Match("bitwise", reason, "IDENTICAL", "bitwise identical")
        msg = f"{head}: bitwise difference ({reason}): {describe_diff(d)}"
        if pair is not None:
            msg += (f"; against {env_from}: {pair.verdict}" + (f" from {_first(pair.first)}" if pair.first else ""))
        raise BaselineMismatch(msg)
    if env is None:
        raise BaselineError(f"{head}: envelope mode ({reason}) needs an envelope: pass envelope=[folders of "
                               "--perturb-ulp runs], or save the baseline with one (save_baseline(..., envelope=...))")
    if pair.first is not None:
        raise BaselineMismatch(f"{head}: envelope mode ({reason}; envelope: {env_from}): {pair.verdict} from "
                               f"{_first(pair.first)}")
    return Match("envelope", reason, pair.verdict, f"{pair.verdict} against {env_from}")


def _first(f: dict[str, Any]) -> str:
    fac = f.get("factor")
    fac = "inf" if fac is None or fac != fac or fac == float("inf") else f"{fac:.3g}x"
    return (f"step {f['step']} {f['series']}: {f['b_value']!r} vs baseline {f['a_value']!r} "
            f"({fac} the envelope)")


# --------------------------------------------------------------------------- the pytest plugin
class BaselineChecker:
    """The `duipai_baseline` fixture: `duipai_baseline(run_dir, name=None, mode=..., envelope=...)`."""

    def __init__(self, request: Any):
        self.request = request
        cfg = request.config
        self.update = bool(cfg.getoption("duipai_update_baselines"))
        self.folder = Path(cfg.rootpath) / (cfg.getini("duipai_baselines") or "tests/baselines")

    def path_for(self, name: str | None = None) -> Path:
        n = name or self.request.node.name
        return self.folder / (re.sub(r"[^A-Za-z0-9_.-]+", "_", n).strip("_") + ".json")

    def __call__(self, run_dir: str | Path, name: str | None = None, *, mode: str = "auto",
                 envelope: Iterable[str | Path] | None = None) -> Match | None:
        import pytest
        path = self.path_for(name)
        if self.update:
            save_baseline(run_dir, path, envelope=envelope or ())
            return None
        if not path.is_file():
            pytest.fail(f"no baseline {path}: create it with `pytest --duipai-update-baselines`", pytrace=False)
        return assert_matches_baseline(run_dir, path, mode=mode, envelope=envelope)


try:
    import pytest as _pytest
except ImportError:   # the assertion functions work without pytest
    _pytest = None

if _pytest is not None:
    def pytest_addoption(parser: Any) -> None:
        group = parser.getgroup("duipai")
        group.addoption("--duipai-update-baselines", action="store_true", default=False,
                        help="duipai_baseline: write or rewrite the baselines instead of comparing.")
        parser.addini("duipai_baselines", "folder of duipai_baseline's baseline files (default tests/baselines)",
                      default="tests/baselines")

    @_pytest.fixture
    def duipai_baseline(request: Any) -> BaselineChecker:
        """Compare a run folder with this test's golden baseline (see harness.testing)."""
        return BaselineChecker(request)


__all__ = ["assert_matches_baseline", "save_baseline", "train", "BaselineMismatch", "Match", "BaselineChecker"]
