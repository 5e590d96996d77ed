"""optax optimizers whose mathematics are the reference's, with the learning rate (and Adam's eps) injected
as traced hyper-parameters; Adam's bias-correction rescaling; the optimizer state in the canonical names;
the optimizer-fault seam (adam_eps_hat, keras_momentum_schedule) applied on the host before each step."""
from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from optax import tree_utils as otu

from algorithms.faults import Seams
from algorithms.optim import HParams


ADAM_STATE = "ScaleByAdamState"
INJECT_STATE = "InjectStatefulHyperparamsState"
TRACE_STATE = "TraceState"


def make_optimizer(hp: HParams, fault: str | None) -> optax.GradientTransformationExtraArgs:
    """The native optax optimizer whose mathematics are the reference's, with the learning rate
    (and eps, for Adam) as injected hyper-parameters. L2 weight decay (sgd, momentum, nesterov,
    adam) is added to the gradient before the transform; adamw's decay is decoupled."""
    wd = hp.weight_decay
    coupled = hp.optimizer != "adamw" or Seams(fault).coupled_adamw

    def l2(tx: optax.GradientTransformation) -> optax.GradientTransformation:
        return optax.chain(optax.add_decayed_weights(wd), tx) if wd and coupled else tx

    if hp.optimizer == "sgd":
        return optax.inject_hyperparams(lambda learning_rate: l2(optax.sgd(learning_rate)))(learning_rate=hp.lr)
    if hp.optimizer in ("momentum", "nesterov"):
        nesterov = hp.optimizer == "nesterov"
        return optax.inject_hyperparams(
            lambda learning_rate: l2(optax.sgd(learning_rate, momentum=hp.momentum, nesterov=nesterov))
        )(learning_rate=hp.lr)
    if coupled:   # adam, or adamw with the l2_not_decoupled fault (torch Adam(weight_decay=...))
        return optax.inject_hyperparams(
            lambda learning_rate, eps: l2(optax.adam(learning_rate, b1=hp.beta1, b2=hp.beta2, eps=eps))
        )(learning_rate=hp.lr, eps=hp.eps)
    return optax.inject_hyperparams(
        lambda learning_rate, eps, weight_decay: optax.adamw(learning_rate, b1=hp.beta1, b2=hp.beta2, eps=eps,
                                                             weight_decay=weight_decay)
    )(learning_rate=hp.lr, eps=hp.eps, weight_decay=wd)


def in_tuple(tuple_name: str) -> Callable[[Any, Any], bool]:
    """optax.tree_utils filter: the field belongs to a NamedTuple called `tuple_name`."""
    return lambda path, _v: bool(path) and getattr(path[-1], "tuple_name", None) == tuple_name


def _set_field(tree: Any, tuple_name: str, field: str, value: Any) -> Any:
    """`tree` with `field` of every NamedTuple called `tuple_name` replaced by `value`. (Not
    optax.tree_utils.tree_set: it does not descend below a node that already has a field of that
    name, so it cannot reach ScaleByAdamState.count inside InjectStatefulHyperparamsState.)"""
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        kids = {f: _set_field(getattr(tree, f), tuple_name, field, value) for f in tree._fields}
        if type(tree).__name__ == tuple_name and field in kids:
            kids[field] = value
        return type(tree)(**kids)
    if isinstance(tree, (tuple, list)):
        return type(tree)(_set_field(t, tuple_name, field, value) for t in tree)
    if isinstance(tree, dict):
        return {k: _set_field(v, tuple_name, field, value) for k, v in tree.items()}
    return tree


def adam_hyperparams(hyper: dict[str, jax.Array], count: jax.Array, b1: float, b2: float) -> dict[str, jax.Array]:
    """The learning rate, eps (and adamw's weight decay) to inject so that optax's Adam step equals
    the reference's, whose bias corrections 1 - b^t are exact (float64 in torch and in
    algorithms.optim). optax computes 1 - b^t in the parameters' dtype: in float32, b2 = 0.999 rounds
    to 0.99900001287 and its 1 - b2^t is off by 1.3e-5 at t = 1 (up to 2e-5 later), a systematic
    6e-6 on every update. With c1, c2 the accurate corrections (-expm1(t log b), log b from float64)
    and c1', c2' optax's own, rho = sqrt(c2 / c2'):
        lr' = lr * rho * c1' / c1,   eps' = eps * rho,   weight_decay' = weight_decay * c1 / (rho * c1')
    turn optax's  lr' (m / c1') / (sqrt(v / c2') + eps') (+ lr' wd' p)  into  lr (m / c1) / (sqrt(v / c2) + eps)
    (+ lr wd p) exactly; the rescaling costs float32 rounding only (~1e-7 relative)."""
    dtype = hyper["learning_rate"].dtype
    t = optax.safe_increment(count)                              # the count optax's update will use
    ones = jnp.ones((), dtype)
    inv_c1q = optax.tree.bias_correction(ones, b1, t)            # 1 / c1', optax's own expression
    inv_c2q = optax.tree.bias_correction(ones, b2, t)
    tf = t.astype(dtype)
    c1 = -jnp.expm1(tf * jnp.asarray(math.log(b1), dtype))
    c2 = -jnp.expm1(tf * jnp.asarray(math.log(b2), dtype))
    rho = jnp.sqrt(c2 * inv_c2q)
    gain = rho / (c1 * inv_c1q)                                  # lr' / lr
    out = dict(hyper, learning_rate=hyper["learning_rate"] * gain, eps=hyper["eps"] * rho)
    if "weight_decay" in hyper:
        out["weight_decay"] = hyper["weight_decay"] / gain
    return out


def step_eps(hp: HParams, step: int, fault: str | None) -> float:
    """Adam's eps for the update at `step`; adam_eps_hat: Keras/TF's eps-hat form == eps / sqrt(1 - b2^t)."""
    if fault == "adam_eps_hat":
        return hp.eps / math.sqrt(1.0 - hp.beta2 ** (step + 1))
    return hp.eps


def keras_velocity(opt_state: Any, prev_lr: float | None, lr: float, fault: str | None, has_momentum: bool) -> Any:
    """keras_momentum_schedule: Keras' velocity v = mu v - lr g <=> the optax trace rescaled by lr_prev / lr
    when the learning rate changes; the state unchanged otherwise."""
    if fault != "keras_momentum_schedule" or not has_momentum or prev_lr is None or prev_lr == lr:
        return opt_state
    ratio = prev_lr / lr
    trace = otu.tree_get(opt_state, "trace")
    return _set_field(opt_state, TRACE_STATE, "trace", jax.tree.map(lambda t: t * ratio, trace))


def export_state(opt_state: Any, trainable: list[str], canon: Callable[[str, Any], np.ndarray], has_momentum: bool,
                 is_adam: bool, host: Callable[[Any], Any]) -> dict[str, np.ndarray]:
    """The optax state as canonical 'momentum/<param>', 'exp_avg/<param>', 'exp_avg_sq/<param>', 'step'."""
    out: dict[str, np.ndarray] = {}
    if has_momentum:
        trace = otu.tree_get(opt_state, "trace")
        out.update({f"momentum/{n}": canon(n, trace[n]) for n in trainable})
    elif is_adam:
        mu = otu.tree_get(opt_state, "mu")
        nu = otu.tree_get(opt_state, "nu")
        out.update({f"exp_avg/{n}": canon(n, mu[n]) for n in trainable})
        out.update({f"exp_avg_sq/{n}": canon(n, nu[n]) for n in trainable})
        out["step"] = np.asarray(float(host(otu.tree_get(opt_state, "count", filtering=in_tuple(ADAM_STATE)))))
    return out


def load_state(st: Any, state: dict[str, np.ndarray], step: int, trainable: list[str],
               native: Callable[[str, np.ndarray], Any], has_momentum: bool, is_adam: bool) -> Any:
    """A fresh optax state `st` holding the canonical `state` exactly (absent entries stay zero), ready for `step`."""
    def tree(prefix: str, like: dict[str, jax.Array]) -> dict[str, jax.Array]:
        return {n: (native(n, state[f"{prefix}/{n}"]) if f"{prefix}/{n}" in state else like[n]) for n in trainable}
    if has_momentum:
        st = _set_field(st, TRACE_STATE, "trace", tree("momentum", otu.tree_get(st, "trace")))
    elif is_adam:
        st = _set_field(st, ADAM_STATE, "mu", tree("exp_avg", otu.tree_get(st, "mu")))
        st = _set_field(st, ADAM_STATE, "nu", tree("exp_avg_sq", otu.tree_get(st, "nu")))
        n_done = int(round(float(state["step"]))) if "step" in state else 0
        st = _set_field(st, ADAM_STATE, "count", jnp.asarray(n_done, jnp.int32))
    return _set_field(st, INJECT_STATE, "count", jnp.asarray(step, jnp.int32))
