"""Linears that read the same input (attention's q/k/v, an MLP's gate/up):

    q = linear(x, Wq);  k = linear(x, Wk, bk);  v = linear(x, Wv)

become `mlx_delegate::linear_group(x, [Wq, Wk, Wv], [None, bk, None])`, read
through getitem. The delegate computes it as one product over the weights
stacked on the output axis and slices the result (MLX slices are views): a
decode step then pays one matrix-vector product's fixed cost instead of three.

Only constant 2-D weights (and biases) read by nothing else are grouped: the
stacked copy is built from them when the program is written out, and the
parts themselves are then not stored. Quantized linears (`quantized_linear`,
rewritten before this runs) of one layout group the same way, into
`mlx_delegate::quantized_linear_group` over stacked packed weights, scales
and biases.
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch
from executorch.exir.dialects._ops import ops as exir_ops
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from .. import quantization  # noqa: F401  (defines the quantized ops grouped here)
from .common import aten, dtype, fusable, is_op, only_user, shape

LINEAR = aten.linear.default
GROUP = exir_ops.edge.mlx_delegate.linear_group.default
QLINEAR = torch.ops.mlx_delegate.quantized_linear.default
QGROUP = exir_ops.edge.mlx_delegate.quantized_linear_group.default
CONSTANT_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


def _constants(ep: ExportedProgram) -> set[str]:
    """Names of the placeholders holding constants (mutated buffers are not)."""
    mutated = {s.target for s in ep.graph_signature.output_specs if s.kind == OutputKind.BUFFER_MUTATION}
    return {s.arg.name for s in ep.graph_signature.input_specs
            if s.kind in CONSTANT_KINDS and s.target not in mutated}


def _is_constant(n: object, constants: set[str], user: torch.fx.Node) -> bool:
    return (isinstance(n, torch.fx.Node) and n.op == "placeholder" and n.name in constants
            and only_user(n, user))


def _group_key(n: torch.fx.Node, constants: set[str]) -> tuple | None:
    """What linears must share to be fused (input, dtype, K; for quantized ones the layout),
    or None if `n` cannot be."""
    if is_op(n, QLINEAR) and n.users:
        x, w, scales, biases, bias, group_size, bits, *mode = n.args
        if mode:  # the grouped op is affine only; other modes carry their mode arguments
            return None
        if not all(_is_constant(t, constants, n) for t in (w, scales, biases)) or \
                (bias is not None and not _is_constant(bias, constants, n)):
            return None
        return (x, "quantized", dtype(scales), shape(w)[1], group_size, bits)
    if not is_op(n, LINEAR) or not n.users:
        return None
    x, w = n.args[0], n.args[1]
    bias = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
    ws = shape(w)
    if len(ws) != 2 or not isinstance(ws[0], int) or not _is_constant(w, constants, n):
        return None
    if bias is not None and (not _is_constant(bias, constants, n) or dtype(bias) != dtype(w)):
        return None
    if dtype(x) != dtype(w) or dtype(n) != dtype(w):
        return None
    return (x, dtype(w), ws[1])


def _group_call(linears: list[torch.fx.Node]) -> tuple[object, tuple]:
    """The grouped op and its arguments for `linears` (one key of _group_key)."""
    if is_op(linears[0], QLINEAR):
        x, *_, group_size, bits = linears[0].args
        parts = [list(part) for part in zip(*(n.args[1:5] for n in linears))]  # ws, scales, biases, bias
        return QGROUP, (x, *parts, group_size, bits)
    weights = [n.args[1] for n in linears]
    biases = [n.args[2] if len(n.args) > 2 else n.kwargs.get("bias") for n in linears]
    return GROUP, (linears[0].args[0], weights, biases)


def _fuse(ep: ExportedProgram, linears: list[torch.fx.Node]) -> bool:
    graph = ep.graph
    with graph.inserting_before(linears[0]):
        group = graph.call_function(*_group_call(linears))
    group.meta = {**linears[0].meta, "val": [n.meta["val"] for n in linears]}
    if not fusable(group):
        graph.erase_node(group)
        return False
    part = group
    for i, old in enumerate(linears):
        with graph.inserting_after(part):
            part = graph.call_function(operator.getitem, (group, i))
        part.meta = {**old.meta}
        old.replace_all_uses_with(part)
        for spec in ep.graph_signature.output_specs:  # outputs are named after their nodes
            if getattr(spec.arg, "name", None) == old.name:
                spec.arg.name = part.name
        graph.erase_node(old)
    return True


def apply(ep: ExportedProgram) -> int:
    constants = _constants(ep)
    groups: dict[tuple, list[torch.fx.Node]] = defaultdict(list)
    for n in ep.graph.nodes:
        key = _group_key(n, constants)
        if key is not None:
            groups[key].append(n)
    return sum(_fuse(ep, linears) for linears in groups.values() if len(linears) > 1)
