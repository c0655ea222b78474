"""Rotary embedding in the rotate-half form (HF Llama and friends):

    pos = arange(start, start + L)   (or pos_tensor + arange(L))
    f = pos[:, None].float() * inv_freq[None, :]      (or * inv_freq)
    emb = cat(f, f);  cos, sin = emb.cos(), emb.sin()      (cast, unsqueezed, times 1.0 ...)
    out = x * cos + cat(-x[..., D/2:], x[..., :D/2]) * sin

becomes `mlx_delegate::rope(x, inv_freq, start, traditional=False, base)`
(-> `mx::fast::rope`). Positions written `pos + arange(L)`, with pos a
one-element integer tensor (a model that keeps its position a tensor, so one
compiled graph serves every decode step), become
`mlx_delegate::rope_at(x, inv_freq, pos, False, base)`: the same kernel at an
array offset, with no host read of the position. `base` is recovered when
inv_freq is the standard base ** (-2i / D) in float32; otherwise the
frequencies are passed as they are (scaled variants such as llama3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from executorch.exir.dialects._ops import ops as exir_ops
from torch.export import ExportedProgram

from .common import (TO_COPY, UNSQUEEZES, aten, constant_value, dtype, erase_dead, is_op, replace, same_shape,
                     same_size, scalar_value, shape)

SLICES = (aten.slice.Tensor, aten.slice_copy.Tensor)
VIEWS = (*UNSQUEEZES, aten.view.default, aten.view_copy.default, *TO_COPY)
ARANGES = (aten.arange.start_step, aten.arange.start, aten.arange.default)
INT_DTYPES = (torch.int32, torch.int64)


@dataclass
class Match:
    x: torch.fx.Node
    inv_freq: torch.fx.Node
    offset: object  # int, SymInt node, or a one-element integer tensor node (rope_at)
    head: torch.fx.Node


def _last_axis(x: torch.fx.Node, axis: object) -> bool:
    return isinstance(axis, int) and axis in (-1, len(shape(x)) - 1)


def _half(n: object, x: torch.fx.Node) -> str | None:
    """'lo' / 'hi' when `n` is x[..., :D/2] / x[..., D/2:]."""
    if not is_op(n, *SLICES) or n.args[0] is not x or not _last_axis(x, n.args[1]):
        return None
    d = shape(x)[-1]
    start = n.args[2] if len(n.args) > 2 else 0
    end = n.args[3] if len(n.args) > 3 else None
    step = n.args[4] if len(n.args) > 4 else 1
    if not isinstance(d, int) or d % 2 or step != 1:
        return None
    if start == 0 and end == d // 2:
        return "lo"
    if start == d // 2 and (end is None or (isinstance(end, int) and end >= d)):
        return "hi"
    return None


def _rotate_half_of(n: object) -> torch.fx.Node | None:
    """x when `n` is cat(-x[..., D/2:], x[..., :D/2])."""
    if not is_op(n, aten.cat.default) or len(n.args[0]) != 2:
        return None
    neg, lo = n.args[0]
    if not is_op(neg, aten.neg.default) or not isinstance(lo, torch.fx.Node):
        return None
    x = lo.args[0] if lo.args else None
    if not isinstance(x, torch.fx.Node) or not _last_axis(x, n.args[1] if len(n.args) > 1 else 0):
        return None
    return x if _half(lo, x) == "lo" and _half(neg.args[0], x) == "hi" else None


def _unit_factor(ep: ExportedProgram, n: object) -> object | None:
    """t when `n` is t * 1.0 (transformers 5 scales its cos/sin tables by `attention_scaling`, 1.0 for
    the default RoPE), else None."""
    if not is_op(n, aten.mul.Tensor) or len(n.args) != 2:
        return None
    for t, c in (n.args, reversed(n.args)):
        if isinstance(t, torch.fx.Node) and scalar_value(ep, c) == 1.0 and same_shape(t, n):
            return t
    return None


def _table(ep: ExportedProgram, n: object, fn: object) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(table node as used, its `fn` (cos/sin) node), looking through casts, unsqueezes and a factor 1."""
    used = n
    while True:
        if is_op(n, *VIEWS):
            n = n.args[0]
        elif (t := _unit_factor(ep, n)) is not None:
            n = t
        else:
            break
    return (used, n) if is_op(n, fn) else None


def _arange_start(n: object) -> object | None:
    """start of `n` = arange(start, end) with step 1 (None when `n` is no such arange)."""
    if not is_op(n, *ARANGES):
        return None
    if is_op(n, aten.arange.default):
        return 0
    if is_op(n, aten.arange.start_step) and len(n.args) > 3 and n.args[3] != 1:
        return None
    return n.args[0]


def _is_position_tensor(n: object) -> bool:
    """A one-element integer tensor (the model's `input_pos`, maybe reshaped)."""
    return dtype(n) in INT_DTYPES and all(same_size(d, 1) for d in shape(n))


def _tensor_offset(n: object) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(n, pos) for `n` = pos + arange(L) with pos a one-element integer tensor."""
    if not is_op(n, aten.add.Tensor) or len(n.args) != 2 or n.kwargs.get("alpha", 1) != 1:
        return None
    for pos, ar in (n.args, reversed(n.args)):
        start = _arange_start(ar)
        if isinstance(start, int) and start == 0 and _is_position_tensor(pos) and dtype(n) in INT_DTYPES:
            return n, pos
    return None


def _positions(n: object) -> tuple[torch.fx.Node, object] | None:
    """(positions node [L], offset) for `n` = positions[:, None] (maybe cast), where positions is
    arange(start, start + L) (offset: the int or SymInt start) or pos + arange(L) (offset: the
    one-element tensor pos)."""
    while is_op(n, *UNSQUEEZES, *TO_COPY):
        n = n.args[0]
    start = _arange_start(n)
    return (n, start) if start is not None else _tensor_offset(n)


def _frequencies(ep: ExportedProgram, emb: object, length: object) -> tuple[torch.fx.Node, object] | None:
    """(inv_freq placeholder, offset) for emb = cat(f, f) with f = positions * inv_freq."""
    if not is_op(emb, aten.cat.default) or len(emb.args[0]) != 2 or emb.args[0][0] is not emb.args[0][1]:
        return None
    f = emb.args[0][0]
    if not is_op(f, aten.mul.Tensor) or dtype(f) != torch.float32:
        return None
    for p, i in ((f.args[0], f.args[1]), (f.args[1], f.args[0])):
        pos = _positions(p)
        # inv_freq[None, :] or, as a strict export folds the matmul of transformers 5, inv_freq itself
        inv = i.args[0] if is_op(i, *UNSQUEEZES) else i
        if pos is None or not isinstance(inv, torch.fx.Node) or constant_value(ep, inv) is None:
            continue
        arange, offset = pos
        # positions as a column (last axis 1) times the frequencies along the last axis: an outer product
        if (same_size(shape(arange)[0], length) and len(shape(inv)) == 1 and shape(p) and same_size(shape(p)[-1], 1)
                and same_size(shape(f)[-1], shape(inv)[0])):
            return inv, offset
    return None


def match(ep: ExportedProgram, add: torch.fx.Node) -> Match | None:
    if not is_op(add, aten.add.Tensor) or len(add.args) != 2:
        return None
    a, b = add.args
    for direct, rotated in ((a, b), (b, a)):
        if not (is_op(direct, aten.mul.Tensor) and is_op(rotated, aten.mul.Tensor)):
            continue
        for r, s in (rotated.args[:2], reversed(rotated.args[:2])):
            x = _rotate_half_of(r)
            if x is None or x not in direct.args[:2]:
                continue
            c = direct.args[1] if direct.args[0] is x else direct.args[0]
            cos, sin = _table(ep, c, aten.cos.default), _table(ep, s, aten.sin.default)
            if cos is None or sin is None or cos[1].args[0] is not sin[1].args[0]:
                continue
            xs, cs = shape(x), shape(cos[0])
            if len(cs) < 2 or len(cs) > len(xs) or not same_size(cs[-1], xs[-1]) or not all(
                    same_size(d, 1) for d in cs[:-2]) or not same_shape_tail(cs, xs):
                continue
            found = _frequencies(ep, cos[1].args[0], xs[-2])
            if found is not None and dtype(add) == dtype(x):
                return Match(x, found[0], found[1], add)
    return None


def same_shape_tail(table: list[object], x: list[object]) -> bool:
    return same_size(table[-2], x[-2]) and same_size(table[-1], x[-1])


def standard_base(inv_freq: torch.Tensor) -> float | None:
    """base when inv_freq == base ** (-2i / D) (float32, D = 2 * len), else None."""
    if inv_freq.dtype != torch.float32 or inv_freq.numel() < 2:
        return None
    dim = 2 * inv_freq.numel()
    base = float(inv_freq[1].double() ** (-dim / 2))
    if abs(base - round(base)) < 1e-4 * base:
        base = float(round(base))
    expected = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    return base if torch.allclose(expected, inv_freq, rtol=1e-6, atol=0) else None


def apply(ep: ExportedProgram, tensor_positions: bool = True) -> int:
    """Fuse every match; `tensor_positions=False` leaves the tensor-position form (`rope_at`) composed."""
    graph, count = ep.graph, 0
    for add in [n for n in graph.nodes if is_op(n, aten.add.Tensor)]:
        found = match(ep, add)
        if found is None:
            continue
        at_tensor = _is_position_tensor(found.offset)
        if at_tensor and not tensor_positions:
            continue
        base = standard_base(constant_value(ep, found.inv_freq))
        op = exir_ops.edge.mlx_delegate.rope_at if at_tensor else exir_ops.edge.mlx_delegate.rope
        if replace(ep, found.head, op.default, (found.x, found.inv_freq, found.offset, False, base)):
            erase_dead(graph, [found.head])
            count += 1
    return count
