"""Dtype conversions and copies: _to_copy, _to_dim_order_copy, clone, alias."""

from __future__ import annotations

import torch
from executorch.exir.dialects._ops import ops as exir_ops

from ..builder import ProgramBuilder
from ..ir import nodes as N
from ..registry import register

aten = torch.ops.aten


def _check_layout(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    dim_order = args.get("dim_order")
    if dim_order and list(dim_order) != list(range(len(dim_order))):
        raise b.unsupported(f"non-contiguous dim_order {list(dim_order)}")
    fmt = args.get("memory_format")
    if fmt not in (None, torch.contiguous_format, torch.preserve_format):
        raise b.unsupported(f"memory_format {fmt}")


@register(aten._to_copy.default, exir_ops.edge.dim_order_ops._to_dim_order_copy.default)
def to_copy(b: ProgramBuilder, n: torch.fx.Node) -> None:
    _check_layout(b, n)
    x = n.args[0]
    src, dst = b.dtype_of(x), b.dtype_of(n)
    b.ir_dtype(src)
    node = N.AsTypeNode if src != dst else N.IdentityNode
    fields = {"dtype": b.ir_dtype(dst)} if src != dst else {}
    b.emit(node(x=b.tensor(x), out=b.out(n), **fields))


@register(aten.clone.default, aten.alias_copy.default, aten.alias.default, aten.lift_fresh_copy.default,
          exir_ops.edge.dim_order_ops._clone_dim_order.default)
def clone(b: ProgramBuilder, n: torch.fx.Node) -> None:
    # MLX arrays are immutable, so a copy is the same array under a new slot.
    _check_layout(b, n)
    b.emit(N.IdentityNode(x=b.tensor(n.args[0]), out=b.out(n)))
