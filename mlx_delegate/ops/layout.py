"""Layout ops that move data: repeat (tile), roll, flip and padding.

tril/triu, eye, linspace, narrow, chunk, tile, flatten and repeat_interleave
need no handler: export decomposes them into ops lowered here and in shape.py.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from ..builder import ProgramBuilder
from ..ir import nodes as N
from ..registry import register
from .creation import exact_value
from .shape import axis, rank_of, static_int

aten = torch.ops.aten
P = N.PadMode


def _static_ints(b: ProgramBuilder, values: Sequence[Any], what: str) -> list[int]:
    ints = [static_int(v) for v in values]
    if None in ints:
        raise b.unsupported(f"symbolic {what} {list(values)}")
    return ints


@register(aten.repeat.default)
def repeat(b: ProgramBuilder, n: torch.fx.Node) -> None:
    x, repeats = n.args[0], list(n.args[1])
    b.ir_dtype(b.dtype_of(x))
    rank = rank_of(b, x)
    reps = [static_int(b.meta(r) if isinstance(r, torch.fx.Node) else r) for r in repeats]
    if len(reps) < rank or min((r for r in reps if r is not None), default=0) < 0:
        raise b.unsupported(f"repeats {repeats} for a rank-{rank} tensor")
    if None not in reps:
        b.emit(N.TileNode(x=b.tensor(x), reps=reps, out=b.out(n)))
        return
    _tile_symbolic(b, n, x, repeats)


def _tile_symbolic(b: ProgramBuilder, n: torch.fx.Node, x: Any, repeats: list[Any]) -> None:
    """Tiling by sizes known only at run time (e.g. `repeat(batch, 1, 1)` of a learned token):
    interleave a unit axis before each axis, broadcast it to the repeat count, then merge pairs."""
    lead = len(repeats) - rank_of(b, x)
    shape = [1] * lead + list(b.shape_of(x))
    spread = b.temp()
    axes = sorted([2 * i for i in range(len(repeats))] + [2 * i + 1 for i in range(lead)])
    b.emit(N.ExpandDimsNode(x=b.tensor(x), axes=axes, out=spread))
    wide = b.temp()
    b.emit(N.BroadcastNode(x=spread, shape=[s for r in repeats for s in (b.int_or_vid(r), b.int_or_vid(-1))],
                           out=wide))
    sizes = [_product(b, x, r, d, i - lead) for i, (r, d) in enumerate(zip(repeats, shape))]
    b.emit(N.ReshapeNode(x=wide, shape=sizes, out=b.out(n)))


def _product(b: ProgramBuilder, x: Any, rep: Any, dim: Any, axis_of_x: int) -> Any:
    """rep * dim as an IntOrVid, computing at run time whichever factor is symbolic."""
    r, d = static_int(b.meta(rep) if isinstance(rep, torch.fx.Node) else rep), static_int(dim)
    if r is not None and d is not None:
        return b.int_or_vid(r * d)
    if d == 1:
        return b.int_or_vid(rep)
    if d is None:
        size = b.value_temp()
        b.emit(N.SymSizeNode(x=b.tensor(x), dim=axis_of_x, out=size))
        d_val = N.FloatOrVid(literal=0.0, vid=size.idx)
    else:
        d_val = b.float_or_vid(d)
    if r == 1:
        return N.IntOrVid(literal=0, vid=d_val.vid)
    out = b.value_temp()
    b.emit(N.ScalarOpNode(op=N.ScalarOp.Mul, a=b.float_or_vid(rep), b=d_val, is_int=True, out=out))
    return N.IntOrVid(literal=0, vid=out.idx)
@register(aten.roll.default)
def roll(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    x = args["self"]
    b.ir_dtype(b.dtype_of(x))
    shifts, dims = _static_ints(b, args["shifts"], "shifts"), list(args["dims"] or [])
    if len(shifts) != max(len(dims), 1):
        raise b.unsupported(f"{len(shifts)} shifts for dims {dims}")
    axes = [axis(b, d, rank_of(b, x)) for d in dims]
    # The IR holds int32 shifts: wrap larger ones by the size they rotate, when it is static.
    shape = b.shape_of(x)
    sizes = [static_int(shape[a]) for a in axes] if axes else [static_int(math.prod(shape))]
    shifts = [s % size if size else s for s, size in zip(shifts, sizes)]
    if any(abs(s) >= 2**31 for s in shifts):
        raise b.unsupported(f"shift out of int32 range: {shifts}")
    b.emit(N.RollNode(x=b.tensor(x), shifts=shifts, axes=axes, out=b.out(n)))


@register(aten.flip.default)
def flip(b: ProgramBuilder, n: torch.fx.Node) -> None:
    x, dims = n.args[0], n.args[1]
    b.ir_dtype(b.dtype_of(x))
    rank = rank_of(b, x)
    axes = sorted({axis(b, d, rank) for d in dims}) if rank > 0 else []
    if axes:
        b.emit(N.FlipNode(x=b.tensor(x), axes=axes, out=b.out(n)))
    else:
        b.emit(N.IdentityNode(x=b.tensor(x), out=b.out(n)))


def _pads(b: ProgramBuilder, x: Any, pads: Sequence[Any]) -> list[Any]:
    if len(pads) % 2 != 0 or len(pads) // 2 > rank_of(b, x):
        raise b.unsupported(f"padding {list(pads)} for a rank-{rank_of(b, x)} tensor")
    return [b.int_or_vid(p) for p in pads]


@register(aten.constant_pad_nd.default)
def constant_pad(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    x, dtype = args["self"], b.dtype_of(n)
    b.ir_dtype(dtype)
    value = exact_value(b, args["value"], dtype)
    pads = _pads(b, x, args["pad"])
    b.emit(N.PadNode(x=b.tensor(x), pads=pads, mode=P.Constant, value=value, out=b.out(n)))


def _border_pad(mode: Any, spatial: int):
    """reflection_pad{1,2,3}d / replication_pad{1,2,3}d: `spatial` trailing dims."""

    def handle(b: ProgramBuilder, n: torch.fx.Node) -> None:
        x, padding = n.args[0], n.args[1]
        b.ir_dtype(b.dtype_of(x))
        shape = b.shape_of(x)
        if len(padding) != 2 * spatial or len(shape) not in (spatial + 1, spatial + 2):
            raise b.unsupported(f"padding {list(padding)} for shape {shape}")
        for i, p in enumerate(padding):
            size, pad = static_int(shape[-1 - i // 2]), static_int(p)
            # Negative pads crop in torch; MLX's border modes cannot express that.
            if pad is not None and pad < 0:
                raise b.unsupported(f"negative padding {list(padding)}")
            if mode == P.Reflect and size is not None and pad is not None and pad >= size:
                raise b.unsupported(f"reflect padding {pad} not smaller than the size {size}")
        b.emit(N.PadNode(x=b.tensor(x), pads=_pads(b, x, padding), mode=mode, value=b.float_or_vid(0),
                         out=b.out(n)))

    return handle


BORDER_PADS = {
    aten.reflection_pad1d.default: (P.Reflect, 1), aten.reflection_pad2d.default: (P.Reflect, 2),
    aten.reflection_pad3d.default: (P.Reflect, 3), aten.replication_pad1d.default: (P.Replicate, 1),
    aten.replication_pad2d.default: (P.Replicate, 2), aten.replication_pad3d.default: (P.Replicate, 3),
}
for _target, (_mode, _spatial) in BORDER_PADS.items():
    register(_target)(_border_pad(_mode, _spatial))
