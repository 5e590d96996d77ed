"""Hand-written Keras 3 loop for resnet_tiny (32x32x3), the way Keras users write a ResNet: the functional API
(Conv2D 'same' without bias, BatchNormalization(momentum=0.9, epsilon=1e-5), Add, ReLU, a 1x1 projection with
its BatchNorm on the stride-2 blocks, GlobalAveragePooling2D, Dense), compile(SGD(momentum), sparse
cross-entropy from logits, accuracy), one plain `model.fit` over arrays already in the harness's batch order
(_keras_fit.py, as keras.py). The framework under Keras is $KERAS_BACKEND (tensorflow | jax | torch; default
tensorflow).

    KERAS_BACKEND=jax python bench/hand_loops/resnet_keras.py --steps 100   -> one JSON line
"""
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parents[1]))

from bench.hand_loops._common import (BN_EPS, BN_MOMENTUM, LR, MOMENTUM, RESNET_BLOCKS,  # noqa: E402
                                      keras_backend_pinned, parse_args, problem, setup_env)

args = parse_args(__doc__)
setup_env()
KB = keras_backend_pinned()
import keras  # noqa: E402
from keras import layers  # noqa: E402

from bench.hand_loops._keras_fit import fit_and_report  # noqa: E402

P = problem(args.steps, "resnet_tiny")


def conv(x, filters, kernel, stride, name):
    return layers.Conv2D(filters, kernel, strides=stride, padding="same", use_bias=False, name=name)(x)


def bn(x, name):
    return layers.BatchNormalization(momentum=1 - BN_MOMENTUM, epsilon=BN_EPS, name=name)(x)


inputs = keras.Input((32, 32, 3))
x = layers.ReLU()(bn(conv(inputs, 16, 3, 1, "stem"), "stem_bn"))
for name, _, cout, stride in RESNET_BLOCKS:
    h = layers.ReLU()(bn(conv(x, cout, 3, stride, f"{name}_conv1"), f"{name}_bn1"))
    h = bn(conv(h, cout, 3, 1, f"{name}_conv2"), f"{name}_bn2")
    short = x if stride == 1 else bn(conv(x, cout, 1, stride, f"{name}_proj"), f"{name}_proj_bn")
    x = layers.ReLU()(layers.Add()([h, short]))
outputs = layers.Dense(10, name="fc")(layers.GlobalAveragePooling2D()(x))
model = keras.Model(inputs, outputs)
w = P.params     # canonical layout is Keras's (HWIO kernels, (in, out) dense)
for layer in model.layers:
    if isinstance(layer, layers.Conv2D):
        layer.set_weights([w[f"{layer.name}.kernel"]])
    elif isinstance(layer, layers.BatchNormalization):
        layer.set_weights([w[f"{layer.name}.{k}"] for k in ("gamma", "beta", "running_mean", "running_var")])
    elif isinstance(layer, layers.Dense):
        layer.set_weights([w["fc.kernel"], w["fc.bias"]])
model.compile(optimizer=keras.optimizers.SGD(learning_rate=LR, momentum=MOMENTUM),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])


fit_and_report(model, P, args.steps, args.warmup, KB)
