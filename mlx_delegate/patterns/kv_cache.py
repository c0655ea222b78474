"""A KV-cache write at consecutive positions along the sequence axis of a [B, H, S, D] cache:

    cache.index_copy_(2, pos + arange(L), new)     pos: a one-element integer tensor
    cache.index_copy_(2, pos, new)                 pos: a one-element 1-D integer tensor (L = 1)
    cache.index_copy_(2, arange(start, start + L), new)

(transformers' `StaticCache`, caches written the same way by hand) becomes
`mlx_delegate::kv_cache_update_at(cache, new, pos)` or `kv_cache_update(cache, new, start)`: a slice
update at an (array) offset, where `index_copy` is a scatter with an index array built every step.

The position is traced back through the copies, selects and reshapes that leave its one value as it
is (`cumulative_length.copy_(cache_position[0])` in transformers 5) to the method input it comes
from: the runtime checks a write position that is an input on the host, on every call (a write past
the cache's end is then a named error; a computed position can only be clamped).
"""

from __future__ import annotations

import math

import torch
from executorch.exir.dialects._ops import ops as exir_ops
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from .. import custom_ops
from .common import aten, dtype, erase_dead, is_op, replace, same_size, shape
from .rope import INT_DTYPES, _arange_start, _is_position_tensor, _tensor_offset

INDEX_COPY = (aten.index_copy.default,)
# Ops whose result holds the same single value as their first tensor argument (second for copy).
SAME_VALUE = {aten.select_copy.int: 0, aten.select.int: 0, aten.view_copy.default: 0, aten.view.default: 0,
              aten.squeeze_copy.dims: 0, aten.squeeze_copy.dim: 0, aten.squeeze_copy.default: 0,
              aten.unsqueeze_copy.default: 0, aten.unsqueeze.default: 0, aten.reshape.default: 0,
              aten.clone.default: 0, aten.alias_copy.default: 0, aten.copy.default: 1}


def _numel(n: torch.fx.Node) -> int | None:
    dims = shape(n)
    return math.prod(dims) if all(isinstance(d, int) for d in dims) else None


def _user_input(ep: ExportedProgram, n: torch.fx.Node) -> bool:
    return n.op == "placeholder" and any(
        s.arg.name == n.name and s.kind == InputKind.USER_INPUT for s in ep.graph_signature.input_specs)


def position_source(ep: ExportedProgram, pos: torch.fx.Node) -> torch.fx.Node:
    """The method input that holds the same single value as `pos`, else `pos` itself."""
    n = pos
    while _numel(n) == 1 and n.op == "call_function":
        i = next((v for k, v in SAME_VALUE.items() if is_op(n, k)), None)
        src = n.args[i] if i is not None and len(n.args) > i else None
        if not isinstance(src, torch.fx.Node) or _numel(src) != 1 or dtype(src) != dtype(pos):
            break
        n = src
    return n if n is not pos and _numel(n) == 1 and _user_input(ep, n) else pos


def _start(index: object, length: object) -> tuple[str, object] | None:
    """('at', pos tensor) or ('int', start) when `index` is `length` consecutive positions."""
    if not isinstance(index, torch.fx.Node) or dtype(index) not in INT_DTYPES or len(shape(index)) != 1 \
            or not same_size(shape(index)[0], length):
        return None
    offset = _tensor_offset(index)
    if offset is not None:
        return "at", offset[1]
    start = _arange_start(index)
    if start is not None:
        return "int", start
    if same_size(length, 1) and _is_position_tensor(index):
        return "at", index
    return None


def apply(ep: ExportedProgram) -> int:
    graph, count = ep.graph, 0
    for n in [n for n in graph.nodes if is_op(n, *INDEX_COPY)]:
        cache, dim, index, new = n.args[:4]
        if not isinstance(cache, torch.fx.Node) or not isinstance(new, torch.fx.Node) or len(shape(cache)) != 4 \
                or dim not in (custom_ops.SEQ_AXIS, custom_ops.SEQ_AXIS - 4) or len(shape(new)) != 4:
            continue
        found = _start(index, shape(new)[custom_ops.SEQ_AXIS])
        if found is None:
            continue
        kind, start = found
        if kind == "at":
            op, start = exir_ops.edge.mlx_delegate.kv_cache_update_at.default, position_source(ep, start)
        else:
            op = exir_ops.edge.mlx_delegate.kv_cache_update.default
        if replace(ep, n, op, (cache, new, start)):
            erase_dead(graph, [n])
            count += 1
    return count
