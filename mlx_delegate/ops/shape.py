"""Shape ops: views (reshape, permute, squeeze, expand, slice, select), cat/stack, split/unbind.

MLX arrays are immutable, so every view is a fresh IR value; the Edge `_copy`
forms and the aliasing ATen forms lower identically. Sizes may be symbolic
(fx nodes from `sym_size`), which `b.int_or_vid` turns into value slots.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..builder import ProgramBuilder
from ..ir import nodes as N
from ..registry import register

aten = torch.ops.aten
INT64_MAX = 2**63 - 1


def static_int(v: Any) -> int | None:
    """`v` as an int when it is known at lowering time, else None (symbolic)."""
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return v
    if isinstance(v, torch.SymInt) and v.node.is_constant():
        return int(v)
    return None


def same_dim(a: Any, b: Any) -> bool:
    """Whether two (possibly symbolic) sizes are provably equal, without adding guards."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return a.node.expr == b.node.expr
    return False


def axis(b: ProgramBuilder, dim: Any, rank: int) -> int:
    """`dim` normalised to [0, rank); a 0-d tensor accepts 0 and -1 like torch."""
    if not isinstance(dim, int):
        raise b.unsupported(f"dimension {dim!r} is not a constant")
    bound = max(rank, 1)
    if not -bound <= dim < bound:
        raise b.unsupported(f"dimension {dim} out of range for rank {rank}")
    return dim % bound


def rank_of(b: ProgramBuilder, x: Any) -> int:
    return len(b.shape_of(x))


def _check_dtype(b: ProgramBuilder, x: Any) -> None:
    b.ir_dtype(b.dtype_of(x))


def _sizes(b: ProgramBuilder, sizes: Sequence[Any]) -> list[Any]:
    return [b.int_or_vid(s) for s in sizes]


def _check_rank(b: ProgramBuilder, n: torch.fx.Node, expected: int) -> None:
    """Guards against lowering a shape decision that torch made differently."""
    if rank_of(b, n) != expected:
        raise b.unsupported(f"result rank {rank_of(b, n)} differs from the {expected} computed here")


@register(aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.view_copy.default)
def view(b: ProgramBuilder, n: torch.fx.Node) -> None:
    x, size = n.args[0], n.args[1]
    _check_dtype(b, x)
    b.emit(N.ReshapeNode(x=b.tensor(x), shape=_sizes(b, size), out=b.out(n)))


def _transpose(b: ProgramBuilder, n: torch.fx.Node, x: Any, perm: list[int]) -> None:
    _check_dtype(b, x)
    if perm == sorted(perm):
        b.emit(N.IdentityNode(x=b.tensor(x), out=b.out(n)))
    else:
        b.emit(N.TransposeNode(x=b.tensor(x), perm=perm, out=b.out(n)))


@register(aten.permute.default, aten.permute_copy.default)
def permute(b: ProgramBuilder, n: torch.fx.Node) -> None:
    x, dims = n.args[0], n.args[1]
    rank = rank_of(b, x)
    perm = [axis(b, d, rank) for d in dims]
    if sorted(perm) != list(range(rank)):
        raise b.unsupported(f"{list(dims)} is not a permutation of {rank} dimensions")
    _transpose(b, n, x, perm)


@register(aten.transpose.int, aten.transpose_copy.int)
def transpose(b: ProgramBuilder, n: torch.fx.Node) -> None:
    x, d0, d1 = n.args[0], n.args[1], n.args[2]
    rank = rank_of(b, x)
    perm = list(range(rank))
    if rank > 0:
        i, j = axis(b, d0, rank), axis(b, d1, rank)
        perm[i], perm[j] = perm[j], perm[i]
    _transpose(b, n, x, perm)


@register(aten.t.default, aten.t_copy.default)
def t(b: ProgramBuilder, n: torch.fx.Node) -> None:
    x = n.args[0]
    rank = rank_of(b, x)
    if rank > 2:
        raise b.unsupported("t() takes at most 2-D tensors")
    _transpose(b, n, x, [1, 0] if rank == 2 else list(range(rank)))


@register(aten.unsqueeze.default, aten.unsqueeze_copy.default)
def unsqueeze(b: ProgramBuilder, n: torch.fx.Node) -> None:
    x, dim = n.args[0], n.args[1]
    _check_dtype(b, x)
    ax = axis(b, dim, rank_of(b, x) + 1)
    b.emit(N.ExpandDimsNode(x=b.tensor(x), axes=[ax], out=b.out(n)))


@register(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze_copy.default,
          aten.squeeze_copy.dim, aten.squeeze_copy.dims)
def squeeze(b: ProgramBuilder, n: torch.fx.Node) -> None:
    x = n.args[0]
    _check_dtype(b, x)
    shape = b.shape_of(x)
    dims = n.args[1] if len(n.args) > 1 else range(len(shape))
    dims = [dims] if isinstance(dims, int) else dims
    # Only sizes known to be 1 are squeezed; a symbolic size is never 1 in an exported graph.
    candidates = {axis(b, d, len(shape)) for d in dims}
    axes = sorted(a for a in candidates if a < len(shape) and static_int(shape[a]) == 1)
    _check_rank(b, n, len(shape) - len(axes))
    if axes:
        b.emit(N.SqueezeNode(x=b.tensor(x), axes=axes, out=b.out(n)))
    else:
        b.emit(N.IdentityNode(x=b.tensor(x), out=b.out(n)))


@register(aten.expand.default, aten.expand_copy.default)
def expand(b: ProgramBuilder, n: torch.fx.Node) -> None:
    x, size = n.args[0], n.args[1]
    _check_dtype(b, x)
    if len(size) < rank_of(b, x):
        raise b.unsupported("expand to fewer dimensions than the input has")
    if any(static_int(s) == -1 for s in size[: len(size) - rank_of(b, x)]):
        raise b.unsupported("-1 in a new leading dimension")
    b.emit(N.BroadcastNode(x=b.tensor(x), shape=_sizes(b, size), out=b.out(n)))


@register(aten.slice.Tensor, aten.slice_copy.Tensor)
def slice_(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    x = args["self"]
    _check_dtype(b, x)
    step = args["step"] if args["step"] is not None else 1
    if not isinstance(step, int) or step <= 0:
        raise b.unsupported(f"slice step {step!r} (must be a positive constant)")
    start = 0 if args["start"] is None else args["start"]
    end = INT64_MAX if args["end"] is None else args["end"]
    b.emit(N.SliceNode(x=b.tensor(x), axis=axis(b, args["dim"], rank_of(b, x)), start=b.int_or_vid(start),
                       stop=b.int_or_vid(end), step=step,
                       out=b.out(n)))


@register(aten.select.int, aten.select_copy.int)
def select(b: ProgramBuilder, n: torch.fx.Node) -> None:
    x, dim, index = n.args[0], n.args[1], n.args[2]
    _check_dtype(b, x)
    rank = rank_of(b, x)
    if rank == 0:
        raise b.unsupported("select on a 0-d tensor")
    b.emit(N.SelectNode(x=b.tensor(x), axis=axis(b, dim, rank), index=b.int_or_vid(index), out=b.out(n)))


def _joined(b: ProgramBuilder, tensors: Sequence[Any], dtype: torch.dtype) -> list[Any]:
    """The input slots, each cast to the result dtype (cat/stack promote like arithmetic)."""
    if not tensors:
        raise b.unsupported("no tensors to join")
    return [b.operand(t, dtype) for t in tensors]


@register(aten.cat.default)
def cat(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    rank, dtype = rank_of(b, n), b.dtype_of(n)
    b.ir_dtype(dtype)
    # torch skips legacy empty 1-D inputs when joining higher-rank tensors.
    tensors = [t for t in args["tensors"] if rank == 1 or b.shape_of(t) != [0]]
    if any(rank_of(b, t) != rank for t in tensors):
        raise b.unsupported("inputs of different ranks")
    b.emit(N.ConcatNode(xs=_joined(b, tensors, dtype), axis=axis(b, args["dim"], rank), out=b.out(n)))


@register(aten.stack.default)
def stack(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    dtype = b.dtype_of(n)
    b.ir_dtype(dtype)
    b.emit(N.StackNode(xs=_joined(b, args["tensors"], dtype), axis=axis(b, args["dim"], rank_of(b, n)),
                       out=b.out(n)))


def _split(b: ProgramBuilder, n: torch.fx.Node, x: Any, dim: Any, sizes: Sequence[Any]) -> None:
    _check_dtype(b, x)
    ax = axis(b, dim, rank_of(b, x))
    # A copy: getitem later takes the slots out of the builder's own list.
    outs = list(b.outs(n, len(sizes)))
    b.emit(N.SplitNode(x=b.tensor(x), axis=ax, sizes=_sizes(b, sizes), outs=outs))


@register(aten.split_with_sizes.default, aten.split_with_sizes_copy.default)
def split_with_sizes(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    _split(b, n, args["self"], args["dim"], args["split_sizes"])


@register(aten.split.Tensor, aten.split_copy.Tensor)
def split(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    x = args["self"]
    ax = axis(b, args["dim"], rank_of(b, x))
    # The piece sizes torch computed; the last one may be shorter.
    sizes = [static_int(o.shape[ax]) for o in b.meta(n)]
    if None in sizes:
        raise b.unsupported("split of a dimension with a symbolic size")
    _split(b, n, x, ax, sizes)


@register(aten.unbind.int, aten.unbind_copy.int)
def unbind(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    x = args["self"]
    _check_dtype(b, x)
    rank = rank_of(b, x)
    if rank == 0:
        raise b.unsupported("unbind of a 0-d tensor")
    ax, src = axis(b, args["dim"], rank), b.tensor(x)
    outs = b.outs(n, len(b.meta(n)))
    for i, out in enumerate(outs):
        b.emit(N.SelectNode(x=src, axis=ax, index=b.int_or_vid(i), out=out))
