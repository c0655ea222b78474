"""Creation ops: full / zeros / ones / empty (and their `_like` and `new_` forms), fill, arange.

Fill values travel as doubles (`FloatOrVid`), so integer values beyond 2**53
are refused rather than rounded. `empty` is lowered as zeros: its contents are
unspecified, and zeros are a valid (and deterministic) choice.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from executorch.exir.dialects._ops import ops as exir_ops

from ..builder import ProgramBuilder
from ..ir import nodes as N
from ..registry import register

aten = torch.ops.aten
EXACT_INT = 2**53  # doubles hold every integer up to here


def exact_value(b: ProgramBuilder, v: Any, dtype: torch.dtype) -> Any:
    """`v` (a number or scalar node) as a FloatOrVid that converts exactly to `dtype`."""
    if isinstance(v, torch.fx.Node):
        return b.float_or_vid(v)
    if not isinstance(v, (bool, int, float)):
        raise b.unsupported(f"fill value {v!r} is not a number")
    if not (dtype.is_floating_point or dtype == torch.bool):
        if not math.isfinite(v):
            raise b.unsupported(f"{v} cannot fill an integer tensor")
        if abs(v) > EXACT_INT:
            raise b.unsupported(f"{v} is beyond the integers a double holds exactly")
    return b.float_or_vid(v)


def _check_layout(b: ProgramBuilder, args: dict[str, Any]) -> None:
    # Delegate outputs are written contiguously, so other layouts are left to ExecuTorch.
    fmt = args.get("memory_format")
    if fmt not in (None, torch.contiguous_format, torch.preserve_format):
        raise b.unsupported(f"memory_format {fmt}")
    dim_order = args.get("dim_order")
    if dim_order and list(dim_order) != list(range(len(dim_order))):
        raise b.unsupported(f"non-contiguous dim_order {list(dim_order)}")


def _fill_value(args: dict[str, Any], value: Any) -> Any:
    """The row's constant, or the op's own fill argument when the row says None."""
    if value is not None:
        return value
    return args["fill_value"] if "fill_value" in args else args["value"]


# Ops taking an explicit `size`: the fill value (None: the op's fill argument).
SIZED = {
    aten.full.default: None, aten.new_full.default: None, aten.zeros.default: 0, aten.new_zeros.default: 0,
    aten.ones.default: 1, aten.new_ones.default: 1, aten.empty.memory_format: 0, aten.new_empty.default: 0,
    exir_ops.edge.dim_order_ops._empty_dim_order.default: 0,
}
# Ops shaped like their input tensor.
LIKE = {
    aten.full_like.default: None, aten.zeros_like.default: 0, aten.ones_like.default: 1,
    aten.empty_like.default: 0, aten.fill.Scalar: None,
}


def _sized(value: Any):
    def handle(b: ProgramBuilder, n: torch.fx.Node) -> None:
        args = b.args(n)
        _check_layout(b, args)
        dtype = b.dtype_of(n)
        fill = exact_value(b, _fill_value(args, value), dtype)
        b.emit(N.FullNode(shape=[b.int_or_vid(s) for s in args["size"]], value=fill, dtype=b.ir_dtype(dtype),
                          out=b.out(n)))
    return handle


def _like(value: Any):
    def handle(b: ProgramBuilder, n: torch.fx.Node) -> None:
        args = b.args(n)
        _check_layout(b, args)
        dtype = b.dtype_of(n)
        fill = exact_value(b, _fill_value(args, value), dtype)
        b.emit(N.FullLikeNode(x=b.tensor(args["self"]), value=fill, dtype=b.ir_dtype(dtype), out=b.out(n)))
    return handle


for _table, _make in ((SIZED, _sized), (LIKE, _like)):
    for _target, _value in _table.items():
        register(_target)(_make(_value))


@register(aten.scalar_tensor.default)
def scalar_tensor(b: ProgramBuilder, n: torch.fx.Node) -> None:
    dtype = b.dtype_of(n)
    value = exact_value(b, n.args[0], dtype)
    b.emit(N.FullNode(shape=[], value=value, dtype=b.ir_dtype(dtype), out=b.out(n)))


@register(aten.arange.default, aten.arange.start, aten.arange.start_step)
def arange(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    start = 0 if args.get("start") is None else args["start"]
    end, step = args["end"], 1 if args.get("step") is None else args["step"]
    dtype = b.dtype_of(n)
    b.ir_dtype(dtype)
    if dtype == torch.bool:
        raise b.unsupported("arange of bool")
    literals = [v for v in (start, end, step) if not isinstance(v, torch.fx.Node)]
    if step == 0 or any(not math.isfinite(v) for v in literals):
        raise b.unsupported(f"arange bounds {start}, {end}, {step}")
    # torch casts fractional bounds of integer ranges in its own way; only whole numbers match.
    if not dtype.is_floating_point and any(float(v) != int(v) for v in literals):
        raise b.unsupported(f"fractional bounds {start}, {end}, {step} for an integer range")
    if any(abs(v) > EXACT_INT for v in literals):
        raise b.unsupported("bounds beyond the integers a double holds exactly")
    b.emit(N.ArangeNode(start=b.float_or_vid(start), stop=b.float_or_vid(end), step=b.float_or_vid(step),
                        dtype=b.ir_dtype(dtype), out=b.out(n)))
