"""Where a catalogued fault reaches in a configuration: the layer a correct localization names, and why a fault
changes nothing in a run (a model without the layer it rewrites, an optimizer without the hyper-parameter it
moves, a run that ends before it starts). The catalogue's `where` and `needs` read on a model's inferred shapes
and a run's hyper-parameters; framework-free, like the catalogue."""
from __future__ import annotations

import re

from .faults import (ACTIVATION_KINDS, KERAS_LEAKY_RELU_ALPHA, KERAS_LN_EPS, bias_that_matters, fault_info,
                     perturbation, projection_norms)
from .layout import depthwise_multiplier
from .optim import HParams
from .spec import ModelSpec

# the optimizers whose update reads a perturbed hyper-parameter
_READS = {"momentum": ("momentum", "nesterov"), "beta1": ("adam", "adamw"), "beta2": ("adam", "adamw"),
          "eps": ("adam", "adamw")}


def expected_layer(fault: str, model: ModelSpec) -> tuple[bool, str | None]:
    """(whether the fault touches this model, the layer a correct localization names or None): the
    catalogue's `where` read on the model's inferred shapes."""
    layers = model.layers

    def first(pred) -> tuple[bool, str | None]:
        hit = next((l for l in layers if pred(l)), None)
        return (hit is not None, hit.name if hit is not None else None)

    if fault == "flatten_no_permute":
        return first(lambda l: l.kind == "dense" and l.flattened_from is not None
                     and l.flattened_from[0] * l.flattened_from[1] > 1)
    if fault == "symmetric_same_padding":
        return first(lambda l: l.kind == "conv2d" and l.padding is not None
                     and any((a + b) % 2 for a, b in l.padding))
    if fault in ("bn_momentum_flipped", "bn_eps_keras"):
        return first(lambda l: l.kind == "batchnorm2d")
    if fault in ("bn_eps_abs_1e-05", "bn_momentum_abs_1e-04"):
        return (model.has("batchnorm2d"), None)
    if fault == "dropout_in_eval":
        return first(lambda l: l.kind == "dropout")
    if fault == "missing_bias":
        hit = bias_that_matters(model)
        return (hit is not None, hit)
    if fault == "maxpool_ceil":   # a floor/ceil difference that a global pooling absorbs (a flatten would not fit)
        after_gap = {l.name for i, l in enumerate(layers) if any(m.kind == "global_avgpool2d" for m in layers[i:])}
        return first(lambda l: l.kind == "maxpool2d" and l.name in after_gap and l.spec.options.get("padding") == "valid"
                     and (l.in_shape[0] - l.spec.options["pool"]) % l.spec.options["stride"] != 0)
    if fault == "gelu_tanh_approx":
        return first(lambda l: l.kind == "gelu" and l.spec["approximate"] == "none")
    if fault == "layernorm_eps_default":
        return first(lambda l: l.kind == "layernorm" and l.spec["eps"] != KERAS_LN_EPS)
    if fault == "leaky_relu_default_alpha":
        return first(lambda l: l.kind == "leaky_relu" and l.spec["alpha"] != KERAS_LEAKY_RELU_ALPHA)
    if fault == "dilation_dropped":   # 'same' padding: a 'valid' one would change the shapes the weights fit
        dilated = [l for l in layers if l.kind == "conv2d" and l.spec["dilation"] > 1]
        if any(l.spec["padding"] != "same" for l in dilated):
            return (False, None)
        return (bool(dilated), dilated[0].name if dilated else None)
    if fault == "residual_after_activation":   # the add's place computes the activation under the fault
        readers = {l.name: [m for m in layers if l.name in m.inputs] for l in layers}
        return first(lambda l: l.kind == "add" and len(readers[l.name]) == 1
                     and readers[l.name][0].kind in ACTIVATION_KINDS)
    if fault == "projection_without_bn":
        norms = projection_norms(model)
        return (bool(norms), norms[0] if norms else None)
    if fault == "concat_wrong_axis":  # on the width: equal shapes, and only a flatten after it fits the new shape
        flat_next = {l.inputs[0] for l in layers if l.kind == "flatten"}
        return first(lambda l: l.kind == "concat" and len(set(l.in_shapes)) == 1 and l.name in flat_next)
    if fault == "depthwise_multiplier_order":
        return first(lambda l: depthwise_multiplier(l) > 1)
    return (True, None)


def inert_reason(fault: str, model: ModelSpec, h: HParams, devices: int = 1) -> str | None:
    """Why `fault` computes exactly the clean model in this configuration (what it needs that the run lacks), or
    None when it changes something. A fault run that is the clean run is not a test of anything: said loudly."""
    p = perturbation(fault)
    if p is not None:
        if p.target.startswith("bn_") and not model.has("batchnorm2d"):
            return f"it moves BatchNorm's {p.target[3:]} and model '{model.name}' has no batchnorm2d layer"
        if p.target in _READS and h.optimizer not in _READS[p.target]:
            return f"it moves {p.target}, which optimizer {h.optimizer} does not read"
        if p.start and h.steps <= p.start:
            return f"it starts at step {p.start} and the run has {h.steps} steps"
        return None
    needs = fault_info(fault).needs
    touches, _ = expected_layer(fault, model)
    if not touches:
        return f"it needs {needs or 'a layer it rewrites'}, and model '{model.name}' has none"
    opt = re.match(r"optimizer ([a-z/]+)", needs)
    if opt and h.optimizer not in opt.group(1).split("/"):
        return f"it needs {opt.group(0)}; the run's optimizer is {h.optimizer}"
    if "weight_decay > 0" in needs and not h.weight_decay > 0:
        return "it needs weight_decay > 0; the run has none"
    if "non-constant schedule" in needs and h.schedule == "constant":
        return "it needs a non-constant schedule; the run's is constant"
    if needs == "devices > 1" and devices < 2:
        return "it needs data parallelism (--devices > 1); the run has one replica"
    return None


__all__ = ["expected_layer", "inert_reason"]
