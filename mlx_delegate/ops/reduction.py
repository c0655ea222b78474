"""Reductions, arg-reductions, variance, scans, softmax, sorting and selection.

torch's dtype rules are applied here, the runtime only reduces: sums,
products and scans of ints/bools give int64 (or the `dtype=` kwarg), so the
input is cast to the result dtype first. The runtime accumulates fp16/bf16 in
fp32 (see cpp/ops/reduction.cpp).

Ops that are not core ATen (cumprod, sort.stable, median, var_mean) only reach the
delegate when the exporter lists them in `_core_aten_ops_exception_list`.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from ..builder import ProgramBuilder
from ..ir import nodes as N
from ..registry import base_name, register
from .elementwise import check_dtype

aten = torch.ops.aten
R, A = N.ReduceOp, N.ArgReduceOp

# Ops whose result takes the `dtype` of the node (promoted or requested): the input is cast to it.
CAST_TO_RESULT = {R.Sum, R.Prod, R.Mean, R.LogSumExp}
BOOLEAN = {R.Any, R.All}

REDUCTIONS = {
    aten.sum.default: R.Sum, aten.sum.dim_IntList: R.Sum, aten.mean.default: R.Mean, aten.mean.dim: R.Mean,
    aten.amax.default: R.Max, aten.amin.default: R.Min, aten.max.default: R.Max, aten.min.default: R.Min,
    aten.prod.default: R.Prod, aten.prod.dim_int: R.Prod, aten.logsumexp.default: R.LogSumExp,
    aten.any.default: R.Any, aten.any.dim: R.Any, aten.any.dims: R.Any,
    aten.all.default: R.All, aten.all.dim: R.All, aten.all.dims: R.All,
}
ARG_REDUCTIONS = {aten.argmax.default: A.ArgMax, aten.argmin.default: A.ArgMin}
VALUE_AND_INDEX = {aten.max.dim: (R.Max, A.ArgMax), aten.min.dim: (R.Min, A.ArgMin)}
SCANS = {aten.cumsum.default: R.Sum, aten.cumprod.default: R.Prod}
SOFTMAX = {aten._softmax.default: False, aten._log_softmax.default: True,
           aten.softmax.int: False, aten.log_softmax.int: True}
VARIANCE = {aten.var.correction: False, aten.var.dim: False, aten.var.default: False,
            aten.std.correction: True, aten.std.dim: True, aten.std.default: True}


# ------------------------------------------------------------------ helpers
def _ndim(b: ProgramBuilder, x: Any) -> int:
    return len(b.shape_of(x))


def axes(b: ProgramBuilder, x: Any, dim: int | Sequence[int] | None) -> list[int]:
    """torch's `dim` argument as non-negative axes; [] means every axis (dim=None or [])."""
    if dim is None:
        return []
    dims = [dim] if isinstance(dim, int) else list(dim)
    ndim = _ndim(b, x)
    if ndim == 0:
        if any(d not in (0, -1) for d in dims):
            raise b.unsupported(f"dim {dims} out of range for a 0-d tensor")
        return []
    out = []
    for d in dims:
        if not isinstance(d, int) or not -ndim <= d < ndim:
            raise b.unsupported(f"dim {d!r} out of range for {ndim} dims")
        out.append(d % ndim)
    if len(set(out)) != len(out):
        raise b.unsupported(f"repeated dims {dims}")
    return out


def axis(b: ProgramBuilder, x: Any, dim: int) -> int:
    """One axis of x (0 for a 0-d tensor, which torch lets dim 0/-1 address)."""
    found = axes(b, x, dim)
    return found[0] if found else 0


def _input(b: ProgramBuilder, x: Any, dtype: torch.dtype | None = None) -> Any:
    """x's slot, cast to dtype when given; refuses dtypes the IR cannot hold."""
    src = b.dtype_of(x)
    check_dtype(b, src)
    if dtype is None:
        return b.tensor(x)
    check_dtype(b, dtype)
    return b.operand(x, dtype)


def _static_numel(b: ProgramBuilder, x: Any, over: list[int]) -> int | None:
    """Elements per reduced slice over `over` ([] = all axes), None when a size is dynamic."""
    shape = b.shape_of(x)
    sizes = [shape[a] for a in (over or range(len(shape)))]
    return None if any(not isinstance(s, int) for s in sizes) else math.prod(sizes)


def _axis_of_nd(b: ProgramBuilder, x: Any, dim: int, what: str) -> int:
    """The axis for scans and softmax, which the runtime applies to tensors of rank >= 1."""
    if _ndim(b, x) == 0:
        raise b.unsupported(f"{what} of a 0-d tensor")
    return axis(b, x, dim)


# --------------------------------------------------------------- reductions
def _reduction(op: Any):
    def handle(b: ProgramBuilder, n: torch.fx.Node) -> None:
        args = b.args(n)
        x, out_dtype = args["self"], b.dtype_of(n)
        check_dtype(b, out_dtype)
        over = axes(b, x, args.get("dim"))
        if op in (R.Max, R.Min) and _static_numel(b, x, over) == 0:
            raise b.unsupported("max/min over an empty slice")  # torch raises
        keep = bool(args.get("keepdim", False))
        src = _input(b, x, out_dtype if op in CAST_TO_RESULT else None)
        if op in BOOLEAN and out_dtype != torch.bool:  # any/all of uint8 give uint8
            tmp = b.temp()
            b.emit(N.ReduceNode(op=op, x=src, axes=over, keepdims=keep, out=tmp))
            b.emit(N.AsTypeNode(x=tmp, dtype=b.ir_dtype(out_dtype), out=b.out(n)))
            return
        b.emit(N.ReduceNode(op=op, x=src, axes=over, keepdims=keep, out=b.out(n)))
    return handle


def _flat(b: ProgramBuilder, x: Any) -> Any:
    """x reshaped to 1-D (a temp)."""
    t = b.temp()
    b.emit(N.ReshapeNode(x=b.tensor(x), shape=[b.int_or_vid(-1)], out=t))
    return t


def _arg_reduction(op: Any):
    def handle(b: ProgramBuilder, n: torch.fx.Node) -> None:
        args = b.args(n)
        x, dim, keep = args["self"], args["dim"], bool(args["keepdim"])
        if b.dtype_of(x) == torch.bool:
            raise b.unsupported("arg-reduction of bool")
        _input(b, x)
        if _static_numel(b, x, axes(b, x, dim)) == 0:
            raise b.unsupported("argmax/argmin over an empty slice")  # torch raises
        if dim is not None and _ndim(b, x) > 0:
            b.emit(N.ArgReduceNode(op=op, x=b.tensor(x), axis=axis(b, x, dim), keepdims=keep, out=b.out(n)))
            return
        # dim=None indexes the flattened input; keepdim keeps every axis as size 1.
        ndim = _ndim(b, x)
        if not keep or ndim <= 1:
            b.emit(N.ArgReduceNode(op=op, x=_flat(b, x), axis=0, keepdims=keep and ndim == 1, out=b.out(n)))
            return
        tmp = b.temp()
        b.emit(N.ArgReduceNode(op=op, x=_flat(b, x), axis=0, keepdims=True, out=tmp))
        b.emit(N.ReshapeNode(x=tmp, shape=[b.int_or_vid(1)] * ndim, out=b.out(n)))
    return handle


def _value_and_index(ops: tuple[Any, Any]):
    reduce_op, arg_op = ops

    def handle(b: ProgramBuilder, n: torch.fx.Node) -> None:
        args = b.args(n)
        x, keep = args["self"], bool(args["keepdim"])
        dtype = b.dtype_of(x)
        if dtype == torch.bool:
            raise b.unsupported("max/min with indices of bool")
        src = _input(b, x)
        ax = axis(b, x, args["dim"])
        if _static_numel(b, x, [ax] if _ndim(b, x) else []) == 0:
            raise b.unsupported("max/min over an empty slice")  # torch raises
        values, indices = b.outs(n, 2)
        over = [ax] if _ndim(b, x) else []
        b.emit(N.ReduceNode(op=reduce_op, x=src, axes=over, keepdims=keep, out=values))
        if _ndim(b, x) == 0:  # a 0-d input is its own maximum, at index 0
            b.emit(N.FullNode(shape=[], value=b.float_or_vid(0), dtype=b.ir_dtype(torch.int64), out=indices))
            return
        b.emit(N.ArgReduceNode(op=arg_op, x=src, axis=ax, keepdims=keep, out=indices))
    return handle


def _variance_args(b: ProgramBuilder, n: torch.fx.Node) -> tuple[Any, list[int], bool, int]:
    """(input slot, axes, keepdim, ddof) of var/std/var_mean in any of their overloads."""
    args = b.args(n)
    x, dtype = args["self"], b.dtype_of(args["self"])
    if not dtype.is_floating_point:
        raise b.unsupported(f"var/std of {dtype}")
    if "correction" in args:
        correction = 1 if args["correction"] is None else args["correction"]
    else:
        correction = int(args.get("unbiased", True) is not False)
    if correction != int(correction):
        raise b.unsupported(f"fractional correction {correction}")
    return _input(b, x), axes(b, x, args.get("dim")), bool(args.get("keepdim")), int(correction)


def _variance(std: bool):
    def handle(b: ProgramBuilder, n: torch.fx.Node) -> None:
        x, over, keep, ddof = _variance_args(b, n)
        b.emit(N.VarNode(x=x, axes=over, keepdims=keep, ddof=ddof, std=std, out=b.out(n)))
    return handle


@register(aten.var_mean.correction)
def var_mean(b: ProgramBuilder, n: torch.fx.Node) -> None:
    x, over, keep, ddof = _variance_args(b, n)
    var, mean = b.outs(n, 2)
    b.emit(N.VarNode(x=x, axes=over, keepdims=keep, ddof=ddof, std=False, out=var))
    b.emit(N.ReduceNode(op=R.Mean, x=x, axes=over, keepdims=keep, out=mean))


def _scan(op: Any):
    def handle(b: ProgramBuilder, n: torch.fx.Node) -> None:
        args = b.args(n)
        x, dtype = args["self"], b.dtype_of(n)
        src = _input(b, x, dtype)
        ax = _axis_of_nd(b, x, args["dim"], "scan")
        b.emit(N.CumulativeNode(op=op, x=src, axis=ax, reverse=False, out=b.out(n)))
    return handle


def _softmax(log: bool):
    def handle(b: ProgramBuilder, n: torch.fx.Node) -> None:
        args = b.args(n)
        x, dtype = args["self"], b.dtype_of(n)
        if args.get("half_to_float"):
            raise b.unsupported("half_to_float=True")
        if not dtype.is_floating_point:
            raise b.unsupported(f"softmax of {dtype}")
        ax = _axis_of_nd(b, x, args["dim"], "softmax")
        b.emit(N.SoftmaxNode(x=_input(b, x, dtype), axis=ax, log=log, out=b.out(n)))
    return handle


for _table, _make in ((REDUCTIONS, _reduction), (ARG_REDUCTIONS, _arg_reduction),
                      (VALUE_AND_INDEX, _value_and_index), (VARIANCE, _variance), (SCANS, _scan),
                      (SOFTMAX, _softmax)):
    for _target, _op in _table.items():
        register(_target)(_make(_op))


# ------------------------------------------------------- sorting, selection
def _sortable(b: ProgramBuilder, x: Any) -> Any:
    if b.dtype_of(x) == torch.bool:
        raise b.unsupported("sorting bool")
    return _input(b, x)


@register(aten.sort.default, aten.sort.stable, aten.argsort.default, aten.argsort.stable)
def sort(b: ProgramBuilder, n: torch.fx.Node) -> None:
    """Always stable: a stable order is also a valid answer to stable=False."""
    args = b.args(n)
    x = args["self"]
    src = _sortable(b, x)
    ax, descending = axis(b, x, args["dim"]), bool(args["descending"])
    if base_name(n.target) == "argsort":
        b.emit(N.SortNode(x=src, axis=ax, descending=descending, out_values=None, out_indices=b.out(n)))
        return
    values, indices = b.outs(n, 2)
    b.emit(N.SortNode(x=src, axis=ax, descending=descending, out_values=values, out_indices=indices))


@register(aten.topk.default)
def topk(b: ProgramBuilder, n: torch.fx.Node) -> None:
    """Results come sorted (ties in index order) whatever `sorted` says: any order is valid then."""
    args = b.args(n)
    x = args["self"]
    src = _sortable(b, x)
    k = b.int_or_vid(args["k"])
    values, indices = b.outs(n, 2)
    b.emit(N.TopkNode(x=src, k=k, axis=axis(b, x, args["dim"]), largest=bool(args["largest"]),
                      out_values=values, out_indices=indices))


@register(aten.median.default, aten.median.dim)
def median(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    x = args["self"]
    src = _sortable(b, x)
    flatten = "dim" not in args
    if _static_numel(b, x, [] if flatten else axes(b, x, args["dim"])) == 0:
        raise b.unsupported("median of an empty slice")  # torch raises (or returns nan) here
    if flatten:
        b.emit(N.MedianNode(x=src, axis=0, flatten=True, keepdims=False, out_values=b.out(n), out_indices=None))
        return
    values, indices = b.outs(n, 2)
    b.emit(N.MedianNode(x=src, axis=axis(b, x, args["dim"]), flatten=False, keepdims=bool(args["keepdim"]),
                        out_values=values, out_indices=indices))

