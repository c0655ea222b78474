"""A residual connection added to a linear's result, `r + linear(x, w, b)`, as one
`mlx_delegate::linear_residual` node: the delegate's LinearNode then adds the bias and the residual
to each output block while the block is in cache (on the CPU, inside the product's own parallel
parts), instead of a broadcast add over the whole output on one core after the product.

The linear's result may reach the add through views that keep its elements in row-major order
(`nn.MultiheadAttention`'s `view(L, N, E)` and batch-first `transpose(1, 0)` at batch 1, a clone):
the residual is then viewed in the linear's shape and the fused result viewed back. Only linears
whose result nothing else reads are fused, with a residual of the add's shape and dtype (no
broadcast); grouped linears (`fuse_linears`) and linears with an activation (`fuse_linear_activation`)
are left alone.
"""

from __future__ import annotations

import torch
from executorch.exir.dialects._ops import ops as exir_ops
from torch.export import ExportedProgram

from .. import custom_ops  # noqa: F401  (defines mlx_delegate::linear_residual)
from .common import aten, dtype, erase_dead, fusable, is_op, same_shape, shape

LINEAR = aten.linear.default
FUSED = torch.ops.mlx_delegate.linear_residual.default
VIEW = exir_ops.edge.aten.view_copy.default
RESHAPES = (aten.view.default, aten.view_copy.default, aten._unsafe_view.default, aten.reshape.default,
            aten.squeeze.dim, aten.squeeze.dims, aten.squeeze_copy.dim, aten.squeeze_copy.dims,
            aten.unsqueeze.default, aten.unsqueeze_copy.default)
PERMUTES = (aten.permute.default, aten.permute_copy.default)
TRANSPOSES = (aten.transpose.int, aten.transpose_copy.int)
CLONES = (aten.clone.default, aten.alias.default, aten.alias_copy.default,
          torch.ops.dim_order_ops._clone_dim_order.default)


def _keeps_order(n: torch.fx.Node) -> bool:
    """Whether view-like node n leaves its input's elements in row-major order (a reshape in effect)."""
    if is_op(n, *RESHAPES, *CLONES):
        return True
    src = shape(n.args[0])
    if is_op(n, *PERMUTES):
        perm = [d % len(src) for d in n.args[1]]
    elif is_op(n, *TRANSPOSES):
        perm = list(range(len(src)))
        a, b = n.args[1] % len(src), n.args[2] % len(src)
        perm[a], perm[b] = perm[b], perm[a]
    else:
        return False
    # Axes of size 1 may move anywhere; the others must keep their order.
    moved = [d for d in perm if not (isinstance(src[d], int) and src[d] == 1)]
    return moved == sorted(moved)


def _linear_below(n: object) -> tuple[torch.fx.Node, list[torch.fx.Node]] | None:
    """(linear, the views between it and the add) when add operand n is a linear's only use."""
    chain: list[torch.fx.Node] = []
    while isinstance(n, torch.fx.Node) and not is_op(n, LINEAR):
        if not (len(n.users) == 1 and n.args and isinstance(n.args[0], torch.fx.Node) and _keeps_order(n)):
            return None
        if dtype(n) != dtype(n.args[0]):
            return None
        chain.append(n)
        n = n.args[0]
    if not isinstance(n, torch.fx.Node) or len(n.users) != 1:
        return None
    return n, chain


def _static(s: list) -> bool:
    return all(isinstance(d, int) for d in s)


def _fuse(ep: ExportedProgram, add: torch.fx.Node) -> bool:
    if len(add.args) != 2 or add.kwargs.get("alpha", 1) != 1:
        return False
    for i in (0, 1):
        found, r = _linear_below(add.args[i]), add.args[1 - i]
        if found is None or not isinstance(r, torch.fx.Node):
            continue
        linear, chain = found
        if not (same_shape(r, add) and same_shape(add.args[i], add) and dtype(r) == dtype(add) == dtype(linear)):
            continue
        if chain and not (_static(shape(linear)) and _static(shape(add))):
            continue  # the views put in need static shapes
        x, w, bias = (list(linear.args) + [linear.kwargs.get("bias")])[:3]
        graph = ep.graph
        added: list[torch.fx.Node] = []
        with graph.inserting_before(add):
            if chain:  # the residual in the linear's shape, the fused result back in the add's
                r = graph.call_function(VIEW, (r, shape(linear)))
                r.meta = {**add.meta, "val": add.meta["val"].reshape(shape(linear))}
                added.append(r)
            fused = graph.call_function(FUSED, (x, w, bias, r))
            fused.meta = {**linear.meta, "val": linear.meta["val"]}
            added.append(fused)
            out = fused
            if chain:
                out = graph.call_function(VIEW, (fused, shape(add)))
                out.meta = {**add.meta, "val": add.meta["val"]}
                added.append(out)
        if not fusable(fused):
            for n in reversed(added):
                graph.erase_node(n)
            return False
        add.replace_all_uses_with(out)
        for spec in ep.graph_signature.output_specs:  # outputs are named after their nodes
            if getattr(spec.arg, "name", None) == add.name:
                spec.arg.name = out.name
        erase_dead(graph, [add])
        return True
    return False


def apply(ep: ExportedProgram) -> int:
    adds = [n for n in ep.graph.nodes if is_op(n, aten.add.Tensor)]
    return sum(_fuse(ep, n) for n in adds if not n._erased)
