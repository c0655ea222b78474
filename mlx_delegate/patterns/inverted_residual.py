"""A MobileNet-style inverted-residual block fused into one `mlx_delegate::inverted_residual` node:
an optional 1x1 expand convolution (with its activation), a depthwise convolution (with its
activation), optionally a squeeze-excite gate on the depthwise output (MobileNetV3, EfficientNet:
per-channel mean, 1x1 reduce + activation, 1x1 expand + activation, multiplying the project's input)
and a 1x1 project convolution (with its residual add), each already a convolution or a `conv_fused`
after the BatchNorm, residual, activation and input-scale fusions (so this runs after them; the gate's
multiply is the project's `in_scale` by then). On the CPU the node is one kernel that keeps the
expanded activation in cache (`cpp/kernels/block_cpu.cpp`).

Matched only where each convolution's output is read by the next one alone (the depthwise output also
by the gate's mean); the expand convolution is left out of the block (the depthwise reads its output)
when it does not fit (another reader, a residual of its own, padding)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.export import ExportedProgram

from .. import custom_ops  # mlx_delegate::inverted_residual
from .common import dtype, erase_dead, is_op, only_user, replace, shape
from .conv_fusions import _conv_args, _unclamped

BLOCK = torch.ops.mlx_delegate.inverted_residual.default
aten = torch.ops.aten
NO_STAGE = (None, None, -math.inf, math.inf, "none")
NO_SE = (None, None, -math.inf, math.inf, "none", None, None, -math.inf, math.inf, "none")


def _block_epilogue(args: dict[str, Any]) -> bool:
    """Only what a block stage carries: a clamp and an activation (any of conv_fused's), no input scale."""
    return args.get("act", "none") in custom_ops.CONV_ACTIVATIONS and args.get("in_scale") is None


def _one_by_one(args: dict[str, Any]) -> bool:
    """A 1x1 convolution over all channels, stride 1, no padding."""
    w = shape(args["weight"])
    return (len(w) == 4 and w[2:] == [1, 1] and args["groups"] == 1 and list(args["stride"]) == [1, 1]
            and list(args["padding"]) == [0, 0] and list(args["padding_hi"]) == [0, 0]
            and list(args["dilation"]) == [1, 1])


def _pointwise(args: dict[str, Any]) -> bool:
    return _block_epilogue(args) and _one_by_one(args)


def _depthwise(args: dict[str, Any]) -> bool:
    """One filter per channel (weight [C, 1, kh, kw]), 2-D, undilated, no residual of its own."""
    w, x = shape(args["weight"]), shape(args["x"])
    return (_block_epilogue(args) and len(w) == 4 and len(x) == 4 and w[1] == 1 and args["groups"] == w[0] == x[1]
            and list(args["dilation"]) == [1, 1] and args["residual"] is None)


def _stage(args: dict[str, Any]) -> tuple[Any, ...]:
    return args["weight"], args["bias"], args["lo"], args["hi"], args.get("act", "none")


def _global_mean(n: Any) -> bool:
    """`n` is the per-channel mean of a [N, C, H, W] map as [N, C, 1, 1]: mean over H and W with keepdim,
    or adaptive average pooling to 1x1 (kept whole when the partitioner lowers it)."""
    if is_op(n, aten.mean.dim):
        dims, keep = (list(n.args[1:3]) + [False])[:2]
        keep = n.kwargs.get("keepdim", keep)
        return (keep is True and n.kwargs.get("dtype") is None and isinstance(dims, (list, tuple))
                and sorted(d % 4 for d in dims) == [2, 3])
    if is_op(n, aten.adaptive_avg_pool2d.default, aten._adaptive_avg_pool2d.default):
        size = n.args[1]
        return list(size) in ([1], [1, 1]) if isinstance(size, (list, tuple)) else size == 1
    return False


def _squeeze_excite(gate: Any, dw: torch.fx.Node, project: torch.fx.Node) -> tuple[Any, ...] | None:
    """The gate `act(conv(act(conv(mean(dw, [H, W])))))` read by the project alone, as the node's SE arguments."""
    ga = isinstance(gate, torch.fx.Node) and _conv_args(gate)
    if not ga or not _pointwise(ga) or ga["residual"] is not None or not only_user(gate, project):
        return None
    reduce = ga["x"]
    ra = isinstance(reduce, torch.fx.Node) and _conv_args(reduce)
    if not ra or not _pointwise(ra) or ra["residual"] is not None or not only_user(reduce, gate):
        return None
    mean = ra["x"]
    if not _global_mean(mean) or not only_user(mean, reduce) or mean.args[0] is not dw:
        return None
    if len({dtype(n) for n in (dw, mean, reduce, gate)}) != 1:
        return None
    return (*_stage(ra), *_stage(ga))


def apply(ep: ExportedProgram) -> int:
    done = 0
    for project in list(ep.graph.nodes):
        pa = _conv_args(project)
        if not pa or not _one_by_one(pa) or not _unclamped(pa):
            continue
        dw = pa["x"]
        da = isinstance(dw, torch.fx.Node) and _conv_args(dw)
        if not da or not _depthwise(da) or dtype(dw) != dtype(project):
            continue
        if pa["in_scale"] is None:
            se = NO_SE
            if not only_user(dw, project):
                continue
        else:
            se = _squeeze_excite(pa["in_scale"], dw, project)
            if se is None or len(dw.users) != 2:  # the gate's mean and the project
                continue
        expand = da["x"]
        ea = isinstance(expand, torch.fx.Node) and _conv_args(expand)
        if (ea and _pointwise(ea) and ea["residual"] is None and only_user(expand, dw)
                and dtype(expand) == dtype(dw)):
            x, stage = ea["x"], _stage(ea)
        else:
            x, stage = expand, NO_STAGE
        if len(shape(x)) != 4 or dtype(x) != dtype(project):
            continue
        we, be, elo, ehi, eact = stage
        args = (x, we, be, da["weight"], da["bias"], pa["weight"], pa["bias"], pa["residual"], list(da["stride"]),
                list(da["padding"]), list(da["padding_hi"]), elo, ehi, da["lo"], da["hi"], eact,
                da.get("act", "none"), *se)
        if replace(ep, project, BLOCK, args):
            erase_dead(ep.graph, [project])
            done += 1
    return done
