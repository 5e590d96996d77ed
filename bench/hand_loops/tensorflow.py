"""Hand-written native TensorFlow loop for cnn2d_2conv_2fc (no Keras): tf.Variables, tf.nn ops in
NHWC, a GradientTape step inside one tf.function, SGD with momentum as plain assign ops
(buf = mu*buf + g; w -= lr*buf, PyTorch's form), the loss fetched (.numpy()) every step as users log it, the
test set evaluated by a tf.function loss-and-accuracy every 50 steps.

    python bench/hand_loops/tensorflow.py --steps 400  -> one JSON line (see _common.report)
"""
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent          # this file is tensorflow.py: never let it shadow tensorflow
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parents[1]))

from bench.hand_loops._common import (BATCH, LR, MOMENTUM, Timer, evaluates_after, parse_args, problem,  # noqa: E402
                                      report, setup_env)

args = parse_args(__doc__)
setup_env()
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
P = problem(args.steps)

names = ["conv1.kernel", "conv1.bias", "conv2.kernel", "conv2.bias", "fc1.kernel", "fc1.bias", "fc2.kernel", "fc2.bias"]
W = [tf.Variable(P.params[n], name=n.replace(".", "_")) for n in names]   # canonical layout is TF's (NHWC/HWIO)
BUF = [tf.Variable(tf.zeros_like(w), trainable=False) for w in W]


def model(x):
    k1, b1, k2, b2, k3, b3, k4, b4 = W
    x = tf.nn.relu(tf.nn.conv2d(x, k1, 1, "SAME") + b1)
    x = tf.nn.max_pool2d(x, 2, 2, "VALID")
    x = tf.nn.relu(tf.nn.conv2d(x, k2, 1, "SAME") + b2)
    x = tf.reshape(x, [tf.shape(x)[0], -1])
    x = tf.nn.relu(tf.matmul(x, k3) + b3)
    return tf.matmul(x, k4) + b4


@tf.function
def train_step(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=model(x)))
    grads = tape.gradient(loss, W)
    for w, b, g in zip(W, BUF, grads):
        b.assign(MOMENTUM * b + g)
        w.assign_sub(LR * b)
    return loss


@tf.function
def eval_step(x, y):
    logits = model(x)
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
