"""Weight-only quantized linear and embedding, as torchao exports them:

    w = torchao.dequantize_affine(q, [1, group], scale, zero_point, int8, qmin, qmax, output_dtype)
    linear(x, w, bias)      ->  mlx_delegate::quantized_linear(x, w', scales, biases, bias, g, bits)
    embedding(w, indices)   ->  mlx_delegate::quantized_embedding(w', scales, biases, indices, g, bits)

(-> `mx::quantized_matmul`, and a gather of packed rows + `mx::dequantize`.)
q, scale and zero_point must be constants: they are repacked here into MLX's
affine format (`quantization.to_mlx`) and stored as new constants w', scales
and biases; the torchao tensors are dropped once nothing reads them. A layout
MLX's kernels cannot take (a group not a multiple of 32, more than 8 bits, a
weight that is not 2-D) is left alone; the delegate then runs the dequantize
as element-wise ops (`ops/quant.py`) and the product as a plain linear.
"""

from __future__ import annotations

from typing import Any

import torch
from executorch.backends.transforms.utils import create_constant_placeholder, delete_constant_placeholder
from executorch.exir.dialects._ops import ops as exir_ops
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from .. import quantization
from ..builder import ProgramBuilder
from ..ops.quant import _TARGET as DEQUANTIZE
from .common import aten, constant_value, dtype, is_op, replace

QUANTIZED_LINEAR = exir_ops.edge.mlx_delegate.quantized_linear.default
QUANTIZED_EMBEDDING = exir_ops.edge.mlx_delegate.quantized_embedding.default


def repack(ep: ExportedProgram, dq: torch.fx.Node) -> quantization.MLXQuantized | None:
    """The MLX form of the weight `dq` dequantizes, or None when MLX's kernels cannot take it."""
    args = ProgramBuilder(check_only=True).args(dq)
    q, scale = constant_value(ep, args["input"]), constant_value(ep, args["scale"])
    zp = constant_value(ep, args["zero_point"]) if args["zero_point"] is not None else None
    block, out_dtype = list(args["block_size"]), dtype(dq)
    if q is None or scale is None or (args["zero_point"] is not None and zp is None) or q.dim() != 2:
        return None
    if block[0] != 1 or q.is_floating_point() or out_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return None
    info = torch.iinfo(q.dtype)
    qmin = info.min if args["quant_min"] is None else int(args["quant_min"])
    qmax = info.max if args["quant_max"] is None else int(args["quant_max"])
    return quantization.to_mlx(q, scale, zp, int(block[1]), qmin, qmax, out_dtype)


def _constants(ep: ExportedProgram, dq: torch.fx.Node, packed: quantization.MLXQuantized) -> list[torch.fx.Node]:
    """Placeholders for the packed tensors (named after the source weight, so a repeat finds them)."""
    graph = ep.graph
    first_input = next((n for n, spec in zip(_placeholders(graph), ep.graph_signature.input_specs)
                        if spec.kind == InputKind.USER_INPUT), None)
    anchor = first_input or next(n for n in graph.nodes if n.op != "placeholder")
    stem = f"{dq.args[0].name}_mlx_{packed.bits}b{packed.group_size}_{str(packed.scales.dtype)[6:]}"
    nodes = []
    with graph.inserting_before(anchor):
        for part in ("w", "scales", "biases"):
            nodes.append(create_constant_placeholder(ep, graph, f"{stem}_{part}", InputKind.CONSTANT_TENSOR,
                                                     getattr(packed, part)))
    return nodes


def _placeholders(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    return [n for n in graph.nodes if n.op == "placeholder"]


def _role(user: torch.fx.Node, dq: torch.fx.Node) -> str | None:
    """'linear' / 'embedding' when `user` reads `dq` as its weight (and only there)."""
    if is_op(user, aten.linear.default) and user.args[1] is dq and user.args[0] is not dq \
            and dtype(user.args[0]) == dtype(dq):
        return "linear"
    if is_op(user, aten.embedding.default) and user.args[0] is dq and user.args[1] is not dq:
        return "embedding"
    return None


def _fused_call(role: str, user: torch.fx.Node, consts: list[torch.fx.Node],
                packed: quantization.MLXQuantized) -> tuple[Any, tuple]:
    w, scales, biases = consts
    if role == "linear":
        bias = user.args[2] if len(user.args) > 2 else None
        return QUANTIZED_LINEAR, (user.args[0], w, scales, biases, bias, packed.group_size, packed.bits)
    return QUANTIZED_EMBEDDING, (w, scales, biases, user.args[1], packed.group_size, packed.bits)


def _drop_unused(ep: ExportedProgram, nodes: list[Any]) -> None:
    """Delete constant placeholders nothing reads any more (keeping state another input still names)."""
    for n in nodes:
        if not isinstance(n, torch.fx.Node) or n.op != "placeholder" or n.users:
            continue
        specs = ep.graph_signature.input_specs
        target = next((s.target for s in specs if s.arg.name == n.name), None)
        if sum(s.target == target for s in specs) == 1:
            delete_constant_placeholder(ep, n)


def apply(ep: ExportedProgram) -> int:
    if DEQUANTIZE is None:
        return 0
    graph, count = ep.graph, 0
    for dq in [n for n in graph.nodes if is_op(n, DEQUANTIZE)]:
        roles = {u: _role(u, dq) for u in dq.users}
        packed = repack(ep, dq) if any(roles.values()) else None
        if packed is None:
            continue
        consts = _constants(ep, dq, packed)
        for user, role in roles.items():
            if role is not None and replace(ep, user, *_fused_call(role, user, consts, packed)):
                graph.erase_node(user)
                count += 1
        sources = list(dq.all_input_nodes)
        if not dq.users:
            graph.erase_node(dq)
        _drop_unused(ep, sources + consts)
    return count

