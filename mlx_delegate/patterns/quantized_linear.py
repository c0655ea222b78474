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

The export-friendly torchao formats ExecuTorch ships (`executorch.extension.
llm.export`: `ExportableInt4Tensor`, `ExportableNVFP4Tensor`, `ExportableMXTensor`)
are matched the same way (table `SOURCES`): `dequantize_int4_tensor` repacks
onto affine, `dequantize_nvfp4` / `dequantize_mx` (e4m3 elements) are MLX's
`nvfp4` / `mxfp8` modes bit for bit. Such a dequantize read by anything else
becomes `mlx_delegate::dequantize` (ExecuTorch has no kernel for them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from executorch.backends.transforms.utils import create_constant_placeholder
from executorch.exir.dialects._ops import ops as exir_ops
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .. import quantization
from ..builder import ProgramBuilder
from ..ops.affine import DEQUANTIZE
from ..registry import canonical
from .common import aten, constant_anchor, constant_value, drop_unused_constants, dtype, is_op, replace

QUANTIZED_LINEAR = exir_ops.edge.mlx_delegate.quantized_linear.default
QUANTIZED_EMBEDDING = exir_ops.edge.mlx_delegate.quantized_embedding.default
DEQUANTIZE_MLX = exir_ops.edge.mlx_delegate.dequantize.default
# The same ops for the ATen graph `apply_formats` rewrites (before to_edge).
_mlxd = torch.ops.mlx_delegate
ATEN_OPS = (_mlxd.quantized_linear.default, _mlxd.quantized_embedding.default, _mlxd.dequantize.default)
EDGE_OPS = (QUANTIZED_LINEAR, QUANTIZED_EMBEDDING, DEQUANTIZE_MLX)
FORMAT_LAYOUTS = ("int4: groups a multiple of 32; NVFP4: blocks of 16; MX: float8_e4m3fn elements in blocks "
                  "of 32, MLX has no e5m2")


def repack(ep: ExportedProgram, dq: torch.fx.Node) -> quantization.MLXQuantized | None:
    """The MLX form of the weight `dq` (torchao.dequantize_affine) dequantizes, or None when MLX's kernels cannot take it."""
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


def _constants_of(ep: ExportedProgram, dq: torch.fx.Node, names: tuple[str, ...]) -> list[torch.Tensor] | None:
    args = ProgramBuilder(check_only=True).args(dq)
    values = [constant_value(ep, args[name]) for name in names]
    return None if any(v is None for v in values) else values


def _repack_int4(ep: ExportedProgram, dq: torch.fx.Node) -> quantization.MLXQuantized | None:
    values = _constants_of(ep, dq, ("qdata", "scale", "zero_point"))
    out_dtype = dtype(dq)
    if values is None or out_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return None
    return quantization.int4_tensor_to_mlx(*values, int(dq.args[3]), out_dtype)


def _repack_nvfp4(ep: ExportedProgram, dq: torch.fx.Node) -> quantization.MLXQuantized | None:
    values = _constants_of(ep, dq, ("qdata", "scale", "per_tensor_scale"))
    return None if values is None else quantization.nvfp4_to_mlx(*values, int(dq.args[3]))


def _repack_mx(ep: ExportedProgram, dq: torch.fx.Node) -> quantization.MLXQuantized | None:
    values = _constants_of(ep, dq, ("qdata", "scale"))
    return None if values is None else quantization.mx_to_mlx(*values, dq.args[2], int(dq.args[3]))


def _torchao_op(name: str) -> Any:
    """torchao::<name>, or None when nothing registered it (then no graph can hold it)."""
    packet = getattr(torch.ops.torchao, name, None) if DEQUANTIZE is not None else None
    return packet.default if packet is not None else None


def sources() -> list[tuple[Any, Callable[[ExportedProgram, torch.fx.Node], quantization.MLXQuantized | None]]]:
    """(dequantize op, repack) per weight format. The Exportable* ops are registered when
    `executorch.extension.llm.export` is imported, so they are looked up at each run."""
    table = [(DEQUANTIZE, repack), (_torchao_op("dequantize_int4_tensor"), _repack_int4),
             (_torchao_op("dequantize_nvfp4"), _repack_nvfp4), (_torchao_op("dequantize_mx"), _repack_mx)]
    return [(op, fn) for op, fn in table if op is not None]


def _constants(ep: ExportedProgram, dq: torch.fx.Node, packed: quantization.MLXQuantized) -> list[torch.fx.Node]:
    """Placeholders for the packed tensors (named after the source weight, so a repeat finds them)."""
    graph = ep.graph
    anchor = constant_anchor(ep)
    stem = f"{dq.args[0].name}_mlx_{packed.mode}{packed.bits}b{packed.group_size}_{str(packed.scales.dtype)[6:]}"
    nodes = []
    with graph.inserting_before(anchor):
        for part in ("w", "scales", "biases"):
            t = getattr(packed, part)
            nodes.append(None if t is None else create_constant_placeholder(
                ep, graph, f"{stem}_{part}", InputKind.CONSTANT_TENSOR, t))
    return nodes


def _role(user: torch.fx.Node, dq: torch.fx.Node) -> str | None:
    """'linear' / 'embedding' when `user` reads `dq` as its weight (and only there)."""
    if is_op(user, aten.linear.default) and user.args[1] is dq and user.args[0] is not dq \
            and dtype(user.args[0]) == dtype(dq):
        return "linear"
    if is_op(user, aten.embedding.default) and user.args[0] is dq and user.args[1] is not dq:
        return "embedding"
    return None


def _mode_args(packed: quantization.MLXQuantized) -> tuple:
    """The trailing mode arguments: none for affine (the op's defaults, which `fuse_linears` groups)."""
    return () if packed.mode == "affine" else (packed.mode, packed.global_scale)


def _fused_call(role: str, user: torch.fx.Node, consts: list[torch.fx.Node | None],
                packed: quantization.MLXQuantized, ops: tuple = EDGE_OPS) -> tuple[Any, tuple]:
    w, scales, biases = consts
    if role == "linear":
        bias = user.args[2] if len(user.args) > 2 else None
        return ops[0], (user.args[0], w, scales, biases, bias, packed.group_size, packed.bits,
                                  *_mode_args(packed))
    extra = (*_mode_args(packed), dtype(user)) if packed.mode != "affine" else ()
    return ops[1], (w, scales, biases, user.args[1], packed.group_size, packed.bits, *extra)


def apply(ep: ExportedProgram) -> int:
    graph, count = ep.graph, 0
    for target, repack_fn in sources():
        for dq in [n for n in graph.nodes if is_op(n, target)]:
            count += _rewrite(ep, dq, target is not DEQUANTIZE, repack_fn)
    return count


def apply_formats(ep: ExportedProgram) -> ExportedProgram:
    """Before to_edge (`MLXPartitioner.transform_for_pre_decomposition`): a program holding the Exportable*
    tensor subclasses is unwrapped (run_decompositions) and their dequantizes rewritten here, since
    ExecuTorch's Edge verifier refuses uint32 / float8 operands (NVFP4's words, MX's elements)."""
    if not any(is_traceable_wrapper_subclass(v) for v in (*ep.state_dict.values(), *ep.constants.values())):
        return ep
    ep = ep.run_decompositions({})
    for target, repack_fn in sources()[1:]:  # dequantize_affine is left to the pattern pass, on the Edge graph
        for dq in [n for n in ep.graph.nodes if is_op(n, target)]:
            _rewrite(ep, dq, True, repack_fn, ATEN_OPS)
    ep.graph_module.recompile()
    return ep


def _rewrite(ep: ExportedProgram, dq: torch.fx.Node, standalone: bool,
             repack_fn: Callable[[ExportedProgram, torch.fx.Node], quantization.MLXQuantized | None],
             ops: tuple = EDGE_OPS) -> int:
    """Fuse `dq`'s linear / embedding readers; with `standalone`, any other reader gets
    `mlx_delegate::dequantize` (dequantize_affine has its own element-wise lowering)."""
    graph, count = ep.graph, 0
    roles = {u: _role(u, dq) for u in dq.users}
    packed = repack_fn(ep, dq) if standalone or any(roles.values()) else None
    if packed is None and standalone:  # ExecuTorch has no kernel for these either: say why here
        raise ValueError(f"{canonical(dq.target)} ({dq.name}): not a layout MLX takes ({FORMAT_LAYOUTS}), "
                         "or its tensors are not constants")
    if packed is None:
        return 0
    consts = _constants(ep, dq, packed)
    for user, role in roles.items():
        if role is not None and replace(ep, user, *_fused_call(role, user, consts, packed, ops)):
            graph.erase_node(user)
            count += 1
    if standalone and dq.users:
        args = (*consts, packed.group_size, packed.bits, packed.mode, packed.global_scale, dtype(dq))
        if replace(ep, dq, ops[2], args):
            count += 1
    sources_ = list(dq.all_input_nodes)
    if not dq.users:
        graph.erase_node(dq)
    drop_unused_constants(ep, sources_ + consts)
    return count
