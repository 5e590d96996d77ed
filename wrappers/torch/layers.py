"""The spec's layers lowered to torch.nn.functional in NCHW, and canonical <-> torch layouts."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from algorithms.faults import Seams, parts as fault_parts
from algorithms.layout import (CHANNELS_FIRST, Pads, converters, flat_from_canonical, flat_sources,  # noqa: F401
                               flat_to_canonical, is_asymmetric)
from algorithms.spec import INPUT, ModelSpec, keep_output, layer_input

# ----------------------------------------------------------------------------- layouts (algorithms/layout.py)
LAYOUT = CHANNELS_FIRST
to_native, from_native = converters(LAYOUT)


def nhwc(t: torch.Tensor) -> np.ndarray:
    a = t.detach().cpu().numpy()
    return a.transpose(0, 2, 3, 1) if a.ndim == 4 else a


# ----------------------------------------------------------------------------- forward
def _pad(x: torch.Tensor, pads: Pads, value: float) -> torch.Tensor:
    (t, b), (l, r) = pads
    if t == b == l == r == 0:
        return x
    return F.pad(x, (l, r, t, b), value=value)


def _biased_running_var(x: torch.Tensor, rv: torch.Tensor, mom: float) -> None:
    """The bn_running_var_biased emulation: the running variance moves towards the biased batch variance
    (Keras' running_var * m + var * (1 - m), m = 1 - torch momentum)."""
    with torch.no_grad():
        var = x.detach().var(dim=(0, 2, 3), unbiased=False)
        rv.copy_(rv * (1.0 - mom) + var * mom)


def replica_mean_stats(p: dict[str, torch.Tensor], fault: str | None) -> list[str]:
    """The running statistics the bn_replica_mean_running_stats emulation averages over the replicas
    (tf.distribute's MEAN aggregation) instead of keeping replica 0's (DDP's); none without it."""
    if "bn_replica_mean_running_stats" not in fault_parts(fault):
        return []
    return [name for name in p if name.endswith(("running_mean", "running_var"))]


def fold_replica_buffers(replicas: list[dict[str, torch.Tensor]], fault: str | None) -> None:
    """After the emulated replicas' forward passes (replica 0 on the real buffers, the others on copies):
    replica_mean_stats' running statistics replaced by their mean over the replicas."""
    if len(replicas) < 2:
        return
    with torch.no_grad():
        for name in replica_mean_stats(replicas[0], fault):
            replicas[0][name].copy_(torch.stack([r[name] for r in replicas]).mean(0))


def forward(model: ModelSpec, p: dict[str, torch.Tensor], x: torch.Tensor, *, train: bool,
            masks: dict[str, torch.Tensor] | None, fault: str | None, record: dict[str, torch.Tensor] | None = None,
            native_dropout: bool = False, bn_momentum_flip: bool = False, sync_bn: Any = None) -> torch.Tensor:
    """Logits for NCHW input `x`. In training mode BatchNorm updates p's running buffers in place.

    `sync_bn`: a (process group, world size) pair: training-mode BatchNorm then uses the statistics
    of the global batch across the group, as torch.nn.SyncBatchNorm does (its autograd function;
    torch allows it on GPU only)."""
    seams = Seams(fault)
    no_bias = seams.dropped_bias(model)
    no_norm = seams.bypassed_norms(model)
    cat_axis = seams.concat_axis(channels_first=True)
    emulate = fault_parts(fault)
    outs: dict[str, torch.Tensor] = {INPUT: x}      # every layer's output by name: the graph's edges
    for layer in model.layers:
        o = layer.spec.options
        k = layer.kind
        x = layer_input(layer, outs)        # an `add` is its inputs' sum, in `inputs` order
        if k == "concat":
            x = torch.cat([outs[src] for src in layer.inputs], dim=cat_axis)     # NCHW: channels are axis 1
        elif k == "conv2d":
            pad: tuple[int, int] | int = 0
            if o["padding"] == "same":
                pads = seams.same_pads(layer)
                if not is_asymmetric(layer.padding) and not seams.symmetric_padding:
                    pad = (pads[0][0], pads[1][0])   # symmetric: the conv pads itself (bit-identical, ~20 % faster)
                else:                      # TF SAME's odd pixel goes bottom/right: pad explicitly
                    x = _pad(x, pads, 0.0)
            bias = None if layer.name == no_bias else p.get(f"{layer.name}.bias")
            x = F.conv2d(x, p[f"{layer.name}.kernel"], bias, stride=o["stride"], padding=pad,
                         dilation=o["dilation"], groups=o["groups"])
        elif k == "maxpool2d":
            if o["padding"] == "same":
                x = F.max_pool2d(_pad(x, layer.padding, float("-inf")), o["pool"], o["stride"])
            else:
                x = F.max_pool2d(x, o["pool"], o["stride"], ceil_mode=seams.maxpool_ceil)
        elif k == "avgpool2d":
            (t, b), (l, r) = layer.padding if o["padding"] == "same" else ((0, 0), (0, 0))
            if "avgpool_replicate_pad" in emulate and (t != b or l != r):
                # keras-torch: edge pixels replicated into the padding and counted in the mean
                x = F.avg_pool2d(F.pad(x, (l, r, t, b), mode="replicate"), o["pool"], o["stride"])
            elif o["padding"] == "same":
                # TF 'SAME' average excludes the padding from the count (asymmetric pads: divide by a pooled mask)
                ones = torch.ones_like(x[:1, :1])
                num = F.avg_pool2d(_pad(x, layer.padding, 0.0), o["pool"], o["stride"], divisor_override=1)
                den = F.avg_pool2d(_pad(ones, layer.padding, 0.0), o["pool"], o["stride"], divisor_override=1)
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
        elif k == "batchnorm2d" and layer.name in no_norm:
            pass                                # projection_without_bn: the port has no BatchNorm here
        elif k == "batchnorm2d":
            mom, eps = seams.bn_params(o)
            if train and sync_bn is not None and sync_bn[1] > 1:
                from torch.nn.modules._functions import SyncBatchNorm
                x = SyncBatchNorm.apply(x, p[f"{layer.name}.gamma"], p[f"{layer.name}.beta"],
                                        p[f"{layer.name}.running_mean"], p[f"{layer.name}.running_var"],
                                        eps, mom, sync_bn[0], sync_bn[1])
            else:
                rv = p[f"{layer.name}.running_var"]
                biased = train and seams.biased_running_var
                xin = x   # (biased: batch_norm updates a copy, which autograd keeps; the buffer gets Keras' value)
                x = F.batch_norm(x, p[f"{layer.name}.running_mean"], rv.clone() if biased else rv,
                                 p[f"{layer.name}.gamma"], p[f"{layer.name}.beta"], training=train,
                                 momentum=mom, eps=eps)
                if biased:
                    _biased_running_var(xin, rv, mom)
        elif k == "dropout":
            if train and not native_dropout and masks is not None:
                x = x * masks[layer.name] / (1.0 - o["rate"])
            elif train or seams.eval_dropout:
                x = F.dropout(x, o["rate"], training=True)
        elif k == "flatten":
            x = torch.flatten(x, 1)             # (C, H, W) order: the first dense kernel is permuted to match
        elif k == "global_avgpool2d":
            x = x.mean(dim=(2, 3))
        elif k == "dense":
            bias = None if layer.name == no_bias else p.get(f"{layer.name}.bias")
            x = F.linear(x, p[f"{layer.name}.kernel"], bias)
        elif k != "add":  # pragma: no cover - the spec validates kinds
            raise NotImplementedError(k)
        keep_output(outs, record, layer.name, x)
    return x


__all__ = ["forward", "to_native", "from_native", "nhwc", "LAYOUT", "fault_parts",
           "fold_replica_buffers", "replica_mean_stats", "flat_sources", "flat_to_canonical", "flat_from_canonical"]
