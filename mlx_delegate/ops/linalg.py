"""Matrix products: linear, mm/bmm/matmul/mv/dot and the scaled-accumulate forms
addmm/baddbmm (beta * c + alpha * a @ b). (addmv cannot reach a delegate: it is
neither core ATen nor decomposed, so ExecuTorch's verifier rejects it first.)

MLX's matmul is floating-point only, so integer products stay on ExecuTorch
(casting through float would round large integers).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import custom_ops  # noqa: F401  (defines mlx_delegate::linear_group)
from ..builder import ProgramBuilder
from ..ir import nodes as N
from ..registry import register

aten = torch.ops.aten

# Plain products: mx::matmul has torch.matmul's semantics for every rank
# (1-D operands, broadcast batch dims), so one node covers them all.
PRODUCTS = (aten.mm.default, aten.bmm.default, aten.matmul.default, aten.mv.default, aten.dot.default)
# beta * self + alpha * (a @ b); the two factors are the 2nd and 3rd arguments.
SCALED_PRODUCTS = (aten.addmm.default, aten.baddbmm.default)


def float_dtype(b: ProgramBuilder, n: torch.fx.Node) -> torch.dtype:
    """The node's result dtype, refused unless it is a floating type MLX multiplies."""
    dtype = b.dtype_of(n)
    b.ir_dtype(dtype)
    if not dtype.is_floating_point:
        raise b.unsupported(f"MLX matrix products are floating-point only, got {dtype}")
    return dtype


def literal_scalar(b: ProgramBuilder, v: Any, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise b.unsupported(f"{name} must be a number known when lowering, got {v!r}")
    return float(v)


@register(aten.linear.default)
def linear(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    x, w, bias = args["input"], args["weight"], args["bias"]
    if len(b.shape_of(w)) != 2:
        raise b.unsupported("linear with a non-2-D weight")
    dtype = float_dtype(b, n)
    b.emit(N.LinearNode(x=b.operand(x, dtype), weight=b.operand(w, dtype),
                        bias=None if bias is None else b.operand(bias, dtype), out=b.out(n)))


# `linear_act`'s activation names (custom_ops.LINEAR_ACTIVATIONS) as the LinearNode's act_op.
LINEAR_ACT_OPS = {"gelu": N.UnaryOp.GeluErf, "gelu_tanh": N.UnaryOp.GeluTanh, "silu": N.UnaryOp.Silu,
                  "hardswish": N.UnaryOp.Hardswish, "hardsigmoid": N.UnaryOp.Hardsigmoid}


@register(torch.ops.mlx_delegate.linear_act.default)
def linear_act(b: ProgramBuilder, n: torch.fx.Node) -> None:
    """A linear with its activation fused (patterns/linear_activation.py)."""
    x, w, bias, act = n.args
    if act not in LINEAR_ACT_OPS:
        raise b.unsupported(f"linear_act activation {act!r}; known: {sorted(LINEAR_ACT_OPS)}")
    if len(b.shape_of(w)) != 2:
        raise b.unsupported("linear with a non-2-D weight")
    dtype = float_dtype(b, n)
    b.emit(N.LinearNode(x=b.operand(x, dtype), weight=b.operand(w, dtype),
                        bias=None if bias is None else b.operand(bias, dtype), out=b.out(n),
                        act=True, act_op=LINEAR_ACT_OPS[act]))


@register(torch.ops.mlx_delegate.linear_residual.default)
def linear_residual(b: ProgramBuilder, n: torch.fx.Node) -> None:
    """A linear with a residual add fused (patterns/linear_residual.py): residual in the output's
    shape and dtype."""
    x, w, bias, residual = n.args
    if len(b.shape_of(w)) != 2:
        raise b.unsupported("linear with a non-2-D weight")
    dtype = float_dtype(b, n)
    if b.dtype_of(residual) != dtype:
        raise b.unsupported(f"linear_residual residual of dtype {b.dtype_of(residual)}, output {dtype}")
    out_shape, r_shape = b.shape_of(n), b.shape_of(residual)
    if len(r_shape) != len(out_shape) or any(isinstance(a, int) and isinstance(c, int) and a != c
                                             for a, c in zip(r_shape, out_shape)):
        raise b.unsupported(f"linear_residual residual of shape {list(r_shape)}, output {list(out_shape)}")
    b.emit(N.LinearNode(x=b.operand(x, dtype), weight=b.operand(w, dtype),
                        bias=None if bias is None else b.operand(bias, dtype), out=b.out(n),
                        residual=b.tensor(residual)))


@register(torch.ops.mlx_delegate.linear_group.default)
def linear_group(b: ProgramBuilder, n: torch.fx.Node) -> None:
    """Linears sharing input x (patterns/linear_group.py): one product over the weights
    stacked on the output axis (a derived constant), each result a slice of it."""
    x, weights, biases = n.args
    shapes = [b.shape_of(w) for w in weights]
    if any(len(s) != 2 or not isinstance(s[0], int) for s in shapes) or len({s[1] for s in shapes}) != 1:
        raise b.unsupported("linear_group needs 2-D weights of static output size and one input size")
    dtype = b.dtype_of(weights[0])
    if any(b.dtype_of(t) != dtype for t in [*weights, *filter(None, biases)]):
        raise b.unsupported("linear_group weights and biases must share a dtype")
    float_dtype(b, weights[0])
    sizes = [s[0] for s in shapes]
    bias = None
    if any(t is not None for t in biases):  # a linear without one adds zeros
        bias = b.concat_constant([t if t is not None else size for t, size in zip(biases, sizes)], dtype)
    full = b.temp()
    b.emit(N.LinearNode(x=b.operand(x, dtype), weight=b.concat_constant(weights, dtype), bias=bias, out=full))
    split_last_axis(b, n, full, sizes)


def split_last_axis(b: ProgramBuilder, n: torch.fx.Node, full: Any, sizes: list[int]) -> None:
    """Node n's outputs as consecutive slices of `full` along its last axis (MLX views)."""
    axis = len(b.shape_of(n.args[0])) - 1
    start = 0
    for out, size in zip(b.outs(n, len(sizes)), sizes):
        b.emit(N.SliceNode(x=full, axis=axis, start=b.int_or_vid(start), stop=b.int_or_vid(start + size), step=1,
                           out=out))
        start += size


@register(*PRODUCTS)
def product(b: ProgramBuilder, n: torch.fx.Node) -> None:
    dtype = float_dtype(b, n)
    x, y = n.args[0], n.args[1]
    b.emit(N.MatmulNode(a=b.operand(x, dtype), b=b.operand(y, dtype), out=b.out(n)))


@register(*SCALED_PRODUCTS)
def scaled_product(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    c, x, y = list(args.values())[:3]
    alpha = literal_scalar(b, args["alpha"], "alpha")
    beta = literal_scalar(b, args["beta"], "beta")
    dtype = float_dtype(b, n)
    b.emit(N.AddmmNode(c=b.operand(c, dtype), a=b.operand(x, dtype), b=b.operand(y, dtype), alpha=alpha, beta=beta,
                       out=b.out(n)))


@register(torch.ops.mlx_delegate.grouped_mm.default, "transformers.grouped_mm_fallback.default")
def grouped_mm(b: ProgramBuilder, n: torch.fx.Node) -> None:
    """Mixture-of-experts product (transformers' default experts path, and torch._grouped_mm):
    x [S, K] sorted by expert, weights [E, K, N], cumulative row counts [E]."""
    x, w, offs = n.args[:3]
    if len(b.shape_of(x)) != 2 or len(b.shape_of(w)) != 3 or len(b.shape_of(offs)) != 1:
        raise b.unsupported("grouped product other than [S, K] x [E, K, N]")
    dtype = float_dtype(b, n)
    if b.dtype_of(offs) not in (torch.int32, torch.int64):
        raise b.unsupported(f"offsets of dtype {b.dtype_of(offs)}")
    b.emit(N.GroupedMatmulNode(x=b.operand(x, dtype), weight=b.operand(w, dtype), offsets=b.tensor(offs),
                               out=b.out(n)))
