"""A linear followed by GELU (erf or tanh form), SiLU, hard-swish or hard-sigmoid, as one
`mlx_delegate::linear_act` node: the delegate's LinearNode then adds the bias and applies the
activation in one pass over the product while it is written (on the CPU, in place: one read and one
write of the result instead of a bias add and an activation, each reading it and writing a new array). Only linears whose output
nothing else reads are fused; linears grouped by `fuse_linears` (which runs first) are left alone."""

from __future__ import annotations

import torch
from torch.export import ExportedProgram

from .. import custom_ops  # noqa: F401  (defines mlx_delegate::linear_act)
from .common import aten, dtype, erase_dead, is_op, only_user, replace


def _activation(n: torch.fx.Node) -> str | None:
    """The `linear_act` name of activation node n, or None."""
    if is_op(n, aten.silu.default):
        return "silu"
    if is_op(n, aten.hardswish.default):  # MobileNetV3's classifier
        return "hardswish"
    if is_op(n, aten.hardsigmoid.default):
        return "hardsigmoid"
    if is_op(n, aten.gelu.default):
        approximate = n.kwargs.get("approximate", n.args[1] if len(n.args) > 1 else "none")
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(approximate)
    return None


def _fuse(ep: ExportedProgram, linear: torch.fx.Node) -> bool:
    if len(linear.users) != 1:
        return False
    (act,) = linear.users
    name = _activation(act)
    if name is None or act.args[0] is not linear or not only_user(linear, act) or dtype(act) != dtype(linear):
        return False
    x, w, bias = (list(linear.args) + [None])[:3]
    if not replace(ep, act, torch.ops.mlx_delegate.linear_act.default, (x, w, bias, name)):
        return False
    erase_dead(ep.graph, [act])
    return True


def apply(ep: ExportedProgram) -> int:
    return sum(_fuse(ep, n) for n in [n for n in ep.graph.nodes if is_op(n, aten.linear.default)])
