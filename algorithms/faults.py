"""The catalogue of injectable faults: real bug classes, each changing one backend's computation in one
precise way (`duipai run --fault NAME`). A wrapper lists which it implements; the run manifest records the
fault. `stage` and `where` are what a correct localization must report."""
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
          "scheduler.step() called before optimizer.step(): every update uses the next step's lr (the lr "
          "logged is the schedule's)",
          "a non-constant schedule"),
    Fault("dropout_in_eval", "eval", "dropout layer",
          "model.train() left on during evaluation", "a dropout layer (shows in eval series only)"),
    # biases start at zero, so the forward pass agrees at step 0: the first disagreement is the unused bias's
    # gradient (zero), i.e. the backward stage at that layer
    Fault("missing_bias", "backward", "first conv2d/dense layer with a bias that not only a BatchNorm reads",
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
    # the graph layers' porting bugs (issue 15). Five are declaration rewrites (`rewrite_declaration`): every
    # wrapper builds its layers from the rewritten declaration, so every backend computes the same wrong model;
    # three need the lowering itself (Seams below: the concat axis, a bypassed BatchNorm, a kernel's load order)
    Fault("gelu_tanh_approx", "forward", "first gelu layer with approximate = 'none'",
          "GELU's tanh approximation where the spec says exact: jax.nn.gelu's default is approximate=True, "
          "torch's F.gelu and Keras' gelu default to exact (keras.activations.gelu(approximate=False)); a port "
          "that leaves the default changes it", "a gelu layer with approximate = 'none'"),
    Fault("layernorm_eps_default", "forward", "first layernorm layer whose eps is not 1e-3",
          "Keras LayerNormalization's default epsilon 1e-3 where the spec says otherwise (ConvNeXt: 1e-6; "
          "torch's LayerNorm default: 1e-5)", "a layernorm layer with eps != 1e-3"),
    Fault("leaky_relu_default_alpha", "forward", "first leaky_relu layer whose alpha is not 0.3",
          "keras.layers.LeakyReLU() with its default negative_slope 0.3 where the spec's alpha differs (torch's "
          "nn.LeakyReLU default is 0.01, keras.activations.leaky_relu's 0.2)", "a leaky_relu layer with alpha != 0.3"),
    Fault("dilation_dropped", "forward", "first conv2d with dilation > 1",
          "a dilated convolution ported without its dilation (dilation_rate / rhs_dilation left at 1); with "
          "'same' padding the shapes still fit, so nothing fails", "a conv2d with dilation > 1 and 'same' padding"),
    Fault("residual_after_activation", "forward", "first add read only by an activation",
          "a residual block whose shortcut is added after the activation, act(branch) + shortcut, where the "
          "spec adds before it, act(branch + shortcut) (ResNet's basic block: relu(bn2 + shortcut))",
          "an add whose output only an activation reads (its first input is taken as the branch)"),
    Fault("projection_without_bn", "forward", "first BatchNorm of a 1x1 projection shortcut",
          "a downsampling shortcut ported as the 1x1 convolution alone, without its BatchNorm (its gamma and "
          "beta still exist as parameters: loaded, exported, decayed, with a zero gradient)",
          "a batchnorm2d after a 1x1 conv2d that reads a branching output, feeding an add"),
    Fault("concat_wrong_axis", "forward", "first concat of inputs with equal shapes",
          "an NCHW port concatenating on the NHWC channel index (axis 3 = width in NCHW, torch.cat(dim=3) copied "
          "from TF's axis=-1): the maps are joined side by side, and a following flatten still fits",
          "a concat of equal-shaped inputs followed by a flatten (a conv would not fit the wrong shape)"),
    Fault("depthwise_multiplier_order", "forward", "first depthwise conv2d with a channel multiplier > 1",
          "a depthwise kernel with channel multiplier m > 1 loaded with its C*m outputs in multiplier-major "
          "order (j*C + c) where the framework (torch groups, TF depthwise_conv2d) is channel-major (c*m + j): "
          "every input channel gets another channel's filters", "a conv2d with groups = input channels < filters"),
]}

# The reference backend's emulations of declared differences (algorithms/differences.py `emulated_by`) that
# are not catalogued bug classes of their own: the verdict engine runs them, the self-test does not inject them.
EMULATIONS: dict[str, Fault] = {f.name: f for f in [
    Fault("adam_float32_betas", "optimizer", "",
          "Adam's bias corrections 1 - b^t computed from the betas cast to float32 (Keras) where the reference "
          "computes them from the exact betas in float64", "optimizer adam/adamw in a float32 run"),
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
    bad = m is None or (m.group(4) and m.group(1) != "lr")   # _from_ for lr only
    return None if bad else Perturbation(m.group(1), m.group(2), float(m.group(3)), int(m.group(4) or 0))


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
    return JOIN.join(sorted(set(names))) or None


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
KERAS_LN_EPS = 1e-3        # the `layernorm_eps_default` fault's epsilon (Keras LayerNormalization's default)
KERAS_LEAKY_RELU_ALPHA = 0.3   # the `leaky_relu_default_alpha` fault's slope (keras.layers.LeakyReLU's default)
ACTIVATION_KINDS = ("relu", "relu6", "leaky_relu", "gelu", "silu", "sigmoid", "tanh")


# --------------------------------------------------------------------------- declaration rewrites
# the faults that are a rewrite of the model declaration, with the layer kind (Entry.layer_kinds' names) each
# rewrites: every wrapper builds its layers from wrappers.base.effective_model_decl, so every backend that
# lowers that kind implements the fault, alike
DECLARATION_FAULTS: dict[str, str] = {"gelu_tanh_approx": "gelu", "layernorm_eps_default": "layernorm",
                                      "leaky_relu_default_alpha": "leaky_relu", "dilation_dropped": "conv2d:dilation",
                                      "residual_after_activation": "add"}


def _explicit_inputs(decl: dict) -> list[dict]:
    """The declaration's layers normalised (names and defaults filled) with every `inputs` written out, so
    that a rewrite may move layers' roles without changing what the others read."""
    from .spec import build_model
    model = build_model(decl)
    return [dict(d, inputs=list(l.inputs)) for d, l in zip(model.to_dict()["layers"], model.layers)]


def bias_that_matters(model) -> str | None:
    """missing_bias's layer: the first conv2d/dense bias that not only a BatchNorm reads. BatchNorm subtracts such a
    bias again with the batch mean (a zero gradient in exact arithmetic; the biases start at zero, so the running mean
    never sees it): a port that drops it computes the same function, and calling that a bug is a false alarm."""
    readers: dict[str, set[str]] = {}
    for layer in model.layers:
        for src in layer.inputs:
            readers.setdefault(src, set()).add(layer.kind)
    return next((l.name for l in model.layers if l.kind in ("conv2d", "dense") and l.spec.options.get("use_bias", True)
                 and readers.get(l.name) != {"batchnorm2d"}), None)


def _residual_after_activation(decl: dict) -> list[dict]:
    """Every add whose only reader is an activation: the add's place now computes act(first input) and the
    activation's place adds the other inputs to it. Both keep their names (and so their probes): the add's
    place is where a correct localization finds the first disagreement."""
    layers = _explicit_inputs(decl)
    readers: dict[str, list[int]] = {}
    for i, l in enumerate(layers):
        for src in l["inputs"]:
            readers.setdefault(src, []).append(i)
    for l in list(layers):
        if l.get("type") != "add":
            continue
        after = readers.get(l["name"], [])
        if len(after) != 1 or layers[after[0]].get("type") not in ACTIVATION_KINDS:
            continue
        j, i = after[0], layers.index(l)
        act = layers[j]
        branch, shortcuts = l["inputs"][0], l["inputs"][1:]
        layers[i] = {**{k: v for k, v in act.items() if k not in ("name", "inputs")}, "name": l["name"],
                     "inputs": [branch]}
        layers[j] = {"type": "add", "name": act["name"], "inputs": [l["name"], *shortcuts]}
    return layers


def rewrite_declaration(decl: dict, fault: str | None) -> dict:
    """The model declaration as a port with this fault declares it (the declaration-level faults of
    `DECLARATION_FAULTS`); any other fault returns `decl` itself. Layer names never change, so every probe
    of the faulty run has its counterpart in the clean one."""
    if fault not in DECLARATION_FAULTS or not isinstance(decl, dict) or not isinstance(decl.get("layers"), list):
        return decl
    if fault == "residual_after_activation":
        return dict(decl, layers=_residual_after_activation(decl))
    layers = [dict(l) if isinstance(l, dict) else l for l in decl["layers"]]
    for l in layers:
        if not isinstance(l, dict):
            continue
        kind = l.get("type")
        if fault == "gelu_tanh_approx" and kind == "gelu":
            l["approximate"] = "tanh"
        elif fault == "layernorm_eps_default" and kind == "layernorm":
            l["eps"] = KERAS_LN_EPS
        elif fault == "leaky_relu_default_alpha" and kind == "leaky_relu":
            l["alpha"] = KERAS_LEAKY_RELU_ALPHA
        elif fault == "dilation_dropped" and kind == "conv2d" and "dilation" in l:
            l["dilation"] = 1
    return dict(decl, layers=layers)


# --------------------------------------------------------------------------- where the lowering faults act
def projection_norms(model) -> tuple[str, ...]:
    """The batchnorm2d layers of 1x1 projection shortcuts: after a 1x1 conv2d that reads a branching output
    (one read by another layer too), feeding an add (ResNet's downsample; not MobileNet's linear projection,
    whose 1x1 conv reads an unbranched output)."""
    reads: dict[str, int] = {}
    for l in model.layers:
        for src in l.inputs:
            reads[src] = reads.get(src, 0) + 1
    by_name = {l.name: l for l in model.layers}
    into_add = {src for l in model.layers if l.kind == "add" for src in l.inputs}
    out = []
    for l in model.layers:
        conv = by_name.get(l.inputs[0])
        if (l.kind == "batchnorm2d" and l.name in into_add and conv is not None and conv.kind == "conv2d"
                and conv.spec["kernel"] == 1 and reads.get(conv.inputs[0], 0) > 1):
            out.append(l.name)
    return tuple(out)



@dataclass(frozen=True)
class Seams:
    """The catalogued lowering faults read once from a run's fault value, as the named seams where a wrapper
    applies them: the weight layout on load (`permute`, `depthwise_channel_major`), padding (`same_pads`),
    normalisation parameters (`bn_params`; `biased_running_var`, Keras' emulated, alone or '+'-joined), which
    bias a port dropped (`dropped_bias`), which BatchNorm it left out (`bypassed_norms`), the concatenation axis
    (`concat_axis`), pooling (`maxpool_ceil`), the loss (`label_smoothing`), gradients (`grad_scale`) and
    evaluation mode (`eval_dropout`). A wrapper's `forward` asks these and stays the clean lowering."""
    fault: str | None = None

    @property
    def biased_running_var(self) -> bool:
        return "bn_running_var_biased" in parts(self.fault)

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
        """missing_bias: the layer whose port dropped use_bias (`bias_that_matters`)."""
        return bias_that_matters(model) if self.fault == "missing_bias" else None

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

    def concat_axis(self, channels_first: bool) -> int:
        """The native axis a concat joins (NCHW or NHWC activations): the channels; under concat_wrong_axis
        the width (the NHWC channel index 3 used on NCHW maps, or its canonical equivalent, NHWC axis 2)."""
        wrong = self.fault == "concat_wrong_axis"
        return (3 if wrong else 1) if channels_first else (2 if wrong else 3)

    def bypassed_norms(self, model) -> tuple[str, ...]:
        """projection_without_bn: the projection shortcuts' batchnorm2d layers, passed through unchanged in
        training and inference (their parameters stay, unused: a zero gradient, unmoved running statistics)."""
        return projection_norms(model) if self.fault == "projection_without_bn" else ()

    @property
    def leaves_unused_parameters(self) -> bool:
        """Whether some parameter takes no part in the computation (a dropped bias, a bypassed BatchNorm):
        torch DDP must then be told to look for unused parameters."""
        return self.fault in ("missing_bias", "projection_without_bn")

    @property
    def depthwise_channel_major(self) -> bool:
        """False under depthwise_multiplier_order: a multiplied depthwise kernel loaded with its outputs in
        multiplier-major order (algorithms/layout.py `to_native(channel_major=False)`)."""
        return self.fault != "depthwise_multiplier_order"

    @property
    def coupled_adamw(self) -> bool:
        """l2_not_decoupled: adamw's weight decay coupled into the gradient (torch Adam(weight_decay=...))."""
        return self.fault == "l2_not_decoupled"
