"""Pooling: max_pool{1,2,3}d (with or without indices), avg_pool{1,2,3}d and
adaptive average pooling when the output evenly divides the input.

The window arithmetic (ceil_mode, count_include_pad, dilation) lives in the
runtime's PoolNode; handlers only validate and normalise the arguments.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from ..builder import ProgramBuilder
from ..ir import nodes as N
from ..registry import register
from .conv import float_dtype, int_list

aten = torch.ops.aten
P = N.PoolOp

# target -> (op, spatial rank, returns indices)
POOLS: dict[Any, tuple[Any, int, bool]] = {
    aten.max_pool1d.default: (P.Max, 1, False), aten.max_pool2d.default: (P.Max, 2, False),
    aten.max_pool3d.default: (P.Max, 3, False),
    aten.max_pool2d_with_indices.default: (P.Max, 2, True),
    aten.max_pool3d_with_indices.default: (P.Max, 3, True),
    aten.avg_pool1d.default: (P.Avg, 1, False), aten.avg_pool2d.default: (P.Avg, 2, False),
    aten.avg_pool3d.default: (P.Avg, 3, False),
}
# target -> spatial rank
ADAPTIVE_AVG = {
    aten.adaptive_avg_pool1d.default: 1, aten.adaptive_avg_pool2d.default: 2,
    aten._adaptive_avg_pool2d.default: 2, aten.adaptive_avg_pool3d.default: 3,
    aten._adaptive_avg_pool3d.default: 3,
}


def _check_input(b: ProgramBuilder, x: Any, nd: int) -> list[Any]:
    shape = b.shape_of(x)
    if len(shape) not in (nd + 1, nd + 2):
        raise b.unsupported(f"expected a rank-{nd + 1} or rank-{nd + 2} input, got rank {len(shape)}")
    return shape


def _used_outputs(n: torch.fx.Node) -> set[int]:
    return {u.args[1] for u in n.users if u.target is operator.getitem}


def _window(b: ProgramBuilder, args: dict[str, Any], nd: int) -> dict[str, Any]:
    kernel = int_list(b, args["kernel_size"], nd, "kernel_size")
    # An empty stride means "the kernel size".
    stride = int_list(b, args["stride"], nd, "stride") if args.get("stride") else kernel
    padding = int_list(b, args["padding"], nd, "padding")
    dilation = int_list(b, args.get("dilation", 1), nd, "dilation")
    if any(k < 1 for k in kernel) or any(s < 1 for s in stride) or any(d < 1 for d in dilation):
        raise b.unsupported("kernel, stride and dilation must be positive")
    if any(p < 0 or 2 * p > k for p, k in zip(padding, kernel)):
        raise b.unsupported("padding must be at most half the kernel")
    ceil_mode = args.get("ceil_mode")
    if not isinstance(ceil_mode, bool):
        raise b.unsupported(f"ceil_mode must be a bool, got {ceil_mode!r}")
    return dict(kernel=kernel, stride=stride, padding=padding, dilation=dilation, ceil_mode=ceil_mode)


def _pool(op: Any, nd: int, with_indices: bool):
    def handle(b: ProgramBuilder, n: torch.fx.Node) -> None:
        args = b.args(n)
        x = args["self"]
        _check_input(b, x, nd)
        float_dtype(b, x)
        window = _window(b, args, nd)
        extra: dict[str, Any] = {}
        if op == P.Avg:
            divisor = args.get("divisor_override")
            if divisor is not None and (not isinstance(divisor, int) or divisor <= 0):
                raise b.unsupported(f"divisor_override must be a positive int, got {divisor!r}")
            extra = dict(count_include_pad=bool(args["count_include_pad"]), divisor=divisor or 0)
        if not with_indices:
            b.emit(N.PoolNode(op=op, x=b.tensor(x), out=b.out(n), **window, **extra))
            return
        out, indices = b.outs(n, 2)
        b.emit(N.PoolNode(op=op, x=b.tensor(x), out=out, out_indices=indices if 1 in _used_outputs(n) else None,
                          **window))
    return handle


for _target, (_op, _nd, _with_indices) in POOLS.items():
    register(_target)(_pool(_op, _nd, _with_indices))


def _adaptive_avg(nd: int):
    def handle(b: ProgramBuilder, n: torch.fx.Node) -> None:
        args = b.args(n)
        x = args["self"]
        shape = _check_input(b, x, nd)
        dtype = float_dtype(b, x)
        sizes = int_list(b, args["output_size"], nd, "output_size")
        spatial = shape[-nd:]
        if all(s == 1 for s in sizes) and not all(isinstance(d, int) for d in spatial):
            _global_mean(b, n, x, dtype, nd)
            return
        if not all(isinstance(d, int) for d in spatial):
            raise b.unsupported("adaptive pooling of dynamic spatial sizes (only to 1x1)")
        if any(s < 1 or d % s != 0 for d, s in zip(spatial, sizes)):
            raise b.unsupported(f"output size {sizes} does not evenly divide the input {spatial}")
        kernel = [d // s for d, s in zip(spatial, sizes)]
        b.emit(N.PoolNode(op=P.Avg, x=b.tensor(x), kernel=kernel, stride=kernel, padding=[0] * nd,
                          dilation=[1] * nd, ceil_mode=False, count_include_pad=True, divisor=0, out=b.out(n)))
    return handle


def _global_mean(b: ProgramBuilder, n: torch.fx.Node, x: Any, dtype: torch.dtype, nd: int) -> None:
    """Adaptive pooling to size 1 as a mean (works for dynamic spatial sizes); halves accumulate in float32."""
    acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    mean = b.temp()
    b.emit(N.ReduceNode(op=N.ReduceOp.Mean, x=b.cast(b.tensor(x), dtype, acc), axes=list(range(-nd, 0)),
                        keepdims=True, out=mean))
    b.emit(N.AsTypeNode(x=mean, dtype=b.ir_dtype(dtype), out=b.out(n)))


for _target, _nd in ADAPTIVE_AVG.items():
    register(_target)(_adaptive_avg(_nd))
