"""Weight-only quantization: the fused `mlx_delegate::quantized_linear` /
`quantized_embedding` ops (emitted by the `quantized_linear` pattern, weights
already in MLX's affine format) map to `mx::quantized_matmul` and a gather of
packed rows + `mx::dequantize`. torchao's own ops left unfused are in `affine.py`.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import quantization as q
from ..builder import ProgramBuilder
from ..ir import nodes as N
from ..registry import register
from .elementwise import binary_slots
from .indexing import index_tensor
from .linalg import split_last_axis

mlxd = torch.ops.mlx_delegate
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _static(b: ProgramBuilder, dims: list[Any], what: str) -> list[int]:
    if not all(isinstance(d, int) for d in dims):
        raise b.unsupported(f"{what} must have a static shape, got {dims}")
    return [int(d) for d in dims]


QUANT_MODES = {"affine": N.QuantMode.Affine, "mxfp4": N.QuantMode.Mxfp4, "nvfp4": N.QuantMode.Nvfp4,
               "mxfp8": N.QuantMode.Mxfp8}


def _packed(b: ProgramBuilder, w: Any, scales: Any, biases: Any, group_size: int, bits: int,
            dtype: torch.dtype, mode: str = "affine") -> int:
    """Validate a packed weight and its scales / biases; returns the unpacked row length K.
    `dtype` is the activations' float dtype. Affine scales / biases share one float dtype of their own
    (GGUF's fp16 d / m stay fp16 under fp32 activations: the runtime reads or widens them)."""
    if mode not in QUANT_MODES:
        raise b.unsupported(f"quantization mode {mode!r} is not one of {', '.join(QUANT_MODES)}")
    if mode == "affine":
        if group_size not in q.MLX_GROUP_SIZES or bits not in q.PACKABLE_BITS:
            raise b.unsupported(f"group size {group_size} / {bits} bits is not an MLX affine layout")
        if dtype not in FLOAT_DTYPES or biases is None or b.dtype_of(scales) not in FLOAT_DTYPES \
                or b.dtype_of(biases) != b.dtype_of(scales):
            raise b.unsupported(f"scales / biases must share one float dtype, got {b.dtype_of(scales)} / "
                                f"{b.dtype_of(biases) if biases is not None else None}")
    else:
        if (group_size, bits) != q.MICROSCALED[mode]:
            raise b.unsupported(f"{mode} takes groups of {q.MICROSCALED[mode][0]} at {q.MICROSCALED[mode][1]} bits, "
                                f"got {group_size} / {bits}")
        if biases is not None or b.dtype_of(scales) != torch.uint8:
            raise b.unsupported(f"{mode} takes uint8 scales and no biases")
    if b.dtype_of(w) != torch.int32:
        raise b.unsupported(f"packed weights must be int32 words, got {b.dtype_of(w)}")
    rows, words = _static(b, b.shape_of(w), "packed weight")
    k = words * 32 // bits
    if k % group_size or _static(b, b.shape_of(scales), "scales") != [rows, k // group_size] \
            or (biases is not None and b.shape_of(biases) != b.shape_of(scales)):
        raise b.unsupported(f"scales {b.shape_of(scales)} do not fit a [{rows}, {k}] weight in groups of {group_size}")
    return k


def _scaled(b: ProgramBuilder, y: Any, global_scale: float, dtype: torch.dtype) -> Any:
    """y * global_scale (nvfp4's per-tensor scale), or y when it is 1."""
    return y if global_scale == 1.0 else binary_slots(b, N.BinaryOp.Mul, y, b.full(global_scale, dtype))


@register(mlxd.quantized_linear.default)
def quantized_linear(b: ProgramBuilder, n: torch.fx.Node) -> None:
    """mx::quantized_matmul (* global scale) (+ bias); affine (groups 32/64/128, 2/4/8 bits) or nvfp4 / mxfp8 / mxfp4.

    Affine scales / biases are in any float dtype (the runtime reads or widens them); the other modes
    have uint8 scales and no biases."""
    a = b.args(n)
    x, bias, mode, global_scale = a["x"], a["bias"], a["mode"], float(a["global_scale"])
    dtype = b.dtype_of(x)
    if dtype not in FLOAT_DTYPES:
        raise b.unsupported(f"input dtype {dtype}")
    k = _packed(b, a["w"], a["scales"], a["biases"], a["group_size"], a["bits"], dtype, mode)
    if not b.shape_of(x) or b.shape_of(x)[-1] != k:
        raise b.unsupported(f"input {b.shape_of(x)} does not end in the weight's {k} columns")
    if bias is not None and (b.dtype_of(bias) != dtype or len(b.shape_of(bias)) != 1):
        raise b.unsupported("bias must be 1-D in the input's dtype")
    scaled = global_scale != 1.0
    residual = a["residual"]
    if residual is not None and (scaled or b.dtype_of(residual) != dtype
                                 or b.shape_of(residual) != b.shape_of(n)):
        raise b.unsupported("a fused residual needs no global scale and the output's shape and dtype")
    norm = _norm(b, a, x)
    out = b.temp() if scaled else b.out(n)
    b.emit(N.QuantizedLinearNode(x=b.tensor(x), w=b.tensor(a["w"]), scales=b.tensor(a["scales"]),
                                 biases=b.tensor(a["biases"]) if a["biases"] is not None else None,
                                 bias=b.tensor(bias) if bias is not None and not scaled else None,
                                 group_size=a["group_size"], bits=a["bits"], out=out, mode=QUANT_MODES[mode],
                                 residual=b.tensor(residual) if residual is not None else None, **norm))
    if scaled:  # the bias is added after the per-tensor scale
        y = _scaled(b, out, global_scale, dtype)
        b.emit(N.BinaryNode(op=N.BinaryOp.Add, a=y, b=b.tensor(bias), out=b.out(n)) if bias is not None
               else N.IdentityNode(x=y, out=b.out(n)))


def _norm(b: ProgramBuilder, a: dict[str, Any], x: Any) -> dict[str, Any]:
    """The QuantizedLinearNode fields of a fused RMSNorm (`norm`, `norm_eps` arguments), checked."""
    if a.get("norm") is None:
        return {}
    norm = a["norm"]
    if b.dtype_of(norm) != b.dtype_of(x) or b.shape_of(norm) != [b.shape_of(x)[-1]]:
        raise b.unsupported("a fused norm's weight must be x's dtype and as long as its last axis")
    return {"norm_weight": b.tensor(norm), "norm_eps": float(a["norm_eps"])}


@register(mlxd.quantized_linear_group.default)
def quantized_linear_group(b: ProgramBuilder, n: torch.fx.Node) -> None:
    """Quantized linears of one layout sharing x (patterns/linear_group.py): one
    QuantizedLinearNode over the packed weights, scales and biases stacked on the output
    axis (derived constants), each result a slice of it."""
    full = b.temp()
    sizes = _stacked_product(b, n, full, glu=False)
    split_last_axis(b, n, full, sizes)


@register(mlxd.quantized_linear_glu.default)
def quantized_linear_glu(b: ProgramBuilder, n: torch.fx.Node) -> None:
    """silu(gate) * up of a [gate, up] quantized group, as one QuantizedLinearNode with `glu`.

    Emitted by patterns/quantized_epilogue.py; the product runs over the stacked weights."""
    ws = b.args(n)["ws"]
    if len(ws) != 2 or b.shape_of(ws[0]) != b.shape_of(ws[1]):
        raise b.unsupported("quantized_linear_glu needs a gate and an up weight of one shape")
    _stacked_product(b, n, b.out(n), glu=True)


def _stacked_product(b: ProgramBuilder, n: torch.fx.Node, out: Any, glu: bool) -> list[int]:
    """Emit one QuantizedLinearNode over the group's stacked constants into `out`; returns the parts' sizes."""
    a = b.args(n)
    x, ws, scales, biases, bias, group_size, bits = (a[k] for k in ("x", "ws", "scales", "biases", "bias",
                                                                    "group_size", "bits"))
    dtype = b.dtype_of(x)
    ks = {_packed(b, *parts, group_size, bits, dtype) for parts in zip(ws, scales, biases)}
    if len(ks) != 1 or not b.shape_of(x) or b.shape_of(x)[-1] != ks.pop():
        raise b.unsupported("quantized_linear_group needs one input size matching x's last axis")
    scale_dtypes = {b.dtype_of(t) for t in scales}
    if len(scale_dtypes) != 1:
        raise b.unsupported(f"quantized_linear_group needs one scales dtype, got {sorted(map(str, scale_dtypes))}")
    scale_dtype = scale_dtypes.pop()
    if any(t is not None and (b.dtype_of(t) != dtype or len(b.shape_of(t)) != 1) for t in bias):
        raise b.unsupported("bias must be 1-D in the input's dtype")
    sizes = [b.shape_of(w)[0] for w in ws]
    stacked_bias = None
    if any(t is not None for t in bias):  # a linear without one adds zeros
        stacked_bias = b.concat_constant([t if t is not None else size for t, size in zip(bias, sizes)], dtype)
    norm = _norm(b, a, x)
    b.emit(N.QuantizedLinearNode(x=b.tensor(x), w=b.concat_constant(ws, torch.int32),
                                 scales=b.concat_constant(scales, scale_dtype),
                                 biases=b.concat_constant(biases, scale_dtype),
                                 bias=stacked_bias, group_size=group_size, bits=bits, out=out, glu=glu, **norm))
    return sizes


@register(mlxd.quantized_embedding.default)
def quantized_embedding(b: ProgramBuilder, n: torch.fx.Node) -> None:
    """Gathers packed rows, then mx::dequantize; affine (groups 32/64/128, 2/4/8 bits) or nvfp4 / mxfp8 / mxfp4.

    Affine is one QuantizedEmbeddingNode: in the scales' dtype, or, where they differ from the output
    (GGUF's fp16 scales under fp32), dequantized in float32 (`float32_out`) and cast where the output is
    narrower. Otherwise rows of w, scales (and biases) are taken, then DequantizeNode to the output
    dtype (* global scale)."""
    a = b.args(n)
    w, scales, biases, indices, mode = a["w"], a["scales"], a["biases"], a["indices"], a["mode"]
    dtype = b.dtype_of(n)
    if dtype not in FLOAT_DTYPES:
        raise b.unsupported(f"{mode} embedding needs a float output dtype, got {dtype}")
    k = _packed(b, w, scales, biases, a["group_size"], a["bits"], dtype, mode)
    if mode == "affine" and float(a["global_scale"]) == 1.0:
        widen = b.dtype_of(scales) != dtype
        cast = widen and dtype != torch.float32
        rows = b.temp() if cast else b.out(n)
        b.emit(N.QuantizedEmbeddingNode(w=b.tensor(w), scales=b.tensor(scales), biases=b.tensor(biases),
                                        indices=index_tensor(b, indices), group_size=a["group_size"],
                                        bits=a["bits"], out=rows, float32_out=widen))
        if cast:
            b.emit(N.AsTypeNode(x=rows, dtype=b.ir_dtype(dtype), out=b.out(n)))
        return
    flat = _reshape(b, index_tensor(b, indices), [-1])
    rows = []
    for t in (w, scales, biases) if biases is not None else (w, scales):
        rows.append(b.temp())
        b.emit(N.TakeNode(x=b.tensor(t), indices=flat, axis=0, out=rows[-1]))
    y = b.temp()
    b.emit(N.DequantizeNode(w=rows[0], scales=rows[1], biases=rows[2] if len(rows) > 2 else None,
                            group_size=a["group_size"], bits=a["bits"],
                            mode=QUANT_MODES[mode], dtype=b.ir_dtype(dtype), out=y))
    y = _scaled(b, y, float(a["global_scale"]), dtype)
    # Back to the indices' shape: a dynamic size (a prompt's length) is the one the rows fill.
    dims = [d if isinstance(d, int) else -1 for d in b.shape_of(indices)]
    if dims.count(-1) > 1:
        raise b.unsupported(f"indices {b.shape_of(indices)} have more than one dynamic dimension")
    b.emit(N.ReshapeNode(x=y, shape=[b.int_or_vid(d) for d in [*dims, k]], out=b.out(n)))


@register(mlxd.dequantize.default)
def dequantize(b: ProgramBuilder, n: torch.fx.Node) -> None:
    """mx::dequantize (* global scale) of a whole packed weight that feeds other ops than a linear / embedding."""
    a = b.args(n)
    mode, dtype = a["mode"], a["dtype"]
    if dtype not in FLOAT_DTYPES:
        raise b.unsupported(f"dequantize to {dtype}")
    # affine scales / biases are in their own float dtype; mx::dequantize then casts to `dtype`
    _packed(b, a["w"], a["scales"], a["biases"], a["group_size"], a["bits"], b.dtype_of(a["scales"]), mode)
    scaled = float(a["global_scale"]) != 1.0
    out = b.temp() if scaled else b.out(n)
    b.emit(N.DequantizeNode(w=b.tensor(a["w"]), scales=b.tensor(a["scales"]),
                            biases=b.tensor(a["biases"]) if a["biases"] is not None else None,
                            group_size=a["group_size"], bits=a["bits"], mode=QUANT_MODES[mode],
                            dtype=b.ir_dtype(dtype), out=out))
    if scaled:
        b.emit(N.IdentityNode(x=_scaled(b, out, float(a["global_scale"]), dtype), out=b.out(n)))


def _reshape(b: ProgramBuilder, x: Any, shape: list[int]) -> Any:
    t = b.temp()
    b.emit(N.ReshapeNode(x=x, shape=[b.int_or_vid(d) for d in shape], out=t))
    return t
