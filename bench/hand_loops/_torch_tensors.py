"""The torch hand loops' shared data and evaluation: the data set as NCHW tensors once, the batch order, and
the test-set evaluation (model.eval(), no_grad, loss and accuracy read back). Imported after torch (after
_common.setup_env)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from bench.hand_loops._common import BATCH, Problem


def tensors(problem: Problem, steps: int) -> tuple[torch.Tensor, ...]:
    """(X, Y, order, X_test, Y_test): images NCHW, labels int64, converted once before the loop."""
    nchw = lambda a: torch.from_numpy(a).permute(0, 3, 1, 2).contiguous()   # noqa: E731
    order = torch.from_numpy(problem.order)
    assert order.shape == (steps, BATCH)
    return (nchw(problem.x_train), torch.from_numpy(problem.y_train).long(), order, nchw(problem.x_test),
            torch.from_numpy(problem.y_test).long())


def evaluator(model: nn.Module, loss_fn: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], tuple[float, float]]:
    """The test set's (loss, accuracy) in inference mode; the model left in training mode."""
    @torch.no_grad()
    def evaluate() -> tuple[float, float]:
        model.eval()
        logits = model(x)
        out = loss_fn(logits, y).item(), (logits.argmax(1) == y).float().mean().item()
        model.train()
        return out
    return evaluate
