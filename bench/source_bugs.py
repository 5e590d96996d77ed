"""Bugs written straight into a wrapper's source (not through `--fault`), as a porting engineer makes them,
and equivalent rewrites that are no bug: would `duipai compare` tell which is which, and say where?

Each mutation is one exact text replacement in one wrapper file of a pristine copy of HEAD (`git archive`).
The candidate backend is trained from that copy, from a folder outside both trees (as a user would), and
compared with a reference trained from the unmodified copy (`duipai compare -r REF_BACKEND REF CANDIDATE`,
the reference's envelope trained on demand). A bug must be BUG with its expected stage (and layer or parameter
where one is named); a rewrite that computes the same thing must be IDENTICAL or DRIFT.

The reference is torch, except for a mutation of the torch wrapper itself, which is compared with numpy (the
arbiter backend, no framework). The comparison runs from the mutated tree, and everything it trains or probes
for the reference (the envelope runs, the step-0 probes, the replays) runs that tree's code of the reference
backend: a torch candidate against a torch reference would have its bug in the reference's probes and
envelope too (the run_key of a probe job hashes the wrapper's sources, so no pristine job is reused). A
mutation of the reference's own wrapper, or of a file every backend shares, is refused.

`args` are extra `duipai run` options (optimizer, schedule, weight decay, lr, steps) given to the reference
and to the candidate alike (the pair must share its hyper-parameters); --steps defaults to STEPS.

    python bench/source_bugs.py [--only NAME,...] [-j 2] [--work DIR] [--keep]
        -> bench/results/source_bugs.{md,json}; exit 1 when a verdict is wrong
    python bench/source_bugs.py --list [--only NAME,...]
        checks every mutation without training (its text occurs once in HEAD's file, the file still
        compiles with the replacement, its args, its reference) and lists them; exit 1 when one is broken

The fault catalogue (`duipai faults`, the self-test) exercises the seams every wrapper exposes for faults;
these mutations sit elsewhere in the lowering: in the data-parallel loss scaling, an optimizer's constructor,
the evaluation function, BatchNorm's arguments, a pooling divisor, an activation; in the torch wrapper's DDP
step, evaluation and optimizer; in the Keras runtimes' own train steps (keras-torch, keras-jax) and
keras-jax's data-parallel L2 share; in the graph models' LayerNorm; and bugs that start late: a step schedule
one step early, a momentum buffer rescaled at the schedule's first decay, gradients accumulated from step 1,
SGD dampening that bites from step 1; a --sync-bn flag that never reaches the layers; conventions of other
libraries (AdamW's decay without lr, no weight decay on biases, AMSGrad, optax's eps_root); the statistics a
wrapper reports beside its training (a copy-pasted norm, an accuracy over one replica's batch, a norm
scaled by the schedule's rate, wrong from its first decay); hyper-parameters a port hard-codes, bugs behind a
declared difference (per-replica statistics at dp 2, Keras' velocity), a data bug that starts at step 180, the
evaluation's labels.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import py_compile
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
STEPS = 300


# torch's one-process step: what it is fed (the two mutations of its input edit this text)
TORCH_STEP_INPUT = ("            xt, yt = self._input(x), torch.as_tensor(y, dtype=torch.long, device=self.device)\n"
                    "            loss, replica_losses, acc = self._grads_single")


# the shard-order mutations' configuration
SHARD_ORDER_ARGS = ("--optimizer", "momentum", "--schedule", "cosine", "--steps", "120")


@dataclass(frozen=True)
class Mutation:
    name: str
    model: str
    backend: str
    devices: int
    file: str
    old: str
    new: str
    expect: tuple[str, ...]          # the verdicts that are right
    stages: tuple[str, ...] = ()     # a BUG's right stages (empty: any)
    where: str = ""                  # the layer or parameter a BUG must name ("" when none is expected)
    why: str = ""
    args: tuple[str, ...] = ()       # extra `duipai run` options, the reference's and the candidate's alike
    reference: str = "torch"         # the reference backend (numpy for a mutation of the torch wrapper)
    also: tuple[tuple[str, str], ...] = ()   # further (old, new) edits of the same file, one bug in several places

    def edits(self) -> tuple[tuple[str, str], ...]:
        return ((self.old, self.new),) + self.also


def mutated(m: Mutation, text: str) -> str:
    """`text` (the file as HEAD holds it) with every edit of `m`; ValueError naming an edit whose text does not
    occur exactly once, or that changes nothing."""
    for i, (old, new) in enumerate(m.edits()):
        if text.count(old) != 1:
            raise ValueError(f"{m.file} holds {text.count(old)} copies of the text to replace (edit {i + 1})")
        if new == old:
            raise ValueError(f"the replacement is the text itself (edit {i + 1})")
        text = text.replace(old, new)
    return text


MUTATIONS = (
    Mutation("tf_dp_loss_per_replica_batch", "cnn2d_2conv_2fc", "tensorflow", 2, "wrappers/tensorflow/parallel.py",
             "global_batch_size=b)", "global_batch_size=b // n)", ("BUG",), ("reduction", "backward"), "",
             "each replica divides its loss by its own batch, then the all-reduce sums: gradients x 2"),
    Mutation("keras_sgd_nesterov_always", "cnn2d_2conv_2fc", "keras-jax", 1, "wrappers/keras/optim.py",
             'nesterov=hp.optimizer == "nesterov")', "nesterov=True)", ("BUG",), ("optimizer",), "",
             "a config copied from another project: Nesterov momentum where plain momentum is asked for"),
    Mutation("jax_eval_label_smoothing", "cnn2d_2conv_2fc", "jax", 1, "wrappers/jax/backend.py",
             "return jnp.stack([cross_entropy(logits, y), jnp.mean", "return jnp.stack([cross_entropy(logits, y, 0.1), jnp.mean",
             ("BUG",), ("eval",), "", "the training loss's label smoothing leaks into the evaluation loss"),
    Mutation("keras_bn_momentum_torch_convention", "cnn2d_hard", "keras-tensorflow", 1, "wrappers/keras/layers.py",
             "momentum=keras_mom, epsilon=eps", "momentum=1.0 - keras_mom, epsilon=eps", ("BUG",),
             ("forward", "eval"), "bn1",
             "torch's BatchNorm momentum 0.1 handed to Keras, whose momentum is the weight of the old running value"),
    Mutation("jax_bn_eps_keras_default", "cnn2d_hard", "jax", 1, "wrappers/jax/layers.py",
             "            mom, eps = seams.bn_params(o)\n", "            mom, eps = seams.bn_params(o); eps = 1e-3\n",
             ("BUG",), ("forward",), "bn1", "Keras' BatchNorm epsilon default (1e-3) instead of the spec's 1e-5"),
    Mutation("jax_avgpool_counts_padding", "cnn2d_hard", "jax", 1, "wrappers/jax/layers.py",
             "x = num / jnp.asarray(den, x.dtype)", 'x = num / (o["pool"] * o["pool"])', ("BUG",), ("forward",),
             "pool1", "'same' average pooling divided by the window size, padding counted (torch's count_include_pad)"),
    Mutation("tf_gelu_tanh_always", "convnext_tiny", "tensorflow", 1, "wrappers/tensorflow/layers.py",
             'x = gelu(x, o["approximate"])', 'x = gelu(x, "tanh")', ("BUG",), ("forward",), "stage1_gelu",
             "GELU's tanh approximation where the spec asks for the exact erf form"),
    Mutation("jax_relu_rewritten", "cnn2d_2conv_2fc", "jax", 1, "wrappers/jax/layers.py",
             "x = jax.nn.relu(x)", "x = jnp.maximum(x, 0.0)", ("IDENTICAL", "DRIFT"), (), "",
             "no bug: jax.nn.relu written out as a maximum"),
    Mutation("tf_dp_loss_times_reciprocal", "cnn2d_3conv_3fc", "tensorflow", 2, "wrappers/tensorflow/parallel.py",
             "loss = tf.nn.compute_average_loss(per_sample, global_batch_size=b)",
             "loss = tf.reduce_sum(per_sample) * (1.0 / b)", ("IDENTICAL", "DRIFT"), (), "",
             "no bug: the replica's loss scaled by a rounded reciprocal of the global batch instead of divided"),
    # ---- the torch wrapper itself (against a numpy reference: see the module docstring)
    Mutation("torch_ddp_loss_over_world_size", "cnn2d_2conv_2fc", "torch", 2, "wrappers/torch/parallel.py",
             "        loss = self._loss(logits, yt)\n        loss.backward()\n        self._fold_rank_buffers()\n",
             "        loss = self._loss(logits, yt)\n        (loss / self.replicas).backward()\n"
             "        self._fold_rank_buffers()\n",
             ("BUG",), ("reduction", "backward"), "",
             "each DDP rank's loss divided by the world size before backward, as for a SUM all-reduce; DDP "
             "averages already: every gradient halved (the reported loss unchanged)",
             reference="numpy"),
    Mutation("torch_eval_in_train_mode", "cnn2d_hard", "torch", 1, "wrappers/torch/backend.py",
             "p or self.p, x, train=False", "p or self.p, x, train=True",
             ("BUG",), ("eval",), "bn1",
             "model.eval() forgotten: the evaluation runs in training mode (BatchNorm on the test batch's statistics, "
             "moving the running ones; dropout on)",
             reference="numpy"),
    Mutation("torch_adam_l2_decoupled", "cnn2d_2conv_2fc", "torch", 1, "wrappers/torch/optim.py",
             "        return torch.optim.Adam(params, lr=hp.lr, betas=betas, eps=hp.eps, weight_decay=hp.weight_decay)\n",
             "        return torch.optim.AdamW(params, lr=hp.lr, betas=betas, eps=hp.eps, weight_decay=hp.weight_decay)\n",
             ("BUG",), ("optimizer",), "",
             "Adam 'upgraded' to AdamW: the weight decay asked as coupled L2 (g + wd p) is applied decoupled (p -= lr wd p)",
             args=("--optimizer", "adam", "--lr", "0.001", "--weight-decay", "0.01"), reference="numpy"),
    Mutation("torch_momentum_buffer_rescaled_at_lr_change", "cnn2d_2conv_2fc", "torch", 1, "wrappers/torch/optim.py",
             '    if "keras_momentum_schedule" in emulate and prev_lr is not None and prev_lr != lr:\n',
             "    if prev_lr is not None and prev_lr != lr:\n",
             ("BUG",), ("optimizer",), "",
             "starts late, in the optimizer state: Keras' velocity convention carried over, torch's momentum buffer "
             "rescaled by lr_prev / lr whenever the lr changes; nothing happens until the step schedule's first decay "
             "(step 100), where the buffer doubles",
             args=("--schedule", "step"), reference="numpy"),
    # ---- a schedule off by one (starts late)
    Mutation("jax_step_schedule_one_step_early", "cnn2d_3conv_3fc", "jax", 1, "wrappers/jax/backend.py",
             "        lr = self.lr_for(step)\n        self.opt_state = keras_velocity(",
             "        lr = self.lr_for(step + 1)\n        self.opt_state = keras_velocity(",
             ("BUG",), ("optimizer",), "",
             "starts late: the schedule advanced before the update (lr_scheduler.step() before optimizer.step()), so "
             "the step schedule decays one step early, at steps 99, 199 and 299; the logged lr is right",
             args=("--schedule", "step")),
    # ---- the Keras runtimes' own train steps
    Mutation("keras_torch_zero_grad_forgotten", "cnn2d_2conv_2fc", "keras-torch", 1, "wrappers/keras/runtimes/torch.py",
             "    self.zero_grad()\n    logits = self(x, training=True)\n", "    logits = self(x, training=True)\n",
             ("BUG",), ("backward", "optimizer"), "",
             "starts after the first step: the custom train step does not zero the gradients (Keras' own train_step "
             "does), so loss.backward() accumulates every step's gradient into the last ones"),
    Mutation("keras_jax_train_step_inference_mode", "cnn2d_hard", "keras-jax", 1, "wrappers/keras/runtimes/jax.py",
             "self.stateless_call(tv, non_trainable, x, training=True)", "self.stateless_call(tv, non_trainable, x)",
             ("BUG",), ("forward",), "bn1",
             "training=True left out of the custom train step's stateless_call (its default is inference): BatchNorm "
             "normalises with the moving statistics and never updates them, dropout is off"),
    Mutation("keras_tensorflow_train_step_inference_mode", "cnn2d_hard", "keras-tensorflow", 1,
             "wrappers/keras/runtimes/tensorflow.py", "logits = self(x, training=True)", "logits = self(x)",
             ("BUG",), ("forward",), "bn1",
             "training=True left out of the custom train step's model call (Keras' default is inference): BatchNorm "
             "normalises with the moving statistics and never updates them, dropout is off"),
    Mutation("torch_train_step_in_eval_mode", "cnn2d_hard", "torch", 1, "wrappers/torch/backend.py",
             "p or self.p, x, train=True", "p or self.p, x, train=False",
             ("BUG",), ("forward",), "bn1",
             "model.train() forgotten after an evaluation: the training forward runs in inference mode (BatchNorm on "
             "the running statistics, which never move; dropout off)",
             reference="numpy"),
    Mutation("torch_grad_clip_copied", "cnn2d_2conv_2fc", "torch", 1, "wrappers/torch/backend.py",
             "        loss.backward()\n        acc = (logits.argmax(1) == yt)",
             "        loss.backward()\n        torch.nn.utils.clip_grad_norm_([self.p[n] for n in self.trainable], 1.0)\n"
             "        acc = (logits.argmax(1) == yt)",
             ("BUG",), ("backward",), "",
             "a gradient clip copied from another training script into the step (max norm 1): the optimizer gets "
             "the clipped gradient whenever the norm exceeds 1",
             reference="numpy"),
    Mutation("torch_zero_grad_forgotten", "cnn2d_2conv_2fc", "torch", 1, "wrappers/torch/backend.py",
             "        self._zero_grads()\n        if self.distributed:",
             "        if self.distributed:",
             ("BUG",), ("backward", "optimizer"), "",
             "starts after the first step: the gradients' zeroing dropped from the step, so backward accumulates every "
             "step's gradient into the last ones; the gradients are state the checkpoint does not hold",
             reference="numpy"),
    Mutation("jax_lr_scaled_by_its_own_step_count", "cnn2d_3conv_3fc", "jax", 1, "wrappers/jax/backend.py",
             "        lr = self.lr_for(step)\n",
             "        self._taken = getattr(self, '_taken', 0) + 1\n"
             "        lr = self.lr_for(step) * (1.02 if self._taken > 100 else 1.0)\n",
             ("BUG",), ("state",), "",
             "starts after step 100 on a chaotic model: the step counts the steps its backend object took and scales "
             "the learning rate by 1.02 from the 101st (the logged lr is right); a counter no checkpoint holds, so "
             "every step the resync starts from a checkpoint agrees"),
    Mutation("keras_torch_eval_loss_from_probabilities", "cnn2d_2conv_2fc", "keras-torch", 1, "wrappers/keras/backend.py",
             'self.eval_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")',
             'self.eval_loss = keras.losses.SparseCategoricalCrossentropy(reduction="sum")',
             ("BUG",), ("eval",), "",
             "from_logits=True forgotten in the evaluation loss (Keras' default is probabilities): the logits are "
             "normalised by their sum and clipped, the evaluation loss is wrong, its accuracy right"),
    # ---- data parallel (--devices 2) paths other than tensorflow's loss scaling
    Mutation("keras_jax_dp_l2_shared_per_replica", "cnn2d_2conv_2fc", "keras-jax", 2, "wrappers/keras/backend.py",
             "wd_share=1.0 / self.replicas if RT.REPLICA_GRADIENTS_SUMMED else 1.0)", "wd_share=1.0 / self.replicas)",
             ("BUG",), ("reduction", "optimizer"), "",
             "every Keras strategy assumed to sum the replicas' gradients (MirroredStrategy does): on keras-jax, one "
             "GSPMD program whose gradient is the global one already, each step adds half the coupled L2 term",
             args=("--weight-decay", "0.001")),
    # ---- graph models (fewer steps: a step is 100-250 ms here)
    Mutation("keras_torch_layernorm_keras_epsilon", "convnext_tiny", "keras-torch", 1, "wrappers/keras/layers.py",
             'll = ChannelLayerNorm(o["eps"], formula=k in formula_kinds, name=n)',
             'll = ChannelLayerNorm(1e-3, formula=k in formula_kinds, name=n)',
             ("BUG",), ("forward",), "stem_ln",
             "keras.layers.LayerNormalization's default epsilon (1e-3) instead of the spec's 1e-6, in every LayerNorm",
             args=("--steps", "100")),
    # ---- rewrites that compute the same thing (no bug)
    Mutation("torch_ddp_interleaved_shards", "cnn2d_2conv_2fc", "torch", 2, "wrappers/torch/parallel.py",
             "        lo, hi = self._shards(len(x))[self.rank]\n"
             "        xt = self._input(x[lo:hi])\n"
             "        yt = torch.as_tensor(y[lo:hi], dtype=torch.long, device=self.device)\n"
             "        logits = self.ddp(xt, self._masks(self._shard_masks(masks, lo, hi)))\n",
             "        rows = slice(self.rank, None, self.replicas)   # DistributedSampler's way: samples r, r+N, ...\n"
             "        xt = self._input(x[rows])\n"
             "        yt = torch.as_tensor(y[rows], dtype=torch.long, device=self.device)\n"
             "        logits = self.ddp(xt, self._masks({k: v[rows] for k, v in masks.items()}))\n",
             ("IDENTICAL", "DRIFT"), (), "",
             "no bug on a model without BatchNorm: interleaved DDP shards instead of contiguous ones; the mean of the "
             "two shards' mean gradients is the global-batch mean either way",
             reference="numpy"),
    Mutation("jax_dp_objective_global_mean", "cnn2d_2conv_2fc", "jax", 2, "wrappers/jax/backend.py",
             'objective = jnp.sum(reps) if self.fault == "grad_sum_replicas" else jnp.mean(reps)',
             'objective = jnp.sum(reps) if self.fault == "grad_sum_replicas" else jnp.mean(per)',
             ("IDENTICAL", "DRIFT"), (), "",
             "no bug: the data-parallel objective as the mean over the global batch instead of the mean of the "
             "replicas' means (equal shards: the same number, summed in another order)"),
    Mutation("tf_layernorm_via_moments", "convnext_tiny", "tensorflow", 1, "wrappers/tensorflow/layers.py",
             "    mean = tf.reduce_mean(x, axis=-1, keepdims=True)\n"
             "    var = tf.reduce_mean(tf.math.square(x - mean), axis=-1, keepdims=True)\n",
             "    mean, var = tf.nn.moments(x, axes=[-1], keepdims=True)\n",
             ("IDENTICAL", "DRIFT"), (), "",
             "no bug: LayerNorm's statistics from tf.nn.moments, which stops the gradient through the mean inside "
             "the variance; that gradient is -2/C sum(x - mean) = 0 exactly, so only rounding changes",
             args=("--steps", "100")),
    # ---- written 2026-12-03 (session 6): seams no mutation above touched, three of them subtle
    Mutation("tf_dropout_not_rescaled", "cnn2d_hard", "tensorflow", 1, "wrappers/tensorflow/layers.py",
             'x = x * tf.cast(masks[layer.name], x.dtype) / (1.0 - o["rate"])',
             "x = x * tf.cast(masks[layer.name], x.dtype)", ("BUG",), ("forward",), "drop1",
             "inverted dropout without its 1 / (1 - rate) rescaling (the kept units are not scaled up in training)"),
    Mutation("tf_dropout_scale_folded", "cnn2d_hard", "tensorflow", 1, "wrappers/tensorflow/layers.py",
             'x = x * tf.cast(masks[layer.name], x.dtype) / (1.0 - o["rate"])',
             'x = x * (tf.cast(masks[layer.name], x.dtype) / (1.0 - o["rate"]))', ("IDENTICAL", "DRIFT"), (), "",
             "no bug: the dropout mask scaled before it multiplies (another rounding of the same product)"),
    Mutation("jax_bn_running_var_biased", "cnn2d_hard", "jax", 1, "wrappers/jax/layers.py",
             "unbiased = var_sg * (n / (n - 1)) if n > 1 and not seams.biased_running_var else var_sg   # torch's",
             "unbiased = var_sg   # torch's", ("BUG",), (), "bn1",
             "buffer-only: the running variance from the biased batch variance (Keras' convention); training is "
             "unchanged, only the running statistics and so the evaluation move (by n/(n-1) - 1 = 0.4% at 4x4x64)",
             args=("--optimizer", "nesterov", "--schedule", "cosine", "--weight-decay", "0.0005")),
    Mutation("tf_l2_doubled", "cnn2d_3conv_3fc", "tensorflow", 1, "wrappers/tensorflow/optim.py",
             "g = g + h.weight_decay * var", "g = g + 2.0 * h.weight_decay * var", ("BUG",), ("optimizer",), "",
             "subtle: the coupled L2 term doubled (a 0.5 wd |w|^2 penalty's gradient taken as wd |w|^2's); at "
             "weight decay 5e-4 it moves one update by ~1e-3 relative",
             args=("--optimizer", "momentum", "--schedule", "warmup", "--weight-decay", "0.0005")),
    Mutation("keras_adam_epsilon_keras_default", "cnn2d_2conv_2fc", "keras-tensorflow", 1, "wrappers/keras/optim.py",
             "beta_2=hp.beta2, epsilon=hp.eps)", "beta_2=hp.beta2, epsilon=1e-7)", ("BUG",), ("optimizer",), "",
             "subtle: Keras' Adam epsilon default (1e-7) where the spec says 1e-8; it moves an update only where "
             "sqrt(v) is near epsilon",
             args=("--optimizer", "adam", "--lr", "0.001", "--schedule", "cosine")),
    # ---- written 2026-12-03 (session 7): a flag that stops reaching the math, two conventions from other
    #      libraries, a decay that skips some parameters, one rewrite of the loss (no bug) on a chaotic model
    Mutation("jax_sync_bn_ignored", "cnn2d_hard", "jax", 2, "wrappers/jax/backend.py",
             "self.bn_groups = 1 if (self.mesh is None or self.sync_bn) else self.replicas",
             "self.bn_groups = 1 if self.mesh is None else self.replicas", ("BUG",), ("forward",), "bn1",
             "--sync-bn accepted and recorded but never reaching the layers: BatchNorm statistics per replica while the "
             "run declares synchronized ones (so no declared difference may explain it)",
             args=("--sync-bn",)),
    Mutation("tf_adamw_decay_without_lr", "cnn2d_2conv_2fc", "tensorflow", 1, "wrappers/tensorflow/optim.py",
             "1.0 - lr * h.weight_decay]", "1.0 - h.weight_decay]", ("BUG",), ("optimizer",), "",
             "AdamW's decoupled decay as TensorFlow Addons wrote it (var -= wd * var, not lr * wd * var): every "
             "parameter shrinks 1,000x faster than asked",
             args=("--optimizer", "adamw", "--lr", "0.001", "--weight-decay", "0.0001")),
    Mutation("tf_l2_skips_biases", "cnn2d_3conv_3fc", "tensorflow", 1, "wrappers/tensorflow/optim.py",
             "if h.weight_decay and not self.decoupled:", "if h.weight_decay and not self.decoupled and len(var.shape) > 1:",
             ("BUG",), ("optimizer",), "",
             "subtle: the 'no weight decay on biases' convention of many training scripts, where the spec decays "
             "every parameter; only the biases' updates move, by ~wd |b| / |g|",
             args=("--schedule", "cosine", "--weight-decay", "0.0005")),
    Mutation("torch_sgd_dampening_copied", "cnn2d_hard", "torch", 1, "wrappers/torch/optim.py",
             "momentum=hp.momentum, nesterov=hp.optimizer == \"nesterov\",",
             "momentum=hp.momentum, dampening=hp.momentum, nesterov=hp.optimizer == \"nesterov\",",
             ("BUG",), ("optimizer",), "",
             "starts after the first step: SGD's dampening set to the momentum (an old Lua-torch config); torch "
             "initialises the buffer with the undampened gradient, so step 0 is right and every later gradient "
             "enters the buffer x 0.1",
             reference="numpy"),
    Mutation("jax_log_softmax_via_logsumexp", "cnn2d_3conv_3fc", "jax", 1, "wrappers/jax/layers.py",
             "logp = jax.nn.log_softmax(logits, axis=-1)",
             "logp = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)",
             ("IDENTICAL", "DRIFT"), (), "",
             "no bug, on a chaotic model: log_softmax written out as logits - logsumexp (another rounding of the "
             "same function and its gradient)",
             args=("--optimizer", "adam", "--lr", "0.001", "--schedule", "warmup")),
    # ---- session 8: the graph models' layers, written wrong in a wrapper's source
    Mutation("jax_gelu_default_approximate", "convnext_tiny", "jax", 1, "wrappers/jax/layers.py",
             'x = jax.nn.gelu(x, approximate=o["approximate"] == "tanh")', "x = jax.nn.gelu(x)",
             ("BUG",), ("forward",), "stage1_gelu",
             "jax.nn.gelu called with its own default, the tanh approximation, where the spec asks for the exact "
             "erf form (torch's and Keras' default)", args=("--steps", "100")),
    Mutation("jax_layernorm_unbiased_variance", "convnext_tiny", "jax", 1, "wrappers/jax/layers.py",
             "var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)",
             "var = jnp.var(x, axis=-1, keepdims=True, ddof=1)",
             ("BUG",), ("forward",), "stem_ln",
             "LayerNorm normalising by the unbiased (n - 1) variance over the channels (numpy/pandas habit); every "
             "framework's LayerNorm uses the biased one", args=("--steps", "100")),
    Mutation("jax_layernorm_over_every_axis", "convnext_tiny", "jax", 1, "wrappers/jax/layers.py",
             "mean = jnp.mean(x, axis=-1, keepdims=True)\n"
             "            var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)",
             "mean = jnp.mean(x, axis=tuple(range(1, x.ndim)), keepdims=True)\n"
             "            var = jnp.mean(jnp.square(x - mean), axis=tuple(range(1, x.ndim)), keepdims=True)",
             ("BUG",), ("forward",), "stem_ln",
             "LayerNorm over every axis but the batch (torch's nn.LayerNorm(x.shape[1:]) habit, GroupNorm(1, C)'s "
             "statistics) where ConvNeXt normalizes each position over its channels", args=("--steps", "100")),
    Mutation("jax_layernorm_one_pass_variance", "convnext_tiny", "jax", 1, "wrappers/jax/layers.py",
             "var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)",
             "var = jnp.mean(jnp.square(x), axis=-1, keepdims=True) - jnp.square(mean)",
             ("IDENTICAL", "DRIFT"), (), "",
             "no bug: LayerNorm's variance in one pass, E[x^2] - E[x]^2 (the same value in exact arithmetic; more "
             "rounding where the mean is large against the spread)", args=("--steps", "100")),
    Mutation("torch_strided_same_padding_symmetric", "resnet_tiny", "torch", 1, "wrappers/torch/layers.py",
             "                else:                      # TF SAME's odd pixel goes bottom/right: pad explicitly\n"
             "                    x = _pad(x, pads, 0.0)\n",
             "                else:                      # TF SAME's odd pixel goes bottom/right: pad explicitly\n"
             "                    pad = (pads[0][1], pads[1][1])\n",
             ("BUG",), ("forward",), "block2_conv1",
             "a stride-2 'same' 3x3 convolution ported with torch's padding=1 on both sides: the output has TF's "
             "shape, but SAME pads the odd pixel only at the bottom/right, so every window is shifted by one",
             args=("--steps", "30"), reference="numpy"),
    Mutation("tf_nesterov_flag_dropped", "mobilenet_tiny", "tensorflow", 1, "wrappers/tensorflow/optim.py",
             'use_nesterov=h.optimizer == "nesterov")', "use_nesterov=False)",
             ("BUG",), ("optimizer",), "",
             "ResourceApplyMomentum without use_nesterov: plain momentum where Nesterov is asked for",
             args=("--steps", "60", "--optimizer", "nesterov", "--schedule", "cosine")),
    Mutation("jax_bn_inference_without_eps", "resnet_tiny", "jax", 1, "wrappers/jax/layers.py",
             "x = (x - buffers[rm_key]) * lax.rsqrt(buffers[rv_key] + eps) * gamma + beta",
             "x = (x - buffers[rm_key]) * lax.rsqrt(buffers[rv_key]) * gamma + beta",
             ("BUG",), ("eval",), "stem_bn",
             "BatchNorm's inference path without eps (1e-5 against running variances near 1): training is "
             "untouched, every evaluation output moves by a few parts per million", args=("--steps", "60")),
    Mutation("jax_global_avgpool_as_sum_over_area", "resnet_tiny", "jax", 1, "wrappers/jax/layers.py",
             "x = jnp.mean(x, axis=(1, 2))", "x = jnp.sum(x, axis=(1, 2)) / (x.shape[1] * x.shape[2])",
             ("IDENTICAL", "DRIFT"), (), "",
             "no bug: the global average pool written as a sum divided by the area (another rounding of the mean)",
             args=("--steps", "100", "--optimizer", "adamw", "--lr", "0.002", "--weight-decay", "0.01",
                   "--schedule", "warmup")),
    # ---- session 9: layout, optimizer-constructor, loss-axis and gradient-path slips
    Mutation("torch_input_hw_transposed", "cnn2d_3conv_3fc", "torch", 1, "wrappers/torch/backend.py",
             "t = self._t(x).permute(0, 3, 1, 2)", "t = self._t(x).permute(0, 3, 2, 1)",
             ("BUG",), ("forward",), "conv1",
             "NHWC -> NCHW written as (0, 3, 2, 1): every image transposed (the digits are not symmetric)",
             reference="numpy"),
    Mutation("jax_adam_betas_swapped", "cnn2d_2conv_2fc", "jax", 1, "wrappers/jax/optim.py",
             "lambda learning_rate, eps: l2(optax.adam(learning_rate, b1=hp.beta1, b2=hp.beta2, eps=eps))",
             "lambda learning_rate, eps: l2(optax.adam(learning_rate, b1=hp.beta2, b2=hp.beta1, eps=eps))",
             ("BUG",), ("optimizer",), "",
             "Adam's two decay rates handed over in the wrong order (the bias corrections keep the right ones)",
             args=("--optimizer", "adam", "--lr", "0.001", "--schedule", "cosine")),
    Mutation("jax_log_softmax_over_the_batch", "cnn2d_hard", "jax", 1, "wrappers/jax/layers.py",
             "logp = jax.nn.log_softmax(logits, axis=-1)", "logp = jax.nn.log_softmax(logits, axis=0)",
             ("BUG",), ("loss",), "",
             "the softmax normalised over the batch axis instead of the classes (an axis copied from a "
             "channels-first port)", args=("--optimizer", "nesterov", "--schedule", "step")),
    Mutation("keras_torch_l2_term_dropped", "cnn2d_2conv_2fc", "keras-torch", 1, "wrappers/keras/runtimes/torch.py",
             "self.optimizer.apply(grads, tv)", "self.optimizer.apply(raw_grads, tv)",
             ("BUG",), ("optimizer",), "",
             "the optimizer applies the raw gradients: Adam's coupled L2 term (weight decay) is lost",
             args=("--optimizer", "adam", "--lr", "0.001", "--weight-decay", "0.0005")),
    Mutation("tf_relu_in_bfloat16", "cnn2d_2conv_2fc", "tensorflow", 1, "wrappers/tensorflow/layers.py",
             "            x = tf.nn.relu(x)\n",
             "            x = tf.cast(tf.nn.relu(tf.cast(x, tf.bfloat16)), x.dtype)\n",
             ("BUG",), ("forward",), "",
             "a mixed-precision cast left in one layer: every ReLU rounds its input to bfloat16 (8 bits of "
             "mantissa) and back"),
    Mutation("torch_bn_momentum_keras_convention", "cnn2d_hard", "torch", 1, "wrappers/torch/layers.py",
             "momentum=mom, eps=eps)", "momentum=1.0 - mom, eps=eps)",
             ("BUG",), (), "bn1",
             "a Keras model's BatchNorm momentum (the weight of the old running value) handed to torch's functional "
             "batch_norm (the weight of the new batch): training is unchanged, only the running statistics and so "
             "the evaluation differ (torch's functional batch_norm takes no momentum=None, so the cumulative "
             "average of nn.BatchNorm2d cannot be written here: tried, a TypeError at the first step)",
             reference="numpy"),
    # ---- session 13: late, buffer-only and eval-only slips, and graph-model rewrites at dp 2
    Mutation("tf_bn_inference_keras_epsilon", "mobilenet_tiny", "tensorflow", 1, "wrappers/tensorflow/layers.py",
             "x = tf.nn.batch_normalization(x, rm, rv, beta, gamma, eps)",
             "x = tf.nn.batch_normalization(x, rm, rv, beta, gamma, 1e-3)",
             ("BUG",), ("eval",), "stem_bn",
             "Keras' BatchNorm epsilon (1e-3) in the inference path only (a serving graph rebuilt with the "
             "framework's defaults): training is exact, every evaluation moves", args=("--steps", "100")),
    Mutation("jax_optimizer_state_lost_on_resume", "cnn2d_3conv_3fc", "jax", 1, "wrappers/jax/backend.py",
             "        lr = self.lr_for(step)\n        self.opt_state = keras_velocity(",
             "        lr = self.lr_for(step)\n"
             "        if step and step % 100 == 0:   # resumed from the step-100 checkpoint: parameters only\n"
             "            self.opt_state = self._place(self.tx.init(self.params))\n"
             "        self.opt_state = keras_velocity(",
             ("BUG",), ("optimizer",), "",
             "a resume from the checkpoint every 100 steps restores the parameters but re-creates the optimizer: "
             "the momentum starts again from zero at steps 100 and 200; the first 100 steps are exact (a chaotic "
             "model, the bug starting after its envelope has grown)"),
    Mutation("tf_sync_bn_running_var_local_count", "resnet_tiny", "tensorflow", 2, "wrappers/tensorflow/parallel.py",
             "        var = ctx.all_reduce(SUM, sq) / n\n        return mean, var, n\n",
             "        var = ctx.all_reduce(SUM, sq) / n\n        return mean, var, n // self.replicas\n",
             ("BUG",), ("forward", "eval"), "running_var",
             "synchronized BatchNorm whose running variance is unbiased with the replica's own count n/2 "
             "(n/(n-1) over 32,768 instead of 65,536 values at the stem, 2,048 instead of 4,096 in the last block): "
             "the batch statistics are right, each step's new running variance is 1.5e-6 to 2.4e-5 relative too "
             "large (every BatchNorm's: where the bias is named is any running variance), so only the buffers and "
             "the evaluations move",
             args=("--steps", "100", "--sync-bn")),
    Mutation("tf_relu6_as_min_max", "mobilenet_tiny", "tensorflow", 2, "wrappers/tensorflow/layers.py",
             "x = tf.nn.relu6(x)", "x = tf.minimum(tf.maximum(x, 0.0), 6.0)",
             ("IDENTICAL", "DRIFT", "DECLARED"), (), "",
             "no bug: ReLU6 written as a clip (the same values; a gradient exactly at 0 or 6 may go another way), "
             "data-parallel over two replicas (the per-replica BatchNorm it declares is verified or not)",
             args=("--steps", "150", "--optimizer", "adamw", "--lr", "0.002", "--weight-decay", "0.01",
                   "--schedule", "warmup")),
    Mutation("torch_concat_inputs_reversed", "scenarios/graph_ops_tiny", "torch", 1, "wrappers/torch/layers.py",
             "x = torch.cat([outs[src] for src in layer.inputs], dim=cat_axis)",
             "x = torch.cat([outs[src] for src in reversed(layer.inputs)], dim=cat_axis)",
             ("BUG",), ("forward",), "cat",
             "a concatenation with its inputs in the other order (a port that lists the branches as the diagram "
             "draws them): the shapes fit when the branches have equal channels, every later weight reads the "
             "other branch", args=("--steps", "60"), reference="numpy"),
    Mutation("keras_last_block_bn_eps_typo", "resnet_tiny", "keras-tensorflow", 1, "wrappers/keras/layers.py",
             '            keras_mom, eps = seams.bn_params(o, "keras")   # Keras: r = M r + (1-M) x\n',
             '            keras_mom, eps = seams.bn_params(o, "keras")   # Keras: r = M r + (1-M) x\n'
             '            eps = 2e-5 if n == "block3_bn2" else eps      # per-block config, one value mistyped\n',
             ("BUG",), ("forward",), "block3_bn2",
             "one BatchNorm of the last block with eps 2e-5 for 1e-5 (a per-block config with one value mistyped): "
             "that layer's outputs move by ~5e-6 relative, under one step's tolerance, and only the few layers after "
             "it inherit it, so the forward kind's median over resnet_tiny's 40 layers does not move",
             args=("--steps", "100")),
    Mutation("tf_sync_bn_mean_of_replica_variances", "cnn2d_hard", "tensorflow", 2, "wrappers/tensorflow/parallel.py",
             "        sq = tf.reduce_sum(tf.math.squared_difference(x, tf.stop_gradient(mean)), axis=[0, 1, 2])\n",
             "        local = tf.reduce_mean(x, axis=[0, 1, 2])          # each replica's deviations from its own mean\n"
             "        sq = tf.reduce_sum(tf.math.squared_difference(x, tf.stop_gradient(local)), axis=[0, 1, 2])\n",
             ("BUG",), ("forward",), "bn1",
             "synchronized BatchNorm whose variance is the mean of the replicas' own variances (the spread of the "
             "replica means left out): the global variance is under-estimated by the between-replica term, "
             "a few parts in a thousand at batch 64 over two replicas",
             args=("--steps", "100", "--sync-bn")),
    Mutation("keras_gelu_ops_default_tanh", "convnext_tiny", "keras-jax", 1, "wrappers/keras/layers.py",
             "            return keras.activations.gelu(x, approximate=tanh)\n",
             "            return ops.gelu(x)                           # keras.ops.gelu: approximate=True by default\n",
             ("BUG",), ("forward",), "stage1_gelu",
             "exact GELU ported as keras.ops.gelu, whose default is the tanh approximation (keras.activations.gelu "
             "defaults to exact): at most 4.7e-4 absolute per activation",
             args=("--steps", "60")),
    Mutation("jax_leaky_relu_default_slope", "scenarios/graph_ops_tiny", "jax", 1, "wrappers/jax/layers.py",
             'x = jax.nn.leaky_relu(x, negative_slope=o["alpha"])', "x = jax.nn.leaky_relu(x)",
             ("BUG",), ("forward",), "leaky",
             "LeakyReLU with jax.nn's default slope 0.01 where the spec says 0.1", args=("--steps", "60")),
    Mutation("tf_depthwise_kernel_multiplier_major", "scenarios/graph_ops_tiny", "tensorflow", 1,
             "wrappers/tensorflow/layers.py",
             "        dw = tf.reshape(kernel, [kh, kw, c_in, c_out // c_in])\n",
             "        dw = tf.transpose(tf.reshape(kernel, [kh, kw, c_out // c_in, c_in]), [0, 1, 3, 2])\n",
             ("BUG",), ("forward",), "dw",
             "a depthwise kernel with channel multiplier 2 reshaped multiplier-major (output m*C_in + c) where the "
             "canonical order is channel-major (c*M + m): the outputs are the right filters in another order",
             args=("--steps", "60")),
    Mutation("torch_layernorm_permuted_back_hw_swapped", "convnext_tiny", "torch", 1, "wrappers/torch/layers.py",
             "x = F.layer_norm(x.permute(0, 2, 3, 1), *args).permute(0, 3, 1, 2) if x.ndim == 4",
             "x = F.layer_norm(x.permute(0, 2, 3, 1), *args).permute(0, 3, 2, 1) if x.ndim == 4",
             ("BUG",), ("forward",), "stem_ln",
             "a channels-last LayerNorm permuted back to NCHW with H and W swapped (0, 3, 2, 1 for 0, 3, 1, 2): "
             "square maps keep their shape, every later layer sees the image transposed",
             args=("--steps", "30"), reference="numpy"),
    Mutation("jax_eval_weights_one_step_stale", "cnn2d_3conv_3fc", "jax", 1, "wrappers/jax/backend.py",
             "        xb, yb, mb = self._batch(x, y, masks)\n        self.params, self.buffers, self.opt_state, stats",
             "        xb, yb, mb = self._batch(x, y, masks)\n"
             "        self.before_step = (self.params, self.buffers)   # what the evaluation reads\n"
             "        self.params, self.buffers, self.opt_state, stats",
             ("BUG",), ("eval",), "",
             "the evaluation reads the weights as they were before the last update (an evaluation hook that runs "
             "before the step, or a snapshot taken one step early): every evaluation one step behind, training "
             "untouched; only the evaluation curve and the evaluation path can show it",
             args=("--schedule", "cosine"),
             also=(("self.lowering.eval(self.params, self.buffers, xe,",
                    "self.lowering.eval(*getattr(self, \"before_step\", (self.params, self.buffers)), xe,"),)),
    Mutation("torch_eval_model_copied_once", "cnn2d_hard", "torch", 1, "wrappers/torch/backend.py",
             "        logits = self._eval_forward(xt)\n        return F.cross_entropy(logits, yt).item()",
             "        # the evaluator's own copy of the model, made when it is first used (a deepcopy never refreshed)\n"
             "        copy = self.__dict__.setdefault(\"eval_copy\", {n: t.detach().clone() for n, t in self.p.items()})\n"
             "        logits = self._eval_forward(xt, p=copy)\n        return F.cross_entropy(logits, yt).item()",
             ("BUG",), ("eval",), "",
             "the evaluation runs on a copy of the model made at its first call (before training) and never "
             "refreshed: every evaluation is of the initial weights, training untouched",
             args=("--steps", "100"), reference="numpy"),
    Mutation("tf_residual_shortcut_gradient_stopped", "resnet_tiny", "tensorflow", 1, "wrappers/tensorflow/layers.py",
             "        x = layer_input(layer, outs)        # an `add` is its inputs' sum, in `inputs` order\n",
             "        x = layer_input(layer, outs)        # an `add` is its inputs' sum, in `inputs` order\n"
             "        if layer.name == \"block3_add\":         # a port of a detached shortcut\n"
             "            x = outs[layer.inputs[0]] + tf.stop_gradient(outs[layer.inputs[1]])\n",
             ("BUG",), ("backward",), "block3_proj_bn",
             "the last block's projection shortcut detached from the gradient (a port of a `.detach()`): every "
             "activation and the loss agree, the backward pass differs; the shared-state step's disagreement is "
             "backward-only with kinks near rounding in a BatchNorm-ReLU net, where the recorded program's "
             "gradients (harness.kinks.same_when_recorded) must not explain it: the same code, recorded, has the bug",
             args=("--steps", "60")),
    # ---- session 27: optimizer flags copied from elsewhere, the statistics a run reports, rewrites that are no bug
    Mutation("keras_adam_amsgrad_copied", "cnn2d_2conv_2fc", "keras-tensorflow", 1, "wrappers/keras/optim.py",
             "return keras.optimizers.Adam(**kw), coupled", "return keras.optimizers.Adam(amsgrad=True, **kw), coupled",
             ("BUG",), ("optimizer",), "",
             "AMSGrad switched on by a config copied from another project: the second moment becomes the running "
             "maximum, which differs only once some gradient shrinks",
             args=("--optimizer", "adam", "--lr", "0.001", "--steps", "150")),
    Mutation("jax_adam_eps_root_added", "cnn2d_3conv_3fc", "jax", 1, "wrappers/jax/optim.py",
             "l2(optax.adam(learning_rate, b1=hp.beta1, b2=hp.beta2, eps=eps))",
             "l2(optax.adam(learning_rate, b1=hp.beta1, b2=hp.beta2, eps=eps, eps_root=1e-8))",
             ("BUG",), ("optimizer",), "",
             "TF1's epsilon inside the square root (optax's eps_root) added to the reference's eps outside it",
             args=("--optimizer", "adam", "--lr", "0.001", "--schedule", "cosine", "--steps", "150")),
    Mutation("jax_update_norm_copy_pasted", "cnn2d_2conv_2fc", "jax", 1, "wrappers/jax/backend.py",
             "_global_norm(jax.tree.map(lambda a, b: a - b, new_params, params)), _global_norm(new_params)]",
             "_global_norm(new_params), _global_norm(new_params)]",
             ("BUG",), ("report",), "",
             "the reported update norm is the parameter norm (a copy-paste): training untouched, the run's "
             "update_norm column wrong from step 0",
             args=("--steps", "100")),
    Mutation("jax_grad_norm_over_lr_ratio", "cnn2d_2conv_2fc", "jax", 1, "wrappers/jax/backend.py",
             "jnp.mean((jnp.argmax(logits, axis=-1) == y).astype(self.dtype)), _global_norm(grads),",
             "jnp.mean((jnp.argmax(logits, axis=-1) == y).astype(self.dtype)), _global_norm(grads) * lr / 0.05,",
             ("BUG",), ("report",), "",
             "the gradient norm written out as the norm of the lr-scaled gradient over the base rate, written as "
             "a constant: right until the step schedule's first decay at step 100, then half: a report slip that "
             "carries no state and starts late",
             args=("--steps", "160", "--schedule", "step", "--lr", "0.05")),
    Mutation("tf_dp_accuracy_over_replica_batch", "cnn2d_3conv_3fc", "tensorflow", 2, "wrappers/tensorflow/parallel.py",
             "tot[n + 1] / self.hp.batch_size, grad_norm", "tot[n + 1] / (self.hp.batch_size // n), grad_norm",
             ("BUG",), ("report",), "",
             "the all-reduced count of correct predictions divided by one replica's batch: the reported training "
             "accuracy doubled, training untouched",
             args=("--steps", "100")),
    Mutation("jax_dp_shards_in_reverse_replica_order", "cnn2d_hard", "jax", 2, "wrappers/jax/parallel.py",
             "        if self.multi:\n            return global_array((x, y, m), self.data_sharded)\n",
             "        # the replicas' shards in reverse order (a port that enumerated the devices backwards)\n"
             "        half = len(x) // self.replicas\n"
             "        x, y, m = np.roll(x, half, 0), np.roll(y, half, 0), {k: np.roll(v, half, 0) for k, v in m.items()}\n"
             "        if self.multi:\n            return global_array((x, y, m), self.data_sharded)\n",
             ("BUG",), ("forward", "eval", "data"), "bn1",
             "replica 0 trains on the second half of the batch: every sample is normalised with the same half's "
             "statistics as before and the mean gradient is the same sum, but the running statistics, folded from "
             "replica 0's, are the other half's",
             args=SHARD_ORDER_ARGS),
    Mutation("keras_tensorflow_dp_shards_in_reverse_replica_order", "cnn2d_hard", "keras-tensorflow", 2,
             "wrappers/keras/runtimes/tensorflow.py",
             "        return shard_bounds(batch, self.replicas, self.fault)\n",
             "        return shard_bounds(batch, self.replicas, self.fault)[::-1]   # replica 0 takes the last shard\n",
             ("BUG",), ("forward", "eval", "data"), "bn1",
             "the same port slip in MirroredStrategy: data and dropout masks stay together, the loss and gradient "
             "are the same sums, the exported and evaluated moving statistics (replica 0's) are the other half's",
             args=SHARD_ORDER_ARGS),
    Mutation("keras_jax_dp_shards_in_reverse_replica_order", "cnn2d_hard", "keras-jax", 2, "wrappers/keras/parallel.py",
             '        if self.fault != "overlapping_shards":\n            return x, y, masks\n',
             '        if self.fault != "overlapping_shards":\n            half = len(x) // self.replicas   # the shards '
             'in reverse order\n            return (np.roll(x, half, 0), np.roll(y, half, 0),\n'
             '                    {k: np.roll(v, half, 0) for k, v in masks.items()})\n',
             ("IDENTICAL", "DRIFT", "DECLARED"), (), "",
             "no bug: keras-jax's one GSPMD program normalises over the global batch (BatchNorm statistics over "
             "all replicas), so which replica holds which half only reorders sums: drift, as the data-parallel "
             "control of the two mutations above",
             args=SHARD_ORDER_ARGS),
    Mutation("jax_bn_stats_moved_by_a_metrics_forward", "cnn2d_hard", "jax", 1, "wrappers/jax/backend.py",
             "        logits, new_buffers = aux[0], aux[1]\n",
             "        # the accuracy's logits from a second training-mode forward, fed the running statistics it just moved\n"
             "        logits, new_buffers = self._train_forward(params, aux[1], x, masks, key)\n",
             ("BUG",), ("forward",), "bn1",
             "a second training-mode forward for the metrics moves BatchNorm's running statistics twice a step: "
             "the loss, gradients and update agree, the buffers and so the evaluation do not",
             args=("--optimizer", "nesterov", "--weight-decay", "0.0005", "--schedule", "cosine", "--steps", "150")),
    Mutation("jax_update_norm_from_updates", "cnn2d_2conv_2fc", "jax", 1, "wrappers/jax/backend.py",
             "_global_norm(jax.tree.map(lambda a, b: a - b, new_params, params)), _global_norm(new_params)]",
             "_global_norm(updates), _global_norm(new_params)]",
             ("IDENTICAL", "DRIFT"), (), "",
             "no bug: the update norm from optax's updates instead of new minus old parameters (equal up to the "
             "rounding of p + u)",
             args=("--steps", "100")),
    Mutation("tf_grad_norm_written_out", "cnn2d_hard", "tensorflow", 1, "wrappers/tensorflow/backend.py",
             "grad_norm = tf.norm(flat(grads))", "grad_norm = tf.sqrt(tf.reduce_sum(tf.square(flat(grads))))",
             ("IDENTICAL", "DRIFT"), (), "",
             "no bug: the gradient norm written out as the square root of a sum of squares",
             args=("--optimizer", "adamw", "--lr", "0.001", "--weight-decay", "0.01", "--schedule", "warmup")),
    Mutation("keras_loss_running_mean", "cnn2d_3conv_3fc", "keras-jax", 1, "wrappers/keras/backend.py",
             "        return StepStats(float(logs[\"loss\"]), float(logs[\"accuracy\"]), float(logs[\"grad_norm\"]),",
             "        self._losses_seen = getattr(self, \"_losses_seen\", []) + [float(logs[\"loss\"])]\n"
             "        return StepStats(float(np.mean(self._losses_seen)), float(logs[\"accuracy\"]), float(logs[\"grad_norm\"]),",
             ("BUG",), ("report",), "",
             "Keras' own trap: the loss reported as the running mean of the losses so far (what fit's loss "
             "metric logs), not the step's; right at step 0, training untouched, the column wrong from step 1",
             args=("--optimizer", "nesterov", "--schedule", "cosine", "--steps", "120")),
    Mutation("tf_accuracy_running_mean", "cnn2d_hard", "tensorflow", 1, "wrappers/tensorflow/backend.py",
             "        self.has_state = True\n        return StepStats(*(float(v) for v in out))",
             "        self.has_state = True\n"
             "        self._accuracies = getattr(self, \"_accuracies\", []) + [float(out[1])]\n"
             "        out[1] = np.mean(self._accuracies)   # as a metric object that is never reset\n"
             "        return StepStats(*(float(v) for v in out))",
             ("BUG",), ("report",), "",
             "a training-accuracy metric that is never reset: the reported accuracy is the mean over every step so "
             "far; right at step 0, training untouched",
             args=("--optimizer", "adam", "--lr", "0.001", "--schedule", "warmup", "--steps", "120")),
    # ---- session 31: a schedule slip that grows late, a decay exclusion copied from common practice
    Mutation("torch_cosine_lr_one_step_late", "cnn2d_hard", "torch", 1, "wrappers/torch/backend.py",
             "        lr = self.lr_for(step)\n        set_hyper(",
             "        lr = self.lr_for(max(step - 1, 0))\n        set_hyper(",
             ("BUG",), ("optimizer",), "",
             "starts small and grows: the scheduler steps after the update instead of before it, so each step uses "
             "the previous step's cosine rate (identical at step 0, 3e-5 relative at step 1, 8e-5 at step 2, ~1 % at step "
             "150, unbounded as the rate nears zero); the logged lr is right",
             args=("--schedule", "cosine"), reference="numpy"),
    Mutation("keras_adamw_decay_excludes_norms_and_biases", "cnn2d_hard", "keras-jax", 1, "wrappers/keras/optim.py",
             "    return keras.optimizers.AdamW(weight_decay=hp.weight_decay, **kw), 0.0",
             "    opt = keras.optimizers.AdamW(weight_decay=hp.weight_decay, **kw)\n"
             "    opt.exclude_from_weight_decay(var_names=[\"gamma\", \"beta\", \"bias\"])   # common practice, not the spec's\n"
             "    return opt, 0.0",
             ("BUG",), ("optimizer",), "",
             "the usual fine-tuning practice (no decay on norms and biases) copied into a port whose spec decays every "
             "parameter: a 1 % difference in those parameters' updates at lr 1e-3, weight decay 0.01",
             args=("--optimizer", "adamw", "--lr", "0.001", "--weight-decay", "0.01", "--schedule", "warmup",
                   "--steps", "150")),
    Mutation("jax_bn_batch_statistics_as_constants", "cnn2d_hard", "jax", 1, "wrappers/jax/layers.py",
             "                x = (x - mean) * lax.rsqrt(var + eps) * gamma + beta\n"
             "                mean_sg, var_sg = lax.stop_gradient(mean), lax.stop_gradient(var)\n",
             "                mean, var = lax.stop_gradient(mean), lax.stop_gradient(var)   # 'statistics are not weights'\n"
             "                x = (x - mean) * lax.rsqrt(var + eps) * gamma + beta\n"
             "                mean_sg, var_sg = mean, var\n",
             ("BUG",), ("backward",), "",
             "backward only: the batch mean and variance are treated as constants in the backward pass, so the "
             "forward, the loss and gamma's and beta's gradients are right and every gradient upstream of the "
             "BatchNorm is not",
             args=("--optimizer", "momentum", "--schedule", "step", "--steps", "150")),
    Mutation("torch_loss_summed_then_divided", "cnn2d_3conv_3fc", "torch", 1, "wrappers/torch/backend.py",
             "        return F.cross_entropy(logits, y, label_smoothing=self.seams.label_smoothing)",
             "        return F.cross_entropy(logits, y, label_smoothing=self.seams.label_smoothing, "
             "reduction=\"sum\") / len(y)",
             ("IDENTICAL", "DRIFT"), (), "",
             "not a bug: the mean written as the sum over the batch divided by its size (a different rounding of "
             "the same mean)",
             args=("--optimizer", "nesterov", "--schedule", "warmup", "--steps", "200"), reference="numpy"),
    # ---- what the step is fed, changed inside the wrapper (the harness hands it the right batch)
    Mutation("torch_labels_rolled_by_one", "cnn2d_2conv_2fc", "torch", 1, "wrappers/torch/backend.py",
             TORCH_STEP_INPUT,
             TORCH_STEP_INPUT.replace("torch.as_tensor(y,", "torch.as_tensor(np.roll(y, 1),"),
             ("BUG",), ("loss",), "",
             "the labels shifted by one sample against their images inside the step (an off-by-one in a "
             "hand-written loader); every layer's output is right, the loss is not", reference="numpy",
             args=("--optimizer", "adam", "--lr", "0.002", "--schedule", "cosine", "--steps", "100")),
    Mutation("torch_last_sample_dropped", "mobilenet_tiny", "torch", 1, "wrappers/torch/backend.py",
             TORCH_STEP_INPUT,
             TORCH_STEP_INPUT.replace("self._input(x), torch.as_tensor(y,", "self._input(x[:-1]), torch.as_tensor(y[:-1],"),
             ("BUG",), ("loss", "data"), "",
             "the step trains on 63 of the batch's 64 samples (a slice written [:-1]); the BatchNorm statistics "
             "and the mean loss are over one sample fewer", reference="numpy",
             args=("--optimizer", "momentum", "--schedule", "step", "--steps", "60")),
    # ---- the numpy backend's hand-written backward passes (the arbiter is a wrapper too)
    Mutation("numpy_gelu_derivative_cdf_only", "convnext_tiny", "numpy", 1, "wrappers/numpy/layers.py",
             "        return dy * (cdf + x * np.exp(-0.5 * x * x) / np.sqrt(2.0 * np.pi))",
             "        return dy * cdf       # d/dx x*Phi(x) taken as Phi(x)",
             ("BUG",), ("backward",), "",
             "backward only: exact GELU's derivative written as its CDF, the x * pdf(x) term dropped; the forward "
             "and the loss are right", args=("--steps", "60")),
    Mutation("numpy_layernorm_backward_without_variance_term", "convnext_tiny", "numpy", 1, "wrappers/numpy/layers.py",
             "    dx = inv * (dxhat - dxhat.mean(axis=-1, keepdims=True) - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))",
             "    dx = inv * (dxhat - dxhat.mean(axis=-1, keepdims=True))   # the variance's gradient forgotten",
             ("BUG",), ("backward",), "",
             "backward only: LayerNorm's input gradient without the term through the variance; gamma's and beta's "
             "gradients and the forward are right", args=("--steps", "60", "--optimizer", "adamw", "--lr", "0.002",
                                                         "--weight-decay", "0.01", "--schedule", "warmup")),
    # ---- session 35: hyper-parameters a port hard-codes or shifts, bugs behind a declared difference, late bugs
    Mutation("tf_momentum_hard_coded", "cnn2d_3conv_3fc", "tensorflow", 1, "wrappers/tensorflow/optim.py",
             "momentum=tf.constant(h.momentum, self.dtype),",
             "momentum=tf.constant(0.9, self.dtype),",
             ("BUG",), ("optimizer",), "",
             "the momentum coefficient written as the usual 0.9 where the configuration says 0.8",
             args=("--optimizer", "nesterov", "--momentum", "0.8", "--schedule", "cosine", "--steps", "150")),
    Mutation("tf_dp_adam_bias_powers_one_step_ahead", "cnn2d_hard", "tensorflow", 2, "wrappers/tensorflow/optim.py",
             "b1p, b2p = h.beta1 ** self.t, h.beta2 ** self.t",
             "b1p, b2p = h.beta1 ** (self.t + 1), h.beta2 ** (self.t + 1)",
             ("BUG",), ("optimizer",), "",
             "Adam's bias-correction powers one step ahead (a count that starts at 1 and is incremented first), "
             "in a data-parallel BatchNorm run whose per-replica statistics are a declared difference",
             args=("--optimizer", "adam", "--lr", "0.001", "--schedule", "warmup", "--steps", "150")),
    Mutation("keras_adamw_decay_scaled_by_lr", "cnn2d_2conv_2fc", "keras-tensorflow", 1, "wrappers/keras/optim.py",
             "    return keras.optimizers.AdamW(weight_decay=hp.weight_decay, **kw), 0.0",
             "    return keras.optimizers.AdamW(weight_decay=hp.weight_decay * lr, **kw), 0.0",
             ("BUG",), ("optimizer",), "",
             "AdamW's decay multiplied by the learning rate twice (a port from a library whose decay is not "
             "scaled by lr): the decoupled decay all but vanishes",
             args=("--optimizer", "adamw", "--lr", "0.002", "--weight-decay", "0.05", "--schedule", "cosine",
                   "--steps", "200")),
    Mutation("keras_momentum_coefficient_off", "cnn2d_2conv_2fc", "keras-jax", 1, "wrappers/keras/optim.py",
             "        return keras.optimizers.SGD(learning_rate=lr, momentum=hp.momentum,",
             "        return keras.optimizers.SGD(learning_rate=lr, momentum=hp.momentum * 0.99,",
             ("BUG",), ("optimizer",), "",
             "the momentum coefficient 1 % low, in a configuration (Nesterov, a step schedule) whose Keras velocity "
             "is a declared difference that must not absorb it",
             args=("--optimizer", "nesterov", "--schedule", "step", "--weight-decay", "0.0005")),
    Mutation("keras_dp_bn_eps_tenfold", "cnn2d_hard", "keras-tensorflow", 2, "wrappers/keras/layers.py",
             '            keras_mom, eps = seams.bn_params(o, "keras")   # Keras: r = M r + (1-M) x\n',
             '            keras_mom, eps = seams.bn_params(o, "keras")   # Keras: r = M r + (1-M) x\n'
             '            eps = eps * 10\n',
             ("BUG",), ("forward",), "bn1",
             "every BatchNorm's eps ten times the spec's, in a data-parallel run whose per-replica statistics are a "
             "declared difference that must not absorb it",
             args=("--optimizer", "momentum", "--schedule", "cosine", "--steps", "150")),
    Mutation("jax_labels_reversed_from_step_180", "cnn2d_hard", "jax", 1, "wrappers/jax/backend.py",
             "        xb, yb, mb = self._batch(x, y, masks)\n        self.params, self.buffers, self.opt_state, stats",
             "        xb, yb, mb = self._batch(x, y if step < 180 else y[::-1], masks)\n"
             "        self.params, self.buffers, self.opt_state, stats",
             ("BUG",), ("loss", "data"), "",
             "the labels in reverse order against their images from step 180 on (a loader bug that starts with a "
             "later epoch): a late bug on a chaotic model, long after the free-running curves parted",
             args=("--optimizer", "momentum", "--schedule", "cosine")),
    Mutation("tf_eval_labels_rolled", "cnn2d_3conv_3fc", "tensorflow", 1, "wrappers/tensorflow/backend.py",
             "(x.shape,), xt, tf.constant(np.asarray(y, np.int32)),",
             "(x.shape,), xt, tf.constant(np.roll(np.asarray(y, np.int32), 1)),",
             ("BUG",), ("eval",), "",
             "evaluation labels shifted by one sample against their images; training is untouched",
             args=("--optimizer", "adam", "--lr", "0.001", "--schedule", "cosine")),
    Mutation("tf_lr_one_step_late", "cnn2d_hard", "tensorflow", 1, "wrappers/tensorflow/optim.py",
             "        lr = self.lr_for(step)\n        eps = b1p = b2p = 0.0",
             "        lr = self.lr_for(max(step - 1, 0))\n        eps = b1p = b2p = 0.0",
             ("BUG",), ("optimizer",), "",
             "the learning rate of the previous step (an off-by-one in a port's schedule), under a warm-up whose "
             "rate changes every step for the first 10 % of training",
             args=("--optimizer", "adamw", "--lr", "0.002", "--weight-decay", "0.01", "--schedule", "warmup",
                   "--steps", "200")),
    Mutation("jax_dp_bias_gradients_doubled", "cnn2d_3conv_3fc", "jax", 2, "wrappers/jax/backend.py",
             "        logits, new_buffers = aux[0], aux[1]\n",
             "        logits, new_buffers = aux[0], aux[1]\n"
             "        if self.mesh is not None:   # the biases' gradients reduced a second time\n"
             "            grads = {n: g * 2 if n.endswith('.bias') else g for n, g in grads.items()}\n",
             ("BUG",), ("reduction", "backward", "optimizer"), "",
             "data parallel only: the biases' gradients summed over the two replicas where the others are averaged "
             "(an all-reduce applied twice to one parameter group), after the gradient the probes read",
             args=("--optimizer", "adam", "--lr", "0.001", "--schedule", "cosine", "--steps", "150")),
    Mutation("torch_sgd_weight_decay_dropped", "cnn2d_hard", "torch", 1, "wrappers/torch/optim.py",
             "        return torch.optim.SGD(params, lr=hp.lr, weight_decay=hp.weight_decay)",
             "        return torch.optim.SGD(params, lr=hp.lr)",
             ("BUG",), ("optimizer",), "",
             "plain SGD constructed without its weight decay (the momentum branch has it)", reference="numpy",
             args=("--optimizer", "sgd", "--lr", "0.1", "--weight-decay", "0.0005", "--schedule", "step",
                   "--steps", "200")),
    Mutation("keras_jax_bn_running_statistics_dropped", "cnn2d_hard", "keras-jax", 1, "wrappers/keras/runtimes/jax.py",
             "    (_, (loss, logits, non_trainable, reps)), raw_grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)",
             "    (_, (loss, logits, _moved, reps)), raw_grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)",
             ("BUG",), ("eval", "state", "forward"), "",
             "the step's new BatchNorm moving statistics thrown away (a name shadowed in a hand-written train_step): "
             "training is right, every evaluation uses the initial statistics",
             args=("--optimizer", "nesterov", "--schedule", "warmup", "--steps", "150")),
    # rewrites that compute the same thing (no bug): must not be BUG
    Mutation("torch_batch_rows_reversed_with_their_labels", "cnn2d_2conv_2fc", "torch", 1, "wrappers/torch/backend.py",
             TORCH_STEP_INPUT,
             TORCH_STEP_INPUT.replace("self._input(x), torch.as_tensor(y,",
                                      "self._input(x[::-1].copy()), torch.as_tensor(y[::-1].copy(),"),
             ("IDENTICAL", "DRIFT"), (), "",
             "no bug: the step takes the batch's samples in reverse order, each with its own label (a loader that "
             "stacks the other way round); the mean loss and gradient are the same up to summation order",
             reference="numpy", args=("--optimizer", "adam", "--lr", "0.001", "--schedule", "step", "--steps", "150")),
    Mutation("jax_sgd_momentum_as_trace_chain", "cnn2d_3conv_3fc", "jax", 1, "wrappers/jax/optim.py",
             "            lambda learning_rate: l2(optax.sgd(learning_rate, momentum=hp.momentum, nesterov=nesterov))",
             "            lambda learning_rate: l2(optax.chain(optax.trace(decay=hp.momentum, nesterov=nesterov),\n"
             "                                                 optax.scale_by_learning_rate(learning_rate)))",
             ("IDENTICAL", "DRIFT"), (), "",
             "no bug: optax.sgd with momentum written out as the chain it is (a trace, then the learning rate)",
             args=("--optimizer", "nesterov", "--schedule", "step", "--weight-decay", "0.0005", "--steps", "200")),
    Mutation("keras_residual_add_inputs_reversed", "resnet_tiny", "keras-tensorflow", 1, "wrappers/keras/layers.py",
             "            x = L.Add(name=n)([edges[src] for src in layer.inputs])",
             "            x = L.Add(name=n)([edges[src] for src in reversed(layer.inputs)])",
             ("IDENTICAL", "DRIFT"), (), "",
             "no bug: every residual sum written shortcut first (floating-point addition of two tensors commutes)",
             args=("--optimizer", "adam", "--lr", "0.001", "--schedule", "cosine", "--steps", "60")),
    Mutation("tf_layernorm_eps_torch_default", "convnext_tiny", "tensorflow", 1, "wrappers/tensorflow/layers.py",
             '            x = layer_norm(x, p[f"{layer.name}.gamma"], p[f"{layer.name}.beta"], o["eps"])',
             '            x = layer_norm(x, p[f"{layer.name}.gamma"], p[f"{layer.name}.beta"], 1e-5)',
             ("BUG",), ("forward",), "stem_ln",
             "every LayerNorm with torch's default eps 1e-5 where the spec (ConvNeXt's) says 1e-6: the normalised "
             "outputs move by a few parts per million where the variance is near 1",
             args=("--optimizer", "adamw", "--lr", "0.002", "--weight-decay", "0.05", "--schedule", "warmup",
                   "--steps", "100")),
    # the arbiter's hand-written code is a wrapper too: a slip there must be found against torch like any other
    Mutation("numpy_leaky_relu_backward_default_slope", "scenarios/graph_ops_tiny", "numpy", 1,
             "wrappers/numpy/layers.py",
             '        return np.where(cache, dy, dy * layer.spec["alpha"])',
             "        return np.where(cache, dy, dy * 0.01)",
             ("BUG",), ("backward",), "",
             "backward only: LeakyReLU's derivative on the negative side with the common default slope 0.01 where "
             "the spec (and the forward) says 0.1", args=("--steps", "60")),
    Mutation("numpy_bn_running_variance_biased", "cnn2d_hard", "numpy", 1, "wrappers/numpy/layers.py",
             "    p[rv] = (1 - m) * p[rv] + m * var * (n / (n - 1) if n > 1 else 1.0)",
             "    p[rv] = (1 - m) * p[rv] + m * var",
             ("BUG",), ("forward", "eval"), "bn1",
             "the running variance moved towards the biased batch variance (Keras' convention) where the spec "
             "says torch's unbiased one: training is right, the running statistics and every evaluation are not",
             args=("--optimizer", "adam", "--lr", "0.001", "--schedule", "step", "--steps", "120")),
    # a port tested at two replicas only: right at dp 2, a bug at dp 4
    Mutation("tf_dp4_global_batch_as_two_shards", "cnn2d_3conv_3fc", "tensorflow", 4, "wrappers/tensorflow/parallel.py",
             "                loss = tf.nn.compute_average_loss(per_sample, global_batch_size=b)",
             "                loss = tf.nn.compute_average_loss(per_sample, global_batch_size=2 * (b // n))",
             ("BUG",), ("reduction", "backward"), "",
             "the global batch written as two shards (a port only ever run on two devices): at four replicas each "
             "replica's loss is scaled for half the batch, the summed gradient is twice the mean's",
             args=("--optimizer", "sgd", "--lr", "0.05", "--schedule", "step", "--steps", "150")),
    Mutation("tf_dp2_global_batch_as_two_shards", "cnn2d_3conv_3fc", "tensorflow", 2, "wrappers/tensorflow/parallel.py",
             "                loss = tf.nn.compute_average_loss(per_sample, global_batch_size=b)",
             "                loss = tf.nn.compute_average_loss(per_sample, global_batch_size=2 * (b // n))",
             ("IDENTICAL", "DRIFT"), (), "",
             "no bug at two replicas: the same slip where two shards are the global batch",
             args=("--optimizer", "sgd", "--lr", "0.05", "--schedule", "step", "--steps", "150")),
    # ---- session 36: precision and layer options lost on the way in, an optimizer that forgets, a rank alone
    Mutation("tf_inputs_through_float16", "cnn2d_3conv_3fc", "tensorflow", 1, "wrappers/tensorflow/backend.py",
             "        xt = tf.constant(np.asarray(x, self.np_dtype))\n",
             "        xt = tf.constant(np.asarray(np.asarray(x, np.float16), self.np_dtype))\n",
             ("BUG",), ("forward", "data"), "conv1",
             "a mixed-precision leftover: every batch rounded through float16 on its way in (the standardised pixels "
             "lose ~5e-4 of their value), training and evaluation alike", args=("--steps", "150")),
    Mutation("keras_dilation_rate_dropped", "scenarios/graph_ops_tiny", "keras-jax", 1, "wrappers/keras/layers.py",
             'dilation_rate=o["dilation"]', "dilation_rate=1",
             ("BUG",), ("forward",), "dilated",
             "the spec's dilation lost in the Keras lowering: a dense 3x3 window where the spec spreads it over 5x5; "
             "'same' padding keeps every shape", args=("--optimizer", "adam", "--lr", "0.002", "--steps", "60")),
    Mutation("torch_gelu_written_out_erf", "scenarios/graph_ops_tiny", "torch", 1, "wrappers/torch/layers.py",
             '            x = F.gelu(x, approximate=o["approximate"])\n',
             '            x = (0.5 * x * (1.0 + torch.erf(x * 0.7071067811865476)) if o["approximate"] == "none"\n'
             '                 else F.gelu(x, approximate=o["approximate"]))\n',
             ("IDENTICAL", "DRIFT"), (), "",
             "no bug: exact GELU written out as x/2 (1 + erf(x / sqrt 2)), the formula F.gelu computes in its own "
             "kernel", reference="numpy", args=("--optimizer", "adam", "--lr", "0.002", "--steps", "60")),
    Mutation("torch_biases_left_out_of_the_optimizer", "cnn2d_2conv_2fc", "torch", 1, "wrappers/torch/backend.py",
             "        self.opt = make_optimizer(self.hp, [self.p[n] for n in self.trainable], self.opts.fault)\n",
             "        self.opt = make_optimizer(self.hp, [self.p[n] for n in self.trainable if not n.endswith('.bias')],\n"
             "                                  self.opts.fault)\n",
             ("BUG",), ("optimizer",), "",
             "parameter groups built by a name filter that drops every bias: they get gradients, never an update",
             reference="numpy", args=("--optimizer", "adamw", "--lr", "0.002", "--weight-decay", "0.01",
                                      "--schedule", "cosine", "--steps", "120")),
    Mutation("torch_momentum_lost_when_the_rate_changes", "cnn2d_3conv_3fc", "torch", 1, "wrappers/torch/backend.py",
             "        set_hyper(self.opt, params, self.hp, step, lr, self.prev_lr, self.opts.fault)\n",
             "        if self.prev_lr is not None and lr != self.prev_lr:\n"
             "            self.opt.state.clear()      # a new optimizer for the new rate\n"
             "        set_hyper(self.opt, params, self.hp, step, lr, self.prev_lr, self.opts.fault)\n",
             ("BUG",), ("optimizer",), "",
             "a hand loop that builds a new optimizer at each rate decay: the momentum buffers are lost at the step "
             "schedule's boundary (step 100) and nowhere before it", reference="numpy",
             args=("--optimizer", "momentum", "--lr", "0.05", "--schedule", "step", "--steps", "160")),
    Mutation("torch_ddp_gradients_never_synchronised", "cnn2d_3conv_3fc", "torch", 2, "wrappers/torch/parallel.py",
             "        logits = self.ddp(xt, self._masks(self._shard_masks(masks, lo, hi)))\n"
             "        loss = self._loss(logits, yt)\n        loss.backward()\n",
             "        with self.ddp.no_sync():    # left over from gradient accumulation\n"
             "            logits = self.ddp(xt, self._masks(self._shard_masks(masks, lo, hi)))\n"
             "            loss = self._loss(logits, yt)\n            loss.backward()\n",
             ("BUG",), ("reduction", "backward"), "",
             "DDP's no_sync() left around the backward: no all-reduce, each rank steps on its own shard's gradient "
             "(rank 0's, half the batch, is what the run reports)", reference="numpy",
             args=("--optimizer", "nesterov", "--lr", "0.03", "--schedule", "cosine", "--steps", "120")),
    Mutation("jax_adamw_weight_decay_optax_default", "cnn2d_hard", "jax", 1, "wrappers/jax/optim.py",
             "eps=eps,\n                                                             weight_decay=weight_decay)\n",
             "eps=eps)\n",
             ("BUG",), ("optimizer",), "",
             "the configured decay not handed to optax.adamw, which then decays by its own default 1e-4 where "
             "the run says 0.05", args=("--optimizer", "adamw", "--lr", "0.002", "--weight-decay", "0.05",
                                        "--schedule", "warmup", "--steps", "120")),
    Mutation("jax_maxpool_padding_value_zero", "cnn2d_hard", "jax", 1, "wrappers/jax/layers.py",
             '            x = _window(x, -np.inf, lax.max, o["pool"], o["stride"], pads)\n',
             '            x = _window(jnp.pad(x, ((0, 0), *pads, (0, 0))), -np.inf, lax.max, o["pool"], o["stride"],\n'
             '                        ((0, 0), (0, 0)))     # padded with zeros first\n',
             ("IDENTICAL", "DRIFT"), (), "",
             "no bug here: max pooling's input padded with zeros (jnp.pad) instead of -inf, wrong for negative inputs, but "
             "cnn2d_hard's 'same' max pool reads an average of ReLU outputs, never below zero",
             args=("--optimizer", "nesterov", "--lr", "0.03", "--schedule", "cosine", "--steps", "150")),
    Mutation("tf_eval_drop_remainder", "cnn2d_2conv_2fc", "tensorflow", 1, "wrappers/tensorflow/backend.py",
             "        xt, _ = self._tensors(x, {})\n        with tf.device(self.device):\n"
             "            loss, acc = self._call(self._eval,",
             "        x, y = x[:len(x) // 64 * 64], y[:len(y) // 64 * 64]     # batch(64, drop_remainder=True)\n"
             "        xt, _ = self._tensors(x, {})\n        with tf.device(self.device):\n"
             "            loss, acc = self._call(self._eval,",
             ("BUG",), ("eval",), "",
             "the test set batched with drop_remainder=True: the last 40 test samples are never evaluated; "
             "training and the layers' inference outputs are right", args=("--optimizer", "sgd", "--steps", "100")),
    Mutation("keras_sgd_global_clipnorm_left_in", "cnn2d_3conv_3fc", "keras-tensorflow", 1, "wrappers/keras/optim.py",
             "keras.optimizers.SGD(learning_rate=lr, momentum=0.0), coupled",
             "keras.optimizers.SGD(learning_rate=lr, momentum=0.0, global_clipnorm=5.0), coupled",
             ("BUG",), ("optimizer",), "",
             "global_clipnorm=5.0 copied from another project's optimizer: it bites only on the steps whose "
             "gradient norm passes 5 (10 of torch's first 300)", args=("--optimizer", "sgd", "--steps", "150")),
    # only in the code a multi-process run takes (each process places its own devices' pieces of the batch)
    Mutation("jax_hosts_shards_by_local_index", "cnn2d_2conv_2fc", "jax", 2, "wrappers/jax/parallel.py",
             "        return jax.make_array_from_callback(h.shape, sharding, lambda idx: h[idx])\n",
             "        def local(idx):     # this process's rows, counted from its own first row\n"
             "            if not idx:\n"
             "                return h[idx]\n"
             "            rows = idx[0]\n"
             "            return h[(slice(0, (rows.stop or len(h)) - (rows.start or 0)),) + tuple(idx[1:])]\n"
             "        return jax.make_array_from_callback(h.shape, sharding, local)\n",
             ("BUG",), ("data",), "",
             "two processes standing in for hosts, each placing its device's shard by a local row index: both "
             "replicas train on the batch's first half; one process (a probe, a replay) is right",
             args=("--hosts", "2", "--optimizer", "adam", "--lr", "0.002", "--schedule", "cosine", "--steps", "100")),
    Mutation("jax_hosts_shards_by_explicit_bounds", "cnn2d_2conv_2fc", "jax", 2, "wrappers/jax/parallel.py",
             "        return jax.make_array_from_callback(h.shape, sharding, lambda idx: h[idx])\n",
             "        def local(idx):     # the same rows, by explicit global bounds\n"
             "            if not idx:\n"
             "                return h[idx]\n"
             "            return h[(slice(idx[0].start or 0, len(h) if idx[0].stop is None else idx[0].stop),)\n"
             "                     + tuple(idx[1:])]\n"
             "        return jax.make_array_from_callback(h.shape, sharding, local)\n",
             ("IDENTICAL", "DRIFT"), (), "",
             "no bug: the same multi-process placement with each shard's global row bounds written out",
             args=("--hosts", "2", "--optimizer", "adam", "--lr", "0.002", "--schedule", "cosine", "--steps", "100")),
    Mutation("jax_hosts_second_process_a_sample_ahead_from_step_40", "cnn2d_2conv_2fc", "jax", 2,
             "wrappers/jax/backend.py",
             "        xb, yb, mb = self._batch(x, y, masks)\n"
             "        self.params, self.buffers, self.opt_state, stats = self._step(\n",
             "        if self.multi and self.process_id == 1 and step >= 40:   # its loader a sample ahead from step 40\n"
             "            x, y = np.roll(x, -1, axis=0), np.roll(y, -1, axis=0)\n"
             "        xb, yb, mb = self._batch(x, y, masks)\n"
             "        self.params, self.buffers, self.opt_state, stats = self._step(\n",
             ("BUG",), ("state", "data"), "",
             "late and only in the multi-process path: from step 40 the second of two processes standing in for "
             "hosts trains on its shard shifted by one sample; the probes and replays, one process, never do",
             args=("--hosts", "2", "--optimizer", "adam", "--lr", "0.002", "--schedule", "cosine", "--steps", "100")),
    # only in resuming: training never loads a checkpoint, a resumed run does
    Mutation("tf_adam_step_count_not_restored", "cnn2d_hard", "tensorflow", 1, "wrappers/tensorflow/optim.py",
             '        if self.adam and "step" in state:\n            self.t = int(round(float(state["step"])))\n',
             "",
             ("BUG",), ("state", "optimizer"), "",
             "a checkpoint load that restores Adam's moments but not its step count: a resumed run's bias "
             "corrections start again from step 1; the uninterrupted training is right",
             args=("--optimizer", "adam", "--lr", "0.001", "--schedule", "cosine", "--steps", "120")),
    Mutation("torch_adam_step_exported_one_short", "cnn2d_2conv_2fc", "torch", 1, "wrappers/torch/optim.py",
             '            out["step"] = np.asarray(float(st["step"]))\n',
             '            out["step"] = np.asarray(float(st["step"]) - 1)     # steps before this one\n',
             ("BUG",), ("optimizer", "state"), "",
             "the checkpoint's Adam step count written one short (an off-by-one in the export): training is right, "
             "every checkpoint resumes with the bias corrections of the step before",
             reference="numpy", args=("--optimizer", "adamw", "--lr", "0.002", "--weight-decay", "0.01",
                                      "--schedule", "warmup", "--steps", "120")),
    Mutation("jax_hosts_update_norm_copy_pasted", "cnn2d_2conv_2fc", "jax", 2, "wrappers/jax/backend.py",
             "_global_norm(jax.tree.map(lambda a, b: a - b, new_params, params)), _global_norm(new_params)]",
             "_global_norm(new_params), _global_norm(new_params)]",
             ("BUG",), ("report",), "",
             "a report slip in a run of two processes standing in for hosts: its replay job's step reports the "
             "same wrong norm, so it stays a report slip, not the multi-process path",
             args=("--hosts", "2", "--optimizer", "adam", "--lr", "0.002", "--schedule", "cosine", "--steps", "100")),
    # ---- session 37: backward passes, sync-BN and grouped paths of the arbiter, dp-only mask/buffer/axis slips,
    #      exported-state sign, a stale host-side write cache, float32 Adam corrections; two rewrites that are no bug
    Mutation("numpy_avgpool_backward_full_window", "cnn2d_hard", "numpy", 1, "wrappers/numpy/layers.py",
             "    d = np.broadcast_to((dy / count)[..., None, None], (*dy.shape, k, k))\n",
             "    d = np.broadcast_to((dy / (k * k))[..., None, None], (*dy.shape, k, k))   # dy / window size\n",
             ("BUG",), ("backward",), "",
             "backward only, border windows only: 'same' average pooling's hand-written backward divides by the "
             "nominal window (k*k) where its forward divides by the real pixels; pool1's last row and column "
             "(7 of 16 windows) send half or a quarter of their gradient",
             args=("--optimizer", "momentum", "--schedule", "step", "--steps", "120")),
    Mutation("numpy_sync_bn_backward_projection_sum_local", "cnn2d_hard", "numpy", 2, "wrappers/numpy/parallel.py",
             "        s1, s2 = [sum(s1)] * len(dys), [sum(s2)] * len(dys)\n",
             "        s1 = [sum(s1)] * len(dys)          # the mean term all-reduced (the xhat term left local)\n",
             ("BUG",), ("backward", "reduction"), "",
             "data parallel, --sync-bn and backward only: synchronized BatchNorm's input gradient all-reduces "
             "sum(dy) but keeps each replica's own sum(dy * xhat); the forward, the loss and gamma's and "
             "beta's gradients are right",
             args=("--sync-bn", "--optimizer", "momentum", "--schedule", "cosine", "--steps", "100")),
    Mutation("keras_tensorflow_dp_dropout_masks_from_row_zero", "cnn2d_hard", "keras-tensorflow", 2,
             "wrappers/keras/runtimes/tensorflow.py",
             "            return tf.gather(mask, tf.range(rows) + tf.gather(starts, ctx.replica_id_in_sync_group))\n",
             "            return tf.gather(mask, tf.range(rows))      # this replica's rows, counted from 0\n",
             ("BUG",), ("forward", "data"), "drop1",
             "data parallel only: each replica's dropout mask cut from the global mask by its local row range, "
             "the replica's offset forgotten: replica 1's samples get replica 0's masks; data and labels stay "
             "right, only drop1's output (and all after it) moves for the second half",
             args=SHARD_ORDER_ARGS),
    Mutation("jax_adam_bias_corrections_in_float32", "cnn2d_3conv_3fc", "jax", 1, "wrappers/jax/optim.py",
             "    c1 = -jnp.expm1(tf * jnp.asarray(math.log(b1), dtype))\n"
             "    c2 = -jnp.expm1(tf * jnp.asarray(math.log(b2), dtype))\n",
             "    c1 = 1.0 - jnp.asarray(b1, dtype) ** tf           # 'simplified': 1 - b^t in the step's dtype\n"
             "    c2 = 1.0 - jnp.asarray(b2, dtype) ** tf\n",
             ("BUG",), ("optimizer",), "",
             "subtle, Adam only: the exact bias corrections 'simplified' to 1 - b^t in float32, which is optax's "
             "own rounding (b2 = 0.999 -> 0.99900001): 1 - b2^t 1.3e-5 low, every update ~6e-6 off; Keras "
             "declares this (keras_float32_betas), jax does not",
             args=("--optimizer", "adam", "--lr", "0.001", "--schedule", "cosine", "--steps", "150")),
    Mutation("tf_dp_bn_running_stats_replica_zero", "cnn2d_hard", "tensorflow", 2, "wrappers/tensorflow/parallel.py",
             "            self.v[k].assign(local0(val) if self.sync_bn else s.reduce(MEAN, val, axis=None))\n",
             "            self.v[k].assign(local0(val))      # replica 0's, as DDP keeps them\n",
             ("BUG",), ("forward", "eval", "state"), "bn1",
             "data parallel, buffers only: the custom loop writes replica 0's moving statistics where "
             "tf.distribute (and this wrapper's manifest, 'MEAN over replicas') averages the replicas'; "
             "training is right, the running statistics and every evaluation are not",
             args=SHARD_ORDER_ARGS),
    Mutation("keras_torch_momentum_exported_without_sign", "cnn2d_2conv_2fc", "keras-torch", 1,
             "wrappers/keras/optim.py",
             "        return (-a.astype(np.float64) / np.float64(last_lr)).astype(a.dtype)\n",
             "        return (a.astype(np.float64) / np.float64(last_lr)).astype(a.dtype)   # b = v / lr\n",
             ("BUG",), ("optimizer", "state"), "",
             "exported state only, momentum only: Keras' velocity (v = mu v - lr g) converted to torch's buffer "
             "without its minus sign; training is right, every checkpoint's momentum points the other way, so "
             "a resume steps backwards",
             args=("--optimizer", "momentum", "--lr", "0.05", "--steps", "120")),
    Mutation("keras_jax_lr_cached_by_shape", "cnn2d_3conv_3fc", "keras-jax", 1, "wrappers/keras/runtimes/jax.py",
             "            raw = (val.shape, val.tobytes())\n",
             "            raw = val.shape                     # the same shape: the same value, no transfer\n",
             ("BUG",), ("state", "optimizer"), "",
             "late, schedule only: the Stepper's write cache keyed by shape, so the learning rate written at "
             "step 0 stays until the next sync (each checkpoint/evaluation, every 50 steps): 3e-5 off at step 1, "
             "7 % at step 49; a cache no checkpoint holds (every resynced step starts right)",
             args=("--optimizer", "sgd", "--lr", "0.05", "--schedule", "cosine", "--steps", "150")),
    Mutation("jax_dp_bn_groups_interleaved", "cnn2d_hard", "jax", 2, "wrappers/jax/layers.py",
             "                xs = x.reshape(bn_groups, x.shape[0] // bn_groups, *x.shape[1:])\n",
             "                xs = x.reshape(x.shape[0] // bn_groups, bn_groups, *x.shape[1:]).swapaxes(0, 1)\n",
             ("BUG",), ("forward",), "bn1",
             "data parallel, behind the declared per-replica BatchNorm: the replica groups reshaped "
             "(B/G, G) then transposed, so 'replica' g normalises samples g, g+2, ... while GSPMD gives it the "
             "contiguous half; the outputs return in order, the statistics are the interleaved halves'",
             args=SHARD_ORDER_ARGS,
             also=(("                x = ((xs - mean) * lax.rsqrt(var + eps) * gamma + beta).reshape(x.shape)\n",
                    "                x = ((xs - mean) * lax.rsqrt(var + eps) * gamma + beta).swapaxes(0, 1).reshape(x.shape)\n"),)),
    Mutation("numpy_grouped_conv_kernel_grad_untransposed", "scenarios/graph_ops_tiny", "numpy", 1,
             "wrappers/numpy/layers.py",
             "    grads = {f\"{layer.name}.kernel\": dk.transpose(1, 0, 2).reshape(kern.shape)}\n",
             "    grads = {f\"{layer.name}.kernel\": dk.reshape(kern.shape)}   # (g, k*k*cg, O/g) read as (k, k, cg, O)\n",
             ("BUG",), ("backward",), "",
             "backward only, grouped convolutions only: the hand-written kernel gradient reshaped group-major "
             "without its transpose; the dilated (one group) conv is unaffected, the depthwise 'dw' kernel's "
             "gradient is scrambled", args=("--optimizer", "adam", "--lr", "0.002", "--steps", "60")),
    # realistic: `=` for `+=` in a per-replica loop; new: numpy backend.py, what its data-parallel step reports
    Mutation("numpy_dp_accuracy_of_the_last_replica", "cnn2d_2conv_2fc", "numpy", 2, "wrappers/numpy/backend.py",
             "            correct += int((pred == y[lo:hi]).sum())\n",
             "            correct = int((pred == y[lo:hi]).sum())      # this replica's hits\n",
             ("BUG",), ("report",), "",
             "data parallel, report only: the accuracy counts the last replica's hits over the whole batch (about "
             "half the true value); training is right", args=("--optimizer", "adam", "--lr", "0.002", "--steps", "80")),
    # realistic: a checkpoint writer that saves the moments and forgets the scalar; new: numpy optim.py's export
    Mutation("numpy_adam_step_not_exported", "cnn2d_2conv_2fc", "numpy", 1, "wrappers/numpy/optim.py",
             "        if \"step\" in self.state:\n            out[\"step\"] = np.asarray(float(self.state[\"step\"]))\n",
             "",
             ("BUG",), ("state", "optimizer", "probe-keys"), "",
             "checkpoint only, Adam only: the exported state holds Adam's moments but not its step count, so a "
             "resumed run's bias corrections start again from step 1; the uninterrupted training is right (the "
             "exported state lacks the key the reference exports: probe-keys opt0/step is that place)",
             args=("--optimizer", "adam", "--lr", "0.002", "--schedule", "cosine", "--steps", "80")),
    # realistic: the norm logged after the L2 term is folded in; new: keras prepare_grads, a report with weight decay
    Mutation("keras_grad_norm_after_weight_decay", "cnn2d_3conv_3fc", "keras-tensorflow", 1, "wrappers/keras/backend.py",
             "        grad_norm = ops.sqrt(RT.sum_of_squares(summed))\n"
             "        if self.coupled_wd:           # reference L2 for sgd/momentum/nesterov/adam: g + wd * p\n"
             "            wd = self.coupled_wd * self.wd_share   # straight to g.dtype: TF casts a Python float via float32\n"
             "            grads = [g + ops.convert_to_tensor(wd, dtype=g.dtype) * v for g, v in zip(grads, values)]\n",
             "        if self.coupled_wd:           # reference L2 for sgd/momentum/nesterov/adam: g + wd * p\n"
             "            wd = self.coupled_wd * self.wd_share   # straight to g.dtype: TF casts a Python float via float32\n"
             "            grads = [g + ops.convert_to_tensor(wd, dtype=g.dtype) * v for g, v in zip(grads, values)]\n"
             "        grad_norm = ops.sqrt(RT.sum_of_squares(grads))   # the gradient the optimizer sees\n",
             ("BUG",), ("report",), "",
             "report only, L2 weight decay only: the logged gradient norm includes the weight-decay term (the "
             "gradient the optimizer sees, not the data gradient the others log); training is right",
             args=("--optimizer", "momentum", "--weight-decay", "0.0005", "--schedule", "cosine", "--steps", "100")),
    # realistic: evaluating with the model called in training mode; new: keras evaluate, BatchNorm's batch statistics
    Mutation("keras_jax_eval_in_training_mode", "resnet_tiny", "keras-jax", 1, "wrappers/keras/backend.py",
             "            logits = _np(self.net.predict_on_batch(x))\n",
             "            logits = _np(self.net(x, training=True))   # the model called directly\n",
             ("BUG",), ("eval",), "",
             "evaluation only: the test set evaluated with BatchNorm in training mode (the test batch's own "
             "statistics, not the running ones); training is right",
             args=("--optimizer", "adam", "--lr", "0.001", "--schedule", "cosine", "--steps", "60")),
    # rewrites that compute the same thing (no bug)
    Mutation("torch_tanh_via_sigmoid", "cnn2d_3conv_3fc", "torch", 1, "wrappers/torch/layers.py",
             "            x = torch.tanh(x)\n", "            x = 2.0 * torch.sigmoid(2.0 * x) - 1.0\n",
             ("IDENTICAL", "DRIFT"), (), "",
             "no bug: tanh written as 2 sigmoid(2x) - 1 (the Keras wrapper's own float64 formula); ~1e-7 "
             "absolute rounding near 0", reference="numpy",
             args=("--optimizer", "adam", "--lr", "0.001", "--schedule", "cosine", "--steps", "150")),
    Mutation("tf_gelu_exact_via_erfc", "convnext_tiny", "tensorflow", 1, "wrappers/tensorflow/layers.py",
             "    return 0.5 * x * (1.0 + tf.math.erf(x * c(math.sqrt(0.5))))\n",
             "    return 0.5 * x * tf.math.erfc(-x * c(math.sqrt(0.5)))      # jax.nn.gelu's form\n",
             ("IDENTICAL", "DRIFT"), (), "",
             "no bug: exact GELU as x/2 erfc(-x/sqrt 2) (1 + erf(z) = erfc(-z), jax.nn.gelu's form), another "
             "rounding on the negative side", args=("--steps", "100")),
)


# the `duipai run` options the script sets itself for both runs: a mutation's args may not
SET_BY_SCRIPT = ("-m", "--model", "-b", "--backend", "--devices", "--out", "--name")
# each backend's own wrapper code; a file outside these is shared by every backend
BACKEND_CODE = {"torch": "wrappers/torch/", "jax": "wrappers/jax/", "tensorflow": "wrappers/tensorflow/",
                "numpy": "wrappers/numpy/", "keras-tensorflow": "wrappers/keras/", "keras-jax": "wrappers/keras/",
                "keras-torch": "wrappers/keras/"}


# options of the candidate's process layout, which a one-device reference cannot take (--hosts must divide --devices)
CANDIDATE_ONLY = ("--hosts",)


def run_args(m: Mutation, reference: bool = False) -> list[str]:
    """The hyper-parameter options of both runs of a mutation: its args, --steps STEPS unless they set it;
    the reference's without the candidate's process layout (CANDIDATE_ONLY, each with its value)."""
    args = ([] if "--steps" in m.args else ["--steps", str(STEPS)]) + list(m.args)
    if reference:
        drop = {i + k for i, a in enumerate(args) if a in CANDIDATE_ONLY for k in (0, 1)}
        args = [a for i, a in enumerate(args) if i not in drop]
    return args


def parsed_args(m: Mutation) -> dict:
    """run_args as `duipai run` parses them (its own click command: option names, choices, types); raises
    click.ClickException for what it would refuse."""
    from harness.cli import main as cli
    return cli.get_command(None, "run").make_context("run", run_args(m)).params


def steps_of(m: Mutation) -> int:
    """The training steps of both runs."""
    return int(parsed_args(m)["steps"])


def ref_key(m: Mutation) -> tuple[str, str, tuple[str, ...]]:
    """What a reference run is shared by: model, reference backend, run options."""
    return m.model, m.reference, tuple(run_args(m, reference=True))


def ref_folder_name(m: Mutation) -> str:
    """ref-MODEL for the default configuration (torch, no args); otherwise the backend and args appended."""
    model = m.model.replace("/", "-")    # a scenario model (scenarios/graph_ops_tiny): one folder, not two
    if m.reference == "torch" and not m.args:
        return f"ref-{model}"
    tail = "_".join(a.lstrip("-") for a in m.args)
    tail = "".join(c if c.isalnum() or c in "-_." else "_" for c in tail)
    return f"ref-{model}-{m.reference}" + (f"-{tail}" if tail else "")


def head_text(path: str) -> str:
    """A file as HEAD holds it (what tree_copy extracts)."""
    return subprocess.run(["git", "-C", str(ROOT), "show", f"HEAD:{path}"], check=True, capture_output=True,
                          text=True).stdout


def problems(m: Mutation) -> list[str]:
    """What is wrong with a mutation, without training anything: its text must occur exactly once in HEAD's
    file, the file must still compile with the replacement, its args must be run options the pair can share,
    and the reference's own code must stay untouched."""
    out: list[str] = []
    try:
        text = head_text(m.file)
    except subprocess.CalledProcessError:
        return [f"{m.file} is not in HEAD"]
    try:
        text = mutated(m, text)
    except ValueError as e:
        out.append(str(e))
    else:
        with tempfile.TemporaryDirectory(prefix="duipai-source-bug-") as d:
            src = Path(d) / Path(m.file).name
            src.write_text(text)
            try:
                py_compile.compile(str(src), cfile=str(Path(d) / "out.pyc"), doraise=True)
            except py_compile.PyCompileError as e:
                out.append(f"does not compile: {e.msg.strip().splitlines()[-1]}")
    import click
    fixed = sorted(set(m.args) & set(SET_BY_SCRIPT))
    if fixed:
        out.append(f"args: {', '.join(fixed)} set by the script itself")
    try:
        parsed_args(m)
    except click.ClickException as e:
        out.append(f"args: {e.format_message()}")
    if m.reference not in BACKEND_CODE:
        out.append(f"unknown reference backend {m.reference!r}")
    elif not any(m.file.startswith(c) for c in BACKEND_CODE.values()):
        out.append(f"{m.file} is shared by every backend: the comparison would train and probe the reference "
                   f"({m.reference}) with the mutation too")
    elif m.file.startswith(BACKEND_CODE[m.reference]):
        out.append(f"{m.file} is code of the reference backend {m.reference}: the comparison would train and probe "
                   f"the reference with the mutation (compare it with another reference)")
    if m.backend not in BACKEND_CODE or not m.file.startswith(BACKEND_CODE[m.backend]):
        out.append(f"{m.file} is not code of the candidate backend {m.backend}")
    bad = set(m.expect) - {"IDENTICAL", "DRIFT", "BUG", "DECLARED", "INCONCLUSIVE"}
    if bad:
        out.append(f"unknown verdict(s) {', '.join(sorted(bad))}")
    return out


def list_mutations(chosen: list[Mutation]) -> int:
    """--list: every chosen mutation checked (no training) and printed."""
    broken = 0
    for m in chosen:
        bad = problems(m)
        broken += bool(bad)
        exp = "/".join(m.expect) + (f" ({'/'.join(m.stages)}{' ' + m.where if m.where else ''})" if m.stages else "")
        print(f"{'BROKEN' if bad else 'ok':6} {m.name}: {m.model}, {m.backend}"
              f"{' --devices ' + str(m.devices) if m.devices > 1 else ''} vs {m.reference}, "
              f"{' '.join(run_args(m))}; {m.file}; expected {exp}")
        for old, new in m.edits():
            for line in old.rstrip("\n").splitlines():
                print(f"         - {line.strip()}")
            for line in new.rstrip("\n").splitlines():
                print(f"         + {line.strip()}")
        for b in bad:
            print(f"         PROBLEM: {b}")
    print(f"{len(chosen)} mutation(s), {broken} broken")
    return 1 if broken else 0


def tree_copy(dest: Path) -> Path:
    """HEAD's tracked files, pristine, in `dest` (what a clone holds)."""
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def harness(tree: Path, args: list[str], cwd: Path, log: Path, timeout: float = 3600) -> int:
    """`python -m harness ARGS` with `tree` first on the path, from `cwd`, output to `log`."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    with log.open("w") as fh:
        return subprocess.run([sys.executable, "-m", "harness", *args], cwd=cwd, env=env, stdout=fh,
                              stderr=subprocess.STDOUT, timeout=timeout).returncode


def run_folder(out: Path) -> Path:
    """The one run folder in `out` that is not an envelope run: a reference's folder also holds its envelope
    runs (--perturb-ulp, trained there by compare) once a comparison has been made (a reused --work folder)."""
    found = [p.parent for p in out.glob("*/manifest.json")
             if (json.loads(p.read_text()).get("init") or {}).get("perturb_ulp_seed") is None]
    if len(found) != 1:
        raise RuntimeError(f"{out}: expected one run folder besides envelope runs, found {len(found)}")
    return found[0]


def judge(m: Mutation, pair: dict) -> tuple[bool, str]:
    """Is the verdict right, and why not."""
    v = pair["verdict"]
    if v not in m.expect:
        return False, f"verdict {v}, expected {'/'.join(m.expect)}"
    if v != "BUG":
        return True, ""
    loc = pair.get("localization") or {}
    if m.stages and loc.get("stage") not in m.stages:
        return False, f"stage {loc.get('stage')}, expected {'/'.join(m.stages)}"
    named = " ".join(str(loc.get(k) or "") for k in ("layer", "parameter", "summary"))
    if m.where and m.where not in named:
        return False, f"localized to {named.strip()!r}, expected {m.where}"
    return True, ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated mutation names (default: all)")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    ap.add_argument("--work", type=Path, default=None, help="work folder (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--results-name", default="source_bugs")
    ap.add_argument("--list", action="store_true",
                    help="check the mutations without training (text once in HEAD, compiles, args, reference) and list them")
    a = ap.parse_args()
    chosen = [m for m in MUTATIONS if not a.only or m.name in a.only.split(",")]
    unknown = set(filter(None, a.only.split(","))) - {m.name for m in MUTATIONS}
    if unknown:
        print(f"--only: unknown mutation(s) {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    dup = sorted({m.name for m in MUTATIONS if sum(x.name == m.name for x in MUTATIONS) > 1})
    if dup:
        print(f"duplicate mutation name(s): {', '.join(dup)}", file=sys.stderr)
        return 2
    if a.list:
        return list_mutations(chosen)
    broken = [(m.name, p) for m in chosen for p in problems(m)]
    if broken:
        for name, p in broken:
            print(f"{name}: {p}", file=sys.stderr)
        return 2
    work = a.work or Path(tempfile.mkdtemp(prefix="duipai-source-bugs-"))
    work.mkdir(parents=True, exist_ok=True)
    user_dir = work / "user"                 # the folder the commands are run from: neither tree
    user_dir.mkdir(exist_ok=True)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    t0, load0 = time.time(), os.getloadavg()
    pristine = tree_copy(work / "pristine") if not (work / "pristine").exists() else work / "pristine"
    refs: dict[tuple[str, str, tuple[str, ...]], Path] = {}
    rows = []
    for m in chosen:
        key = ref_key(m)
        if key not in refs:     # the reference of this model, backend and configuration, from the pristine tree
            name = ref_folder_name(m)
            out = work / name
            if not any(out.glob("*/manifest.json")):
                shutil.rmtree(out, ignore_errors=True)
                rc = harness(pristine, ["run", "-m", m.model, "-b", m.reference, *run_args(m, reference=True),
                                        "--out", str(out)],
                             user_dir, work / f"{name}.log")
                if rc:
                    raise RuntimeError(f"reference run {name} failed (rc {rc}): {work / f'{name}.log'}")
            refs[key] = run_folder(out)
        t1 = time.time()
        tree = work / f"tree-{m.name}"
        shutil.rmtree(tree, ignore_errors=True)
        tree_copy(tree)
        src = tree / m.file
        try:
            src.write_text(mutated(m, src.read_text()))
        except ValueError as e:
            raise RuntimeError(f"{m.name}: {e}") from None
        out = work / f"runs-{m.name}"
        shutil.rmtree(out, ignore_errors=True)
        rc = harness(tree, ["run", "-m", m.model, "-b", m.backend, "--devices", str(m.devices), *run_args(m),
                            "--out", str(out)], user_dir, work / f"{m.name}.run.log")
        row = {**{k: v for k, v in asdict(m).items() if k not in ("old", "new", "also")}, "steps": steps_of(m),
               "diff": "\n".join(f"{sign} {l.strip()}" for old, new in m.edits()
                                  for sign, part in (("-", old), ("+", new)) for l in part.strip().splitlines())}
        if rc:
            row.update(verdict="CRASH", correct=False, problem=f"training failed (rc {rc}), {work / f'{m.name}.run.log'}")
        else:
            rc = harness(tree, ["compare", "-r", m.reference, str(refs[key]), str(run_folder(out)), "-j", str(a.jobs),
                                "--out", str(out / "cmp")], user_dir, work / f"{m.name}.cmp.log")
            cand = run_folder(out).name
            written = out / "cmp" / "comparison.json"
            if not written.is_file():    # the comparison itself failed: a wrong answer, recorded, not a stop
                row.update(verdict="CRASH", correct=False, problem=f"compare wrote no comparison.json (rc {rc}), "
                                                                   f"{work / f'{m.name}.cmp.log'}")
                rows.append(dict(row, seconds=round(time.time() - t1, 1)))
                print(f"{m.name}: CRASH -> WRONG: {row['problem']}", flush=True)
                continue
            pair = next(p for p in json.loads(written.read_text())["pairs"]
                        if p.get("with_reference") and p["candidate"] == cand)
            ok, problem = judge(m, pair)
            loc = pair.get("localization") or {}
            first = pair.get("first_divergence") or {}
            row.update(verdict=pair["verdict"], exit=rc, stage=loc.get("stage"), summary=loc.get("summary"),
                       first=f"{first.get('series', '')} @ {first.get('step', '')}" if first else "",
                       notes=pair.get("notes") or [], correct=ok, problem=problem)
        row["seconds"] = round(time.time() - t1, 1)
        rows.append(row)
        print(f"{m.name}: {row['verdict']} {row.get('summary') or ''} -> {'ok' if row['correct'] else 'WRONG: ' + row['problem']}"
              f" ({row['seconds']} s)", flush=True)
        if not a.keep:
            shutil.rmtree(tree, ignore_errors=True)
        write_results(a, rows, commit, t0, load0, done=len(rows), of=len(chosen))   # a stopped run keeps its table
    print(write_results(a, rows, commit, t0, load0, done=len(rows), of=len(chosen)))
    if not a.keep and a.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r["correct"] for r in rows) else 1


def write_results(a: argparse.Namespace, rows: list[dict], commit: str, t0: float, load0: tuple, done: int,
                  of: int) -> str:
    """bench/results/<results-name>.{json,md} with the rows so far (`done` of `of` mutations); the table's text."""
    meta = {"when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": commit,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "load": f"{load0[0]:.1f} -> {os.getloadavg()[0]:.1f}", "seconds": round(time.time() - t0),
            "command": "python bench/source_bugs.py" + (f" --only {a.only}" if a.only else "") + f" -j {a.jobs}",
            "done": done, "of": of}
    RESULTS.mkdir(parents=True, exist_ok=True)
    text = render(rows, meta)
    (RESULTS / f"{a.results_name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (RESULTS / f"{a.results_name}.md").write_text(text)
    return text


def render(rows: list[dict], meta: dict) -> str:
    right = sum(r["correct"] for r in rows)
    lines = [f"# Bugs written into a wrapper's source ({meta['when']}, {meta['machine']}, load {meta['load']}, "
             f"commit {meta['commit']})", "",
             f"`{meta['command']}`: {len(rows)} mutations"
             + (f" ({meta['done']} of {meta['of']} chosen: a run stopped or still going)"
                if meta.get("done", 0) < meta.get("of", 0) else "") + f", {STEPS} steps each unless their args say otherwise, "
             f"against a reference trained from the pristine tree with the same args (torch; numpy for a mutation "
             f"of the torch wrapper); **{right}/{len(rows)} verdicts right**; {meta['seconds']} s.", "",
             "| mutation | model | backend | args | the change | expected | verdict | where | first | right |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        exp = "/".join(r["expect"]) + (f" ({'/'.join(r['stages'])}{' ' + r['where'] if r['where'] else ''})"
                                       if r["stages"] else "")
        change = r["diff"].replace("\n", "<br>").replace("|", "\\|")
        ref = r.get("reference", "torch")
        args = " ".join(r.get("args") or ()) or "-"
        lines.append(f"| {r['name']} ({r['why']}) | {r['model']} | {r['backend']}{' dp' + str(r['devices']) if r['devices'] > 1 else ''}"
                     f"{' vs ' + ref if ref != 'torch' else ''} | `{args}` "
                     f"| `{change}` | {exp} | {r['verdict']} | {r.get('summary') or ''} | {r.get('first', '')} | "
                     f"{'yes' if r['correct'] else 'NO: ' + r['problem']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
