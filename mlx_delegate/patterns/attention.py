"""Attention written out (nanoGPT, HF "eager" attention, Whisper-style encoders):

    s = (q @ k.transpose(-2, -1)) * scale          (or / sqrt(d); q may be scaled instead)
    s = s + mask                                   (additive float mask), or
    s = s.masked_fill(not_keep, -inf)              (boolean mask), or
    s = where(keep, s, -1e9)
    out = softmax(s, -1) @ v                       (softmax may run in float32 and cast back)

becomes `aten.scaled_dot_product_attention` (-> SdpaNode, `mx::fast` SDPA).
k / v repeated for grouped-query attention (unsqueeze, expand, reshape, as
`repeat_kv` and `repeat_interleave` export) are used unrepeated with
enable_gqa. A boolean mask that is a constant lower triangle becomes
is_causal. Filled values must be -inf or at most -1e9, so only rows in which
every key is masked differ (the fused op gives zeros there).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from executorch.exir.dialects._ops import ops as exir_ops
from torch.export import ExportedProgram

from .common import TO_COPY, UNSQUEEZES, aten, dtype, erase_dead, is_op, replace, shape
from .subgraph import closed, evaluate, scalar_constant

MATMUL = aten.matmul.default
SOFTMAX = (aten.softmax.int, aten._softmax.default)
TRANSPOSES = (aten.permute.default, aten.permute_copy.default, aten.transpose.int, aten.transpose_copy.int)
VIEWS = (aten.view.default, aten.view_copy.default, aten._unsafe_view.default)
EXPANDS = (aten.expand.default, aten.expand_copy.default)
CLONES = (aten.clone.default, torch.ops.dim_order_ops._clone_dim_order.default)
MASK_FILL = -1e9  # filled scores at or below this are "masked out"


@dataclass
class Match:
    q: torch.fx.Node
    k: torch.fx.Node
    v: torch.fx.Node
    head: torch.fx.Node
    scale: float = 1.0
    mask: torch.fx.Node | None = None
    invert_mask: bool = False  # masked_fill names what to drop; SDPA's boolean mask what to keep
    gqa: bool = False
    nodes: list[torch.fx.Node] = field(default_factory=list)


def _single_user(n: object) -> bool:
    return isinstance(n, torch.fx.Node) and len(n.users) == 1


def _through(n: object, ops: tuple, nodes: list) -> object:
    """Step down through single-user `ops` nodes, recording them."""
    while is_op(n, *ops) and _single_user(n):
        nodes.append(n)
        n = n.args[0]
    return n


def _last_axis(n: torch.fx.Node, axis: object) -> bool:
    return isinstance(axis, int) and axis in (-1, len(shape(n)) - 1)


def _swaps_last_two(t: torch.fx.Node) -> bool:
    rank = len(shape(t.args[0]))
    if is_op(t, aten.permute.default, aten.permute_copy.default):
        return list(t.args[1]) == [*range(rank - 2), rank - 1, rank - 2]
    return {a % rank for a in t.args[1:3]} == {rank - 2, rank - 1}


def _unrepeated(x: object, nodes: list) -> tuple[object, bool]:
    """(k, True) for k repeated per query group: view(clone?(expand(unsqueeze(k, 2)))), else (x, False)."""
    view = x
    if not is_op(view, *VIEWS) or not _single_user(view):
        return x, False
    expand = view.args[0]
    clone = expand if is_op(expand, *CLONES) and _single_user(expand) else None
    expand = expand.args[0] if clone is not None else expand
    if not is_op(expand, *EXPANDS) or not _single_user(expand):
        return x, False
    unsq = expand.args[0]
    if not is_op(unsq, *UNSQUEEZES) or not _single_user(unsq) or unsq.args[1] not in (2, -3):
        return x, False
    base, out = unsq.args[0], shape(view)
    bs, es = shape(base), shape(expand)
    if len(bs) != 4 or len(es) != 5 or len(out) != 4:
        return x, False
    b, h, s, d = bs
    if not (isinstance(h, int) and isinstance(es[2], int) and out[1] == h * es[2] and
            [out[0], out[2], out[3]] == [b, s, d]):
        return x, False
    nodes.extend(n for n in (view, clone, expand, unsq) if n is not None)
    return base, True


def _scale_of(ep: ExportedProgram, n: object, nodes: list) -> tuple[object, float]:
    """(n without a scalar mul/div, the factor)."""
    if is_op(n, aten.mul.Tensor, aten.div.Tensor):  # other readers are refused later (`closed`)
        for i in ((0, 1) if is_op(n, aten.mul.Tensor) else (0,)):
            c = scalar_constant(ep, n.args[1 - i])
            if c is not None and c != 0 and isinstance(n.args[i], torch.fx.Node):
                nodes.append(n)
                return n.args[i], c if is_op(n, aten.mul.Tensor) else 1.0 / c
    return n, 1.0


def _fill_value(ep: ExportedProgram, a: object) -> float | None:
    if is_op(a, aten.full_like.default, aten.full.default):
        a = a.args[1]
    return scalar_constant(ep, a)


def _masked(ep: ExportedProgram, s: torch.fx.Node, nodes: list) -> tuple[object, object, bool]:
    """(scores before masking, mask, mask names dropped positions) for the three mask forms."""
    if not _single_user(s):
        return s, None, False
    if is_op(s, aten.add.Tensor) and len(s.args) == 2 and not s.kwargs:
        for i in (0, 1):  # the scores are the operand that is (a scaled) q @ k^T
            scores, mask = s.args[i], s.args[1 - i]
            if is_op(_scale_of(ep, scores, [])[0], MATMUL) and isinstance(mask, torch.fx.Node):
                nodes.append(s)
                return scores, mask, False
    if is_op(s, aten.masked_fill.Scalar):
        fill = s.args[2]
        if isinstance(fill, (int, float)) and fill <= MASK_FILL:
            nodes.append(s)
            return s.args[0], s.args[1], True
    if is_op(s, aten.where.self):
        cond, a, b = s.args
        fill = _fill_value(ep, b)
        if fill is not None and fill <= MASK_FILL and dtype(cond) == torch.bool:
            nodes.append(s)
            if is_op(b, aten.full_like.default) and b.args[0] is a and len(b.users) == 1:
                nodes.append(b)
            return a, cond, False
    return s, None, False


def _broadcasts(mask: torch.fx.Node, scores: torch.fx.Node) -> bool:
    m, s = shape(mask), shape(scores)
    return len(m) <= len(s) and all(a == 1 or a == b for a, b in zip(reversed(m), reversed(s)))


def match(ep: ExportedProgram, pv: torch.fx.Node) -> Match | None:
    """The attention ending in `pv` = softmax(...) @ v."""
    if not is_op(pv, MATMUL) or len(pv.args) != 2:
        return None
    nodes: list[torch.fx.Node] = []
    probs = _through(pv.args[0], TO_COPY, nodes)
    if not is_op(probs, *SOFTMAX) or not _single_user(probs) or not _last_axis(probs, probs.args[1]):
        return None
    if is_op(probs, aten._softmax.default) and probs.args[2]:
        return None  # half_to_float changes the output dtype
    nodes.append(probs)
    s = _through(probs.args[0], TO_COPY, nodes)
    s, mask, invert = _masked(ep, s, nodes)
    s, scale = _scale_of(ep, s, nodes)
    if not is_op(s, MATMUL):
        return None
    nodes.append(s)
    q, kt = s.args
    if not is_op(kt, *TRANSPOSES) or not _single_user(kt) or not _swaps_last_two(kt):
        return None
    nodes.append(kt)
    q, q_scale = _scale_of(ep, q, nodes)
    k, k_gqa = _unrepeated(kt.args[0], nodes)
    v, v_gqa = _unrepeated(pv.args[1], nodes)
    if k_gqa != v_gqa or any(len(shape(t)) != 4 for t in (q, k, v)):
        return None
    if len({dtype(q), dtype(k), dtype(v), dtype(pv)}) != 1:
        return None
    if mask is not None and not _broadcasts(mask, s):
        return None
    if not closed(nodes, pv):
        return None
    return Match(q, k, v, pv, scale * q_scale, mask, invert, k_gqa, nodes)


def _is_causal(ep: ExportedProgram, m: Match, scores_shape: list) -> bool:
    """Whether the (keep-)mask is a constant lower triangle over [L, S] (torch's is_causal)."""
    if m.mask is None or dtype(m.mask) != torch.bool or len(scores_shape) != 4:
        return False
    length, keys = scores_shape[-2:]
    if not (isinstance(length, int) and isinstance(keys, int)):
        return False
    value = evaluate(ep, m.mask, {})
    if value is None:
        return False
    keep = ~value if m.invert_mask else value
    tril = torch.ones(length, keys, dtype=torch.bool).tril()
    return bool((keep.broadcast_to(scores_shape) == tril).all())


def apply(ep: ExportedProgram) -> int:
    graph, count = ep.graph, 0
    for pv in [n for n in graph.nodes if is_op(n, MATMUL)]:
        if pv._erased:
            continue
        m = match(ep, pv)
        if m is None:
            continue
        scores = next(n for n in reversed(m.nodes) if is_op(n, MATMUL))
        mask, causal = m.mask, _is_causal(ep, m, shape(scores))
        if causal:
            mask = None
        elif mask is not None and m.invert_mask:
            with graph.inserting_before(pv):
                mask = graph.call_function(exir_ops.edge.aten.logical_not.default, (mask,))
            mask.meta["val"] = torch.logical_not(m.mask.meta["val"])
        kwargs = {"scale": m.scale, "enable_gqa": m.gqa}
        if replace(ep, pv, exir_ops.edge.aten.scaled_dot_product_attention.default,
                   (m.q, m.k, m.v, mask, 0.0, causal), kwargs):
            erase_dead(graph, [pv])
            count += 1
        elif mask is not m.mask and mask is not None:
            graph.erase_node(mask)
    return count
