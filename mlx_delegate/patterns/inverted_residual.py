"""A MobileNet-style inverted-residual block fused into one `mlx_delegate::inverted_residual` node:
an optional 1x1 expand convolution (with its activation), a depthwise convolution (with its
activation) and a 1x1 project convolution (with its residual add), each already a convolution or a
`conv_fused` after the BatchNorm, residual and activation fusions (so this runs after them). On the CPU
the node is one kernel that keeps the expanded activation in cache (`cpp/kernels/block_cpu.cpp`).

Matched only where each convolution's output is read by the next one alone; the expand convolution
is left out of the block (the depthwise reads its output) when it does not fit (another reader, a
residual of its own, padding)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.export import ExportedProgram

from .. import custom_ops  # noqa: F401  (defines mlx_delegate::inverted_residual)
from .common import dtype, erase_dead, only_user, replace, shape
from .conv_fusions import _conv_args, _unclamped

BLOCK = torch.ops.mlx_delegate.inverted_residual.default


def _block_epilogue(args: dict[str, Any]) -> bool:
    """Only what the block node carries: a clamp, no other activation and no squeeze-excite input scale."""
    return args.get("act", "none") == "none" and args.get("in_scale") is None


def _pointwise(args: dict[str, Any]) -> bool:
    """A 1x1 convolution over all channels, stride 1, no padding."""
    w = shape(args["weight"])
    return (_block_epilogue(args) and len(w) == 4 and w[2:] == [1, 1] and args["groups"] == 1 and list(args["stride"]) == [1, 1]
            and list(args["padding"]) == [0, 0] and list(args["padding_hi"]) == [0, 0]
            and list(args["dilation"]) == [1, 1])


def _depthwise(args: dict[str, Any]) -> bool:
    """One filter per channel (weight [C, 1, kh, kw]), 2-D, undilated, no residual of its own."""
    w, x = shape(args["weight"]), shape(args["x"])
    return (_block_epilogue(args) and len(w) == 4 and len(x) == 4 and w[1] == 1 and args["groups"] == w[0] == x[1]
            and list(args["dilation"]) == [1, 1] and args["residual"] is None)


def apply(ep: ExportedProgram) -> int:
    done = 0
    for project in list(ep.graph.nodes):
        pa = _conv_args(project)
        if not pa or not _pointwise(pa) or not _unclamped(pa):
            continue
        dw = pa["x"]
        da = isinstance(dw, torch.fx.Node) and _conv_args(dw)
        if not da or not _depthwise(da) or not only_user(dw, project) or dtype(dw) != dtype(project):
            continue
        expand = da["x"]
        ea = isinstance(expand, torch.fx.Node) and _conv_args(expand)
        if (ea and _pointwise(ea) and ea["residual"] is None and only_user(expand, dw)
                and dtype(expand) == dtype(dw)):
            x, stage = ea["x"], (ea["weight"], ea["bias"], ea["lo"], ea["hi"])
        else:
            x, stage = expand, (None, None, -math.inf, math.inf)
        if len(shape(x)) != 4 or dtype(x) != dtype(project):
            continue
        we, be, elo, ehi = stage
        args = (x, we, be, da["weight"], da["bias"], pa["weight"], pa["bias"], pa["residual"], list(da["stride"]),
                list(da["padding"]), list(da["padding_hi"]), elo, ehi, da["lo"], da["hi"])
        if replace(ep, project, BLOCK, args):
            erase_dead(ep.graph, [project])
            done += 1
    return done
