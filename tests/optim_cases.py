"""The optimizer cases every backend's native optimizer is checked against `reference_update` with (float64):
name -> (HParams fields, fault). One table, so every backend is held to the same cases."""
from __future__ import annotations

BASE = dict(steps=3, batch_size=16)
REFERENCE_CASES: dict[str, tuple[dict, str | None]] = {
    "sgd": (dict(optimizer="sgd", lr=0.1, **BASE), None),
    "sgd_l2": (dict(optimizer="sgd", lr=0.1, weight_decay=1e-2, **BASE), None),
    "momentum_step": (dict(optimizer="momentum", lr=0.1, schedule="step", step_size=1, **BASE), None),
    "nesterov_l2_cosine": (dict(optimizer="nesterov", lr=0.1, weight_decay=1e-2, schedule="cosine", **BASE), None),
    "adam_l2": (dict(optimizer="adam", lr=1e-3, weight_decay=1e-2, **BASE), None),
    "adamw_warmup": (dict(optimizer="adamw", lr=1e-3, weight_decay=1e-2, schedule="warmup", **BASE), None),
    "adam_eps_hat": (dict(optimizer="adam", lr=1e-3, **BASE), "adam_eps_hat"),
}
