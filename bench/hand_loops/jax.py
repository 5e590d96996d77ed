"""Hand-written JAX loop for cnn2d_2conv_2fc, the way JAX users write it: a pure loss over a params
pytree (jax.lax convolutions in NHWC/HWIO), one jax.jit train step with value_and_grad and
optax.sgd(momentum), the loss pulled to Python (float) every step as users log it, the test set evaluated by
a jitted loss-and-accuracy every 50 steps.

    python bench/hand_loops/jax.py --steps 400        -> one JSON line (see _common.report)
"""
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent          # this file is jax.py: never let it shadow jax
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parents[1]))

from bench.hand_loops._common import (BATCH, LR, MOMENTUM, Timer, evaluates_after, parse_args, problem,  # noqa: E402
                                      report, setup_env)

args = parse_args(__doc__)
setup_env()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

P = problem(args.steps)
params = {k.replace(".", "_"): jnp.asarray(v) for k, v in P.params.items()}   # canonical layout is JAX's


def conv(x, k, b):
    y = jax.lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return y + b


def model(p, x):
    x = jax.nn.relu(conv(x, p["conv1_kernel"], p["conv1_bias"]))
    x = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    x = jax.nn.relu(conv(x, p["conv2_kernel"], p["conv2_bias"]))
    x = x.reshape(x.shape[0], -1)
    x = jax.nn.relu(x @ p["fc1_kernel"] + p["fc1_bias"])
    return x @ p["fc2_kernel"] + p["fc2_bias"]


def loss_fn(p, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(p, x), y).mean()


tx = optax.sgd(LR, momentum=MOMENTUM)
opt_state = tx.init(params)


@jax.jit
def train_step(p, s, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s, loss


@jax.jit
def eval_step(p, x, y):
    logits = model(p, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), (logits.argmax(-1) == y).mean()


def evaluate() -> tuple[float, float]:
    loss, acc = eval_step(params, P.x_test, P.y_test)
    return float(loss), float(acc)


X, Y, order = P.x_train, P.y_train, P.order      # numpy on the host; each batch gathered there
assert order.shape == (args.steps, BATCH)
losses, timer = [], Timer()
evals = [evaluate()]
timer.stamp()
for step in range(args.steps):
    idx = order[step]
    params, opt_state, loss = train_step(params, opt_state, X[idx], Y[idx])
    losses.append(float(loss))
    timer.stamp()
    if evaluates_after(step + 1, args.steps):
        with timer.evaluating():
            evals.append(evaluate())
report("jax", timer, args.warmup, losses, evals, versions={"jax": jax.__version__, "optax": optax.__version__})
