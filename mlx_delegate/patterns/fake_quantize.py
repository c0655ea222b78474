"""A static activation's quantize_per_tensor -> dequantize_per_tensor pair (PT2E's, between every two
layers of a converted model) fused into one `mlx_delegate::fake_quantize` node: one pass over the
activation on the CPU instead of eight element-wise ops (MLX's round alone is a libm call per element).

- Only where the pair uses one set of Python-number parameters, x and the result are float32, and the
  quantized tensor is read by such dequantizes alone. The result is the pair's to the bit: torch
  multiplies float32 x by the float32 of 1 / scale (taken in double) and the codes by the float32 of scale.
- A ReLU / ReLU6 / clamp read only by the pair becomes the node's clamp of x (`lo`, `hi`).
- A zero pad read only by the node moves after it where fake_quantize(0) is 0 (the zero point in range):
  the pad then meets the convolution after it, which takes it as padding (`fold_conv_pad`).
- A node reading a node with the same parameters is that node (re-quantizing codes gives the same codes:
  PT2E's shared-qparams ops, a pad or a pool between two pairs).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.export import ExportedProgram

from .. import custom_ops  # noqa: F401  (defines mlx_delegate::fake_quantize)
from .common import aten, dtype, erase_dead, is_op, only_user, replace

qd = torch.ops.quantized_decomposed
FAKE_QUANTIZE = torch.ops.mlx_delegate.fake_quantize.default
PARAMS = slice(1, 6)  # scale, zero_point, quant_min, quant_max, dtype
QUANT = slice(1, 6)   # fake_quantize's inv_scale, scale, zero_point, quant_min, quant_max


def _clamp(n: Any) -> tuple[Any, float, float] | None:
    """(input, lo, hi) of a ReLU, hardtanh (ReLU6) or clamp with number bounds."""
    if is_op(n, aten.relu.default):
        return n.args[0], 0.0, math.inf
    if is_op(n, aten.hardtanh.default):
        return n.args[0], float(n.args[1]) if len(n.args) > 1 else -1.0, float(n.args[2]) if len(n.args) > 2 else 1.0
    if is_op(n, aten.clamp.default):
        lo, hi = (list(n.args[1:3]) + [None, None])[:2]
        if all(v is None or isinstance(v, (int, float)) for v in (lo, hi)):
            return n.args[0], -math.inf if lo is None else float(lo), math.inf if hi is None else float(hi)
    return None


def _fuse(ep: ExportedProgram, dq: torch.fx.Node) -> bool:
    q = dq.args[0]
    if not is_op(q, qd.quantize_per_tensor.default) or dtype(q.args[0]) != torch.float32:
        return False
    if dtype(dq) != torch.float32 or tuple(dq.args[PARAMS]) != tuple(q.args[PARAMS]):
        return False
    if any(not is_op(u, qd.dequantize_per_tensor.default) or tuple(u.args[PARAMS]) != tuple(q.args[PARAMS])
           for u in q.users):
        return False
    x, lo, hi = q.args[0], -math.inf, math.inf
    if (clamped := _clamp(x)) is not None and only_user(x, q):
        x, lo, hi = clamped
    scale, zero_point, quant_min, quant_max = q.args[1:5]
    inv = float(torch.tensor(1.0 / float(scale), dtype=torch.float32))
    args = (x, inv, float(torch.tensor(float(scale), dtype=torch.float32)), int(zero_point), int(quant_min),
            int(quant_max), lo, hi)
    if not replace(ep, dq, FAKE_QUANTIZE, args):
        return False
    erase_dead(ep.graph, [dq])
    return True


def _is_output(n: torch.fx.Node) -> bool:
    """Read by the graph's output (whose specs name it: left as it is)."""
    return any(u.op == "output" for u in n.users)


def _pad_after(ep: ExportedProgram, f: torch.fx.Node) -> bool:
    """fake_quantize(pad(x, 0)) -> pad(fake_quantize(x), 0) where fake_quantize(0) is 0."""
    pad = f.args[0]
    if not is_op(pad, aten.constant_pad_nd.default) or not only_user(pad, f) or _is_output(f):
        return False
    zero_point, quant_min, quant_max, lo, hi = f.args[3:8]
    if (len(pad.args) > 2 and pad.args[2] != 0) or not quant_min <= zero_point <= quant_max or not lo <= 0 <= hi:
        return False
    graph = ep.graph
    with graph.inserting_before(f):
        inner = graph.call_function(FAKE_QUANTIZE, (pad.args[0], *f.args[1:]))
        inner.meta = {**f.meta, "val": pad.args[0].meta["val"]}
        outer = graph.call_function(pad.target, (inner, *pad.args[1:]))
        outer.meta = {**pad.meta, "val": f.meta["val"]}
    f.replace_all_uses_with(outer)
    erase_dead(graph, [f])
    return True


def _same_as_input(f: torch.fx.Node) -> bool:
    """fake_quantize(fake_quantize(x, P), P) with no clamp of its own: the inner node's result."""
    inner = f.args[0]
    if not is_op(inner, FAKE_QUANTIZE) or tuple(inner.args[QUANT]) != tuple(f.args[QUANT]) or _is_output(f):
        return False
    if (f.args[6], f.args[7]) != (-math.inf, math.inf):
        return False
    f.replace_all_uses_with(inner)
    return True


def apply(ep: ExportedProgram) -> int:
    count = sum(_fuse(ep, n) for n in list(ep.graph.nodes) if is_op(n, qd.dequantize_per_tensor.default))
    for f in [n for n in ep.graph.nodes if is_op(n, FAKE_QUANTIZE)]:
        count += _pad_after(ep, f)
    for f in [n for n in ep.graph.nodes if is_op(n, FAKE_QUANTIZE)]:
        if _same_as_input(f):
            erase_dead(ep.graph, [f])
            count += 1
    return count
