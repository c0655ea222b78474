"""Convolution (1/2/3-D, transposed, grouped), resampling (upsample_*) and
pixel (un)shuffle.

All run on torch's channels-first layout and weights stay as torch stores them:
on the CPU, 1-D / 2-D convolutions run the channels-first kernel
(`cpp/kernels/conv_cpu.cpp`); elsewhere `cpp/ops/conv.cpp` moves channels last
around MLX's convolution.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from .. import custom_ops  # noqa: F401  (defines mlx_delegate::conv_fused)
from ..builder import ProgramBuilder
from ..ir import nodes as N
from ..registry import register

aten = torch.ops.aten
R = N.ResampleMode


def float_dtype(b: ProgramBuilder, n: torch.fx.Node) -> torch.dtype:
    dtype = b.dtype_of(n)
    b.ir_dtype(dtype)
    if not dtype.is_floating_point:
        raise b.unsupported(f"only floating-point inputs are supported, got {dtype}")
    return dtype


def int_list(b: ProgramBuilder, v: Any, count: int, name: str) -> list[int]:
    """A per-spatial-axis int list known when lowering (a single entry applies to every axis)."""
    values = [v] if isinstance(v, int) else list(v or [])
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in values):
        raise b.unsupported(f"{name} must be ints known when lowering, got {v!r}")
    if len(values) == 1:
        values = values * count
    if len(values) != count:
        raise b.unsupported(f"{name} has {len(values)} entries for {count} spatial axes")
    return values


# ---------------------------------------------------------------- convolution
def _conv(b: ProgramBuilder, n: torch.fx.Node, args: dict[str, Any], transposed: bool,
          fused: dict[str, Any] | None = None) -> None:
    x, w, bias = args["input"] if "input" in args else args["x"], args["weight"], args["bias"]
    dtype = float_dtype(b, n)
    rank = len(b.shape_of(x))
    if rank not in (3, 4, 5) or len(b.shape_of(w)) != rank:
        raise b.unsupported(f"convolution of a rank-{rank} input (expected batched 1/2/3-D)")
    nd = rank - 2
    groups = args["groups"]
    if not isinstance(groups, int) or groups < 1:
        raise b.unsupported(f"groups must be a positive int, got {groups!r}")
    lists = {k: int_list(b, args.get(k, 0), nd, k) for k in ("stride", "padding", "dilation", "output_padding")}
    b.emit(N.ConvNode(x=b.operand(x, dtype), weight=b.operand(w, dtype),
                      bias=None if bias is None else b.operand(bias, dtype), groups=groups,
                      transpose=transposed, out=b.out(n), **lists, **(fused or {})))


@register(aten.convolution.default)
def convolution(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    _conv(b, n, args, bool(args["transposed"]))


# conv_fused's activations (custom_ops.CONV_ACTIVATIONS) as the ConvNode's act_op.
CONV_ACT_OPS = {"hardswish": N.UnaryOp.Hardswish, "hardsigmoid": N.UnaryOp.Hardsigmoid,
                "sigmoid": N.UnaryOp.Sigmoid, "silu": N.UnaryOp.Silu, "gelu": N.UnaryOp.GeluErf,
                "gelu_tanh": N.UnaryOp.GeluTanh}


@register(torch.ops.mlx_delegate.conv_fused.default)
def conv_fused(b: ProgramBuilder, n: torch.fx.Node) -> None:
    """A convolution with its input scale, pad, residual and activations fused (patterns/conv_fusions.py)."""
    args = b.args(n)
    act, in_scale = args.get("act", "none"), args.get("in_scale")
    lo, hi = args["lo"], args["hi"]
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (lo, hi)) or not lo <= hi:
        raise b.unsupported(f"conv_fused bounds must be numbers with lo <= hi, got {lo!r}, {hi!r}")
    nd = len(b.shape_of(args["x"])) - 2
    low, high = (int_list(b, args[k], nd, k) for k in ("padding", "padding_hi"))
    if min(low + high, default=0) < 0:
        raise b.unsupported(f"negative padding {low} / {high}")
    fused: dict[str, Any] = {"padding_hi": high}
    if (lo, hi) != (-math.inf, math.inf):
        fused |= {"clamp": True, "clamp_min": float(lo), "clamp_max": float(hi)}
    residual = args["residual"]
    if residual is not None:
        same = lambda s: [str(d) for d in b.shape_of(s)]  # symbolic sizes compared unguarded
        if same(residual) != same(n) or b.dtype_of(residual) != b.dtype_of(n):
            raise b.unsupported(f"residual {list(b.shape_of(residual))} {b.dtype_of(residual)} does not match the "
                                f"convolution's output {list(b.shape_of(n))} {b.dtype_of(n)}")
        fused["residual"] = b.tensor(residual)
    if act != "none":
        if act not in CONV_ACT_OPS:
            raise b.unsupported(f"conv_fused activation {act!r}; known: {sorted(CONV_ACT_OPS)}")
        fused |= {"act": True, "act_op": CONV_ACT_OPS[act]}
    if in_scale is not None:
        x_shape, s_shape = b.shape_of(args["x"]), b.shape_of(in_scale)
        want = [*x_shape[:2], *[1] * nd]
        if [str(d) for d in s_shape] != [str(d) for d in want] or b.dtype_of(in_scale) != b.dtype_of(n):
            raise b.unsupported(f"in_scale {list(s_shape)} {b.dtype_of(in_scale)}: expected {want} "
                                f"{b.dtype_of(n)} (one value per image and input channel)")
        fused["in_scale"] = b.tensor(in_scale)
    _conv(b, n, args, False, fused)


def _bound(b: ProgramBuilder, v: Any, name: str) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise b.unsupported(f"inverted_residual {name} must be a number, got {v!r}")
    return float(v)


# conv_fused's activation names (custom_ops.CONV_ACTIVATIONS) as a block stage's BlockActivation.
BLOCK_ACTS = {"none": N.BlockActivation.Clamp, "hardswish": N.BlockActivation.Hardswish,
              "hardsigmoid": N.BlockActivation.Hardsigmoid, "sigmoid": N.BlockActivation.Sigmoid,
              "silu": N.BlockActivation.Silu, "gelu": N.BlockActivation.GeluErf,
              "gelu_tanh": N.BlockActivation.GeluTanh}


def _stage_act(b: ProgramBuilder, args: dict[str, Any], stage: str) -> dict[str, Any]:
    """A stage's clamp bounds and activation kind as the node's `<stage>_lo / _hi / _act` fields."""
    lo, hi, act = _bound(b, args[f"{stage}_lo"], f"{stage}_lo"), _bound(b, args[f"{stage}_hi"], f"{stage}_hi"), \
        args[f"{stage}_act"]
    if not lo <= hi:
        raise b.unsupported(f"inverted_residual {stage} bounds need lo <= hi, got {lo}, {hi}")
    if act not in BLOCK_ACTS:
        raise b.unsupported(f"inverted_residual {stage} activation {act!r}; known: {sorted(BLOCK_ACTS)}")
    return {f"{stage}_lo": lo, f"{stage}_hi": hi, f"{stage}_act": BLOCK_ACTS[act]}


@register(torch.ops.mlx_delegate.inverted_residual.default)
def inverted_residual(b: ProgramBuilder, n: torch.fx.Node) -> None:
    """A 1x1 expand, depthwise, squeeze-excite and 1x1 project convolution block as one node.

    From patterns/inverted_residual.py (the expand and squeeze-excite optional). On the CPU one kernel
    runs the block; elsewhere the convolutions and the gate as MLX ops."""
    args = b.args(n)
    x = args["x"]
    dtype = float_dtype(b, n)
    shape = lambda t: [str(d) for d in b.shape_of(t)]  # symbolic sizes compared unguarded
    if len(shape(x)) != 4:
        raise b.unsupported(f"inverted_residual of a rank-{len(shape(x))} input (expected [N, C, H, W])")
    we, wd, wp = args["expand_weight"], args["dw_weight"], args["project_weight"]
    wr, wx = args["se_reduce_weight"], args["se_expand_weight"]
    if (wr is None) != (wx is None):
        raise b.unsupported("inverted_residual squeeze-excite needs both its reduce and its expand weight")
    channels = b.shape_of(x)[1]
    hidden = b.shape_of(we)[0] if we is not None else channels
    squeezed = b.shape_of(wr)[0] if wr is not None else None
    for w, want in ((we, [None, channels, 1, 1]), (wd, [hidden, 1, None, None]), (wp, [None, hidden, 1, 1]),
                    (wr, [None, hidden, 1, 1]), (wx, [hidden, squeezed, 1, 1])):
        if w is None:
            continue
        got = b.shape_of(w)
        if len(got) != 4 or any(k is not None and str(g) != str(k) for g, k in zip(got, want)):
            raise b.unsupported(f"inverted_residual weight {list(got)} does not fit the block")
        if b.dtype_of(w) != dtype:
            raise b.unsupported(f"inverted_residual weight of {b.dtype_of(w)} in a {dtype} block")
    for w, bias, what in ((we, "expand_bias", "expand"), (wr, "se_reduce_bias", "squeeze-excite reduce"),
                          (wx, "se_expand_bias", "squeeze-excite expand")):
        if w is None and args[bias] is not None:
            raise b.unsupported(f"inverted_residual {what} bias without its weight")
    stages = {k: v for stage in ("expand", "dw", "se_reduce", "se_expand") for k, v in _stage_act(b, args, stage).items()}
    lists = {k: int_list(b, args[k], 2, k) for k in ("stride", "padding", "padding_hi")}
    if min(lists["stride"]) < 1 or min(lists["padding"] + lists["padding_hi"]) < 0:
        raise b.unsupported(f"inverted_residual stride / padding out of range: {lists}")
    residual = args["residual"]
    if residual is not None and (shape(residual) != shape(n) or b.dtype_of(residual) != dtype):
        raise b.unsupported(f"residual {list(b.shape_of(residual))} {b.dtype_of(residual)} does not match the "
                            f"block's output {list(b.shape_of(n))} {dtype}")
    optional = lambda t: None if t is None else b.operand(t, dtype)
    b.emit(N.InvertedResidualNode(
        x=b.operand(x, dtype), expand_weight=optional(we), expand_bias=optional(args["expand_bias"]),
        dw_weight=b.operand(wd, dtype), dw_bias=optional(args["dw_bias"]), project_weight=b.operand(wp, dtype),
        project_bias=optional(args["project_bias"]), residual=None if residual is None else b.tensor(residual),
        se_reduce_weight=optional(wr), se_reduce_bias=optional(args["se_reduce_bias"]), se_expand_weight=optional(wx),
        se_expand_bias=optional(args["se_expand_bias"]), **lists, **stages, out=b.out(n)))


# ----------------------------------------------------------------- resampling
# target -> (mode, spatial rank). `.vec` takes output_size/scale_factors lists,
# `.default` an output_size and one optional scale per axis.
RESAMPLE: dict[Any, tuple[Any, int]] = {}
for _mode, _names in ((R.Nearest, ("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d")),
                      (R.NearestExact, ("_upsample_nearest_exact1d", "_upsample_nearest_exact2d",
                                        "_upsample_nearest_exact3d")),
                      (R.Linear, ("upsample_linear1d", "upsample_bilinear2d", "upsample_trilinear3d"))):
    for _nd, _name in enumerate(_names, start=1):
        for _overload in ("vec", "default"):
            RESAMPLE[getattr(getattr(aten, _name), _overload)] = (_mode, _nd)


def _scales(b: ProgramBuilder, args: dict[str, Any], nd: int) -> list[float]:
    """torch's per-axis scale factors (0 where none is given)."""
    if "scale_factors" in args:
        given = args["scale_factors"] or [None] * nd
    else:
        given = [v for k, v in args.items() if k.startswith("scales")]
    if len(given) != nd:
        raise b.unsupported(f"{len(given)} scale factors for {nd} axes")
    if any(s is not None and not isinstance(s, (int, float)) for s in given):
        raise b.unsupported(f"scale factors must be numbers known when lowering, got {given!r}")
    return [float(s) if s is not None else 0.0 for s in given]


def _sizes(b: ProgramBuilder, n: torch.fx.Node, requested: Sequence[Any] | None, scales: list[float],
           nd: int) -> list[Any]:
    """Output sizes: literals when static, the graph's size values, or -1 (from the scale) when dynamic."""
    out = []
    for i, d in enumerate(b.shape_of(n)[-nd:]):
        if isinstance(d, int):
            out.append(N.IntOrVid(literal=d, vid=-1))
        elif requested is not None and isinstance(requested[i], torch.fx.Node):
            out.append(b.int_or_vid(requested[i]))
        elif scales[i] > 0:
            out.append(N.IntOrVid(literal=-1, vid=-1))
        else:
            raise b.unsupported(f"dynamic output size {d} with neither a size value nor a scale")
    return out


def _resample(mode: Any, nd: int):
    def handle(b: ProgramBuilder, n: torch.fx.Node) -> None:
        args = b.args(n)
        x = args.get("input", args.get("self"))
        dtype = b.dtype_of(n)
        if mode == R.Linear:
            dtype = float_dtype(b, n)
        b.ir_dtype(dtype)
        if len(b.shape_of(x)) != nd + 2:
            raise b.unsupported(f"expected a rank-{nd + 2} input")
        if any(d == 0 for d in b.shape_of(x)[2:]):
            raise b.unsupported("resampling an empty spatial axis")
        scales = _scales(b, args, nd)
        sizes = _sizes(b, n, args.get("output_size"), scales, nd)
        b.emit(N.ResampleNode(x=b.tensor(x), mode=mode, align_corners=bool(args.get("align_corners") or False),
                              size=sizes, scales=scales, out=b.out(n)))
    return handle


for _target, (_mode, _nd) in RESAMPLE.items():
    register(_target)(_resample(_mode, _nd))


# --------------------------------------------------------------- pixel shuffle
def _pixel_shuffle(inverse: bool):
    def handle(b: ProgramBuilder, n: torch.fx.Node) -> None:
        x, factor = n.args[0], n.args[1]
        b.ir_dtype(b.dtype_of(n))
        if not isinstance(factor, int) or factor < 1:
            raise b.unsupported(f"factor must be a positive int, got {factor!r}")
        if len(b.shape_of(x)) < 3:
            raise b.unsupported("pixel shuffle needs a (*, C, H, W) input")
        b.emit(N.PixelShuffleNode(x=b.tensor(x), factor=factor, inverse=inverse, out=b.out(n)))
    return handle


register(aten.pixel_shuffle.default)(_pixel_shuffle(False))
register(aten.pixel_unshuffle.default)(_pixel_shuffle(True))
