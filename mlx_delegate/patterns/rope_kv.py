"""One attention layer's RoPE and KV-cache writes as one node:

    q_rot = rope_at(q, inv_freq, pos)                 k_new = kv_cache_update_at(k_cache, rope_at(k, ...), wpos)
    v_new = kv_cache_update_at(v_cache, v, wpos)      attention(q_rot, k_new, v_new) (through views: repeat_kv)

becomes `mlx_delegate::rope_kv_write(q, k, v, k_cache, v_cache, inv_freq, pos, wpos, ...)`, whose three
results replace q_rot, k_new and v_new (`RopeKvWriteNode`: on the CPU one primitive that rotates the
rows and writes them into the caches in place, where a decode step otherwise runs two RoPE primitives
and two slice updates with their position casts and clamps per layer). When q, k and v are each a
[B, L, H, D] projection transposed for this alone, the node reads the projections (`seq_first`, through
their strides) and the three transposes go too.

It runs on the ops the `rope` (tensor positions) and `kv_cache` patterns produce, so every export that
reaches them fuses: `mlx_delegate.models`' Llama family (which calls `kv_cache_update_at` itself) and
transformers' static-cache export (`index_copy` at `cumulative_length + arange(L)`). q and k must be
rotated by one RoPE (same frequencies, position, layout) and the three must meet in one
`scaled_dot_product_attention`, so k / v of different layers, or a q of another attention, are never
paired.
"""

from __future__ import annotations

import operator

import torch
from executorch.exir.dialects._ops import ops as exir_ops
from torch.export import ExportedProgram

from .common import aten, fusable, is_op, shape

ROPE_AT = torch.ops.mlx_delegate.rope_at.default
UPDATE_AT = torch.ops.mlx_delegate.kv_cache_update_at.default
FUSED = exir_ops.edge.mlx_delegate.rope_kv_write.default
SDPA = aten.scaled_dot_product_attention.default
PERMUTES = (aten.permute.default, aten.permute_copy.default)
TRANSPOSES = (*PERMUTES, aten.transpose.int, aten.transpose_copy.int)
# Ops between a cache write (or q's RoPE) and the attention that reads it: views, and repeat_kv's
# unsqueeze + expand + reshape.
PASS_THROUGH = (aten.view.default, aten.view_copy.default, aten._unsafe_view.default, aten.reshape.default,
                aten.expand.default, aten.expand_copy.default, aten.unsqueeze.default, aten.unsqueeze_copy.default,
                aten.clone.default, aten.alias_copy.default, torch.ops.dim_order_ops._clone_dim_order.default)


def _source(n: object) -> object:
    """What `n` is a view (or a repeat) of: the first node up its chain of pass-through ops."""
    while is_op(n, *PASS_THROUGH) and n.args:
        n = n.args[0]
    return n


def _arg(n: torch.fx.Node, i: int, name: str) -> object:
    return n.args[i] if len(n.args) > i else n.kwargs.get(name)


def _match(sdpa: torch.fx.Node) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node] | None:
    """(q's rope_at, the k write, the v write) that `sdpa` reads, when they form one layer's RoPE + writes."""
    rq, uk, uv = (_source(_arg(sdpa, i, name)) for i, name in enumerate(("query", "key", "value")))
    if not (is_op(rq, ROPE_AT) and is_op(uk, UPDATE_AT) and is_op(uv, UPDATE_AT)) or uk is uv:
        return None
    rk = uk.args[1]
    if not is_op(rk, ROPE_AT) or list(rk.users) != [uk]:
        return None
    # One RoPE for q and k (frequencies, position, layout, base), one write position for k and v.
    if rq.args[1:] != rk.args[1:] or uk.args[2] is not uv.args[2]:
        return None
    return rq, uk, uv


def _untransposed(x: object, user: torch.fx.Node) -> torch.fx.Node | None:
    """y when `x` is y [B, L, H, D] with its axes 1 and 2 swapped, read only by `user`."""
    if not (is_op(x, *TRANSPOSES) and list(x.users) == [user] and len(shape(x)) == 4):
        return None
    axes = tuple(a % 4 for a in x.args[1]) if is_op(x, *PERMUTES) else tuple(sorted(a % 4 for a in x.args[1:3]))
    return x.args[0] if axes in ((0, 2, 1, 3), (1, 2)) else None


def _fuse(ep: ExportedProgram, rq: torch.fx.Node, uk: torch.fx.Node, uv: torch.fx.Node) -> bool:
    rk = uk.args[1]
    qkv = [rq.args[0], rk.args[0], uv.args[1]]
    # The projections as they come ([B, L, H, D]), when all three are transposed only for this.
    untransposed = [_untransposed(x, user) for x, user in zip(qkv, (rq, rk, uv))]
    if all(x is not None for x in untransposed) and _replace(ep, rq, uk, uv, untransposed, qkv):
        return True
    return _replace(ep, rq, uk, uv, qkv, [])


def _replace(ep: ExportedProgram, rq: torch.fx.Node, uk: torch.fx.Node, uv: torch.fx.Node,
             qkv: list[torch.fx.Node], dead: list[torch.fx.Node]) -> bool:
    """Puts the fused op on `qkv` in place of the four ops (and the transposes in `dead`, which
    makes the inputs [B, L, H, D]); False when it cannot go there or the delegate refuses it."""
    graph = ep.graph
    rk = uk.args[1]
    _, inv_freq, rope_pos, traditional, base = rq.args
    args = (*qkv, uk.args[0], uv.args[0], inv_freq, rope_pos, uk.args[2], traditional, base, bool(dead))
    order = {n: i for i, n in enumerate(graph.nodes)}
    # The fused node goes before the first reader of any of the three results; every input must exist there.
    readers = [u for r in (rq, uk, uv) for u in r.users if u.op != "output" and u is not rk]
    first = min(readers, key=order.__getitem__)
    if any(order[a] >= order[first] for a in args if isinstance(a, torch.fx.Node)):
        return False
    with graph.inserting_before(first):
        fused = graph.call_function(FUSED, args)
    fused.meta = {**uk.meta, "val": (rq.meta["val"], uk.meta["val"], uv.meta["val"])}
    if not fusable(fused):
        graph.erase_node(fused)
        return False
    for i, old in enumerate((rq, uk, uv)):
        with graph.inserting_after(fused):
            part = graph.call_function(operator.getitem, (fused, i))
        part.meta = {**old.meta}
        old.replace_all_uses_with(part)
        for spec in ep.graph_signature.output_specs:  # outputs (buffer mutations) are named after their nodes
            if getattr(spec.arg, "name", None) == old.name:
                spec.arg.name = part.name
    for old in (uk, uv, rq, rk, *dead):
        graph.erase_node(old)
    return True


def apply(ep: ExportedProgram) -> int:
    count = 0
    for sdpa in [n for n in ep.graph.nodes if is_op(n, SDPA)]:
        found = _match(sdpa)
        if found is not None and _fuse(ep, *found):
            count += 1
    return count
