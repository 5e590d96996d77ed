"""Hand-written Keras 3 loop for cnn2d_2conv_2fc, the way Keras users write it: keras.Sequential,
compile(SGD(momentum), sparse cross-entropy from logits, accuracy), then one plain `model.fit` over
arrays already in the harness's batch order (batch 64, shuffle=False, one epoch of `steps` batches).
The framework under Keras is $KERAS_BACKEND (tensorflow | jax | torch; default tensorflow).

The per-step times come from a callback stamping on_train_batch_end (_keras_fit.py); like the harness (and like
any logging callback) it makes Keras hand the batch logs (loss, accuracy) to Python every step; it evaluates
the test set every 50 steps (predict_on_batch, as the harness's Keras backend evaluates).

    KERAS_BACKEND=jax python bench/hand_loops/keras.py --steps 400   -> one JSON line
"""
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent          # this file is keras.py: never let it shadow keras
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parents[1]))

from bench.hand_loops._common import LR, MOMENTUM, keras_backend_pinned, parse_args, problem, setup_env  # noqa: E402

args = parse_args(__doc__)
setup_env()
KB = keras_backend_pinned()
import keras  # noqa: E402
from keras import layers  # noqa: E402

from bench.hand_loops._keras_fit import fit_and_report  # noqa: E402

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


fit_and_report(model, P, args.steps, args.warmup, KB)
