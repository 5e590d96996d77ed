"""Hand-written Keras 3 loop for cnn2d_2conv_2fc, the way Keras users write it: keras.Sequential,
compile(SGD(momentum), sparse cross-entropy from logits, accuracy), then one plain `model.fit` over
arrays already in the harness's batch order (batch 64, shuffle=False, one epoch of `steps` batches).
The framework under Keras is $KERAS_BACKEND (tensorflow | jax | torch; default tensorflow).

The per-step times come from a callback stamping on_train_batch_end; like the harness (and like
any logging callback) it makes Keras hand the batch logs (loss, accuracy) to Python every step.

    KERAS_BACKEND=jax python bench/hand_loops/keras.py --steps 400   -> one JSON line
"""
import os
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent          # this file is keras.py: never let it shadow keras
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parents[1]))

from bench.hand_loops._common import BATCH, LR, MOMENTUM, Timer, parse_args, problem, report, setup_env  # noqa: E402

args = parse_args(__doc__)
setup_env()
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
KB = os.environ["KERAS_BACKEND"]
if KB == "tensorflow":      # pin TF's pools before Keras starts the runtime
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
elif KB == "torch":
    import torch
    torch.set_num_threads(1)
import keras  # noqa: E402
from keras import layers  # noqa: E402

P = problem(args.steps)
model = keras.Sequential([
    keras.Input((8, 8, 1)),
    layers.Conv2D(16, 3, padding="same", activation="relu"),
    layers.MaxPooling2D(2),
    layers.Conv2D(32, 3, padding="same", activation="relu"),
    layers.Flatten(),
    layers.Dense(64, activation="relu"),
    layers.Dense(10),
])
w = P.params     # canonical layout is Keras's (HWIO kernels, (in, out) dense, HWC flatten)
model.set_weights([w[n] for n in ("conv1.kernel", "conv1.bias", "conv2.kernel", "conv2.bias",
                                  "fc1.kernel", "fc1.bias", "fc2.kernel", "fc2.bias")])
model.compile(optimizer=keras.optimizers.SGD(learning_rate=LR, momentum=MOMENTUM),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])


class StepTimer(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.timer, self.losses = Timer(), []

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 0:
            self.timer.stamp()

    def on_train_batch_end(self, batch, logs=None):
        self.timer.stamp()
        self.losses.append(logs["loss"])   # Keras 3 logs hold the running epoch mean, as its progress bar shows


assert P.order.shape == (args.steps, BATCH)
flat = P.order.reshape(-1)
x, y = P.x_train[flat], P.y_train[flat]
cb = StepTimer()
model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[cb])
report(f"keras-{KB}", cb.timer.t, args.warmup, cb.losses, versions={"keras": keras.__version__, "backend": KB},
       jit_compile=getattr(model, "jit_compile", None),
       final_weights_sum=float(sum(abs(v).sum() for v in model.get_weights())))
