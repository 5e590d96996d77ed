"""Declared semantic differences: the one list of places where a framework cannot be configured to
compute the reference mathematics. A wrapper that hits one records its id in the run manifest;
the verdict engine then calls the difference DECLARED (naming it) instead of DRIFT or BUG: verified,
where `emulated_by` names a fault that makes the reference compute the declared formula (the candidate
must then agree with that reference on every step-0 probe); by its `probe_keys` alone otherwise.

The reference mathematics are those of `algorithms.optim.reference_update` and the canonical
layer definitions in `algorithms.spec` (PyTorch's conventions where a choice had to be made).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Difference:
    id: str
    title: str
    formula: str
    when: str            # the condition under which it applies
    shows_in: str        # which probes/series it moves
    probe_keys: str = ".*"   # regex of the step-0 probe keys it may move (harness.probes key names)
    # the fault (algorithms/faults.py) that makes the reference backend compute the declared formula: the
    # verdict engine then verifies the difference (reference with the fault vs candidate) instead of
    # trusting `probe_keys`; None: no emulation, the pattern rule alone applies (said so, unverified)
    emulated_by: str | None = None


DIFFERENCES: dict[str, Difference] = {d.id: d for d in [
    Difference(
        "adam_epsilon_hat",
        "Keras/TF-kernel Adam puts epsilon outside the bias correction ('epsilon hat')",
        "p -= lr * sqrt(1-b2^t)/(1-b1^t) * m / (sqrt(v) + eps)  vs reference  p -= lr * m_hat / (sqrt(v_hat) + eps);"
        " equal to the reference with eps_eff = eps / sqrt(1-b2^t) (about 31.6 x eps at t=1)",
        "optimizer adam or adamw on keras-* (the native tensorflow backend feeds ResourceApplyAdam eps * sqrt(1-b2^t) and so computes the reference)",
        "update, update_norm, and every series after step 0",
        r"^(update\d+|opt\d+|buffer[1-9]\d*)/", emulated_by="adam_eps_hat"),
    Difference(
        "keras_momentum_velocity",
        "Keras SGD momentum keeps lr inside the velocity",
        "v = mu*v - lr_t*g; p += v  vs reference  b = mu*b + g; p -= lr_t*b; equal only for a constant lr",
        "optimizer momentum or nesterov with a non-constant schedule on keras-*",
        "update_norm and every series from the first lr change",
        r"^(update[1-9]\d*|opt[1-9]\d*|buffer[2-9]\d*)/", emulated_by="keras_momentum_schedule"),
    Difference(
        "keras_torch_avgpool_same",
        "Keras on the torch backend pads 'same' average pooling by replication",
        "padded pixels repeat the edge value and are counted, vs reference: padded pixels excluded from the mean",
        "on keras-torch, an avgpool2d 'same' layer with asymmetric padding whose overhanging window holds >= 2 real pixels along a dimension",
        "forward output of that layer and everything after it"),
    Difference(
        "running_var_biased",
        "Keras stores the biased running variance",
        "running_var += (1-mom)*(var_biased - running_var) vs reference var_unbiased = var_biased * n/(n-1)",
        "a batchnorm2d layer, on keras-* and wherever the framework's BatchNorm stores biased variance",
        "running_var buffers, eval loss/accuracy (not training loss)",
        r"^buffer\d+/.*running_var$"),
    Difference(
        "per_replica_batchnorm",
        "BatchNorm statistics computed per replica under data parallelism",
        "mean/var over the B/N samples of each replica vs over the global batch of B",
        "a batchnorm2d layer with devices > 1 and no synchronized BatchNorm",
        "forward of every BatchNorm layer and everything after it, in dp=1 vs dp=N"),
    Difference(
        "native_dropout_masks",
        "Dropout masks drawn by the framework's own RNG",
        "mask_backend != mask_harness; runs are comparable only statistically",
        "a dropout layer with --dropout native",
        "every series after the first dropout layer"),
]}


def describe(ids: list[str]) -> list[dict[str, str]]:
    return [vars(DIFFERENCES[i]) for i in ids]
