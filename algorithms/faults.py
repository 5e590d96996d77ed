"""The catalogue of injectable faults: real bug classes, each changing one backend's computation in one
precise way (`duipai run --fault NAME`). A wrapper lists which it implements; the run manifest
records the fault. `stage` and `where` are what a correct localization must report.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Fault:
    name: str
    stage: str        # data | forward | loss | backward | optimizer | reduction | eval
    where: str        # "first dense after flatten", "stride-2 same conv", ... ("" when no layer)
    practice: str     # where this bug occurs in practice
    needs: str = ""   # what the model / hyper-parameters must contain for the fault to bite


FAULTS: dict[str, Fault] = {f.name: f for f in [
    Fault("flatten_no_permute", "forward", "first dense layer after a flatten",
          "porting NCHW weights to NHWC (or back) without permuting the rows of the first dense kernel",
          "a flatten of a spatial map larger than 1x1 followed by dense"),
    Fault("symmetric_same_padding", "forward", "conv2d/pool with 'same' padding and an odd total padding",
          "torch Conv2d(padding=k//2) used for TF 'SAME' at stride 2: pads top/left where TF pads bottom/right",
          "a 'same' layer whose total padding is odd (stride 2 on an even size)"),
    Fault("bn_momentum_flipped", "forward", "batchnorm2d running statistics",
          "copying Keras momentum=0.99 into torch BatchNorm2d(momentum=0.99) (conventions are opposite)",
          "a batchnorm2d layer (shows in running stats and eval)"),
    Fault("bn_eps_keras", "forward", "batchnorm2d",
          "Keras BatchNormalization's default epsilon 1e-3 where the reference uses 1e-5", "a batchnorm2d layer"),
    Fault("adam_eps_hat", "optimizer", "",
          "Keras/TF Adam's epsilon-hat placement treated as the same optimizer as torch Adam", "optimizer adam/adamw"),
    Fault("keras_momentum_schedule", "optimizer", "",
          "Keras-style velocity v = mu*v - lr*g under a changing learning rate",
          "optimizer momentum/nesterov and a non-constant schedule"),
    Fault("l2_not_decoupled", "optimizer", "",
          "torch Adam(weight_decay=...) used where AdamW (decoupled decay) was meant",
          "optimizer adamw with weight_decay > 0"),
    Fault("grad_sum_replicas", "reduction", "",
          "per-replica mean loss with a SUM all-reduce (or a pmean after shard_map): N x the gradient",
          "devices > 1"),
    Fault("overlapping_shards", "data", "",
          "every replica fed the first shard (a sampler without rank offsets)", "devices > 1"),
    Fault("data_shift_one_batch", "data", "",
          "a data loader that skips the first batch (an off-by-one in resume or epoch logic)"),
    Fault("label_smoothing", "loss", "",
          "label smoothing 0.1 left on in one framework's loss (a default in some training scripts)"),
    Fault("lr_schedule_off_by_one", "optimizer", "",
          "scheduler.step() called before optimizer.step(): every update uses the next step's lr",
          "a non-constant schedule"),
    Fault("dropout_in_eval", "eval", "dropout layer",
          "model.train() left on during evaluation", "a dropout layer (shows in eval series only)"),
    # biases start at zero, so the forward pass agrees at step 0: the first disagreement is the unused bias's
    # gradient (zero), i.e. the backward stage at that layer
    Fault("missing_bias", "backward", "first conv2d/dense layer with a bias",
          "use_bias dropped in one port of a layer", "a layer with use_bias = true"),
    Fault("maxpool_ceil", "forward", "maxpool2d with 'valid' padding on an odd size",
          "torch MaxPool2d(ceil_mode=True) where the reference floors the output size",
          "a valid maxpool2d on an odd-sized input followed by global pooling (cnn2d_hard pool3)"),
    Fault("grad_double", "backward", "",
          "gradient counted twice (e.g. a parameter shared by two hooks; pytorch#160285); Adam hides it in the loss"),
    Fault("lr_scale_1.001", "optimizer", "", "learning rate off by 0.1 % (a mistyped hyper-parameter)"),
    # subtle faults: one step moves by at most ~1e-4 relative, below any per-step tolerance; only a bias over
    # many steps shows them (harness/resync.py's sequential test). Perturbations (below), applied identically
    # by every wrapper; the logged `lr` stays the nominal one (the bug is in what is applied, not in the log).
    Fault("lr_rel_1e-05", "optimizer", "",
          "a learning rate off in the 5th digit (0.05 written back from float32 text as 0.0500005)"),
    Fault("lr_rel_1e-04_from_100", "optimizer", "",
          "the learning rate after the first schedule boundary (step 100) off by 1e-4 relative (a decay "
          "factor computed in another precision): the first 100 steps are exact"),
    Fault("momentum_abs_1e-05", "optimizer", "",
          "momentum 0.9 stored as 0.90001 (a config round-trip)", "optimizer momentum/nesterov"),
    Fault("weight_decay_abs_1e-05", "optimizer", "",
          "a weight decay of 1e-5 left on where the reference has none (a training script's default)"),
    Fault("eps_abs_9e-08", "optimizer", "",
          "Adam epsilon 1e-7 (Keras' default) where the reference uses 1e-8 (torch's)", "optimizer adam/adamw"),
    Fault("bn_eps_abs_1e-05", "forward", "batchnorm2d",
          "BatchNorm epsilon 2e-5 where the reference uses 1e-5", "a batchnorm2d layer"),
    Fault("bn_momentum_abs_1e-04", "forward", "batchnorm2d running statistics",
          "BatchNorm running-statistics momentum 0.1001 for 0.1 (1 - 0.8999 from a Keras conversion): only the "
          "buffers and evaluation move", "a batchnorm2d layer"),
    Fault("eval_input_rel_1e-04", "eval", "",
          "the evaluation pipeline normalizes with a rounded constant (inputs x (1 + 1e-4)); training is exact"),
]}

# The reference backend's emulations of declared differences (algorithms/differences.py `emulated_by`) that
# are not catalogued bug classes of their own: the verdict engine runs them, the self-test does not inject them.
EMULATIONS: dict[str, Fault] = {f.name: f for f in [
    Fault("bn_running_var_biased", "forward", "batchnorm2d running statistics",
          "Keras' biased running variance stored where the reference stores the unbiased one", "a batchnorm2d layer"),
    Fault("avgpool_replicate_pad", "forward", "avgpool2d 'same' with asymmetric padding",
          "'same' average pooling padded by replicating the edge (Keras on torch) instead of excluding the padding",
          "an avgpool2d 'same' layer with asymmetric padding whose overhanging window holds >= 2 real pixels"),
    Fault("bn_replica_mean_running_stats", "forward", "batchnorm2d running statistics",
          "running statistics of per-replica BatchNorm averaged over the replicas (tf.distribute's MEAN "
          "aggregation) where DDP keeps rank 0's", "a batchnorm2d layer and devices > 1"),
]}

# Perturbations: a hyper-parameter off by a little, parametric, `<target>_<rel|abs>_<e>[_from_<step>]`:
# rel: value x (1 + e), abs: value + e; _from_ (lr only): from that step on. Every wrapper applies them
# the same way (wrappers/base.py), so any backend implements any of them; the subtle faults above are named
# ones, bench/mde.py sweeps e. Targets: optimizer hyper-parameters, BatchNorm's eps and momentum (every
# batchnorm2d layer), and the evaluation inputs.
PERTURB_STAGE = {"lr": "optimizer", "momentum": "optimizer", "beta1": "optimizer", "beta2": "optimizer",
                 "eps": "optimizer", "weight_decay": "optimizer", "bn_eps": "forward", "bn_momentum": "forward",
                 "eval_input": "eval"}
_PERTURB = re.compile(r"(" + "|".join(sorted(PERTURB_STAGE, key=len, reverse=True)) +
                      r")_(rel|abs)_(\d+(?:\.\d+)?e[+-]?\d+)(?:_from_(\d+))?")


@dataclass(frozen=True)
class Perturbation:
    target: str
    mode: str          # rel | abs
    e: float
    start: int = 0     # lr: the first step it applies to

    def apply(self, value: float) -> float:
        return value * (1.0 + self.e) if self.mode == "rel" else value + self.e


def perturbation(name: str | None) -> Perturbation | None:
    """The perturbation a fault name is, or None (a catalogued lowering fault, or no fault)."""
    m = _PERTURB.fullmatch(name or "")
    if m is None or (m.group(4) and m.group(1) != "lr"):
        return None
    return Perturbation(m.group(1), m.group(2), float(m.group(3)), int(m.group(4) or 0))


def perturbation_name(target: str, mode: str, e: float, start: int = 0) -> str:
    """The fault name of a perturbation (`lr`, "rel", 1e-5 -> "lr_rel_1e-05")."""
    name = f"{target}_{mode}_{e:.0e}" + (f"_from_{start}" if start else "")
    if perturbation(name) is None:
        raise ValueError(f"not a perturbation: {name!r} (targets: {', '.join(PERTURB_STAGE)}; _from_ for lr only)")
    return name


def fault_info(name: str) -> Fault:
    """The catalogue entry of a fault, or one made for a perturbation that is not catalogued."""
    if name in FAULTS:
        return FAULTS[name]
    p = perturbation(name)
    if p is None:
        raise KeyError(name)
    return Fault(name, PERTURB_STAGE[p.target], "batchnorm2d" if p.target.startswith("bn_") else "",
                 f"{p.target} {'x (1 + ' if p.mode == 'rel' else '+ '}{p.e:g}{')' if p.mode == 'rel' else ''}"
                 + (f" from step {p.start}" if p.start else ""))


JOIN = "+"   # emulations applied together: "adam_eps_hat+bn_running_var_biased" (the reference backend only)


def combine(names: list[str]) -> str | None:
    """One fault value for several emulations at once (sorted, joined by '+'); None for none."""
    names = sorted(set(names))
    return JOIN.join(names) if names else None


def parts(name: str | None) -> set[str]:
    """The faults a (possibly combined) fault value applies."""
    return set(name.split(JOIN)) if name else set()


def check_fault(name: str | None) -> None:
    for part in sorted(parts(name)):
        if part not in FAULTS and part not in EMULATIONS and perturbation(part) is None:
            raise ValueError(f"unknown fault {part!r}; known: {', '.join(FAULTS)}")


# --------------------------------------------------------------------------- the seams a wrapper applies faults at
LABEL_SMOOTHING = 0.1      # the `label_smoothing` fault's smoothing
KERAS_BN_EPS = 1e-3        # the `bn_eps_keras` fault's epsilon (Keras BatchNormalization's default)


@dataclass(frozen=True)
class Seams:
    """The catalogued lowering faults read once from a run's fault value, as the named seams where a wrapper
    applies them: the weight layout on load (`permute`), padding (`same_pads`), normalisation parameters
    (`bn_params`), which bias a port dropped (`dropped_bias`), pooling size (`maxpool_ceil`), the loss
    (`label_smoothing`), gradients (`grad_scale`) and evaluation mode (`eval_dropout`). A wrapper's `forward`
    asks these and stays the clean lowering; the fault itself is one small transformation here."""
    fault: str | None = None

    @property
    def permute(self) -> bool:
        """False under flatten_no_permute: the first dense kernel after a flatten loaded in the other order."""
        return self.fault != "flatten_no_permute"

    @property
    def symmetric_padding(self) -> bool:
        return self.fault == "symmetric_same_padding"

    def same_pads(self, layer):
        """A 'same' layer's ((top, bottom), (left, right)) padding; under symmetric_same_padding k//2 on
        every side where TF 'SAME' pads asymmetrically."""
        from .layout import same_pads
        return same_pads(layer, self.symmetric_padding)

    def bn_params(self, options: dict, convention: str = "torch") -> tuple[float, float]:
        """(momentum, eps) of a batchnorm2d layer, the momentum in the framework's convention: "torch"
        (running = (1 - m) running + m stat, the spec's) or "keras" (running = M running + (1 - M) stat).
        bn_momentum_flipped: one framework's momentum value copied into the other's convention."""
        mom = options["momentum"]
        flipped = self.fault == "bn_momentum_flipped"
        if convention == "keras":
            mom = mom if flipped else 1.0 - mom
        elif flipped:
            mom = 1.0 - mom
        return mom, KERAS_BN_EPS if self.fault == "bn_eps_keras" else options["eps"]

    def dropped_bias(self, model) -> str | None:
        """missing_bias: the name of the first conv2d/dense layer with a bias, whose port dropped use_bias."""
        if self.fault != "missing_bias":
            return None
        return next((l.name for l in model.layers if l.kind in ("conv2d", "dense") and l.spec.options.get("use_bias")),
                    None)

    @property
    def maxpool_ceil(self) -> bool:
        """A 'valid' max pool sized as torch's ceil_mode=True does."""
        return self.fault == "maxpool_ceil"

    @property
    def label_smoothing(self) -> float:
        return LABEL_SMOOTHING if self.fault == "label_smoothing" else 0.0

    @property
    def grad_scale(self) -> float:
        """grad_double: every gradient counted twice (training and probes alike)."""
        return 2.0 if self.fault == "grad_double" else 1.0

    @property
    def eval_dropout(self) -> bool:
        """dropout_in_eval: the framework's random dropout left on in inference mode."""
        return self.fault == "dropout_in_eval"

    @property
    def coupled_adamw(self) -> bool:
        """l2_not_decoupled: adamw's weight decay coupled into the gradient (torch Adam(weight_decay=...))."""
        return self.fault == "l2_not_decoupled"
