"""What follows a weight-only quantized product, fused into it: the delegate's QuantizedLinearNode
applies it to the product as it is written (on the CPU inside the GEMV's call), so a decode step
runs one primitive where it ran two or four.

- `fuse_quantized_glu`: `silu(g) * u` with g and u the two outputs of one `quantized_linear_group`
  (a SwiGLU MLP's gate and up projections, grouped by `fuse_linears`) becomes
  `mlx_delegate::quantized_linear_glu`: no slices, no activation or multiply node;
- `fuse_quantized_residual`: `quantized_linear(x) + r` (a residual connection: r of the output's shape
  and dtype, the product read nowhere else) becomes `quantized_linear(x, ..., residual=r)`;
- `fuse_quantized_norm`: an RMSNorm with a weight (`mlx_delegate::rms_norm`) read only as the input of
  quantized products (a pre-norm block's attention or MLP input) moves into each of them
  (`norm=`, `norm_eps=`): each normalises x while it reads it, and the norm's own node is gone.

They run after `fuse_linears`, on any exported graph with these shapes, whatever model it came from.
"""

from __future__ import annotations

import operator

import torch
from executorch.exir.dialects._ops import ops as exir_ops
from torch.export import ExportedProgram

from .. import quantization  # noqa: F401  (defines the quantized ops)
from .common import aten, dtype, erase_dead, is_op, only_user, replace, same_shape

QLINEAR = torch.ops.mlx_delegate.quantized_linear.default
QGROUP = torch.ops.mlx_delegate.quantized_linear_group.default
EDGE_QLINEAR = exir_ops.edge.mlx_delegate.quantized_linear.default
EDGE_GLU = exir_ops.edge.mlx_delegate.quantized_linear_glu.default
GLU = torch.ops.mlx_delegate.quantized_linear_glu.default
RMS_NORM = torch.ops.mlx_delegate.rms_norm.default
# Each product that takes a norm, and the edge op that replaces it.
NORMED = {QLINEAR: EDGE_QLINEAR, QGROUP: exir_ops.edge.mlx_delegate.quantized_linear_group.default, GLU: EDGE_GLU}


def _part(n: object) -> tuple[torch.fx.Node, int] | None:
    """(group, index) when `n` is `getitem(quantized_linear_group, index)`."""
    if isinstance(n, torch.fx.Node) and n.op == "call_function" and n.target is operator.getitem \
            and is_op(n.args[0], QGROUP):
        return n.args[0], n.args[1]
    return None


def _glu(ep: ExportedProgram, mul: torch.fx.Node) -> bool:
    if len(mul.args) != 2 or mul.kwargs:
        return False
    for act, up in (mul.args, mul.args[::-1]):
        if not (is_op(act, aten.silu.default) and only_user(act, mul)) or act is up:
            continue
        gate_part, up_part = _part(act.args[0]), _part(up)
        if gate_part is None or up_part is None or gate_part[0] is not up_part[0]:
            continue
        group = gate_part[0]
        x, ws, scales, biases, bias, group_size, bits = group.args
        if len(ws) != 2 or {gate_part[1], up_part[1]} != {0, 1} \
                or set(group.users) != {act.args[0], up} or not only_user(act.args[0], act) \
                or not only_user(up, mul) or not (dtype(act) == dtype(up) == dtype(mul)):
            continue
        order = [gate_part[1], up_part[1]]
        args = (x, *([list(a)[i] for i in order] for a in (ws, scales, biases, bias)), group_size, bits)
        if replace(ep, mul, EDGE_GLU, args):
            erase_dead(ep.graph, [mul])
            return True
    return False


def fuse_glu(ep: ExportedProgram) -> int:
    return sum(_glu(ep, n) for n in [n for n in ep.graph.nodes if is_op(n, aten.mul.Tensor)])


def _residual(ep: ExportedProgram, add: torch.fx.Node) -> bool:
    if len(add.args) != 2 or add.kwargs.get("alpha", 1) != 1:
        return False
    for linear, other in (add.args, add.args[::-1]):
        if not is_op(linear, QLINEAR) or linear.kwargs.get("residual") is not None or len(linear.args) > 9 \
                or not only_user(linear, add) or not isinstance(other, torch.fx.Node) or other is linear \
                or not (same_shape(other, add) and same_shape(linear, add)) \
                or not (dtype(other) == dtype(linear) == dtype(add)):
            continue
        if replace(ep, add, EDGE_QLINEAR, linear.args, {**linear.kwargs, "residual": other}):
            erase_dead(ep.graph, [add])
            return True
    return False


def fuse_residual(ep: ExportedProgram) -> int:
    return sum(_residual(ep, n) for n in [n for n in ep.graph.nodes if is_op(n, aten.add.Tensor)])


def _norm(ep: ExportedProgram, norm: torch.fx.Node) -> bool:
    x, weight, eps = norm.args
    users = list(norm.users)
    if weight is None or not users:
        return False
    for user in users:
        if not is_op(user, *NORMED) or user.args[0] is not norm or norm in user.args[1:] \
                or user.kwargs.get("norm") is not None or (is_op(user, QLINEAR) and len(user.args) > 7):
            return False
    done = 0
    for user in users:
        target = next(edge for op, edge in NORMED.items() if is_op(user, op))
        done += replace(ep, user, target, (x, *user.args[1:]), {**user.kwargs, "norm": weight, "norm_eps": eps})
        if done:
            erase_dead(ep.graph, [user])
    return done > 0


def fuse_norm(ep: ExportedProgram) -> int:
    return sum(_norm(ep, n) for n in [n for n in ep.graph.nodes if is_op(n, RMS_NORM)])
