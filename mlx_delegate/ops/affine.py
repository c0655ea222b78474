"""torchao's affine quantization primitives left unfused, as element-wise MLX ops.

`dequantize_affine` of a weight the `quantized` pattern cannot take (a layout MLX's kernels do not
have, or a weight read by other ops), and the dynamic activation quantization of torchao's
`Int8DynamicActivationIntxWeightConfig` (8da4w / 8da8w): `choose_qparams_affine` + `quantize_affine`
+ `dequantize_affine` on every call's activations. ExecuTorch's runtime has no kernels for these ops
(to_executorch refuses a program that keeps them outside a delegate), so the delegate runs them, in
torchao's order of operations and dtypes so the result matches eager bit for bit.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import torch

from ..builder import ProgramBuilder
from ..ir import nodes as N
from ..registry import register
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
        scale = binary_slots(b, N.BinaryOp.Div, binary_slots(b, N.BinaryOp.Sub, pos, neg), b.full(float(qmax - qmin), dtype))
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
