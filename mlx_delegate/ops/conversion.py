"""Dtype conversions and copies: _to_copy, _to_dim_order_copy, clone, alias."""

from __future__ import annotations

import torch
from executorch.exir.dialects._ops import ops as exir_ops

from ..builder import ProgramBuilder
from ..ir import nodes as N
from ..registry import register
from .shape import same_dim

aten = torch.ops.aten


@register(aten._to_copy.default, exir_ops.edge.dim_order_ops._to_dim_order_copy.default)
def to_copy(b: ProgramBuilder, n: torch.fx.Node) -> None:
    x = n.args[0]
    src, dst = b.dtype_of(x), b.dtype_of(n)
    b.ir_dtype(src)
    node = N.AsTypeNode if src != dst else N.IdentityNode
    fields = {"dtype": b.ir_dtype(dst)} if src != dst else {}
    b.emit(node(x=b.tensor(x), out=b.out(n), **fields))


@register(aten.clone.default, aten.alias_copy.default, aten.alias.default, aten.lift_fresh_copy.default,
          exir_ops.edge.dim_order_ops._clone_dim_order.default)
def clone(b: ProgramBuilder, n: torch.fx.Node) -> None:
    # MLX arrays are immutable, so a copy is the same array under a new slot; a
    # dim_order or memory_format only changes how the runtime lays out a delegate
    # output in the caller's tensor, which follows that tensor's own dim order.
    b.emit(N.IdentityNode(x=b.tensor(n.args[0]), out=b.out(n)))


@register(aten.copy.default)
def copy(b: ProgramBuilder, n: torch.fx.Node) -> None:
    """Functional `dst.copy_(src)`: src in dst's dtype, broadcast to dst's shape
    (transformers' static cache writes its `cumulative_length` buffers this way)."""
    dst, src = n.args[:2]
    dst_shape, src_shape = b.shape_of(dst), b.shape_of(src)
    x = b.cast(b.tensor(src), b.dtype_of(src), b.dtype_of(dst))
    if len(dst_shape) == len(src_shape) and all(same_dim(d, s) for d, s in zip(dst_shape, src_shape)):
        b.emit(N.IdentityNode(x=x, out=b.out(n)))
        return
    if not all(isinstance(d, int) for d in dst_shape):
        raise b.unsupported(f"broadcasting copy into a dynamic shape {dst_shape}")
    b.emit(N.BroadcastNode(x=x, shape=[b.int_or_vid(d) for d in dst_shape], out=b.out(n)))

