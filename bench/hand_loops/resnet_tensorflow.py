"""Hand-written native TensorFlow loop for resnet_tiny (32x32x3), the way TF users write one without Keras:
tf.Variables, tf.nn ops in NHWC ('SAME' is TF's own padding, the odd pixel bottom/right), training-mode
BatchNorm with tf.nn.moments and running averages assigned in the step, GradientTape, momentum SGD in a
tf.function, the loss read back every step, the test set evaluated (inference-mode BatchNorm, a
tf.function) every 50 steps.

    python bench/hand_loops/resnet_tensorflow.py --steps 100      -> one JSON line (see _common.report)
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
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
P = problem(args.steps, "resnet_tiny")
STATS = ("running_mean", "running_var")
W = {k: tf.Variable(v) for k, v in P.params.items() if not k.endswith(STATS)}   # canonical layout is TF's
S = {k: tf.Variable(v, trainable=False) for k, v in P.params.items() if k.endswith(STATS)}
NAMES = sorted(W)
BUF = {k: tf.Variable(tf.zeros_like(W[k]), trainable=False) for k in NAMES}


def bn(x, name, train=True):
    if not train:      # inference: the running statistics
        return tf.nn.batch_normalization(x, S[f"{name}.running_mean"], S[f"{name}.running_var"], W[f"{name}.beta"],
                                         W[f"{name}.gamma"], BN_EPS)
    mean, var = tf.nn.moments(x, axes=[0, 1, 2])
    n = tf.cast(tf.reduce_prod(tf.shape(x)[:3]), x.dtype)
    S[f"{name}.running_mean"].assign((1 - BN_MOMENTUM) * S[f"{name}.running_mean"] + BN_MOMENTUM * mean)
    S[f"{name}.running_var"].assign((1 - BN_MOMENTUM) * S[f"{name}.running_var"] + BN_MOMENTUM * var * n / (n - 1))
    return tf.nn.batch_normalization(x, mean, var, W[f"{name}.beta"], W[f"{name}.gamma"], BN_EPS)


def model(x, train=True):
    x = tf.nn.relu(bn(tf.nn.conv2d(x, W["stem.kernel"], 1, "SAME"), "stem_bn", train))
    for name, _, _, stride in RESNET_BLOCKS:
        h = tf.nn.relu(bn(tf.nn.conv2d(x, W[f"{name}_conv1.kernel"], stride, "SAME"), f"{name}_bn1", train))
        h = bn(tf.nn.conv2d(h, W[f"{name}_conv2.kernel"], 1, "SAME"), f"{name}_bn2", train)
        short = x if stride == 1 else bn(tf.nn.conv2d(x, W[f"{name}_proj.kernel"], stride, "SAME"), f"{name}_proj_bn",
                                         train)
        x = tf.nn.relu(h + short)
    return tf.matmul(tf.reduce_mean(x, axis=[1, 2]), W["fc.kernel"]) + W["fc.bias"]


@tf.function
def train_step(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=model(x)))
    grads = tape.gradient(loss, [W[k] for k in NAMES])
    for k, g in zip(NAMES, grads):
        BUF[k].assign(MOMENTUM * BUF[k] + g)
        W[k].assign_sub(LR * BUF[k])
    return loss


@tf.function
def eval_step(x, y):
    logits = model(x, train=False)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    return loss, tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, -1, output_type=y.dtype), y), tf.float32))


def evaluate() -> tuple[float, float]:
    loss, acc = eval_step(tf.constant(P.x_test), tf.constant(P.y_test))
    return float(loss.numpy()), float(acc.numpy())


X, Y, order = P.x_train, P.y_train, P.order
assert order.shape == (args.steps, BATCH)
losses, timer = [], Timer()
evals = [evaluate()]
timer.stamp()
for step in range(args.steps):
    idx = order[step]
    loss = train_step(tf.constant(X[idx]), tf.constant(Y[idx]))
    losses.append(float(loss.numpy()))
    timer.stamp()
    if evaluates_after(step + 1, args.steps):
        with timer.evaluating():
            evals.append(evaluate())
report("tensorflow", timer, args.warmup, losses, evals, versions={"tensorflow": tf.__version__})
