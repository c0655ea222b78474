"""LayerNorm over the last axis as a hand-written module exports it:

    m = x.mean(-1, keepdim=True);  c = x - m
    v = c.pow(2).mean(-1, keepdim=True)       (or c * c, or x.var(-1, unbiased=False, keepdim=True))
    y = c / sqrt(v + eps)                     (or c * rsqrt(v + eps))
    out = y * weight + bias                   (weight and bias optional)

becomes `aten.layer_norm(x, [D], weight, bias, eps)` (-> LayerNormNode, i.e.
`mx::fast::layer_norm`). `x - m` may appear more than once (the graph is not
deduplicated yet); every intermediate must be read only inside the pattern.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from executorch.exir.dialects._ops import ops as exir_ops
from torch.export import ExportedProgram

from .common import aten, dtype, erase_dead, is_op, replace, same_shape, same_size, shape
from .subgraph import closed, scalar_constant

MEAN = aten.mean.dim
MUL, DIV, SUB = aten.mul.Tensor, aten.div.Tensor, aten.sub.Tensor
ADD = (aten.add.Tensor, aten.add.Scalar)


@dataclass
class Match:
    x: torch.fx.Node
    weight: torch.fx.Node | None
    bias: torch.fx.Node | None
    eps: float
    head: torch.fx.Node
    nodes: list[torch.fx.Node]


def _other(n: torch.fx.Node, known: object) -> object:
    a, b = n.args[0], n.args[1]
    return b if a is known else a if b is known else None


def _over_last_axis(n: torch.fx.Node, x: torch.fx.Node, keepdim_at: int = 2) -> bool:
    """A keepdim reduction of `x`-shaped input over its last axis only."""
    dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    keepdim = n.args[keepdim_at] if len(n.args) > keepdim_at else n.kwargs.get("keepdim", False)
    rank = len(shape(x))
    return bool(keepdim) and isinstance(dims, (list, tuple)) and list(dims) in ([-1], [rank - 1])


def _variance(centered: list[torch.fx.Node], x: torch.fx.Node) -> tuple[torch.fx.Node, list] | None:
    """(variance node, its private inputs) from mean(c ** 2) / mean(c * c) or var(x, correction=0)."""
    for c in centered:
        for sq in c.users:
            squares = (is_op(sq, aten.pow.Tensor_Scalar) and sq.args[1] == 2) or (
                is_op(sq, MUL) and sq.args[0] is c and sq.args[1] is c)
            if squares and len(sq.users) == 1:
                v = next(iter(sq.users))
                if is_op(v, MEAN) and _over_last_axis(v, x):
                    return v, [sq]
    for v in x.users:
        if is_op(v, aten.var.correction) and _over_last_axis(v, x) and v.kwargs.get("correction") in (0, 0.0):
            return v, []
        if is_op(v, aten.var.dim) and len(v.args) > 2 and v.args[2] is False and _over_last_axis(v, x, 3):
            return v, []  # var(x, dims, unbiased=False, keepdim)
    return None


def _normalized(a: torch.fx.Node, centered: list[torch.fx.Node]
                ) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(y, the rsqrt/sqrt node) for y = c * rsqrt(a) or c / sqrt(a)."""
    if len(a.users) != 1:
        return None
    r = next(iter(a.users))
    if len(r.users) != 1:
        return None
    y = next(iter(r.users))
    if is_op(r, aten.rsqrt.default) and is_op(y, MUL) and _other(y, r) in centered:
        return y, r
    if is_op(r, aten.sqrt.default) and is_op(y, DIV) and y.args[1] is r and y.args[0] in centered:
        return y, r
    return None


def _affine(y: torch.fx.Node, op: object, x: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """(output, parameter) when y's only user applies `op` with a [D] tensor of x's dtype."""
    if len(y.users) != 1:
        return None
    u = next(iter(y.users))
    if not is_op(u, *op) or len(u.args) < 2 or u.kwargs.get("alpha", 1) != 1:
        return None
    p = _other(u, y)
    ok = isinstance(p, torch.fx.Node) and dtype(p) == dtype(x) and len(shape(p)) == 1 and same_size(
        shape(p)[0], shape(x)[-1])
    return (u, p) if ok else None


def match(ep: ExportedProgram, m: torch.fx.Node) -> Match | None:
    """The LayerNorm whose mean node is `m`."""
    x = m.args[0]
    if not isinstance(x, torch.fx.Node) or dtype(x) not in (torch.float32, torch.float16, torch.bfloat16):
        return None
    if not _over_last_axis(m, x):
        return None
    centered = [u for u in m.users if is_op(u, SUB) and u.args[:2] == (x, m) and not u.kwargs]
    if not centered or len(centered) != len(m.users):
        return None
    found = _variance(centered, x)
    if found is None or len(found[0].users) != 1:
        return None
    var, private = found
    a = next(iter(var.users))
    eps = scalar_constant(ep, _other(a, var)) if is_op(a, *ADD) else None
    normalized = _normalized(a, centered) if eps is not None else None
    if normalized is None:
        return None
    y, r = normalized
    nodes, head, weight, bias = [m, *centered, *private, var, a, r, y], y, None, None
    if (scaled := _affine(head, (MUL,), x)) is not None:
        head, weight = scaled
        nodes.append(head)
    if (shifted := _affine(head, ADD, x)) is not None:
        head, bias = shifted
        nodes.append(head)
    if not closed(nodes, head) or dtype(head) != dtype(x) or not same_shape(head, x):
        return None
    return Match(x, weight, bias, eps, head, nodes)


def apply(ep: ExportedProgram) -> int:
    graph, count = ep.graph, 0
    for m in [n for n in graph.nodes if is_op(n, MEAN)]:
        if m._erased:
            continue
        found = match(ep, m)
        if found is None:
            continue
        d = shape(found.x)[-1]
        if not isinstance(d, int):
            continue  # normalized_shape must be static
        if replace(ep, found.head, exir_ops.edge.aten.layer_norm.default,
                   (found.x, [d], found.weight, found.bias, found.eps)):
            erase_dead(graph, [found.head])
            count += 1
    return count
