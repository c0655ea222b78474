"""GELU and SiLU written out element-wise:

    0.5 * x * (1 + erf(x / sqrt(2)))                                   -> gelu(x)
    0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))           -> gelu(x, approximate="tanh")
    x * sigmoid(x)                                                      -> silu(x)
    x * relu6(x + 3) / 6, x * clamp(x + 3, 0, 6) / 6, ...                -> hardswish(x)
    relu6(x + 3) / 6, clamp(x / 6 + 0.5, 0, 1), ...                     -> hardsigmoid(x)

become one `aten.gelu` / `aten.silu` / `aten.hardswish` / `aten.hardsigmoid`
node (one unary op instead of 3-9, which the convolution fusions can then take
into a convolution's epilogue). The written form is not matched op by op:
starting at each erf / tanh / sigmoid / clamp / hardtanh, the element-wise
subgraph that reads only one tensor x and scalar
constants is evaluated on probe values and compared with the three functions,
so any arrangement of the factors (x * 0.5, / 2, x * x * x, ...) fuses and
anything computing something else (quick-GELU's sigmoid(1.702 x), a wrong
constant) does not. SwiGLU / GeGLU gates `act(a) * b` then need nothing more:
MLX has no fused gate primitive, and act(a) * b is two kernels either way.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from executorch.exir.dialects._ops import ops as exir_ops
from torch.export import ExportedProgram

from .common import aten, dtype, erase_dead, is_op, replace, same_shape
from .subgraph import ELEMENTWISE, closed, matches_function, region, scalar_constant

# The clamps of the hard activations (relu6 exports as hardtanh(x, 0, 6)) join the element-wise ops.
CLAMPS = (aten.clamp.default, aten.hardtanh.default)
OPS = (*ELEMENTWISE, *CLAMPS)
ANCHORS = (aten.erf.default, aten.tanh.default, aten.sigmoid.default, *CLAMPS)
MAX_CLIMB = 6  # how far above the anchor the activation's output may be
PROBE = torch.cat([torch.linspace(-8.0, 8.0, 161, dtype=torch.float64),
                   torch.tensor([-30.0, -12.5, 12.5, 30.0], dtype=torch.float64)])


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


# (reference on the probe, fused target, its kwargs)
FUNCTIONS: list[tuple[Callable[[torch.Tensor], torch.Tensor], object, dict]] = [
    (torch.nn.functional.silu, exir_ops.edge.aten.silu.default, {}),
    (lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2))), exir_ops.edge.aten.gelu.default, {}),
    (_gelu_tanh, exir_ops.edge.aten.gelu.default, {"approximate": "tanh"}),
    (torch.nn.functional.hardswish, exir_ops.edge.aten.hardswish.default, {}),
    (torch.nn.functional.hardsigmoid, exir_ops.edge.aten.hardsigmoid.default, {}),
]


def _inputs(ep: ExportedProgram, anchor: torch.fx.Node) -> list[torch.fx.Node]:
    """Candidates for x: the anchor's argument and the element-wise nodes it reads, nearest first."""
    out, frontier = [], [anchor.args[0]]
    while frontier and len(out) < 8:
        n = frontier.pop(0)
        if not isinstance(n, torch.fx.Node) or n in out or scalar_constant(ep, n) is not None:
            continue
        out.append(n)
        if is_op(n, *OPS):
            frontier.extend(n.all_input_nodes)
    return out


def _heads(anchor: torch.fx.Node) -> list[torch.fx.Node]:
    """The anchor and the chain of single users above it."""
    chain = [anchor]
    while len(chain) <= MAX_CLIMB and len(chain[-1].users) == 1:
        user = next(iter(chain[-1].users))
        if not is_op(user, *OPS):
            break
        chain.append(user)
    return chain


Found = tuple[torch.fx.Node, torch.fx.Node, object, dict]  # (x, head, fused target, its kwargs)


def match(ep: ExportedProgram, anchor: torch.fx.Node) -> Found | None:
    """(x, head, fused target, kwargs) for the activation around `anchor`, if it is one."""
    heads = _heads(anchor)
    for x in _inputs(ep, anchor):
        if not isinstance(x.meta.get("val"), torch.Tensor) or not dtype(x).is_floating_point:
            continue
        for head in heads:
            nodes = region(ep, head, x, OPS)
            if nodes is None or anchor not in nodes or not closed(nodes, head):
                continue
            if dtype(head) != dtype(x) or not same_shape(head, x):
                continue
            for fn, target, kwargs in FUNCTIONS:
                if matches_function(ep, head, x, fn, PROBE):
                    return x, head, target, kwargs
    return None


def apply(ep: ExportedProgram) -> int:
    graph, count = ep.graph, 0
    for anchor in [n for n in graph.nodes if is_op(n, *ANCHORS)]:
        if anchor._erased:
            continue  # removed with an earlier match
        found = match(ep, anchor)
        if found is None:
            continue
        x, head, target, kwargs = found
        if replace(ep, head, target, (x,), kwargs):
            erase_dead(graph, [head])
            count += 1
    return count
