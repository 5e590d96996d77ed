"""Synthetic run folders (manifest.json, steps.csv, eval.csv) for fast tests of the verdict engine."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

SPEC = {"name": "toy", "input_shape": [8, 8, 1], "num_classes": 10,
        "layers": [{"type": "conv2d", "name": "conv1"}, {"type": "relu", "name": "relu_1"},
                   {"type": "flatten", "name": "flatten_1"}, {"type": "dense", "name": "fc1"}]}


def base_series(n: int, batch: int = 64) -> dict[str, np.ndarray]:
    t = np.arange(n, dtype=np.float64)
    return {
        "loss": (2.3 * np.exp(-t / 30) + 0.05).astype(np.float32).astype(np.float64),
        "accuracy": np.round((1 - 0.9 * np.exp(-t / 20)) * batch) / batch,
        "grad_norm": (5 * np.exp(-t / 40) + 0.5 + 0.2 * np.sin(t)).astype(np.float32).astype(np.float64),
        "update_norm": (0.4 * np.exp(-t / 60) + 0.05).astype(np.float32).astype(np.float64),
        "param_norm": (15 + 0.01 * t).astype(np.float32).astype(np.float64),
        "lr": np.full(n, 0.05),
    }


def eval_steps(n: int, every: int = 10) -> np.ndarray:
    s = list(range(0, n, every))
    if s[-1] != n:
        s.append(n)
    return np.array(s)


def base_eval(n: int, every: int = 10, n_test: int = 359) -> dict[str, np.ndarray]:
    s = eval_steps(n, every).astype(np.float64)
    return {"eval_loss": (2.3 * np.exp(-s / 30) + 0.06).astype(np.float32).astype(np.float64),
            "eval_accuracy": np.round((1 - 0.9 * np.exp(-s / 20)) * n_test) / n_test}


def manifest(name: str, n: int, *, backend: str = "torch", seed: int = 0, perturb: int | None = None,
             fault: str | None = None, declared: list[dict] | None = None, **over) -> dict:
    m = {"schema": 1, "status": "complete", "kind": "train", "run": name, "backend": backend, "framework": backend,
         "model": "toy", "spec_hash": "spec0000", "spec": SPEC, "data": {"source": "digits", "n_test": 359},
         "data_hash": "data0000", "order_hash": f"order{seed:04d}", "weights_hash": f"w{perturb}",
         "base_weights_hash": "base0000", "init": {"seed": 0, "perturb_ulp_seed": perturb},
         "hparams": {"steps": n, "batch_size": 64, "seed": seed, "lr": 0.05, "optimizer": "momentum"},
         "hparams_hash": f"hp{seed:04d}", "options": {"threads": 1, "dtype": "float32", "fault": fault, "devices": 1},
         "fault": fault, "declared_differences": declared or []}
    m.update(over)
    return m


def write_run(root: Path, name: str, series: dict[str, np.ndarray], evals: dict[str, np.ndarray], *,
              n: int | None = None, checksums: list[str] | None = None, eval_every: int = 10, **man) -> Path:
    d = Path(root) / name
    d.mkdir(parents=True, exist_ok=True)
    n = n if n is not None else len(series["loss"])
    cs = checksums or [f"{i:012x}" for i in range(n)]
    lines = ["step,epoch,loss,accuracy,grad_norm,update_norm,param_norm,lr,batch_checksum,step_time_s"]
    for i in range(n):
        vals = [repr(float(series[c][i])) for c in ("loss", "accuracy", "grad_norm", "update_norm", "param_norm", "lr")]
        lines.append(",".join([str(i), str(i // 22)] + vals + [cs[i], "0.001"]))
    (d / "steps.csv").write_text("\n".join(lines) + "\n")
    es = eval_steps(n, eval_every)
    el = ["step,eval_loss,eval_accuracy"] + [f"{s},{float(evals['eval_loss'][i])!r},{float(evals['eval_accuracy'][i])!r}"
                                           for i, s in enumerate(es)]
    (d / "eval.csv").write_text("\n".join(el) + "\n")
    (d / "manifest.json").write_text(json.dumps(manifest(name, n, **man), indent=1))
    return d


def family(root: Path, n: int = 100, k: int = 3, rel: float = 1e-6, seed: int = 0) -> tuple[Path, list[Path]]:
    """A reference and k envelope members: the members move every value by a random relative
    amount ~rel * (1 + t/10) (drift that grows with the step)."""
    rng = np.random.default_rng(seed)
    s, e = base_series(n), base_eval(n)
    ref = write_run(root, "ref", s, e)
    members = []
    for j in range(1, k + 1):
        members.append(write_run(root, f"ref__ulp{j}", jitter(s, rng, rel), jitter(e, rng, rel), perturb=j))
    return ref, members


def jitter(series: dict[str, np.ndarray], rng, rel: float) -> dict[str, np.ndarray]:
    out = {}
    for c, v in series.items():
        if c in ("accuracy", "eval_accuracy", "lr"):
            out[c] = v.copy()
            continue
        growth = 1 + np.arange(len(v)) / 10
        out[c] = v * (1 + rel * growth * rng.standard_normal(len(v)))
    return out
