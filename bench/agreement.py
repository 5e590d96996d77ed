"""300-step agreement of every backend with torch, against the 1-ULP envelope of torch itself.

For each model: the torch reference run, K torch runs whose initial weights are moved by one ULP
(seeds 1..K), and every other installed backend; reports max over steps of |loss - loss_torch|
per backend next to the envelope (max over the ULP runs), and their ratio (target <= 3).

    python bench/agreement.py [--models ...] [--backends ...] [--steps 300] [--k 2]
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from algorithms.optim import HParams  # noqa: E402
from harness import runner  # noqa: E402
from algorithms.contract import RunConfig  # noqa: E402
from harness.errors import BackendFailed  # noqa: E402

OUT = Path(__file__).parent / "results"


def loss(folder: Path) -> pd.Series:
    return pd.read_csv(folder / "steps.csv")["loss"]


def measure(model: str, backends: list[str], steps: int, k: int, root: Path, optimizer: str = "momentum") -> list[dict]:
    hp = HParams(steps=steps, optimizer=optimizer, lr=0.05 if optimizer in ("sgd", "momentum", "nesterov") else 1e-3)
    ref = runner.execute(RunConfig(model=model, backend="torch", hparams=hp), root)
    env = max(float((loss(runner.execute(RunConfig(model=model, backend="torch", hparams=hp, perturb_ulp=s), root))
                      - loss(ref)).abs().max()) for s in range(1, k + 1))
    rows = []
    for b in backends:
        try:
            d = float((loss(runner.execute(RunConfig(model=model, backend=b, hparams=hp), root)) - loss(ref)).abs().max())
            rows.append({"model": model, "backend": b, "max_abs_loss_diff": d, "ulp_envelope": env,
                         "ratio": d / env if env else float("inf"), "ok": d <= 3 * env})
        except BackendFailed as e:
            rows.append({"model": model, "backend": b, "error": str(e).splitlines()[0]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["cnn2d_2conv_2fc", "cnn2d_3conv_3fc", "cnn2d_hard"])
    ap.add_argument("--backends", nargs="+", default=["jax", "tensorflow", "keras-tensorflow", "keras-jax", "keras-torch"])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--k", type=int, default=2, help="ULP-perturbed torch runs")
    args = ap.parse_args()
    backends = [b for b in args.backends if b in runner.installed_backends()]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for m in args.models:
            rows += measure(m, backends, args.steps, args.k, Path(tmp))
    df = pd.DataFrame(rows)
    md = df.to_markdown(index=False, floatfmt=".3g")
    stamp = f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, {platform.platform()}"
    text = f"## 300-step loss agreement with torch vs the 1-ULP envelope\n\n{stamp}, {args.steps} steps, K={args.k}\n\n{md}\n"
    print(text)
    OUT.mkdir(exist_ok=True)
    (OUT / "agreement.md").write_text(text)
    (OUT / "agreement.json").write_text(json.dumps({"when": stamp, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
