"""Real torch runs shared by the integration tests of `duipai compare` and of the localization: one
set per session, short enough to keep the whole new test time small (each run is one backend process)."""
from __future__ import annotations

from pathlib import Path

from .conftest import need

STEPS = 40
_CACHE: dict[tuple, Path] = {}


def run(root: Path, optimizer: str = "momentum", backend: str = "torch", **cfg) -> Path:
    """One run of cnn2d_2conv_2fc (runner.execute, default folder name), made once per session."""
    from algorithms.optim import HParams
    from harness import runner
    from algorithms.contract import RunConfig
    need(backend)
    extra_hp = cfg.pop("hp", {})
    key = (str(root), optimizer, backend, tuple(sorted(cfg.items())), tuple(sorted(extra_hp.items())))
    if key not in _CACHE:
        hp = HParams(steps=STEPS, optimizer=optimizer, lr=0.05 if optimizer == "momentum" else 1e-3,
                     eval_every=10, checkpoint_every=10, **extra_hp)
        _CACHE[key] = runner.execute(RunConfig(model="cnn2d_2conv_2fc", backend=backend, hparams=hp, **cfg), root)
    return _CACHE[key]


def compare_root(results_root: Path) -> Path:
    d = results_root / "compare"
    d.mkdir(exist_ok=True)
    return d
