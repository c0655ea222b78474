"""Scatters and in-place-style writes: index_put, scatter / scatter_add / scatter_reduce,
index_copy / index_fill / index_add, slice_scatter, select_scatter, masked_fill.

All of them produce a new array (MLX arrays are immutable). The Edge graph is
functional, so in-place `_` variants never reach us (registering those that the
core decompositions list would only make export warn).
"""

from __future__ import annotations

from typing import Any

import torch

from ..builder import MAX_DIM, ProgramBuilder
from ..ir import nodes as N
from ..registry import base_name, register
from .indexing import MASK_DTYPES, advanced_indices, check_rank, dim_arg, has_mask, index_tensor

aten = torch.ops.aten
M = N.ScatterMode

# scatter_reduce's reductions -> modes ("mean" is a sum divided by a count, see _scatter_mean).
REDUCE_MODES = {"sum": M.Add, "prod": M.Prod, "amax": M.Max, "amin": M.Min}
# Along-axis scatters: (name of the source argument, fixed mode or None to read `reduce`).
# scatter(reduce=...) is left out: it is not core ATen, so it never reaches an Edge graph.
SCATTER_AXIS = {
    aten.scatter.src: ("src", M.Set), aten.scatter.value: ("value", M.Set),
    aten.scatter_add.default: ("src", M.Add), aten.scatter_reduce.two: ("src", None),
}


def _check_mode(b: ProgramBuilder, mode: Any, dtype: torch.dtype) -> None:
    if mode != M.Set and dtype == torch.bool:
        raise b.unsupported("reducing scatter into a bool tensor")


def _scatter_mean(b: ProgramBuilder, n: torch.fx.Node, x: Any, fields: dict[str, Any]) -> None:
    """torch's mean: the sum over contributions (and x, with include_self) divided by their count,
    which is at least 1; integers divide with floor rounding."""
    dtype = b.dtype_of(x)
    total, ones, count = b.temp(), b.temp(), b.temp()
    b.emit(N.ScatterAxisNode(x=b.tensor(x), mode=M.Add, out=total, **fields))
    b.emit(N.FullLikeNode(x=b.tensor(x), value=b.float_or_vid(1), dtype=b.ir_dtype(dtype), out=ones))
    b.emit(N.ScatterAxisNode(x=ones, mode=M.Add, out=count, **(fields | {"updates": b.full(1, dtype)})))
    op = N.BinaryOp.Div if dtype.is_floating_point else N.BinaryOp.FloorDivide
    b.emit(N.BinaryNode(op=op, a=total, b=count, out=b.out(n)))


def _scatter_axis(source: str, fixed: Any):
    def handle(b: ProgramBuilder, n: torch.fx.Node) -> None:
        args = b.args(n)
        x, index = args["self"], args["index"]
        dtype = b.dtype_of(x)
        ndim = check_rank(b, x)
        if len(b.shape_of(index)) != ndim:
            raise b.unsupported("index and input ranks differ")
        reduce = args.get("reduce")
        mode = fixed if fixed is not None else REDUCE_MODES.get(reduce)
        if mode is None and reduce != "mean":
            raise b.unsupported(f"reduce={reduce!r}")
        _check_mode(b, mode if mode is not None else M.Add, dtype)
        fields = dict(indices=index_tensor(b, index), updates=b.operand(args[source], dtype),
                      axis=dim_arg(b, args["dim"], ndim), include_self=bool(args.get("include_self", True)))
        if mode is None:
            _scatter_mean(b, n, x, fields)
            return
        b.emit(N.ScatterAxisNode(x=b.tensor(x), mode=mode, out=b.out(n), **fields))
    return handle


for _target, (_source, _mode) in SCATTER_AXIS.items():
    register(_target)(_scatter_axis(_source, _mode))


def _mask_put(b: ProgramBuilder, n: torch.fx.Node, x: Any, indices: list[Any], values: Any,
              accumulate: bool) -> None:
    """x[mask] = v (or += v) for a one-element v: a where(), since the result's shape is x's."""
    dtype = b.dtype_of(x)
    present = [(axis, i) for axis, i in enumerate(indices) if i is not None]
    if len(present) != 1 or b.dtype_of(present[0][1]) not in MASK_DTYPES:
        raise b.unsupported("a boolean mask mixed with other indices")
    axis, mask = present[0]
    mask_rank, ndim = len(b.shape_of(mask)), check_rank(b, x)
    if any(not isinstance(d, int) or d != 1 for d in b.shape_of(values)):
        raise b.unsupported("x[mask] = values with more than one value (data-dependent layout)")
    if accumulate and dtype == torch.bool:
        raise b.unsupported("accumulating into a bool tensor")
    cond = b.operand(mask, torch.bool)
    trailing = ndim - axis - mask_rank  # the mask covers x's dims axis .. axis + mask_rank - 1
    if trailing > 0:
        widened = b.temp()
        b.emit(N.ExpandDimsNode(x=cond, axes=list(range(mask_rank, mask_rank + trailing)), out=widened))
        cond = widened
    value = b.temp()
    b.emit(N.ReshapeNode(x=b.operand(values, dtype), shape=[], out=value))
    if accumulate:
        total = b.temp()
        b.emit(N.BinaryNode(op=N.BinaryOp.Add, a=b.tensor(x), b=value, out=total))
        value = total
    b.emit(N.WhereNode(cond=cond, a=value, b=b.tensor(x), out=b.out(n)))


@register(aten.index_put.default, aten.index_put_.default, aten._unsafe_index_put.default)
def index_put(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    x, indices, values, accumulate = args["self"], args["indices"], args["values"], bool(args["accumulate"])
    if has_mask(b, indices):
        _mask_put(b, n, x, indices, values, accumulate)
        return
    dtype = b.dtype_of(x)
    tids, axes = advanced_indices(b, x, indices)
    mode = M.Add if accumulate else M.Set
    _check_mode(b, mode, dtype)
    b.emit(N.ScatterNode(x=b.tensor(x), indices=tids, axes=axes, updates=b.operand(values, dtype), mode=mode,
                         out=b.out(n)))


def _along_dim(b: ProgramBuilder, x: Any, dim: Any, index: Any) -> tuple[list[Any], list[int]]:
    """index_copy / index_fill / index_add's (dim, 1-D or 0-d index) as advanced indices."""
    axis = dim_arg(b, dim, check_rank(b, x))
    if len(b.shape_of(index)) > 1:
        raise b.unsupported("index must be 0-d or 1-D")
    return [index_tensor(b, index)], [axis]


@register(aten.index_copy.default, aten.index_add.default)
def index_copy_add(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    x, source, alpha = args["self"], args["source"], args.get("alpha", 1)
    dtype = b.dtype_of(x)
    is_add = base_name(n.target).startswith("index_add")
    if is_add and dtype == torch.bool:
        raise b.unsupported("index_add into a bool tensor")
    if len(b.shape_of(args["index"])) == 0 and len(b.shape_of(source)) == check_rank(b, x):
        raise b.unsupported("0-d index with a full-rank source")
    tids, axes = _along_dim(b, x, args["dim"], args["index"])
    updates = b.operand(source, dtype)
    if is_add and alpha != 1:
        scaled = b.temp()
        b.emit(N.BinaryNode(op=N.BinaryOp.Mul, a=updates, b=b.operand(alpha, dtype), out=scaled))
        updates = scaled
    b.emit(N.ScatterNode(x=b.tensor(x), indices=tids, axes=axes, updates=updates,
                         mode=M.Add if is_add else M.Set, out=b.out(n)))


@register(aten.index_fill.int_Scalar, aten.index_fill.int_Tensor)
def index_fill(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    x = args["self"]
    tids, axes = _along_dim(b, x, args["dim"], args["index"])
    b.emit(N.ScatterNode(x=b.tensor(x), indices=tids, axes=axes, updates=b.operand(args["value"], b.dtype_of(x)),
                         mode=M.Set, out=b.out(n)))


def _bound(b: ProgramBuilder, v: Any, default: int | None) -> Any:
    return None if v is None and default is None else b.int_or_vid(default if v is None else v)


@register(aten.slice_scatter.default)
def slice_scatter(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    x, step = args["self"], args["step"]
    if not isinstance(step, int) or step <= 0:
        raise b.unsupported(f"step {step!r}")
    b.emit(N.SliceUpdateNode(
        x=b.tensor(x), update=b.operand(args["src"], b.dtype_of(x)), axis=dim_arg(b, args["dim"], check_rank(b, x)),
        start=_bound(b, args["start"], 0), stop=_bound(b, args["end"], MAX_DIM), step=step, out=b.out(n)))


@register(aten.select_scatter.default)
def select_scatter(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    x = args["self"]
    axis = dim_arg(b, args["dim"], check_rank(b, x))
    row = b.temp()
    b.emit(N.ExpandDimsNode(x=b.operand(args["src"], b.dtype_of(x)), axes=[axis], out=row))
    # No stop: a one-long slice at `index` (which may be negative or a runtime value).
    b.emit(N.SliceUpdateNode(x=b.tensor(x), update=row, axis=axis, start=b.int_or_vid(args["index"]), stop=None,
                             step=1, out=b.out(n)))


@register(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    x, mask, value = args["self"], args["mask"], args["value"]
    dtype = b.dtype_of(x)
    if b.dtype_of(mask) != torch.bool:
        raise b.unsupported(f"mask of dtype {b.dtype_of(mask)}")
    if len(b.shape_of(mask)) > len(b.shape_of(x)):
        raise b.unsupported("mask has more dims than the input")
    b.emit(N.WhereNode(cond=b.tensor(mask), a=b.operand(value, dtype), b=b.tensor(x), out=b.out(n)))
