"""Element-wise ops: unary math, binary arithmetic, comparisons, logic, where, clamp.

Each family is a table (ATen op -> IR enum row) registered in a loop. Inputs
are cast to the dtype torch computes in before the IR op, because MLX's type
promotion differs from torch's (e.g. for 0-d tensors).
"""

from __future__ import annotations

import torch

from ..builder import ProgramBuilder
from ..ir import nodes as N
from ..registry import base_name, register

aten = torch.ops.aten
U, B = N.UnaryOp, N.BinaryOp

UNARY = {
    aten.neg.default: U.Neg, aten.abs.default: U.Abs, aten.exp.default: U.Exp, aten.log.default: U.Log,
    aten.sqrt.default: U.Sqrt, aten.rsqrt.default: U.Rsqrt, aten.sin.default: U.Sin, aten.cos.default: U.Cos,
    aten.tan.default: U.Tan, aten.tanh.default: U.Tanh, aten.sigmoid.default: U.Sigmoid,
    aten.relu.default: U.Relu, aten.silu.default: U.Silu, aten.erf.default: U.Erf,
    aten.logical_not.default: U.LogicalNot, aten.floor.default: U.Floor, aten.ceil.default: U.Ceil,
    aten.round.default: U.Round, aten.sign.default: U.Sign, aten.square.default: U.Square,
    aten.reciprocal.default: U.Reciprocal, aten.expm1.default: U.Expm1, aten.log1p.default: U.Log1p,
    aten.log2.default: U.Log2, aten.log10.default: U.Log10, aten.asin.default: U.Asin,
    aten.acos.default: U.Acos, aten.atan.default: U.Atan, aten.sinh.default: U.Sinh,
    aten.cosh.default: U.Cosh, aten.asinh.default: U.Asinh, aten.acosh.default: U.Acosh,
    aten.atanh.default: U.Atanh, aten.isnan.default: U.IsNan, aten.isinf.default: U.IsInf,
    aten.bitwise_not.default: U.BitwiseNot, aten.mish.default: U.Mish, aten.hardswish.default: U.Hardswish,
    aten.hardsigmoid.default: U.Hardsigmoid, aten.trunc.default: U.Trunc, aten.erfinv.default: U.Erfinv,
    aten.isposinf.default: U.IsPosInf, aten.isneginf.default: U.IsNegInf,
}
# Ops whose result is a predicate of the input: computed in the input's dtype.
PREDICATES = {U.IsNan, U.IsInf, U.LogicalNot, U.IsPosInf, U.IsNegInf, U.IsFinite}

ARITHMETIC = {
    aten.mul.Tensor: B.Mul, aten.mul.Scalar: B.Mul, aten.div.Tensor: B.Div, aten.div.Scalar: B.Div,
    aten.pow.Tensor_Tensor: B.Pow, aten.pow.Tensor_Scalar: B.Pow, aten.pow.Scalar: B.Pow,
    aten.maximum.default: B.Maximum, aten.minimum.default: B.Minimum,
    aten.remainder.Tensor: B.Remainder, aten.remainder.Scalar: B.Remainder,
    aten.floor_divide.default: B.FloorDivide, aten.atan2.default: B.Atan2,
    aten.logaddexp.default: B.LogAddExp, aten.fmod.Tensor: B.Fmod, aten.fmod.Scalar: B.Fmod,
    aten.bitwise_and.Tensor: B.BitwiseAnd, aten.bitwise_and.Scalar: B.BitwiseAnd,
    aten.bitwise_or.Tensor: B.BitwiseOr, aten.bitwise_or.Scalar: B.BitwiseOr,
    aten.bitwise_xor.Tensor: B.BitwiseXor, aten.bitwise_xor.Scalar: B.BitwiseXor,
    aten.bitwise_left_shift.Tensor: B.LeftShift, aten.bitwise_right_shift.Tensor: B.RightShift,
}
COMPARISONS = {
    aten.eq.Tensor: B.Equal, aten.eq.Scalar: B.Equal, aten.ne.Tensor: B.NotEqual, aten.ne.Scalar: B.NotEqual,
    aten.lt.Tensor: B.Less, aten.lt.Scalar: B.Less, aten.le.Tensor: B.LessEqual, aten.le.Scalar: B.LessEqual,
    aten.gt.Tensor: B.Greater, aten.gt.Scalar: B.Greater, aten.ge.Tensor: B.GreaterEqual,
    aten.ge.Scalar: B.GreaterEqual,
}
LOGICAL = {aten.logical_and.default: B.LogicalAnd, aten.logical_or.default: B.LogicalOr,
           aten.logical_xor.default: B.LogicalXor}


def _compute_dtype(b: ProgramBuilder, x, y) -> torch.dtype:
    """The dtype torch computes `x op y` in (its type promotion rules)."""
    return torch.result_type(b.meta(x), b.meta(y))


def binary(b: ProgramBuilder, op, x, y, dtype: torch.dtype, out=None):
    """Emit `op(x, y)` with both operands in `dtype`; returns the output slot."""
    out = out if out is not None else b.temp()
    b.emit(N.BinaryNode(op=op, a=b.operand(x, dtype), b=b.operand(y, dtype), out=out))
    return out


def _check_float(b: ProgramBuilder, dtype: torch.dtype) -> None:
    b.ir_dtype(dtype)
    if dtype.is_complex:
        raise b.unsupported("complex dtypes are not supported")


def _unary(op):
    def handle(b: ProgramBuilder, n: torch.fx.Node) -> None:
        x = n.args[0]
        dtype = b.dtype_of(x) if op in PREDICATES else b.dtype_of(n)
        _check_float(b, dtype)
        b.emit(N.UnaryNode(op=op, x=b.operand(x, dtype), out=b.out(n)))
    return handle


def _arithmetic(op):
    def handle(b: ProgramBuilder, n: torch.fx.Node) -> None:
        x, y = n.args[0], n.args[1]
        dtype = b.dtype_of(n)
        _check_float(b, dtype)
        binary(b, op, x, y, dtype, out=b.out(n))
    return handle


def _comparison(op):
    def handle(b: ProgramBuilder, n: torch.fx.Node) -> None:
        x, y = n.args[0], n.args[1]
        dtype = _compute_dtype(b, x, y)
        _check_float(b, dtype)
        binary(b, op, x, y, dtype, out=b.out(n))
    return handle


def _logical(op):
    def handle(b: ProgramBuilder, n: torch.fx.Node) -> None:
        x, y = n.args[0], n.args[1]
        tmp = binary(b, op, x, y, torch.bool)
        b.emit(N.AsTypeNode(x=tmp, dtype=b.ir_dtype(b.dtype_of(n)), out=b.out(n)))
    return handle


for _table, _make in ((UNARY, _unary), (ARITHMETIC, _arithmetic), (COMPARISONS, _comparison),
                      (LOGICAL, _logical)):
    for _target, _op in _table.items():
        register(_target)(_make(_op))


@register(aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.rsub.Scalar,
          aten.rsub.Tensor)
def add_sub(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    x, y, alpha = args["self"], args["other"], args.get("alpha", 1)
    name = base_name(n.target)
    if name == "rsub":
        x, y = y, x
    dtype = b.dtype_of(n)
    _check_float(b, dtype)
    ya = binary(b, B.Mul, y, alpha, dtype) if alpha not in (1, None) else b.operand(y, dtype)
    b.emit(N.BinaryNode(op=B.Add if name == "add" else B.Sub, a=b.operand(x, dtype), b=ya, out=b.out(n)))


@register(aten.div.Tensor_mode, aten.div.Scalar_mode)
def div_mode(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    mode, dtype = args["rounding_mode"], b.dtype_of(n)
    _check_float(b, dtype)
    if mode is None:
        binary(b, B.Div, args["self"], args["other"], dtype, out=b.out(n))
    elif mode == "floor":
        binary(b, B.FloorDivide, args["self"], args["other"], dtype, out=b.out(n))
    elif mode == "trunc":
        if dtype.is_floating_point:
            q = binary(b, B.Div, args["self"], args["other"], dtype)
            b.emit(N.UnaryNode(op=U.Trunc, x=q, out=b.out(n)))
        else:
            raise b.unsupported("integer division with rounding_mode='trunc'")
    else:
        raise b.unsupported(f"rounding_mode {mode!r}")


@register(aten.gelu.default)
def gelu(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    op = U.GeluTanh if args.get("approximate") == "tanh" else U.GeluErf
    dtype = b.dtype_of(n)
    _check_float(b, dtype)
    b.emit(N.UnaryNode(op=op, x=b.operand(args["self"], dtype), out=b.out(n)))


@register(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def where(b: ProgramBuilder, n: torch.fx.Node) -> None:
    cond, x, y = n.args[0], n.args[1], n.args[2]
    dtype = b.dtype_of(n)
    _check_float(b, dtype)
    b.emit(N.WhereNode(cond=b.operand(cond, torch.bool), a=b.operand(x, dtype), b=b.operand(y, dtype),
                       out=b.out(n)))


@register(aten.clamp.default, aten.clamp.Tensor, aten.clip.default, aten.hardtanh.default)
def clamp(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    x = args["self"]
    lo = args.get("min", args.get("min_val"))
    hi = args.get("max", args.get("max_val"))
    dtype = b.dtype_of(n)
    _check_float(b, dtype)
    b.emit(N.ClipNode(x=b.operand(x, dtype), lo=None if lo is None else b.operand(lo, dtype),
                      hi=None if hi is None else b.operand(hi, dtype), out=b.out(n)))
