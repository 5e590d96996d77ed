"""Hand-written JAX loop for resnet_tiny (32x32x3), the way JAX users write a ResNet: pure functions over a
params pytree and a batch-statistics pytree (jax.lax convolutions in NHWC/HWIO, training-mode BatchNorm over
the batch, running averages carried out of the step), one jax.jit train step with value_and_grad(has_aux) and
optax.sgd(momentum), the loss pulled to Python (float) every step, the test set evaluated (inference-mode
BatchNorm, jitted) every 50 steps. The stride-2 convolutions pad the odd pixel
bottom/right, as the spec's TF-style 'same' asks.

    python bench/hand_loops/resnet_jax.py --steps 100      -> one JSON line (see _common.report)
"""
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parents[1]))

from bench.hand_loops._common import (BATCH, BN_EPS, BN_MOMENTUM, LR, MOMENTUM, RESNET_BLOCKS, Timer,  # noqa: E402
                                      evaluates_after, parse_args, problem, report, setup_env)

args = parse_args(__doc__)
setup_env()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

P = problem(args.steps, "resnet_tiny")
STATS = ("running_mean", "running_var")
params = {k: jnp.asarray(v) for k, v in P.params.items() if not k.endswith(STATS)}   # canonical layout is JAX's
stats = {k: jnp.asarray(v) for k, v in P.params.items() if k.endswith(STATS)}


def conv(x, k, stride=1):
    pad = "SAME" if stride == 1 or k.shape[0] == 1 else ((0, 1), (0, 1))   # 3x3 stride 2: the odd pixel bottom/right
    return jax.lax.conv_general_dilated(x, k, (stride, stride), pad, dimension_numbers=("NHWC", "HWIO", "NHWC"))


def bn(x, p, s, new, name, train=True):
    if not train:      # inference: the running statistics
        mean, var = s[f"{name}.running_mean"], s[f"{name}.running_var"]
        return (x - mean) / jnp.sqrt(var + BN_EPS) * p[f"{name}.gamma"] + p[f"{name}.beta"]
    mean, var = jnp.mean(x, axis=(0, 1, 2)), jnp.var(x, axis=(0, 1, 2))
    n = x.shape[0] * x.shape[1] * x.shape[2]
    new[f"{name}.running_mean"] = (1 - BN_MOMENTUM) * s[f"{name}.running_mean"] + BN_MOMENTUM * mean
    new[f"{name}.running_var"] = (1 - BN_MOMENTUM) * s[f"{name}.running_var"] + BN_MOMENTUM * var * n / (n - 1)
    return (x - mean) / jnp.sqrt(var + BN_EPS) * p[f"{name}.gamma"] + p[f"{name}.beta"]


def model(p, s, x, train=True):
    new = {}
    x = jax.nn.relu(bn(conv(x, p["stem.kernel"]), p, s, new, "stem_bn", train))
    for name, _, _, stride in RESNET_BLOCKS:
        h = jax.nn.relu(bn(conv(x, p[f"{name}_conv1.kernel"], stride), p, s, new, f"{name}_bn1", train))
        h = bn(conv(h, p[f"{name}_conv2.kernel"]), p, s, new, f"{name}_bn2", train)
        short = x if stride == 1 else bn(conv(x, p[f"{name}_proj.kernel"], stride), p, s, new, f"{name}_proj_bn", train)
        x = jax.nn.relu(h + short)
    return jnp.mean(x, axis=(1, 2)) @ p["fc.kernel"] + p["fc.bias"], new


def loss_fn(p, s, x, y):
    logits, new = model(p, s, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), new


tx = optax.sgd(LR, momentum=MOMENTUM)
opt_state = tx.init(params)


@jax.jit
def train_step(p, s, o, x, y):
    (loss, new_s), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, s, x, y)
    updates, o = tx.update(grads, o, p)
    return optax.apply_updates(p, updates), new_s, o, loss


@jax.jit
def eval_step(p, s, x, y):
    logits, _ = model(p, s, x, train=False)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), (logits.argmax(-1) == y).mean()


def evaluate() -> tuple[float, float]:
    loss, acc = eval_step(params, stats, P.x_test, P.y_test)
    return float(loss), float(acc)


X, Y, order = P.x_train, P.y_train, P.order
assert order.shape == (args.steps, BATCH)
losses, timer = [], Timer()
evals = [evaluate()]
timer.stamp()
for step in range(args.steps):
    idx = order[step]
    params, stats, opt_state, loss = train_step(params, stats, opt_state, X[idx], Y[idx])
    losses.append(float(loss))
    timer.stamp()
    if evaluates_after(step + 1, args.steps):
        with timer.evaluating():
            evals.append(evaluate())
report("jax", timer, args.warmup, losses, evals, versions={"jax": jax.__version__, "optax": optax.__version__})
