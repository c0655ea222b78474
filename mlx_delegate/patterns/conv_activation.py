"""A convolution followed by ReLU, ReLU6 / hardtanh or a constant clamp, as one
`mlx_delegate::conv_clamp` node: the delegate's ConvNode then clamps its result in the pass that
writes it (the CPU kernel's epilogue) instead of a separate element-wise node over the activation.
Only non-transposed convolutions whose output nothing else reads are fused."""

from __future__ import annotations

from typing import Any

import torch
from torch.export import ExportedProgram

from .. import custom_ops  # noqa: F401  (defines mlx_delegate::conv_clamp)
from .common import aten, dtype, erase_dead, is_op, only_user, replace

BIG = 3.4028234663852886e38  # float32's largest: "no upper bound" in the IR's float fields


def _bounds(act: torch.fx.Node) -> tuple[float, float] | None:
    """[lo, hi] of a ReLU / hardtanh / clamp with number bounds."""
    if is_op(act, aten.relu.default):
        return 0.0, BIG
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    if is_op(act, aten.hardtanh.default):
        lo, hi = (list(act.args[1:3]) + [-1.0, 1.0][len(act.args) - 1:])[:2]
        lo, hi = act.kwargs.get("min_val", lo), act.kwargs.get("max_val", hi)
    elif is_op(act, aten.clamp.default):
        lo, hi = (list(act.args[1:3]) + [None, None])[:2]
        lo, hi = act.kwargs.get("min", lo), act.kwargs.get("max", hi)
        lo = -BIG if lo is None else lo
        hi = BIG if hi is None else hi
    else:
        return None
    if not (number(lo) and number(hi)) or not lo <= hi:
        return None
    return float(lo), float(hi)


def _fuse(ep: ExportedProgram, conv: torch.fx.Node) -> bool:
    if len(conv.users) != 1 or conv.args[6]:  # transposed
        return False
    (act,) = conv.users
    bounds = _bounds(act)
    if bounds is None or not only_user(conv, act) or dtype(act) != dtype(conv):
        return False
    x, w, bias, stride, padding, dilation, _, _, groups = conv.args
    args: tuple[Any, ...] = (x, w, bias, list(stride), list(padding), list(dilation), groups, *bounds)
    if not replace(ep, act, torch.ops.mlx_delegate.conv_clamp.default, args):
        return False
    erase_dead(ep.graph, [act])
    return True


def apply(ep: ExportedProgram) -> int:
    return sum(_fuse(ep, n) for n in [n for n in ep.graph.nodes if is_op(n, aten.convolution.default)])
