"""The spec's layers lowered to torch.nn.functional in NCHW, and canonical <-> torch layouts."""
from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from algorithms.spec import INPUT, LayerInfo, ModelSpec, ParamInfo


# ----------------------------------------------------------------------------- layouts
def flatten_perm(h: int, w: int, c: int) -> np.ndarray:
    """perm[j] = the canonical (H, W, C) row of torch's (C, H, W) flatten position j."""
    return np.arange(h * w * c).reshape(h, w, c).transpose(2, 0, 1).ravel()


def to_torch_layout(model: ModelSpec, name: str, a: np.ndarray, permute: bool = True) -> np.ndarray:
    layer, role = _layer_of(model, name)
    if role != "kernel":
        return a
    if layer.kind == "conv2d":               # (kH, kW, I/groups, O) -> (O, I/groups, kH, kW)
        return a.transpose(3, 2, 0, 1)
    if layer.flattened_from and permute:     # rows in HWC order -> CHW order, then (out, in)
        a = a[flatten_perm(*layer.flattened_from)]
    return a.T


def from_torch_layout(model: ModelSpec, name: str, a: np.ndarray, permute: bool = True) -> np.ndarray:
    layer, role = _layer_of(model, name)
    if role != "kernel":
        return a
    if layer.kind == "conv2d":
        return a.transpose(2, 3, 1, 0)
    a = a.T
    if layer.flattened_from and permute:
        out = np.empty_like(a)
        out[flatten_perm(*layer.flattened_from)] = a
        return out
    return a


def flat_sources(model: ModelSpec) -> dict[str, tuple[int, int, int]]:
    """Layers whose output is a flattened (H, W, C) map (the flatten and element-wise layers and sums after it,
    `LayerInfo.flat_of`): torch holds these features in (C, H, W) order, the canonical layout in (H, W, C)."""
    return {layer.name: layer.flat_of for layer in model.layers if layer.flat_of is not None}


def flat_to_canonical(a: np.ndarray, src: tuple[int, int, int]) -> np.ndarray:
    c = np.empty_like(a)
    c[:, flatten_perm(*src)] = a
    return c


def flat_from_canonical(a: np.ndarray, src: tuple[int, int, int]) -> np.ndarray:
    return a[:, flatten_perm(*src)]


def _layer_of(model: ModelSpec, pname: str) -> tuple[LayerInfo, str]:
    lname, role = pname.rsplit(".", 1)
    return next(l for l in model.layers if l.name == lname), role


def nhwc(t: torch.Tensor) -> np.ndarray:
    a = t.detach().cpu().numpy()
    return a.transpose(0, 2, 3, 1) if a.ndim == 4 else a


# ----------------------------------------------------------------------------- forward
def _same_pad(layer: LayerInfo, value: float, x: torch.Tensor, symmetric: bool = False) -> torch.Tensor:
    (t, b), (l, r) = layer.padding
    if symmetric and (t != b or l != r):       # the fault: k//2 on every side, torch-style
        k = layer.spec.options.get("kernel", layer.spec.options.get("pool"))
        t = b = l = r = k // 2
    if t == b == l == r == 0:
        return x
    return F.pad(x, (l, r, t, b), value=value)


# the emulations of declared differences this backend computes (algorithms.faults.EMULATIONS and the two
# catalogued faults that emulate Keras' optimizers), alone or joined by '+' (the verdict engine applies every
# difference a candidate declares at once)
_EMULATING = ("adam_eps_hat", "keras_momentum_schedule", "bn_running_var_biased", "avgpool_replicate_pad",
              "bn_replica_mean_running_stats")
EMULATION_FAULTS = frozenset("+".join(sorted(c)) for n in range(1, len(_EMULATING) + 1)
                             for c in itertools.combinations(_EMULATING, n))


def fault_parts(fault: str | None) -> set[str]:
    """The faults a (possibly '+'-joined) fault value applies."""
    return set(fault.split("+")) if fault else set()


def _biased_running_var(x: torch.Tensor, rv: torch.Tensor, mom: float) -> None:
    """The bn_running_var_biased emulation: the running variance moves towards the biased batch variance
    (Keras' running_var * m + var * (1 - m), m = 1 - torch momentum)."""
    with torch.no_grad():
        var = x.detach().var(dim=(0, 2, 3), unbiased=False)
        rv.copy_(rv * (1.0 - mom) + var * mom)


def fold_replica_buffers(replicas: list[dict[str, torch.Tensor]], fault: str | None) -> None:
    """After the emulated replicas' forward passes (replica 0 on the real buffers, the others on copies):
    the bn_replica_mean_running_stats emulation keeps the mean of the replicas' running statistics
    (tf.distribute's MEAN aggregation) instead of replica 0's (DDP's)."""
    if "bn_replica_mean_running_stats" not in fault_parts(fault) or len(replicas) < 2:
        return
    with torch.no_grad():
        for name, t in replicas[0].items():
            if name.endswith(("running_mean", "running_var")):
                t.copy_(torch.stack([r[name] for r in replicas]).mean(0))


def forward(model: ModelSpec, p: dict[str, torch.Tensor], x: torch.Tensor, *, train: bool,
            masks: dict[str, torch.Tensor] | None, fault: str | None, record: dict[str, torch.Tensor] | None = None,
            native_dropout: bool = False, bn_momentum_flip: bool = False, sync_bn: Any = None) -> torch.Tensor:
    """Logits for NCHW input `x`. In training mode BatchNorm updates p's running buffers in place.

    `sync_bn`: a (process group, world size) pair: training-mode BatchNorm then uses the statistics
    of the global batch across the group, as torch.nn.SyncBatchNorm does (its autograd function;
    torch allows it on GPU only)."""
    skipped_bias = False
    emulate = fault_parts(fault)
    outs: dict[str, torch.Tensor] = {INPUT: x}      # every layer's output by name: the graph's edges
    for layer in model.layers:
        o = layer.spec.options
        k = layer.kind
        x = outs[layer.inputs[0]]
        if k == "add":
            for src in layer.inputs[1:]:
                x = x + outs[src]
        elif k == "concat":
            x = torch.cat([outs[src] for src in layer.inputs], dim=1)     # NCHW: channels are axis 1
        elif k == "conv2d":
            pad: tuple[int, int] | int = 0
            if o["padding"] == "same":
                (t, b), (l, r) = layer.padding
                if t == b and l == r and fault != "symmetric_same_padding":
                    pad = (t, l)           # symmetric: the conv pads itself (bit-identical, ~20 % faster)
                else:                      # TF SAME's odd pixel goes bottom/right: pad explicitly
                    x = _same_pad(layer, 0.0, x, symmetric=(fault == "symmetric_same_padding"))
            bias = p.get(f"{layer.name}.bias")
            if bias is not None and fault == "missing_bias" and not skipped_bias:
                bias, skipped_bias = None, True
            x = F.conv2d(x, p[f"{layer.name}.kernel"], bias, stride=o["stride"], padding=pad,
                         dilation=o["dilation"], groups=o["groups"])
        elif k == "maxpool2d":
            if o["padding"] == "same":
                x = F.max_pool2d(_same_pad(layer, float("-inf"), x), o["pool"], o["stride"])
            else:
                x = F.max_pool2d(x, o["pool"], o["stride"], ceil_mode=(fault == "maxpool_ceil"))
        elif k == "avgpool2d":
            (t, b), (l, r) = layer.padding if o["padding"] == "same" else ((0, 0), (0, 0))
            if "avgpool_replicate_pad" in emulate and (t != b or l != r):
                # keras-torch: edge pixels replicated into the padding and counted in the mean
                x = F.avg_pool2d(F.pad(x, (l, r, t, b), mode="replicate"), o["pool"], o["stride"])
            elif o["padding"] == "same":
                # TF 'SAME' average excludes the padding from the count (asymmetric pads: divide by a pooled mask)
                ones = torch.ones_like(x[:1, :1])
                num = F.avg_pool2d(_same_pad(layer, 0.0, x), o["pool"], o["stride"], divisor_override=1)
                den = F.avg_pool2d(_same_pad(layer, 0.0, ones), o["pool"], o["stride"], divisor_override=1)
                x = num / den
            else:
                x = F.avg_pool2d(x, o["pool"], o["stride"])
        elif k == "relu":
            x = F.relu(x)
        elif k == "tanh":
            x = torch.tanh(x)
        elif k == "leaky_relu":
            x = F.leaky_relu(x, negative_slope=o["alpha"])
        elif k == "gelu":
            x = F.gelu(x, approximate=o["approximate"])
        elif k == "silu":
            x = F.silu(x)
        elif k == "sigmoid":
            x = torch.sigmoid(x)
        elif k == "relu6":
            x = F.relu6(x)
        elif k == "layernorm":            # over channels: NCHW -> NHWC -> F.layer_norm -> NCHW
            args = ((x.shape[1],), p[f"{layer.name}.gamma"], p[f"{layer.name}.beta"], o["eps"])
            x = F.layer_norm(x.permute(0, 2, 3, 1), *args).permute(0, 3, 1, 2) if x.ndim == 4 else F.layer_norm(x, *args)
        elif k == "batchnorm2d":
            mom = o["momentum"]
            if fault == "bn_momentum_flipped":
                mom = 1.0 - mom
            eps = 1e-3 if fault == "bn_eps_keras" else o["eps"]
            if train and sync_bn is not None and sync_bn[1] > 1:
                from torch.nn.modules._functions import SyncBatchNorm
                x = SyncBatchNorm.apply(x, p[f"{layer.name}.gamma"], p[f"{layer.name}.beta"],
                                        p[f"{layer.name}.running_mean"], p[f"{layer.name}.running_var"],
                                        eps, mom, sync_bn[0], sync_bn[1])
            else:
                rv = p[f"{layer.name}.running_var"]
                biased = train and "bn_running_var_biased" in emulate
                xin = x   # (biased: batch_norm updates a copy, which autograd keeps; the buffer gets Keras' value)
                x = F.batch_norm(x, p[f"{layer.name}.running_mean"], rv.clone() if biased else rv,
                                 p[f"{layer.name}.gamma"], p[f"{layer.name}.beta"], training=train,
                                 momentum=mom, eps=eps)
                if biased:
                    _biased_running_var(xin, rv, mom)
        elif k == "dropout":
            if train and not native_dropout and masks is not None:
                x = x * masks[layer.name] / (1.0 - o["rate"])
            elif train or (fault == "dropout_in_eval"):
                x = F.dropout(x, o["rate"], training=True)
        elif k == "flatten":
            x = torch.flatten(x, 1)             # (C, H, W) order: the first dense kernel is permuted to match
        elif k == "global_avgpool2d":
            x = x.mean(dim=(2, 3))
        elif k == "dense":
            bias = p.get(f"{layer.name}.bias")
            if bias is not None and fault == "missing_bias" and not skipped_bias:
                bias, skipped_bias = None, True
            x = F.linear(x, p[f"{layer.name}.kernel"], bias)
        else:  # pragma: no cover - the spec validates kinds
            raise NotImplementedError(k)
        outs[layer.name] = x
        if record is not None:
            record[layer.name] = x
    return x


def param_infos(model: ModelSpec) -> list[ParamInfo]:
    return model.params


__all__ = ["forward", "to_torch_layout", "from_torch_layout", "nhwc", "flatten_perm", "Any"]
