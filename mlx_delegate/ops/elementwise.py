"""Element-wise ops: unary math, binary arithmetic, comparisons, logic, where, clamp.

Each family is a table (ATen op -> IR enum row) registered in a loop. Inputs
are cast to the dtype torch computes in before the IR op, because MLX's type
promotion differs from torch's (e.g. for 0-d tensors and int -> float ops).

Where torch raises at run time (integer division by zero, negative integer
exponents) the runtime checks and raises too (cpp/ops/elementwise.cpp).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..builder import ProgramBuilder
from ..ir import nodes as N
from ..registry import base_name, register

aten = torch.ops.aten
U, B = N.UnaryOp, N.BinaryOp
Handler = Callable[[ProgramBuilder, torch.fx.Node], None]

UNARY = {
    aten.neg.default: U.Neg, aten.abs.default: U.Abs, aten.exp.default: U.Exp, aten.log.default: U.Log,
    aten.sqrt.default: U.Sqrt, aten.rsqrt.default: U.Rsqrt, aten.sin.default: U.Sin, aten.cos.default: U.Cos,
    aten.tan.default: U.Tan, aten.tanh.default: U.Tanh, aten.sigmoid.default: U.Sigmoid,
    aten.erf.default: U.Erf, aten.logical_not.default: U.LogicalNot, aten.floor.default: U.Floor,
    aten.ceil.default: U.Ceil, aten.round.default: U.Round, aten.sign.default: U.Sign,
    aten.square.default: U.Square, aten.reciprocal.default: U.Reciprocal, aten.expm1.default: U.Expm1,
    aten.log1p.default: U.Log1p, aten.log2.default: U.Log2, aten.log10.default: U.Log10,
    aten.asin.default: U.Asin, aten.acos.default: U.Acos, aten.atan.default: U.Atan, aten.sinh.default: U.Sinh,
    aten.cosh.default: U.Cosh, aten.asinh.default: U.Asinh, aten.acosh.default: U.Acosh,
    aten.atanh.default: U.Atanh, aten.isnan.default: U.IsNan, aten.isinf.default: U.IsInf,
    aten.isfinite.default: U.IsFinite, aten.bitwise_not.default: U.BitwiseNot, aten.trunc.default: U.Trunc,
    aten.erfinv.default: U.Erfinv, aten.isposinf.default: U.IsPosInf, aten.isneginf.default: U.IsNegInf,
}
# Ops whose result is a predicate of the input: computed in the input's dtype.
PREDICATES = {U.IsNan, U.IsInf, U.LogicalNot, U.IsPosInf, U.IsNegInf, U.IsFinite}
# Rounding is the identity on integers; MLX keeps their dtype too.
ROUNDING = {U.Floor, U.Ceil, U.Round, U.Trunc}

ARITHMETIC = {
    aten.mul.Tensor: B.Mul, aten.mul.Scalar: B.Mul, aten.div.Tensor: B.Div, aten.div.Scalar: B.Div,
    aten.maximum.default: B.Maximum, aten.minimum.default: B.Minimum, aten.atan2.default: B.Atan2,
    aten.logaddexp.default: B.LogAddExp, aten.pow.Tensor_Tensor: B.Pow, aten.pow.Tensor_Scalar: B.Pow,
    aten.pow.Scalar: B.Pow, aten.remainder.Tensor: B.Remainder, aten.remainder.Scalar: B.Remainder,
    aten.fmod.Tensor: B.Fmod, aten.fmod.Scalar: B.Fmod,
    aten.bitwise_and.Tensor: B.BitwiseAnd, aten.bitwise_and.Scalar: B.BitwiseAnd,
    aten.bitwise_or.Tensor: B.BitwiseOr, aten.bitwise_or.Scalar: B.BitwiseOr,
    aten.bitwise_xor.Tensor: B.BitwiseXor, aten.bitwise_xor.Scalar: B.BitwiseXor,
    # Shifts are not core ATen: they only reach us when the caller lists them as exceptions.
    aten.bitwise_left_shift.Tensor: B.LeftShift, aten.bitwise_right_shift.Tensor: B.RightShift,
    aten.bitwise_left_shift.Tensor_Scalar: B.LeftShift, aten.bitwise_right_shift.Tensor_Scalar: B.RightShift,
}
# floor_divide.default is left out on purpose: it decomposes to div(rounding_mode='floor'), and
# preserving it breaks Edge on `int_tensor // 2` (EXIR re-checks its Tensor-typed `other`).
COMPARISONS = {
    aten.eq.Tensor: B.Equal, aten.eq.Scalar: B.Equal, aten.ne.Tensor: B.NotEqual, aten.ne.Scalar: B.NotEqual,
    aten.lt.Tensor: B.Less, aten.lt.Scalar: B.Less, aten.le.Tensor: B.LessEqual, aten.le.Scalar: B.LessEqual,
    aten.gt.Tensor: B.Greater, aten.gt.Scalar: B.Greater, aten.ge.Tensor: B.GreaterEqual,
    aten.ge.Scalar: B.GreaterEqual,
}
LOGICAL = {aten.logical_and.default: B.LogicalAnd, aten.logical_or.default: B.LogicalOr,
           aten.logical_xor.default: B.LogicalXor}


# ------------------------------------------------------------------ helpers
def _compute_dtype(b: ProgramBuilder, x: Any, y: Any) -> torch.dtype:
    """The dtype torch computes `x op y` in (its type promotion rules)."""
    return torch.result_type(b.meta(x), b.meta(y))


def check_dtype(b: ProgramBuilder, dtype: torch.dtype) -> None:
    """Refuse dtypes the IR cannot hold (float64, complex, ...)."""
    if dtype.is_complex:
        raise b.unsupported("complex dtypes are not supported")
    b.ir_dtype(dtype)


def is_tensor(b: ProgramBuilder, x: Any) -> bool:
    return isinstance(x, torch.fx.Node) and isinstance(b.meta(x), torch.Tensor)


def unary(b: ProgramBuilder, op: Any, x: Any, out: Any = None) -> Any:
    """Emit `op(x)` on slot `x`; returns the output slot."""
    out = out if out is not None else b.temp()
    b.emit(N.UnaryNode(op=op, x=x, out=out))
    return out


def binary_slots(b: ProgramBuilder, op: Any, x: Any, y: Any, out: Any = None) -> Any:
    """Emit `op(x, y)` on two slots; returns the output slot."""
    out = out if out is not None else b.temp()
    b.emit(N.BinaryNode(op=op, a=x, b=y, out=out))
    return out


def binary(b: ProgramBuilder, op: Any, x: Any, y: Any, dtype: torch.dtype, out: Any = None) -> Any:
    """Emit `op(x, y)` on tensor-or-scalar arguments, both taken in `dtype`; returns the output slot."""
    return binary_slots(b, op, b.operand(x, dtype), b.operand(y, dtype), out)


# ----------------------------------------------------------------- families
def unary_handler(op: Any) -> Handler:
    def handle(b: ProgramBuilder, n: torch.fx.Node) -> None:
        x = n.args[0]
        src = b.dtype_of(x)
        dtype = src if op in PREDICATES or (op in ROUNDING and not src.is_floating_point) else b.dtype_of(n)
        check_dtype(b, dtype)
        unary(b, op, b.operand(x, dtype), out=b.out(n))
    return handle


def _arithmetic(op: Any) -> Handler:
    def handle(b: ProgramBuilder, n: torch.fx.Node) -> None:
        x, y = n.args[0], n.args[1]
        dtype = b.dtype_of(n)
        check_dtype(b, dtype)
        binary(b, op, x, y, dtype, out=b.out(n))
    return handle


def _comparison(op: Any) -> Handler:
    def handle(b: ProgramBuilder, n: torch.fx.Node) -> None:
        x, y = n.args[0], n.args[1]
        dtype = _compute_dtype(b, x, y)
        check_dtype(b, dtype)
        binary(b, op, x, y, dtype, out=b.out(n))
    return handle


def _logical(op: Any) -> Handler:
    def handle(b: ProgramBuilder, n: torch.fx.Node) -> None:
        x, y = n.args[0], n.args[1]
        out_dtype = b.dtype_of(n)
        check_dtype(b, out_dtype)
        tmp = binary(b, op, x, y, torch.bool)
        b.emit(N.AsTypeNode(x=tmp, dtype=b.ir_dtype(out_dtype), out=b.out(n)))
    return handle


for _table, _make in ((UNARY, unary_handler), (ARITHMETIC, _arithmetic), (COMPARISONS, _comparison),
                      (LOGICAL, _logical)):
    for _target, _op in _table.items():
        register(_target)(_make(_op))


# ------------------------------------------------------------ special cases
@register(aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.rsub.Scalar,
          aten.rsub.Tensor)
def add_sub(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    x, y, alpha = args["self"], args["other"], args.get("alpha", 1)
    name = base_name(n.target)
    if name == "rsub":
        x, y = y, x
    dtype = b.dtype_of(n)
    check_dtype(b, dtype)
    if dtype == torch.bool and name != "add":
        raise b.unsupported("subtraction of booleans")
    ya = binary(b, B.Mul, y, alpha, dtype) if alpha not in (1, None) else b.operand(y, dtype)
    binary_slots(b, B.Add if name == "add" else B.Sub, b.operand(x, dtype), ya, out=b.out(n))


ROUNDING_MODES = {None: B.Div, "floor": B.FloorDivide, "trunc": B.TruncDivide}


@register(aten.div.Tensor_mode, aten.div.Scalar_mode)
def div_mode(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    mode, dtype = args["rounding_mode"], b.dtype_of(n)
    if mode not in ROUNDING_MODES:
        raise b.unsupported(f"rounding_mode {mode!r}")
    check_dtype(b, dtype)
    binary(b, ROUNDING_MODES[mode], args["self"], args["other"], dtype, out=b.out(n))


@register(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def where(b: ProgramBuilder, n: torch.fx.Node) -> None:
    cond, x, y = n.args[0], n.args[1], n.args[2]
    dtype = b.dtype_of(n)
    check_dtype(b, dtype)
    b.emit(N.WhereNode(cond=b.operand(cond, torch.bool), a=b.operand(x, dtype), b=b.operand(y, dtype),
                       out=b.out(n)))


def clip(b: ProgramBuilder, n: torch.fx.Node, x: Any, lo: Any, hi: Any) -> None:
    """out = min(max(x, lo), hi) in the node's dtype; a None bound is left open."""
    dtype = b.dtype_of(n)
    check_dtype(b, dtype)
    b.emit(N.ClipNode(x=b.operand(x, dtype), lo=None if lo is None else b.operand(lo, dtype),
                      hi=None if hi is None else b.operand(hi, dtype), out=b.out(n)))


@register(aten.clamp.default, aten.clamp.Tensor, aten.clip.default)
def clamp(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    clip(b, n, args["self"], args["min"], args["max"])
