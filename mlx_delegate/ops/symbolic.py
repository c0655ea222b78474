"""Symbolic values: dynamic sizes, SymInt arithmetic, item(), runtime asserts.

These produce value slots (not tensors), so shapes computed at run time can
feed `IntOrVid` fields of later nodes.
"""

from __future__ import annotations

import operator

import torch

from ..builder import ProgramBuilder
from ..ir import nodes as N
from ..registry import register

aten = torch.ops.aten
S = N.ScalarOp

SCALAR_OPS = {
    operator.add: S.Add, operator.sub: S.Sub, operator.mul: S.Mul, operator.floordiv: S.FloorDiv,
    operator.mod: S.Mod, operator.truediv: S.TrueDiv, operator.neg: S.Neg, operator.eq: S.Eq,
    operator.ne: S.Ne, operator.lt: S.Lt, operator.le: S.Le, operator.gt: S.Gt, operator.ge: S.Ge,
    torch.sym_max: S.Max, torch.sym_min: S.Min,
}


@register(aten.sym_size.int)
def sym_size(b: ProgramBuilder, n: torch.fx.Node) -> None:
    x, dim = n.args
    b.emit(N.SymSizeNode(x=b.tensor(x), dim=int(dim), out=b.value_out(n)))


def _is_int(v: object) -> bool:
    return isinstance(v, (bool, int, torch.SymInt, torch.SymBool))


def _scalar_op(op):
    def handle(b: ProgramBuilder, n: torch.fx.Node) -> None:
        operands = [ProgramBuilder.meta(a) for a in n.args]
        if not all(isinstance(v, (bool, int, float, torch.SymInt, torch.SymFloat, torch.SymBool))
                   for v in operands):
            raise b.unsupported("operands are not scalars")
        is_int = all(_is_int(v) for v in operands) and op != S.TrueDiv
        a = b.float_or_vid(n.args[0])
        rhs = b.float_or_vid(n.args[1]) if len(n.args) > 1 else None
        b.emit(N.ScalarOpNode(op=op, a=a, b=rhs, is_int=is_int, out=b.value_out(n)))
    return handle


for _target, _op in SCALAR_OPS.items():
    register(_target)(_scalar_op(_op))


@register(aten._local_scalar_dense.default)
def item(b: ProgramBuilder, n: torch.fx.Node) -> None:
    b.emit(N.ItemNode(x=b.tensor(n.args[0]), out=b.value_out(n)))


@register(aten._assert_scalar.default)
def assert_scalar(b: ProgramBuilder, n: torch.fx.Node) -> None:
    cond, msg = n.args[0], n.args[1] if len(n.args) > 1 else "runtime assertion failed"
    if not isinstance(cond, torch.fx.Node):
        if not cond:
            raise b.unsupported(f"assertion is statically false: {msg}")
        return
    b.emit(N.AssertNode(cond=N.Vid(idx=b.int_or_vid(cond).vid), message=str(msg)))


@register(aten.sym_constrain_range_for_size.default, aten.sym_constrain_range.default,
          aten._assert_tensor_metadata.default)
def no_op(b: ProgramBuilder, n: torch.fx.Node) -> None:
    """Export-time checks with nothing to compute at run time."""

