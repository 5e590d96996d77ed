"""The optimizer of the numpy backend: algorithms.optim's reference maths, state kept in canonical names.

Nothing is re-derived here: `reference_update` is the formula every framework is tested against; this
module only keeps its state between steps and converts it to and from the canonical flat layout
(`momentum/<param>`, `exp_avg/<param>`, `exp_avg_sq/<param>`, `step`) that torch exports.
"""
from __future__ import annotations

import numpy as np

from algorithms.optim import STATE_ROLES, HParams, State, load_flat_state, reference_init, reference_update

class ReferenceOptimizer:
    """reference_update with state; `live` turns True at the first step (or a loaded state), as torch's
    optimizer state is empty before its first step, so both export the same keys at every step."""

    def __init__(self, hp: HParams, params: dict[str, np.ndarray], dtype: np.dtype) -> None:
        self.hp, self.dtype = hp, dtype
        self.state: State = reference_init(hp, params)
        self.live = False

    def step(self, lr: float, params: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """New parameters at the rate the step applies (`Backend.lr_for`: the schedule, moved by an lr fault)."""
        new, state = reference_update(self.hp, 0, params, grads, self.state, lr=lr)
        self.state = {k: ({n: a.astype(self.dtype) for n, a in v.items()} if isinstance(v, dict) else v)
                      for k, v in state.items()}
        self.live = True
        return {n: a.astype(self.dtype) for n, a in new.items()}

    def export(self) -> dict[str, np.ndarray]:
        if not self.live:
            return {}
        out = {f"{role}/{n}": a.copy() for role in STATE_ROLES for n, a in self.state.get(role, {}).items()}
        if "step" in self.state:
            out["step"] = np.asarray(float(self.state["step"]))
        return out

    def load(self, flat: dict[str, np.ndarray]) -> None:
        self.live = load_flat_state(self.state, flat, self.dtype) or self.live
