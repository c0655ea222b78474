"""Gathers: embedding, index_select, gather, take and advanced indexing (index.Tensor).

Scatters (index_put, scatter*, slice/select_scatter, masked_fill, ...) live in
`scatter.py`; the index validation both need lives here.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..builder import ProgramBuilder
from ..ir import nodes as N
from ..registry import register

aten = torch.ops.aten
INDEX_DTYPES = (torch.int32, torch.int64)
MASK_DTYPES = (torch.bool, torch.uint8)  # torch reads uint8 index tensors as masks too


def index_tensor(b: ProgramBuilder, idx: Any, what: str = "index") -> Any:
    """The slot of an integer index tensor, refusing other dtypes."""
    dtype = b.dtype_of(idx)
    if dtype not in INDEX_DTYPES:
        raise b.unsupported(f"{what} of dtype {dtype}")
    return b.tensor(idx)


def check_rank(b: ProgramBuilder, x: Any, minimum: int = 1) -> int:
    ndim = len(b.shape_of(x))
    if ndim < minimum:
        raise b.unsupported(f"needs a tensor of rank >= {minimum}, got rank {ndim}")
    return ndim


def dim_arg(b: ProgramBuilder, dim: Any, ndim: int) -> int:
    """A static dim argument normalised to [0, ndim)."""
    if not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise b.unsupported(f"dim {dim!r} for rank {ndim}")
    return dim % ndim


def has_mask(b: ProgramBuilder, indices: Sequence[Any]) -> bool:
    return any(i is not None and b.dtype_of(i) in MASK_DTYPES for i in indices)


def advanced_indices(b: ProgramBuilder, x: Any, indices: Sequence[Any]) -> tuple[list[Any], list[int]]:
    """(index slots, axes) for torch's `Tensor?[] indices` with integer tensors (None skips an axis)."""
    ndim = check_rank(b, x)
    if len(indices) > ndim:
        raise b.unsupported(f"{len(indices)} indices for rank {ndim}")
    if has_mask(b, indices):
        raise b.unsupported("boolean mask index: the result's size depends on the data")
    pairs = [(index_tensor(b, i), axis) for axis, i in enumerate(indices) if i is not None]
    if not pairs:
        raise b.unsupported("no index tensors")
    return [t for t, _ in pairs], [a for _, a in pairs]


@register(aten.embedding.default)
def embedding(b: ProgramBuilder, n: torch.fx.Node) -> None:
    # padding_idx only affects the gradient.
    args = b.args(n)
    if check_rank(b, args["weight"]) != 2:
        raise b.unsupported("embedding weight must be 2-D")
    b.emit(N.TakeNode(x=b.tensor(args["weight"]), indices=index_tensor(b, args["indices"]), axis=0,
                      out=b.out(n)))


@register(aten.index_select.default)
def index_select(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    x, index = args["self"], args["index"]
    axis = dim_arg(b, args["dim"], check_rank(b, x))
    idx = index_tensor(b, index)
    if len(b.shape_of(index)) == 0:  # a 0-d index keeps the axis (size 1), unlike take
        flat = b.temp()
        b.emit(N.ReshapeNode(x=idx, shape=[b.int_or_vid(1)], out=flat))
        idx = flat
    b.emit(N.TakeNode(x=b.tensor(x), indices=idx, axis=axis, out=b.out(n)))


@register(aten.gather.default)
def gather(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    x, index = args["self"], args["index"]
    ndim = check_rank(b, x)
    if len(b.shape_of(index)) != ndim:
        raise b.unsupported("index and input ranks differ")
    b.emit(N.TakeAlongAxisNode(x=b.tensor(x), indices=index_tensor(b, index), axis=dim_arg(b, args["dim"], ndim),
                               out=b.out(n)))


@register(aten.index.Tensor, aten._unsafe_index.Tensor)
def index(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    x = args["self"]
    tids, axes = advanced_indices(b, x, args["indices"])
    b.emit(N.GatherNode(x=b.tensor(x), indices=tids, axes=axes, out=b.out(n)))


@register(aten.take.default)
def take(b: ProgramBuilder, n: torch.fx.Node) -> None:
    # torch.take indexes the flattened input and wraps negative indices.
    args = b.args(n)
    x = args["self"]
    idx = index_tensor(b, args["index"])
    shape = b.shape_of(x)
    # A static length also covers empty inputs, whose -1 MLX cannot infer.
    numel = int(torch.Size(shape).numel()) if all(isinstance(d, int) for d in shape) else -1
    flat = b.temp()
    b.emit(N.ReshapeNode(x=b.tensor(x), shape=[b.int_or_vid(numel)], out=flat))
    b.emit(N.GatherNode(x=flat, indices=[idx], axes=[0], out=b.out(n)))
