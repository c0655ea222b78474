"""RMSNorm as torch code writes it (HF's LlamaRMSNorm and friends):

    h = x.float();  h = h * rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)

becomes `mlx_delegate::rms_norm(x, weight, eps)` (-> `mx::fast::rms_norm`).
The upcast, the downcast and the weight are optional; `h * h` may stand for
`h.pow(2)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from executorch.exir.dialects._ops import ops as exir_ops
from torch.export import ExportedProgram

from .common import (TO_COPY, aten, dtype, erase_dead, is_op, only_user, replace, same_shape, scalar_value,
                     shape)

MUL, ADD = aten.mul.Tensor, (aten.add.Tensor, aten.add.Scalar)


@dataclass
class Match:
    x: torch.fx.Node
    weight: torch.fx.Node | None
    eps: float
    head: torch.fx.Node  # the node the fused op replaces


def _other(n: torch.fx.Node, known: torch.fx.Node) -> object:
    """The operand of binary node `n` that is not `known` (None if neither is)."""
    a, b = n.args[0], n.args[1]
    return b if a is known else a if b is known else None


def _square_of(p: object) -> torch.fx.Node | None:
    if is_op(p, aten.pow.Tensor_Scalar) and p.args[1] == 2:
        return p.args[0]
    if is_op(p, MUL) and p.args[0] is p.args[1]:
        return p.args[0]
    return None


def _centered(x: torch.fx.Node) -> bool:
    """x = a - mean(a, -1, keepdim)."""
    m = x.args[1] if is_op(x, aten.sub.Tensor) and len(x.args) > 1 else None
    return is_op(m, aten.mean.dim) and m.args[0] is x.args[0]


def match(ep: ExportedProgram, r: torch.fx.Node) -> Match | None:
    """Match the RMSNorm around rsqrt node `r`."""
    if not is_op(r, aten.rsqrt.default) or len(r.users) != 1:
        return None
    a = r.args[0]
    if not is_op(a, *ADD) or not only_user(a, r):
        return None
    m = next((o for o in a.args[:2] if is_op(o, aten.mean.dim)), None)
    eps = scalar_value(ep, _other(a, m)) if m is not None else None
    if m is None or eps is None or not only_user(m, a):
        return None
    h = _square_of(m.args[0])
    rank = len(shape(h)) if h is not None else 0
    keepdim = len(m.args) > 2 and m.args[2]
    if h is None or not only_user(m.args[0], m) or not keepdim or list(m.args[1]) not in ([-1], [rank - 1]):
        return None
    y = next(iter(r.users))
    if not is_op(y, MUL) or _other(y, r) is not h:
        return None
    x = h.args[0] if is_op(h, *TO_COPY) and dtype(h) == torch.float32 else h
    if _centered(x):
        return None  # (x - mean(x)) normalised is a LayerNorm: fuse_layer_norm takes it whole
    head = y
    if len(head.users) == 1 and is_op(next(iter(head.users)), *TO_COPY):
        head = next(iter(head.users))
    weight = None
    if len(head.users) == 1 and is_op(next(iter(head.users)), MUL):
        w = _other(next(iter(head.users)), head)
        if isinstance(w, torch.fx.Node) and dtype(w) == dtype(x) and len(shape(w)) == 1:
            weight, head = w, next(iter(head.users))
    if dtype(head) != dtype(x) or not same_shape(head, x):
        return None  # the fused op returns x's dtype
    return Match(x, weight, eps, head)


def apply(ep: ExportedProgram) -> int:
    graph, count = ep.graph, 0
    for r in [n for n in graph.nodes if is_op(n, aten.rsqrt.default)]:
        found = match(ep, r)
        if found is None:
            continue
        if replace(ep, found.head, exir_ops.edge.mlx_delegate.rms_norm.default,
                   (found.x, found.weight, found.eps)):
            erase_dead(graph, [found.head])
            count += 1
    return count
