"""What follows (or precedes) a convolution, fused into one `mlx_delegate::conv_fused` node, so the
delegate's ConvNode does it in the passes it makes anyway (on the CPU: the convolution kernel reads
the unpadded input, starts its output from bias + residual, and clamps while writing):

- `fold_conv_pad`: a constant zero pad of the spatial axes (TF-style "same" padding, `nn.ZeroPad2d`)
  read only by the convolution becomes the convolution's padding, asymmetric where the pad is;
- `fuse_conv_residual`: `conv(x) + r` (a residual connection; r of the output's shape and dtype);
- `fuse_conv_activation`: ReLU, ReLU6 / hardtanh or a constant clamp after it (or after the residual),
  and hard-swish, hard-sigmoid, sigmoid, SiLU or GELU after that (the CPU kernel applies it to each
  block of results while they are in cache, instead of a separate pass over the activation);
- `fuse_conv_scale`: `conv(x * s)` with s of shape [N, C, 1, ...] (a squeeze-excite gate: one value per
  image and input channel) becomes the convolution's `in_scale`, which the CPU kernel folds into the
  weights (or the input) inside the call instead of a broadcast multiply writing a new activation.

They run in that order, each on a non-transposed `aten.convolution` or an earlier `conv_fused`, and
only where the convolution's output (or the pad's, or the product's) has no other reader."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.export import ExportedProgram

from .. import custom_ops  # noqa: F401  (defines mlx_delegate::conv_fused)
from .common import aten, dtype, erase_dead, is_op, only_user, replace, same_shape, scalar_value, shape

FUSED = torch.ops.mlx_delegate.conv_fused.default
INF = math.inf
ARGS = ("x", "weight", "bias", "residual", "stride", "padding", "padding_hi", "dilation", "groups", "lo",
        "hi", "act", "in_scale")
DEFAULTS = {"act": "none", "in_scale": None}


def _conv_args(n: torch.fx.Node) -> dict[str, Any] | None:
    """`n`'s arguments as conv_fused's, when it is a non-transposed convolution or a conv_fused."""
    if is_op(n, FUSED):
        return DEFAULTS | dict(zip(ARGS, n.args)) | dict(n.kwargs)
    if not is_op(n, aten.convolution.default) or n.args[6]:  # transposed
        return None
    x, w, bias, stride, padding, dilation, _, _, groups = n.args
    nd = len(shape(n)) - 2
    full = lambda v: list(v) * nd if len(v) == 1 else list(v)  # one entry: every axis
    return {"x": x, "weight": w, "bias": bias, "residual": None, "stride": full(stride), "padding": full(padding),
            "padding_hi": full(padding), "dilation": full(dilation), "groups": groups, "lo": -INF, "hi": INF,
            **DEFAULTS}


def _rewrite(ep: ExportedProgram, old: torch.fx.Node, conv: torch.fx.Node, args: dict[str, Any]) -> bool:
    """conv_fused(**args) in place of `old` (the last node of the match, reading `conv`)."""
    if not replace(ep, old, FUSED, tuple(args[k] for k in ARGS)):
        return False
    erase_dead(ep.graph, [old])
    return True


def _bounds(act: torch.fx.Node) -> tuple[float, float] | None:
    """[lo, hi] of a ReLU / hardtanh / clamp with number bounds (-inf / inf: none)."""
    if is_op(act, aten.relu.default):
        return 0.0, INF
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    if is_op(act, aten.hardtanh.default):
        lo, hi = (list(act.args[1:3]) + [-1.0, 1.0][len(act.args) - 1:])[:2]
        lo, hi = act.kwargs.get("min_val", lo), act.kwargs.get("max_val", hi)
    elif is_op(act, aten.clamp.default):
        lo, hi = (list(act.args[1:3]) + [None, None])[:2]
        lo, hi = act.kwargs.get("min", lo), act.kwargs.get("max", hi)
        lo = -INF if lo is None else lo
        hi = INF if hi is None else hi
    else:
        return None
    if not (number(lo) and number(hi)) or not lo <= hi:
        return None
    return float(lo), float(hi)


def _activation(act: torch.fx.Node) -> str | None:
    """The `conv_fused` name (custom_ops.CONV_ACTIVATIONS) of activation node `act`, or None."""
    names = {aten.hardswish.default: "hardswish", aten.hardsigmoid.default: "hardsigmoid",
             aten.sigmoid.default: "sigmoid", aten.silu.default: "silu"}
    for target, name in names.items():
        if is_op(act, target):
            return name
    if is_op(act, aten.gelu.default):
        approximate = act.kwargs.get("approximate", act.args[1] if len(act.args) > 1 else "none")
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(approximate)
    return None


def _unclamped(args: dict[str, Any]) -> bool:
    return args["lo"] == -INF and args["hi"] == INF and args["act"] == "none"


def fold_pad(ep: ExportedProgram) -> int:
    done = 0
    for conv in list(ep.graph.nodes):
        args = _conv_args(conv)
        pad = args and args["x"]
        if not is_op(pad, aten.constant_pad_nd.default) or not only_user(pad, conv):
            continue
        amounts = list(pad.args[1])
        value = scalar_value(ep, pad.args[2] if len(pad.args) > 2 else pad.kwargs.get("value", 0.0))
        nd = len(args["stride"])
        if (value != 0.0 or len(args["padding"]) != nd or len(args["padding_hi"]) != nd or len(amounts) % 2
                or len(amounts) > 2 * nd
                or not all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in amounts)):
            continue  # not zeros, not only spatial axes, symbolic, or a crop
        amounts += [0] * (2 * nd - len(amounts))
        lo, hi = list(args["padding"]), list(args["padding_hi"])
        for i in range(nd):  # F.pad's list starts at the last axis
            lo[nd - 1 - i] += amounts[2 * i]
            hi[nd - 1 - i] += amounts[2 * i + 1]
        done += _rewrite(ep, conv, conv, args | {"x": pad.args[0], "padding": lo, "padding_hi": hi})
    return done


def fuse_residual(ep: ExportedProgram) -> int:
    done = 0
    for add in [n for n in ep.graph.nodes if is_op(n, aten.add.Tensor)]:
        if len(add.args) != 2 or add.kwargs.get("alpha", 1) != 1:
            continue
        for conv, other in (add.args, add.args[::-1]):
            args = isinstance(conv, torch.fx.Node) and _conv_args(conv)
            if (args and args["residual"] is None and _unclamped(args) and only_user(conv, add)
                    and isinstance(other, torch.fx.Node) and other is not conv and same_shape(other, conv)
                    and same_shape(add, conv) and dtype(other) == dtype(conv) == dtype(add)
                    and _rewrite(ep, add, conv, args | {"residual": other})):
                done += 1
                break
    return done


def fuse_activation(ep: ExportedProgram) -> int:
    """A clamp, then an activation (applied after the clamp), each fused once per convolution."""
    done = 0
    for conv in list(ep.graph.nodes):
        args = _conv_args(conv)
        if not args or args["act"] != "none" or len(conv.users) != 1:
            continue
        (act,) = conv.users
        if not only_user(conv, act) or act.args[0] is not conv or dtype(act) != dtype(conv):
            continue
        bounds, name = _bounds(act), _activation(act)
        if bounds is not None and _unclamped(args):
            fused = args | {"lo": bounds[0], "hi": bounds[1]}
        elif name is not None:
            fused = args | {"act": name}
        else:
            continue
        done += _rewrite(ep, act, conv, fused)
    return done


def fuse_scale(ep: ExportedProgram) -> int:
    done = 0
    for conv in list(ep.graph.nodes):
        args = _conv_args(conv)
        mul = args and args["x"]
        if (not is_op(mul, aten.mul.Tensor) or args["in_scale"] is not None or not only_user(mul, conv)
                or args["residual"] is mul):  # the product is needed anyway
            continue
        for x, s in (mul.args, mul.args[::-1]):
            if not (isinstance(x, torch.fx.Node) and isinstance(s, torch.fx.Node)) or x is s:
                continue
            xs, ss = shape(x), shape(s)
            if (len(xs) == len(ss) == len(shape(mul)) and len(xs) >= 3 and same_shape(x, mul)
                    and all(isinstance(d, int) for d in [*ss, *xs[:2]]) and ss[2:] == [1] * (len(ss) - 2)
                    and ss[:2] == xs[:2] and dtype(x) == dtype(s) == dtype(mul)
                    and _rewrite(ep, conv, conv, args | {"x": x, "in_scale": s})):
                done += 1
                break
    return done
