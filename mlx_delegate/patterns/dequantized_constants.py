"""Weights that PT2E quantization stores as int8 constants, read through quantized_decomposed's
dequantize_per_channel / dequantize_per_tensor, dequantized once here into float constants.

The convolution and linear kernels then lay them out once at load like any float weight (and
BatchNorm and the other fusions see a constant weight), instead of a dequantize pass over every
weight on every call. The values come from the op itself, so they are eager's bit for bit; the
program stores them in the float dtype (4x the int8 bytes). Activations keep their quantize /
dequantize pairs: they are the model's arithmetic.
"""

from __future__ import annotations

import torch
from executorch.backends.transforms.utils import create_constant_placeholder
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from ..registry import canonical
from .common import constant_anchor, constant_value, drop_unused_constants, is_op

qd = torch.ops.quantized_decomposed
TARGETS = (qd.dequantize_per_tensor.default, qd.dequantize_per_tensor.tensor, qd.dequantize_per_channel.default)


def _placeholder_value(ep: ExportedProgram, n: torch.fx.Node) -> torch.Tensor | None:
    return constant_value(ep, n) if n.op == "placeholder" else None


def apply(ep: ExportedProgram) -> int:
    graph, count = ep.graph, 0
    for dq in [n for n in graph.nodes if is_op(n, *TARGETS)]:
        sources = dq.all_input_nodes
        values = {a: _placeholder_value(ep, a) for a in sources}
        if not sources or any(v is None for v in values.values()):
            continue
        args, kwargs = torch.fx.node.map_arg((dq.args, dq.kwargs), lambda a: values[a])
        folded = canonical(dq.target)(*args, **kwargs)
        with graph.inserting_before(constant_anchor(ep)):
            const = create_constant_placeholder(ep, graph, f"{sources[0].name}_dequantized",
                                                InputKind.CONSTANT_TENSOR, folded)
        dq.replace_all_uses_with(const)
        graph.erase_node(dq)
        drop_unused_constants(ep, sources)
        count += 1
    return count
