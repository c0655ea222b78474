"""Affine quantization primitives left unfused, as element-wise MLX ops and reductions.

- torchao's: `dequantize_affine` of a weight the `quantized` pattern cannot take (a layout MLX's
  kernels do not have, or a weight read by other ops), and the dynamic activation quantization of
  `Int8DynamicActivationIntxWeightConfig` (8da4w / 8da8w): `choose_qparams_affine` +
  `quantize_affine` + `dequantize_affine` on every call's activations.
- torch's `quantized_decomposed` (PT2E's convert_pt2e): quantize / dequantize per tensor and per
  channel, and dynamic quantization's `choose_qparams.tensor`. PT2E's int8 weights are dequantized
  once at lowering (patterns/dequantized_constants.py); these handlers run the activations' pairs.

ExecuTorch's runtime has no kernels for these ops (to_executorch refuses a program that keeps them
outside a delegate), so the delegate runs them, in the reference's order of operations and dtypes so
the result matches eager bit for bit.
"""

from __future__ import annotations

import importlib.util
import math
import operator
from typing import Any

import torch

from .. import custom_ops  # noqa: F401  (defines mlx_delegate::fake_quantize)
from ..builder import ProgramBuilder
from ..ir import nodes as N
from ..registry import canonical, register
from .elementwise import binary_slots, unary

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAPPINGS = ("SYMMETRIC", "SYMMETRIC_NO_CLIPPING_ERR", "ASYMMETRIC")


class _Blocks:
    """x seen block by block, as torchao's `_get_reduction_params` sees it: a dimension that holds
    several blocks is split into (blocks, block size); `axes` are the view's axes one block spans,
    `groups` the view's shape with those axes at 1 (the per-block parameters' broadcast shape)."""

    def __init__(self, b: ProgramBuilder, x: torch.fx.Node, block_size: Any) -> None:
        shape, block = b.shape_of(x), list(block_size)
        if len(block) != len(shape) or not all(isinstance(blk, int) and blk >= 1 for blk in block):
            raise b.unsupported(f"block size {block} does not fit an input of shape {shape}")
        self.b, self.x, self.split, self.axes, self.keep_squeeze = b, x, False, [], []
        self.view: list[Any] = []  # IntOrVid-able sizes: int, or ("dim", i) for x's dynamic dimension i
        for i, (size, blk) in enumerate(zip(shape, block)):
            static = isinstance(size, int) or (isinstance(size, torch.SymInt) and size.node.is_constant())
            if blk == 1:
                self.view.append(int(size) if static else ("dim", i))
            elif not static:
                raise b.unsupported(f"block size {blk} along dynamic dimension {i} (only 1 is supported)")
            elif blk == int(size):
                self.axes.append(len(self.view))
                self.view.append(blk)
            elif int(size) % blk == 0:
                self.split = True
                self.view += [int(size) // blk, blk]
                self.axes.append(len(self.view) - 1)
                self.keep_squeeze.append(len(self.view) - 1)
            else:
                raise b.unsupported(f"block size {block} does not tile shape {shape}")
        self.groups = [1 if a in self.axes else d for a, d in enumerate(self.view)]

    def _dims(self, dims: list[Any]) -> list[Any]:
        out = []
        for d in dims:
            if isinstance(d, tuple):  # a dynamic size: read from x at run time
                size = self.b.value_temp()
                self.b.emit(N.SymSizeNode(x=self.b.tensor(self.x), dim=d[1], out=size))
                out.append(N.IntOrVid(literal=0, vid=size.idx))
            else:
                out.append(self.b.int_or_vid(d))
        return out

    def reshape(self, tid: Any, dims: list[Any]) -> Any:
        t = self.b.temp()
        self.b.emit(N.ReshapeNode(x=tid, shape=self._dims(dims), out=t))
        return t

    def viewed(self, tid: Any) -> Any:
        """x's tensor `tid` in the block view."""
        return self.reshape(tid, self.view) if self.split else tid

    def back(self, tid: Any, out: Any) -> None:
        """A result in the block view written to `out` in x's shape."""
        if self.split:
            shape = [("dim", i) if not isinstance(s, int) else int(s) for i, s in enumerate(self.b.shape_of(self.x))]
            self.b.emit(N.ReshapeNode(x=tid, shape=self._dims(shape), out=out))
        else:
            self.b.emit(N.IdentityNode(x=tid, out=out))

    def params(self, p: torch.fx.Node | None) -> Any:
        """A per-block parameter (scale, zero point) in the groups' broadcast shape; None when absent or empty."""
        if p is None:
            return None
        shape = self.b.shape_of(p)
        if all(isinstance(d, int) for d in shape) and math.prod(shape) == 0:
            return None  # torchao reads an empty zero point as none
        return self.reshape(self.b.tensor(p), self.groups)


def _clip(b: ProgramBuilder, x: Any, lo: Any, hi: Any, dtype: torch.dtype) -> Any:
    t = b.temp()
    b.emit(N.ClipNode(x=x, lo=None if lo is None else b.full(lo, dtype),
                      hi=None if hi is None else b.full(hi, dtype), out=t))
    return t


def _qrange(b: ProgramBuilder, dtype: torch.dtype, qmin: Any, qmax: Any) -> tuple[int, int]:
    """torchao's bounds for an integer target (its own defaults per dtype, sub-byte ones included)."""
    from torchao.quantization.quant_primitives import _DTYPE_TO_QVALUE_BOUNDS

    if dtype not in _DTYPE_TO_QVALUE_BOUNDS:
        raise b.unsupported(f"quantized dtype {dtype} (integer targets only)")
    lo, hi = _DTYPE_TO_QVALUE_BOUNDS[dtype]
    qmin, qmax = lo if qmin is None else int(qmin), hi if qmax is None else int(qmax)
    if not lo <= qmin <= qmax <= hi:
        raise b.unsupported(f"quant range [{qmin}, {qmax}] is outside {dtype}'s [{lo}, {hi}]")
    return qmin, qmax


def _float_input(b: ProgramBuilder, x: torch.fx.Node) -> torch.dtype:
    dtype = b.dtype_of(x)
    if dtype not in FLOAT_DTYPES:
        raise b.unsupported(f"input dtype {dtype} (float32 / float16 / bfloat16 only)")
    return dtype


def choose_qparams_affine(b: ProgramBuilder, n: torch.fx.Node) -> None:
    """Per block: min / max (with 0 in range), then scale (and zero point) for the mapping type."""
    a = b.args(n)
    x, mapping = a["input"], str(a["mapping_type"])
    dtype = _float_input(b, x)
    if mapping not in MAPPINGS:
        raise b.unsupported(f"mapping type {mapping!r} (one of {', '.join(MAPPINGS)})")
    qmin, qmax = _qrange(b, a["target_dtype"], a["quant_min"], a["quant_max"])
    eps = torch.finfo(dtype).smallest_normal if a["eps"] is None else float(a["eps"])
    scale_meta, zp_meta = b.meta(n)
    blocks = _Blocks(b, x, a["block_size"])
    src = blocks.viewed(b.tensor(x))
    lo = hi = src  # blocks of one element: each is its own min and max
    if blocks.axes:
        lo, hi = b.temp(), b.temp()
        for op, out in ((N.ReduceOp.Min, lo), (N.ReduceOp.Max, hi)):
            b.emit(N.ReduceNode(op=op, x=src, axes=blocks.axes, keepdims=True, out=out))
    zero = b.full(0, dtype)
    neg, pos = binary_slots(b, N.BinaryOp.Minimum, lo, zero), binary_slots(b, N.BinaryOp.Maximum, hi, zero)
    if mapping == "ASYMMETRIC":
        spread = binary_slots(b, N.BinaryOp.Sub, pos, neg)
        scale = binary_slots(b, N.BinaryOp.Div, spread, b.full(float(qmax - qmin), dtype))
        scale = _clip(b, scale, eps, None, dtype)
        shift = unary(b, N.UnaryOp.Round, binary_slots(b, N.BinaryOp.Div, neg, scale))
        zp = _clip(b, binary_slots(b, N.BinaryOp.Sub, b.full(qmin, dtype), shift), qmin, qmax, dtype)
    else:
        if mapping == "SYMMETRIC":
            top = binary_slots(b, N.BinaryOp.Maximum, unary(b, N.UnaryOp.Neg, neg), pos)
            scale = binary_slots(b, N.BinaryOp.Div, top, b.full(float(qmax - qmin) / 2, dtype))
        else:  # the larger of the scales that map the minimum to qmin and the maximum to qmax
            smin = binary_slots(b, N.BinaryOp.Div, neg, b.full(float(qmin), dtype))
            smax = binary_slots(b, N.BinaryOp.Div, pos, b.full(float(qmax), dtype))
            scale = b.temp()
            b.emit(N.WhereNode(cond=binary_slots(b, N.BinaryOp.Greater, smin, smax), a=smin, b=smax, out=scale))
        zp = b.temp()
        b.emit(N.FullLikeNode(x=scale, value=b.float_or_vid(int((qmax + qmin + 1) / 2)), dtype=b.ir_dtype(dtype),
                              out=zp))
        scale = _clip(b, scale, eps, None, dtype)
    # keepdim: one value per block in x's rank; otherwise the reduced axes dropped (torchao's amin / amax).
    drop = blocks.keep_squeeze if bool(a["keepdim"]) else blocks.axes
    outs = b.outs(n, 2)
    for value, meta, out in ((scale, scale_meta, outs[0]), (zp, zp_meta, outs[1])):
        b.ir_dtype(meta.dtype)
        value = b.cast(value, dtype, meta.dtype)
        if drop:
            b.emit(N.SqueezeNode(x=value, axes=drop, out=out))
        else:
            b.emit(N.IdentityNode(x=value, out=out))


def quantize_affine(b: ProgramBuilder, n: torch.fx.Node) -> None:
    """clamp(round(x * (1 / scale)) + zero_point, qmin, qmax), cast to the quantized dtype."""
    a = b.args(n)
    x = a["input"]
    dtype = _float_input(b, x)
    qmin, qmax = _qrange(b, a["output_dtype"], a["quant_min"], a["quant_max"])
    blocks = _Blocks(b, x, a["block_size"])
    scale = blocks.params(a["scale"])
    compute = torch.promote_types(dtype, b.dtype_of(a["scale"]))
    inv = unary(b, N.UnaryOp.Reciprocal, scale)
    y = binary_slots(b, N.BinaryOp.Mul, b.cast(blocks.viewed(b.tensor(x)), dtype, compute),
                b.cast(inv, b.dtype_of(a["scale"]), compute))
    y = unary(b, N.UnaryOp.Round, y)
    zp = blocks.params(a["zero_point"])
    if zp is not None:
        y = binary_slots(b, N.BinaryOp.Add, y, b.cast(zp, b.dtype_of(a["zero_point"]), compute))
    y = b.cast(_clip(b, y, qmin, qmax, compute), compute, b.dtype_of(n))
    blocks.back(y, b.out(n))


def dequantize_affine(b: ProgramBuilder, n: torch.fx.Node) -> None:
    """(q - zero_point) * scale per block, in torchao's order and dtypes."""
    a = b.args(n)
    x, scale = a["input"], a["scale"]
    out_dtype = b.dtype_of(n)
    if out_dtype not in FLOAT_DTYPES:
        raise b.unsupported(f"output dtype {out_dtype}")
    blocks = _Blocks(b, x, a["block_size"])
    # torchao: x.to(out) - zp.to(out), times scale (promoting), then .to(out).
    y = b.cast(blocks.viewed(b.tensor(x)), b.dtype_of(x), out_dtype)
    zp = blocks.params(a["zero_point"])
    if zp is not None:
        y = binary_slots(b, N.BinaryOp.Sub, y, b.cast(zp, b.dtype_of(a["zero_point"]), out_dtype))
    compute = torch.promote_types(out_dtype, b.dtype_of(scale))
    s = b.cast(blocks.params(scale), b.dtype_of(scale), compute)
    y = b.cast(binary_slots(b, N.BinaryOp.Mul, b.cast(y, out_dtype, compute), s), compute, out_dtype)
    blocks.back(y, b.out(n))


# ------------------------------------------- torch's quantized_decomposed (PT2E: prepare_pt2e / convert_pt2e)
QD_FLOAT = torch.float32  # these ops quantize from, and by default dequantize to, float32


def _along(b: ProgramBuilder, p: Any, ndim: int, axis: int | None) -> Any:
    """Per-tensor parameter `p` (a slot) as is, or a per-channel one shaped to broadcast along `axis`."""
    if axis is None:
        return p
    t = b.temp()
    b.emit(N.ReshapeNode(x=p, shape=[b.int_or_vid(-1 if i == axis else 1) for i in range(ndim)], out=t))
    return t


def _qd_params(b: ProgramBuilder, a: dict[str, Any], x: torch.fx.Node) -> tuple[Any, Any, int | None]:
    """(scale slot in float32, zero point slot in float32 or None, channel axis or None) of a q / dq node:
    Python numbers (`.default`), one-element tensors (`.tensor`) or one per channel (per_channel)."""
    ndim = len(b.shape_of(x))
    axis = a.get("axis")
    if axis is not None:
        axis = int(axis) % ndim
    scale, zp = a.get("scale", a.get("scales")), a.get("zero_point", a.get("zero_points"))
    if _chosen_scale(scale):  # float64 in name only: its slot holds the float32 it was computed in
        s = b.tensor(scale, held_as=QD_FLOAT)
    elif isinstance(scale, torch.fx.Node) and b.dtype_of(scale) == torch.float64:
        raise b.unsupported(f"{scale.name} is float64 (refused everywhere: Metal has none)")
    else:
        s = _along(b, b.operand(scale, QD_FLOAT), ndim, axis)
    z = None if zp is None else _along(b, b.operand(zp, QD_FLOAT), ndim, axis)
    return s, z, axis


def _qd_range(b: ProgramBuilder, a: dict[str, Any]) -> tuple[int, int]:
    qmin, qmax = a["quant_min"], a["quant_max"]
    if not isinstance(qmin, int) or not isinstance(qmax, int):
        raise b.unsupported("quant_min / quant_max must be Python ints (tensor bounds: .tensor2)")
    return qmin, qmax


def qd_quantize(b: ProgramBuilder, n: torch.fx.Node) -> None:
    """clamp(round(x * (1 / scale)) + zero_point, qmin, qmax) in float32, cast to the quantized dtype.

    A Python scale's reciprocal is taken in double and used as float32, as torch does; a float32 scale's
    float32 reciprocal is the same number (double rounding of a quotient is innocuous at 53 / 24 bits)."""
    a = b.args(n)
    x = a["input"]
    qmin, qmax = _qd_range(b, a)
    src = b.cast(b.tensor(x), _float_input(b, x), QD_FLOAT)
    scale, zp, _ = _qd_params(b, a, x)
    if isinstance(a.get("scale"), (int, float)):
        inv = b.full(1.0 / float(a["scale"]), QD_FLOAT)
    else:
        inv = unary(b, N.UnaryOp.Reciprocal, scale)
    y = unary(b, N.UnaryOp.Round, binary_slots(b, N.BinaryOp.Mul, src, inv))
    if zp is not None:
        y = binary_slots(b, N.BinaryOp.Add, y, zp)
    b.emit(N.AsTypeNode(x=_clip(b, y, qmin, qmax, QD_FLOAT), dtype=b.ir_dtype(b.dtype_of(n)), out=b.out(n)))


def qd_dequantize(b: ProgramBuilder, n: torch.fx.Node) -> None:
    """(q - zero_point) * scale in float32 (the difference is exact there), cast to out_dtype."""
    a = b.args(n)
    x = a["input"]
    scale, zp, _ = _qd_params(b, a, x)
    y = b.cast(b.tensor(x), b.dtype_of(x), QD_FLOAT)
    if zp is not None:
        y = binary_slots(b, N.BinaryOp.Sub, y, zp)
    y = binary_slots(b, N.BinaryOp.Mul, y, scale)
    b.emit(N.AsTypeNode(x=y, dtype=b.ir_dtype(b.dtype_of(n)), out=b.out(n)))


def _chosen_scale(p: Any) -> bool:
    """Whether `p` is choose_qparams.tensor's scale: float64 by its schema, a float32 value by its making."""
    return isinstance(p, torch.fx.Node) and p.target is operator.getitem and p.args[1] == 0 \
        and canonical(p.args[0].target) is qd.choose_qparams.tensor


def qd_choose_qparams(b: ProgramBuilder, n: torch.fx.Node) -> None:
    """Per-tensor affine qparams of dynamic quantization (torch's determine_qparams): the scale
    (max(x, 0) - min(x, 0)) / (qmax - qmin), at least eps, and zero point qmin - round(min(x, 0) / scale).

    torch computes the scale in float32 and returns it as float64; here its slot keeps the float32 (the
    same number: the quantize / dequantize reading it use it as float32), so the scale may only feed them."""
    a = b.args(n)
    x = a["input"]
    dtype = _float_input(b, x)
    qmin, qmax = _qd_range(b, a)
    for get in n.users:
        readers = [u for u in get.users] if get.target is operator.getitem and get.args[1] == 0 else []
        if any(canonical(u.target) not in (qd.quantize_per_tensor.tensor, qd.dequantize_per_tensor.tensor)
               for u in readers):
            raise b.unsupported("its float64 scale feeds other ops than quantize / dequantize_per_tensor")
    lo, hi = b.temp(), b.temp()
    axes = list(range(len(b.shape_of(x))))
    for op, out in ((N.ReduceOp.Min, lo), (N.ReduceOp.Max, hi)):
        b.emit(N.ReduceNode(op=op, x=b.tensor(x), axes=axes, keepdims=False, out=out))
    zero = b.full(0, dtype)
    neg, pos = binary_slots(b, N.BinaryOp.Minimum, lo, zero), binary_slots(b, N.BinaryOp.Maximum, hi, zero)
    scale = binary_slots(b, N.BinaryOp.Div, binary_slots(b, N.BinaryOp.Sub, pos, neg),
                         b.full(float(qmax - qmin), dtype))
    # torch.max with eps as a float32 tensor: a half-type scale is promoted to float32 here.
    scale = binary_slots(b, N.BinaryOp.Maximum, b.cast(scale, dtype, QD_FLOAT), b.full(float(a["eps"]), QD_FLOAT))
    shift = unary(b, N.UnaryOp.Round, binary_slots(b, N.BinaryOp.Div, b.cast(neg, dtype, QD_FLOAT), scale))
    zp = _clip(b, binary_slots(b, N.BinaryOp.Sub, b.full(qmin, QD_FLOAT), shift), qmin, qmax, QD_FLOAT)
    scale_out, zp_out = b.outs(n, 2)
    b.emit(N.ReshapeNode(x=scale, shape=[b.int_or_vid(1)], out=scale_out))
    b.emit(N.ReshapeNode(x=b.cast(zp, QD_FLOAT, torch.int64), shape=[b.int_or_vid(1)], out=zp_out))


@register(torch.ops.mlx_delegate.fake_quantize.default)
def fake_quantize(b: ProgramBuilder, n: torch.fx.Node) -> None:
    """A fused static quantize_per_tensor -> dequantize_per_tensor pair (patterns/fake_quantize.py)."""
    a = b.args(n)
    if b.dtype_of(a["x"]) != torch.float32:
        raise b.unsupported(f"input dtype {b.dtype_of(a['x'])} (float32 only)")
    b.emit(N.FakeQuantizeNode(x=b.tensor(a["x"]), inv_scale=float(a["inv_scale"]), scale=float(a["scale"]),
                              zero_point=float(a["zero_point"]), quant_min=float(a["quant_min"]),
                              quant_max=float(a["quant_max"]), lo=float(a["lo"]), hi=float(a["hi"]),
                              out=b.out(n)))


def _torchao_op(name: str) -> Any:
    """torchao's op, or None when torchao is not installed (no graph can hold it then)."""
    if importlib.util.find_spec("torchao") is None:
        return None
    import torchao.quantization.quant_primitives  # noqa: F401  (defines the ops)

    return getattr(torch.ops.torchao, name).default


DEQUANTIZE = _torchao_op("dequantize_affine")
for _name, _handler in (("choose_qparams_affine", choose_qparams_affine), ("quantize_affine", quantize_affine),
                        ("dequantize_affine", dequantize_affine)):
    if (_op := _torchao_op(_name)) is not None:
        register(_op)(_handler)

import torch.ao.quantization.fx._decomposed  # noqa: E402,F401  (defines torch.ops.quantized_decomposed)

qd = torch.ops.quantized_decomposed
register(qd.quantize_per_tensor.default, qd.quantize_per_tensor.tensor, qd.quantize_per_channel.default)(qd_quantize)
register(qd.dequantize_per_tensor.default, qd.dequantize_per_tensor.tensor,
         qd.dequantize_per_channel.default)(qd_dequantize)
register(qd.choose_qparams.tensor)(qd_choose_qparams)
