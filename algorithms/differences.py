"""Declared semantic differences: the one list of places where a framework cannot be configured to
compute the reference mathematics. A wrapper that hits one records its id in the run manifest.

The verdict engine calls a pair DECLARED only with evidence: the reference, made to compute the declared
formula (`emulated_by`: a fault of the reference backend; `emulated_with`: options of the candidate the
reference takes over, e.g. its replica count), must agree with the candidate on every probe that was
compared, some of those probes must disagree with the plain reference, and every diverging series must
be one the difference can move (`series`, the machine-readable `shows_in`). A difference without an
emulation can at most have its `probe_keys` set aside; it never makes a verdict DECLARED. A
`statistical` difference (framework-RNG dropout masks) makes lock-step comparison meaningless beyond
the probes it cannot move: such a pair is INCONCLUSIVE (decide with `--stat`), never DECLARED.

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
    shows_in: str        # which probes/series it moves (words; `series` and `probe_keys` are what is enforced)
    series: tuple[str, ...]   # the series (harness.runs.SERIES) it can move: a divergence elsewhere is not its doing
    # regex of the step-0 probe keys it may move (harness.probes key names; the standard probe cases of
    # harness.probes hold every other key to the reference); never "any key". For an emulated difference it
    # is informational: the emulating reference is compared on every key
    probe_keys: str
    # the fault (algorithms/faults.py) that makes the reference backend compute the declared formula: the
    # verdict engine then verifies the difference (reference with the fault vs candidate) on every probe
    emulated_by: str | None = None
    # options of the candidate run that the reference takes over to compute the declared formula
    # (per-replica BatchNorm: the reference's probes use the candidate's replica count)
    emulated_with: tuple[str, ...] = ()
    # the runs are comparable only statistically (framework-RNG dropout): never DECLARED
    statistical: bool = False
    # the forward probes (and step-0 buffers) of layers before the first layer of this kind cannot move
    after_kind: str | None = None

    @property
    def emulated(self) -> bool:
        return self.emulated_by is not None or bool(self.emulated_with)


# the series a difference may move (never `lr`: the schedule does not depend on the arithmetic)
TRAINING = ("loss", "accuracy", "grad_norm", "update_norm", "param_norm")
EVAL = ("eval_loss", "eval_accuracy")

DIFFERENCES: dict[str, Difference] = {d.id: d for d in [
    Difference(
        "adam_epsilon_hat",
        "Keras/TF-kernel Adam puts epsilon outside the bias correction ('epsilon hat')",
        "p -= lr * sqrt(1-b2^t)/(1-b1^t) * m / (sqrt(v) + eps)  vs reference  p -= lr * m_hat / (sqrt(v_hat) + eps);"
        " equal to the reference with eps_eff = eps / sqrt(1-b2^t) (about 31.6 x eps at t=1)",
        "optimizer adam or adamw on keras-* (the native tensorflow backend feeds ResourceApplyAdam eps * sqrt(1-b2^t) and so computes the reference)",
        "update, update_norm, and every series after step 0",
        TRAINING + EVAL, r"^(update\d+|opt\d+|buffer[1-9]\d*)/", emulated_by="adam_eps_hat"),
    Difference(
        "keras_float32_betas",
        "Keras Adam computes its bias corrections from float32 betas",
        "1 - b^t with b = float32(b) (0.999 -> 0.99900001287) and the power in float32, vs reference 1 - b^t in "
        "float64 from the exact b: sqrt(1 - b2^t) 6.4e-6 relative low at t = 1, every update about 50 float32 "
        "ULPs smaller with the same sign (a bias no rounding produces)",
        "optimizer adam or adamw on keras-* in float32, and on keras-tensorflow in float64 (its ops.cast of a "
        "Python float to float64 goes through float32)",
        "update, update_norm, and every series after step 0",
        TRAINING + EVAL, r"^(update\d+|opt\d+|buffer[1-9]\d*)/", emulated_by="adam_float32_betas"),
    Difference(
        "keras_momentum_velocity",
        "Keras SGD momentum keeps lr inside the velocity",
        "v = mu*v - lr_t*g; p += v  vs reference  b = mu*b + g; p -= lr_t*b; equal only for a constant lr",
        "optimizer momentum or nesterov with a non-constant schedule on keras-*",
        "update_norm and every series from the first lr change",
        TRAINING + EVAL, r"^(update[1-9]\d*|opt[1-9]\d*|buffer[2-9]\d*)/", emulated_by="keras_momentum_schedule"),
    Difference(
        "keras_torch_avgpool_same",
        "Keras on the torch backend pads 'same' average pooling by replication",
        "padded pixels repeat the edge value and are counted, vs reference: padded pixels excluded from the mean",
        "on keras-torch, an avgpool2d 'same' layer with asymmetric padding whose overhanging window holds >= 2 real pixels along a dimension",
        "forward output of that layer and everything after it",
        TRAINING + EVAL, r"^(forward|eval)/|^loss$|^(grad|update\d+|opt\d+|buffer\d+)/",
        emulated_by="avgpool_replicate_pad"),
    Difference(
        "running_var_biased",
        "Keras stores the biased running variance",
        "running_var += (1-mom)*(var_biased - running_var) vs reference var_unbiased = var_biased * n/(n-1)",
        "a batchnorm2d layer, on keras-* and wherever the framework's BatchNorm stores biased variance",
        "running_var buffers, eval loss/accuracy (not training loss)",
        EVAL, r"^buffer\d+/.*running_var$", emulated_by="bn_running_var_biased"),
    Difference(
        "per_replica_batchnorm",
        "BatchNorm statistics computed per replica under data parallelism",
        "mean/var over the B/N samples of each replica vs over the global batch of B",
        "a batchnorm2d layer with devices > 1 and no synchronized BatchNorm",
        "forward of every BatchNorm layer and everything after it, in dp=1 vs dp=N",
        TRAINING + EVAL, r"^forward/|^loss$|^(grad|update\d+|opt\d+|buffer\d+)/",
        emulated_with=("devices",)),
    Difference(
        "native_dropout_masks",
        "Dropout masks drawn by the framework's own RNG",
        "mask_backend != mask_harness; runs are comparable only statistically",
        "a dropout layer with --dropout native",
        "every series after the first dropout layer",
        TRAINING + EVAL, r"^forward/|^loss$|^(grad|update\d+|opt\d+|buffer\d+)/",
        statistical=True, after_kind="dropout"),
]}


# how a candidate's manifest (`parallel.batchnorm`) says its per-replica running statistics are folded when it
# averages them over the replicas (tf.distribute); the reference then emulates that too
# (fault bn_replica_mean_running_stats); otherwise replica 0's are kept, as DDP and the reference do
REPLICA_MEAN_FOLD = "MEAN over replicas"


def describe(ids: list[str]) -> list[dict[str, str]]:
    return [vars(DIFFERENCES[i]) for i in ids]
