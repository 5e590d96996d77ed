"""Inside one process, the harness's train_step against variants that each leave one thing out, and
against the hand-written step: what each piece of the harness's step costs, measured side by side.

The variants run interleaved in blocks (round-robin, the order rotated every round) in the backend's
own process and environment, each on its own copy of the model, so the machine's noise falls on
all of them alike. Per variant: the 10th percentile and the median of its step times over all its blocks, and their
ratios to `hand` (on a loaded machine read the p10: the median measures the scheduler).

    python bench/step_breakdown.py -b torch [--rounds 12] [--block 25]

Backends with variants: torch, keras-jax, keras-tensorflow, keras-torch, jax, tensorflow.
A diagnostic for a ratio over target in bench_step.py; it writes nothing unless --json is given.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from bench.profile_worker import make_job  # noqa: E402

Step = Callable[[int, np.ndarray, np.ndarray], float]


# ----------------------------------------------------------------------------- torch
def torch_variants(make_backend, data) -> dict[str, Step]:
    import torch
    from torch import nn
    from bench.hand_loops._common import LR, MOMENTUM, flatten_perm, problem

    bh = make_backend()

    def harness(step, x, y):
        return bh.train_step(step, x, y, {}).loss

    def harness_under(fill: bool, det: bool):
        """The harness's step with torch's deterministic mode and its NaN fill of uninitialized memory set so."""
        b = make_backend()

        def step_fn(step, x, y):
            was = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
            torch.use_deterministic_algorithms(det)
            torch.utils.deterministic.fill_uninitialized_memory = fill
            try:
                return b.train_step(step, x, y, {}).loss
            finally:
                torch.use_deterministic_algorithms(was[0])
                torch.utils.deterministic.fill_uninitialized_memory = was[1]
        return step_fn

    def lean_of(b, det: bool | None = None):
        def lean(step, x, y):
            prev = torch.are_deterministic_algorithms_enabled()
            if det is not None:
                torch.use_deterministic_algorithms(det)
            xt, yt = b._input(x), torch.as_tensor(y, dtype=torch.long)
            b.opt.zero_grad(set_to_none=False)
            loss = b._loss(b._train_forward(xt, {}), yt)
            loss.backward()
            for g in b.opt.param_groups:
                g["lr"] = b.lr_for(step)
            b.opt.step()
            out = loss.item()
            torch.use_deterministic_algorithms(prev)
            return out
        return lean

    bf = make_backend()

    def fused_stats(step, x, y):
        """The harness's step with its statistics computed by foreach kernels and fetched in one sync."""
        b = bf
        xt, yt = b._input(x), torch.as_tensor(y, dtype=torch.long)
        params = [b.p[n] for n in b.trainable]
        before = torch._foreach_mul(params, 1.0)          # one foreach copy instead of 8 clones
        b.opt.zero_grad(set_to_none=False)
        logits = b._train_forward(xt, {})
        loss = b._loss(logits, yt)
        loss.backward()
        for g in b.opt.param_groups:
            g["lr"] = b.lr_for(step)
        with torch.no_grad():
            gn = torch.linalg.vector_norm(torch.stack(torch._foreach_norm([q.grad for q in params])))
            b.opt.step()
            torch._foreach_sub_(before, params)            # before - after = -update
            un = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(before)))
            pn = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(params)))
            acc = (logits.argmax(1) == yt).to(b.dtype).mean()
            vals = torch.stack([loss.detach(), acc, gn, un, pn]).tolist()   # one sync, not five
        return vals[0]

    P = problem(2)
    w = P.params

    def hand_model(explicit_pad: bool):
        conv = (lambda i, o: nn.Sequential(nn.ZeroPad2d(1), nn.Conv2d(i, o, 3))) if explicit_pad else \
            (lambda i, o: nn.Conv2d(i, o, 3, padding=1))
        m = nn.Sequential(conv(1, 16), nn.ReLU(), nn.MaxPool2d(2), conv(16, 32), nn.ReLU(), nn.Flatten(),
                          nn.Linear(512, 64), nn.ReLU(), nn.Linear(64, 10))
        convs = [l if isinstance(l, nn.Conv2d) else l[1] for l in (m[0], m[3])]
        with torch.no_grad():
            for c, n in zip(convs, ("conv1", "conv2")):
                c.weight.copy_(torch.from_numpy(w[f"{n}.kernel"].transpose(3, 2, 0, 1).copy()))
                c.bias.copy_(torch.from_numpy(w[f"{n}.bias"]))
            m[6].weight.copy_(torch.from_numpy(np.ascontiguousarray(w["fc1.kernel"][flatten_perm()].T)))
            m[6].bias.copy_(torch.from_numpy(w["fc1.bias"]))
            m[8].weight.copy_(torch.from_numpy(np.ascontiguousarray(w["fc2.kernel"].T)))
            m[8].bias.copy_(torch.from_numpy(w["fc2.bias"]))
        opt = torch.optim.SGD(m.parameters(), lr=LR, momentum=MOMENTUM)
        lf = nn.CrossEntropyLoss()

        def step_fn(step, x, y):
            xb = torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))
            yb = torch.from_numpy(y).long()
            opt.zero_grad()
            loss = lf(m(xb), yb)
            loss.backward()
            opt.step()
            return loss.item()
        return step_fn

    return {"harness": harness,
            "harness, deterministic without the NaN fill": harness_under(fill=False, det=True),
            "harness, deterministic off": harness_under(fill=True, det=False),
            "harness, stats fused (foreach + 1 sync)": fused_stats,
            "harness minus stats": lean_of(make_backend()),
            "harness minus stats, deterministic off": lean_of(make_backend(), det=False),
            "hand, F.pad + conv(padding=0)": hand_model(True),
            "hand": hand_model(False)}


# ----------------------------------------------------------------------------- keras
def keras_variants(make_backend, data) -> dict[str, Step]:
    import keras
    from bench.hand_loops._common import LR, MOMENTUM, problem
    kb = keras.backend.backend()

    bh = make_backend()

    def harness(step, x, y):
        return bh.train_step(step, x, y, {}).loss

    bt = make_backend()

    def tob(step, x, y):
        logs = bt.net.train_on_batch(*bt._xy(x, y), return_dict=True)
        return float(logs["loss"])

    def hand_model():
        from keras import layers
        m = keras.Sequential([keras.Input((8, 8, 1)), layers.Conv2D(16, 3, padding="same", activation="relu"),
                              layers.MaxPooling2D(2), layers.Conv2D(32, 3, padding="same", activation="relu"),
                              layers.Flatten(), layers.Dense(64, activation="relu"), layers.Dense(10)])
        w = problem(2).params
        m.set_weights([w[n] for n in ("conv1.kernel", "conv1.bias", "conv2.kernel", "conv2.bias",
                                      "fc1.kernel", "fc1.bias", "fc2.kernel", "fc2.bias")])
        m.compile(optimizer=keras.optimizers.SGD(learning_rate=LR, momentum=MOMENTUM),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
        return m

    ba, bb = make_backend(), make_backend()

    def tob_lr_assign(step, x, y):
        ba.optimizer.learning_rate = float(ba.lr_for(step))      # as the harness: a variable assign per step
        logs = ba.net.train_on_batch(*ba._xy(x, y), return_dict=True)
        return float(logs["loss"])

    def tob_lr_readback(step, x, y):
        logs = bb.net.train_on_batch(*bb._xy(x, y), return_dict=True)
        bb.last_lr = np.float32(np.asarray(keras.ops.convert_to_numpy(bb.optimizer._learning_rate.value)))
        return float(logs["loss"])

    out: dict[str, Step] = {"harness": harness, "harness net, plain train_on_batch": tob,
                            "harness net, train_on_batch + lr assign": tob_lr_assign,
                            "harness net, train_on_batch + lr read back": tob_lr_readback}
    hm = hand_model()

    def hand_tob(step, x, y):
        return float(hm.train_on_batch(x, y, return_dict=True)["loss"])
    out["hand model, train_on_batch"] = hand_tob

    if kb == "jax":
        from keras.src.utils.python_utils import pythonify_logs

        def fit_like(net):
            """What fit does between callbacks: the jitted step on state kept as JAX arrays
            (no variable read / write back per step), logs to Python every step."""
            holder: dict = {}

            def step_fn(step, x, y):
                if "state" not in holder:
                    net._symbolic_build(data_batch=(x, y, None))   # what fit does first: optimizer, metrics
                    holder["state"] = net._get_jax_state(trainable_variables=True, non_trainable_variables=True,
                                                         optimizer_variables=True, metrics_variables=True,
                                                         purge_model_variables=False)
                net.make_train_function()
                logs, holder["state"] = net.train_function(holder["state"], iter([(x, y, None)]))
                return float(pythonify_logs(logs)["loss"])
            return step_fn
        bj = make_backend()
        out["harness net, fit-like state (no sync)"] = fit_like(bj.net)
        out["hand"] = fit_like(hand_model())
    elif kb == "tensorflow":
        import tensorflow as tf
        bf = make_backend()
        own_fn = tf.function(lambda x, y: bf.net.train_step((x, y)))

        def own_tf_function(step, x, y):
            """The harness net's custom train_step in a tf.function of our own, fed tensors: no
            train_on_batch machinery (reset_metrics, symbolic-build check, generator, log pythonify)."""
            bf.optimizer.learning_rate.assign(bf.lr_for(step))
            logs = own_fn(tf.constant(x), tf.constant(y))
            return float(logs["loss"])
        out["harness net, own tf.function(train_step), tensors in"] = own_tf_function
    if kb != "jax":
        hm2 = hand_model()
        hm2.make_train_function()
        from keras.src.utils.python_utils import pythonify_logs

        if kb == "tensorflow":
            import tensorflow as tf
            x_tr, y_tr, order = data          # fit's way: a tf.data iterator over the run's batches
            flat = order.reshape(-1)
            it = iter(tf.data.Dataset.from_tensor_slices((x_tr[flat], y_tr[flat])).batch(order.shape[1]).repeat())

            def fit_like_tf(step, x, y):
                return float(pythonify_logs(hm2.train_function(it))["loss"])
            out["hand"] = fit_like_tf
        else:
            def fit_like_torch(step, x, y):
                return float(pythonify_logs(hm2.train_function([(x, y, None)]))["loss"])
            out["hand"] = fit_like_torch
    return out


# ----------------------------------------------------------------------------- jax, tensorflow
def jax_variants(make_backend, data) -> dict[str, Step]:
    import jax
    import jax.numpy as jnp
    import optax
    from bench.hand_loops._common import LR, MOMENTUM, problem
    bh = make_backend()

    def harness(step, x, y):
        return bh.train_step(step, x, y, {}).loss

    def call(b, fn, step, x, y):
        lr = np.asarray(b.lr_for(step), np.float32)
        b.params, b.buffers, b.opt_state, out = fn(b.params, b.buffers, b.opt_state, b._x(x), b._y(y), {},
                                                   b.base_key, np.int32(step), lr, np.asarray(b.hp.eps, np.float32))
        return out

    bl = make_backend()
    # the harness's own compiled step (Backend._step, whose statistics are one stacked vector, loss first),
    # inlined into a jit that returns less: internals of the wrapper are not touched
    loss_only = jax.jit(lambda *a: (lambda r: (*r[:3], r[3][0]))(bl._step(*a)))

    def no_stats(step, x, y):
        """The harness's step returning the loss only: XLA drops the norms and the accuracy."""
        return float(call(bl, loss_only, step, x, y))

    params = {k.replace(".", "_"): jnp.asarray(v) for k, v in problem(2).params.items()}

    def model(p, x):
        def conv(x, k, b):
            return jax.lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")) + b
        x = jax.nn.relu(conv(x, p["conv1_kernel"], p["conv1_bias"]))
        x = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        x = jax.nn.relu(conv(x, p["conv2_kernel"], p["conv2_bias"]))
        x = x.reshape(x.shape[0], -1)
        x = jax.nn.relu(x @ p["fc1_kernel"] + p["fc1_bias"])
        return x @ p["fc2_kernel"] + p["fc2_bias"]

    tx = optax.sgd(LR, momentum=MOMENTUM)
    st = {"p": params, "s": tx.init(params)}

    @jax.jit
    def train_step(p, s, x, y):
        loss, grads = jax.value_and_grad(
            lambda p: optax.softmax_cross_entropy_with_integer_labels(model(p, x), y).mean())(p)
        u, s = tx.update(grads, s, p)
        return optax.apply_updates(p, u), s, loss

    def hand(step, x, y):
        st["p"], st["s"], loss = train_step(st["p"], st["s"], x, y)
        return float(loss)

    return {"harness": harness, "harness, loss only": no_stats, "hand": hand}


def tensorflow_variants(make_backend, data) -> dict[str, Step]:
    import tensorflow as tf
    from tensorflow.python.framework import config as tf_config
    from bench.hand_loops._common import LR, MOMENTUM, problem
    bh = make_backend()

    def harness(step, x, y):
        return bh.train_step(step, x, y, {}).loss

    bl = make_backend()

    def loss_only_impl(x, y, masks, hyper, seed):
        new_buffers: dict = {}
        logits, loss, grads = bl._grads(x, y, masks, new_buffers, seed)
        for n, g in zip(bl.trainable, grads):
            bl._apply(bl.v[n], n, g, hyper)
        return loss
    loss_only = tf.function(loss_only_impl)

    def no_stats(step, x, y):
        """The harness's step (same tensors in, same kernels) without the norms, accuracy and copies."""
        hyper = tf.constant(bl._step_hyper(step))
        with tf.device(bl.device):
            out = loss_only(tf.constant(x), tf.constant(np.asarray(y, np.int32)), {}, hyper,
                            bl._seed(bl.hp.seed, step))
        return float(out.numpy())

    w = problem(2).params
    names = ["conv1.kernel", "conv1.bias", "conv2.kernel", "conv2.bias", "fc1.kernel", "fc1.bias",
             "fc2.kernel", "fc2.bias"]

    def hand_fn(deterministic: bool):
        W = [tf.Variable(w[n]) for n in names]
        B = [tf.Variable(tf.zeros_like(v)) for v in W]

        @tf.function
        def train_step(x, y):
            with tf.GradientTape() as tape:
                k1, b1, k2, b2, k3, b3, k4, b4 = W
                h = tf.nn.relu(tf.nn.conv2d(x, k1, 1, "SAME") + b1)
                h = tf.nn.max_pool2d(h, 2, 2, "VALID")
                h = tf.nn.relu(tf.nn.conv2d(h, k2, 1, "SAME") + b2)
                h = tf.reshape(h, [tf.shape(h)[0], -1])
                h = tf.nn.relu(tf.matmul(h, k3) + b3)
                logits = tf.matmul(h, k4) + b4
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
            for v, b, g in zip(W, B, tape.gradient(loss, W)):
                b.assign(MOMENTUM * b + g)
                v.assign_sub(LR * b)
            return loss

        def hand(step, x, y):
            was = tf_config.is_op_determinism_enabled()
            if was != deterministic:
                tf_config.enable_op_determinism() if deterministic else tf_config.disable_op_determinism()
            out = float(train_step(tf.constant(x), tf.constant(y)).numpy())
            if was != deterministic:
                tf_config.enable_op_determinism() if was else tf_config.disable_op_determinism()
            return out
        return hand
    return {"harness": harness, "harness minus stats": no_stats,
            "hand, op determinism off": hand_fn(False), "hand": hand_fn(True)}


VARIANTS = {"torch": torch_variants, "keras-jax": keras_variants, "keras-tensorflow": keras_variants,
            "keras-torch": keras_variants, "jax": jax_variants, "tensorflow": tensorflow_variants}


def child(job_path: str, rounds: int, block: int, warmup: int, only: list[str] | None = None) -> None:
    from algorithms.contract import Job
    from wrappers.__main__ import set_backend_env
    from wrappers.registry import REGISTRY
    job = Job.read(job_path)
    entry = REGISTRY[job.backend]
    set_backend_env(entry, job.options)
    from algorithms.params import load_npz
    from wrappers import worker as W

    cls = entry.load()
    init = load_npz(job.params)

    def make_backend():
        b = W.build_backend(job, cls)
        b.name = entry.name
        b.load_params(init)
        return b

    arrays = load_npz(job.data)
    order = np.load(job.order)
    variants = VARIANTS[job.backend](make_backend, (arrays["x_train"], arrays["y_train"], order))
    if only:
        variants = {n: f for n, f in variants.items() if n in only or n == "hand"}   # hand: the reference
    x_tr, y_tr = arrays["x_train"], arrays["y_train"]
    names = list(variants)
    steps = {n: 0 for n in names}
    losses: dict[str, list[float]] = {n: [] for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    pc = time.perf_counter

    def run(n: int, count: int, record: bool) -> None:
        f = variants[n]
        for _ in range(count):
            s = steps[n] % len(order)
            idx = order[s]
            x, y = x_tr[idx], y_tr[idx]
            a = pc()
            loss = f(steps[n], x, y)
            dt = pc() - a
            steps[n] += 1
            if record:
                times[n].append(dt)
                losses[n].append(loss)
    failed: dict[str, str] = {}
    for n in list(names):                # compile / first calls, not recorded
        try:
            run(n, warmup, False)
        except Exception as e:           # a variant that leans on a wrapper internal that moved
            if n in ("harness", "hand"):
                raise
            failed[n] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            names.remove(n)
            print(f"step_breakdown: variant {n!r} dropped: {failed[n]}", file=sys.stderr)
    for r in range(rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            run(n, block, True)
    def p10(a: list[float]) -> float:
        return float(np.percentile(a, 10))
    hand, hand10 = statistics.median(times["hand"]), p10(times["hand"])
    res = {"backend": job.backend, "rounds": rounds, "block": block,
           "variants": [{"variant": n, "median_us": statistics.median(times[n]) * 1e6,
                         "p10_us": p10(times[n]) * 1e6,
                         "ratio_to_hand": statistics.median(times[n]) / hand,
                         "p10_ratio_to_hand": p10(times[n]) / hand10,
                         "last_loss": losses[n][-1]} for n in names], "failed": failed}
    print("@@RESULT@@" + json.dumps(res))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-b", "--backend", default="torch", choices=sorted(VARIANTS))
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--block", type=int, default=25, help="steps per block")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--variants", nargs="+", metavar="NAME", help="run only these variants (e.g. harness hand)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.rounds, args.block, args.warmup, args.variants)
        return 0
    with tempfile.TemporaryDirectory(prefix="duipai-breakdown-") as tmp:
        job = make_job(args.backend, 300, Path(tmp))
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONHASHSEED="0")
        r = subprocess.run([sys.executable, __file__, "--child", str(job), "--rounds", str(args.rounds),
                            "--block", str(args.block), "--warmup", str(args.warmup),
                            *(["--variants", *args.variants] if args.variants else [])],
                           capture_output=True, text=True, env=env, cwd=ROOT)
    line = next((l for l in r.stdout.splitlines() if l.startswith("@@RESULT@@")), None)
    if r.returncode != 0 or line is None:
        print(r.stderr[-4000:], file=sys.stderr)
        return 1
    res = json.loads(line[len("@@RESULT@@"):])
    print(f"# {res['backend']}: step variants interleaved in one process "
          f"({res['rounds']} rounds x {res['block']} steps each)\n")
    print("| variant | p10 step (us) | vs hand, p10 | median step (us) | vs hand, median |\n|---|---:|---:|---:|---:|")
    for v in res["variants"]:
        print(f"| {v['variant']} | {v['p10_us']:.0f} | {v['p10_ratio_to_hand']:.3f} | {v['median_us']:.0f} | "
              f"{v['ratio_to_hand']:.3f} |")
    for n, why in res.get("failed", {}).items():
        print(f"\n(variant {n!r} could not run: {why})")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
