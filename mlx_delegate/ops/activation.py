"""Activations: fixed ones are UnaryOp rows; parameterised ones (leaky_relu, elu,
softplus, hardtanh, glu) are composed from element-wise IR nodes.

Registering an op that the core ATen decompositions would split (softplus, glu,
silu, mish, ...) keeps it whole, so it lowers to the few nodes below.
"""

from __future__ import annotations

from typing import Any

import torch

from ..builder import ProgramBuilder
from ..ir import nodes as N
from ..registry import register
from .elementwise import binary_slots, check_dtype, clip, unary, unary_handler

aten = torch.ops.aten
U, B = N.UnaryOp, N.BinaryOp

ACTIVATIONS = {
    aten.relu.default: U.Relu, aten.silu.default: U.Silu, aten.mish.default: U.Mish,
    aten.hardswish.default: U.Hardswish, aten.hardsigmoid.default: U.Hardsigmoid,
}
for _target, _op in ACTIVATIONS.items():
    register(_target)(unary_handler(_op))

GELU = {"none": U.GeluErf, "tanh": U.GeluTanh}

# Above this, softplus(x) == x to within fp32 precision (log1p(exp(-20)) ~ 2e-9), so torch's
# threshold only needs a select below it.
SOFTPLUS_SATURATION = 20.0


def _float_input(b: ProgramBuilder, n: torch.fx.Node) -> tuple[Any, torch.dtype]:
    """(slot of the first argument, dtype) for activations defined on floats only."""
    dtype = b.dtype_of(n)
    check_dtype(b, dtype)
    if not dtype.is_floating_point:
        raise b.unsupported(f"{dtype} input (torch defines this activation on floats)")
    return b.operand(n.args[0], dtype), dtype


def _scaled(b: ProgramBuilder, x: Any, factor: float, dtype: torch.dtype) -> Any:
    """x * factor, or x itself when factor is 1."""
    return x if factor == 1 else binary_slots(b, B.Mul, x, b.full(factor, dtype))


def _positive(b: ProgramBuilder, x: Any, dtype: torch.dtype, threshold: float = 0.0) -> Any:
    """Boolean slot: x > threshold."""
    return binary_slots(b, B.Greater, x, b.full(threshold, dtype))


@register(aten.gelu.default)
def gelu(b: ProgramBuilder, n: torch.fx.Node) -> None:
    approximate = b.args(n)["approximate"]
    if approximate not in GELU:
        raise b.unsupported(f"approximate={approximate!r}")
    x, _ = _float_input(b, n)
    unary(b, GELU[approximate], x, out=b.out(n))


@register(aten.hardtanh.default)
def hardtanh(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    clip(b, n, args["self"], args["min_val"], args["max_val"])


@register(aten.leaky_relu.default)
def leaky_relu(b: ProgramBuilder, n: torch.fx.Node) -> None:
    slope = b.args(n)["negative_slope"]
    x, dtype = _float_input(b, n)
    b.emit(N.WhereNode(cond=_positive(b, x, dtype), a=x, b=_scaled(b, x, slope, dtype), out=b.out(n)))


@register(aten.elu.default)
def elu(b: ProgramBuilder, n: torch.fx.Node) -> None:
    """scale * x for x > 0, else alpha * scale * expm1(x * input_scale) (also selu, celu)."""
    args = b.args(n)
    alpha, scale, input_scale = args["alpha"], args["scale"], args["input_scale"]
    x, dtype = _float_input(b, n)
    negative = _scaled(b, unary(b, U.Expm1, _scaled(b, x, input_scale, dtype)), alpha * scale, dtype)
    b.emit(N.WhereNode(cond=_positive(b, x, dtype), a=_scaled(b, x, scale, dtype), b=negative, out=b.out(n)))


@register(aten.softplus.default)
def softplus(b: ProgramBuilder, n: torch.fx.Node) -> None:
    """softplus(beta * x) / beta, and x itself where beta * x > threshold."""
    args = b.args(n)
    beta, threshold = args["beta"], args["threshold"]
    if beta == 0:
        raise b.unsupported("beta=0")
    x, dtype = _float_input(b, n)
    saturated = threshold >= SOFTPLUS_SATURATION
    out = b.out(n)
    smooth_out = out if saturated else None
    if beta == 1:
        smooth = unary(b, U.Softplus, x, out=smooth_out)
    else:
        smooth = binary_slots(b, B.Div, unary(b, U.Softplus, _scaled(b, x, beta, dtype)), b.full(beta, dtype),
                              out=smooth_out)
    if not saturated:
        cond = _positive(b, _scaled(b, x, beta, dtype), dtype, threshold)
        b.emit(N.WhereNode(cond=cond, a=x, b=smooth, out=out))


@register(aten.glu.default)
def glu(b: ProgramBuilder, n: torch.fx.Node) -> None:
    """a * sigmoid(b) for the two halves of x along dim."""
    dim = b.args(n)["dim"]
    shape = b.shape_of(n.args[0])
    size = shape[dim] if -len(shape) <= dim < len(shape) else None
    if not isinstance(size, int) or size % 2:
        raise b.unsupported(f"glu needs a static, even size along dim {dim}")
    x, _ = _float_input(b, n)
    first, second = b.temp(), b.temp()
    half = b.int_or_vid(size // 2)
    b.emit(N.SplitNode(x=x, axis=dim, sizes=[half, half], outs=[first, second]))
    binary_slots(b, B.Mul, first, unary(b, U.Sigmoid, second), out=b.out(n))
