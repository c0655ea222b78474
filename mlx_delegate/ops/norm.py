"""Normalisation: layer norm (native and undecomposed), RMS norm, group norm,
batch norm (inference, and training-mode batch statistics without running
stats, e.g. instance_norm) and linalg.vector_norm.

The native_* ops return saved statistics besides the result; they are
computed only when the graph reads them.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from ..builder import ProgramBuilder
from ..ir import nodes as N
from ..registry import register
from .conv import float_dtype

aten = torch.ops.aten


def _used_outputs(n: torch.fx.Node) -> set[int]:
    return {u.args[1] for u in n.users if u.target is operator.getitem}


def _optional(b: ProgramBuilder, x: Any, dtype: torch.dtype) -> Any:
    return None if x is None else b.operand(x, dtype)


def _eps(b: ProgramBuilder, eps: Any) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise b.unsupported(f"eps must be a number known when lowering, got {eps!r}")
    return float(eps)


def _stat_slots(b: ProgramBuilder, n: torch.fx.Node, count: int) -> tuple[Any, list[Any]]:
    """(result slot, statistics slots or None where the graph does not read them)."""
    slots = b.outs(n, count)
    used = _used_outputs(n)
    return slots[0], [s if i in used else None for i, s in enumerate(slots) if i > 0]


def _normalized_ndim(b: ProgramBuilder, x: torch.fx.Node, normalized_shape: Any) -> int:
    """How many trailing dims a layer / RMS norm normalises over (1 to the input's rank)."""
    k = len(normalized_shape)
    if not 1 <= k <= len(b.shape_of(x)):
        raise b.unsupported(f"normalized_shape of rank {k} for a rank-{len(b.shape_of(x))} input")
    return k


# ------------------------------------------------------------------ layer norm
def _layer_norm(native: bool):
    def handle(b: ProgramBuilder, n: torch.fx.Node) -> None:
        args = b.args(n)
        x = args["input"]
        dtype = float_dtype(b, x)
        k = _normalized_ndim(b, x, args["normalized_shape"])
        eps = _eps(b, args["eps"])
        if native:
            out, (mean, rstd) = _stat_slots(b, n, 3)
        else:
            out, mean, rstd = b.out(n), None, None
        b.emit(N.LayerNormNode(x=b.tensor(x), weight=_optional(b, args["weight"], dtype),
                               bias=_optional(b, args["bias"], dtype), eps=eps, normalized_ndim=k, out=out,
                               out_mean=mean, out_rstd=rstd))
    return handle


register(aten.native_layer_norm.default)(_layer_norm(native=True))
register(aten.layer_norm.default)(_layer_norm(native=False))


@register(aten.rms_norm.default)
def rms_norm(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    x = args["input"]
    dtype = float_dtype(b, x)
    k = _normalized_ndim(b, x, args["normalized_shape"])
    # torch's default is float32's epsilon for every floating input (it computes in float).
    eps = torch.finfo(torch.float32).eps if args["eps"] is None else _eps(b, args["eps"])
    b.emit(N.RmsNormNode(x=b.tensor(x), weight=_optional(b, args["weight"], dtype), eps=eps, normalized_ndim=k,
                         out=b.out(n)))


# ------------------------------------------------------------------ group norm
def _group_norm(native: bool):
    def handle(b: ProgramBuilder, n: torch.fx.Node) -> None:
        args = b.args(n)
        x = args["input"]
        dtype = float_dtype(b, x)
        groups = args["group"] if native else args["num_groups"]
        shape = b.shape_of(x)
        if len(shape) < 2 or not isinstance(groups, int) or groups < 1:
            raise b.unsupported("group norm needs (N, C, *) and a positive group count")
        if isinstance(shape[1], int) and shape[1] % groups:
            raise b.unsupported(f"{shape[1]} channels do not split into {groups} groups")
        if native:
            out, (mean, rstd) = _stat_slots(b, n, 3)
        else:
            out, mean, rstd = b.out(n), None, None
        b.emit(N.GroupNormNode(x=b.tensor(x), weight=_optional(b, args["weight"], dtype),
                               bias=_optional(b, args["bias"], dtype), groups=groups, eps=_eps(b, args["eps"]),
                               out=out, out_mean=mean, out_rstd=rstd))
    return handle


register(aten.native_group_norm.default)(_group_norm(native=True))
register(aten.group_norm.default)(_group_norm(native=False))


# ------------------------------------------------------------------ batch norm
# All return (out, save_mean, save_invstd). batch_norm / native_batch_norm are
# not listed: export always decomposes them into these.
BATCH_NORMS = (aten._native_batch_norm_legit_no_training.default, aten._native_batch_norm_legit.default,
               aten._native_batch_norm_legit.no_stats)


@register(*BATCH_NORMS)
def batch_norm(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    x = args["input"]
    dtype = float_dtype(b, x)
    if len(b.shape_of(x)) < 2:
        raise b.unsupported("batch norm needs an (N, C, *) input")
    mean, var = args.get("running_mean"), args.get("running_var")
    # The no_training variant has no `training` argument.
    training = bool(args.get("training", False))
    if training and mean is not None:
        raise b.unsupported("training-mode batch norm updates its running statistics in place")
    if not training and (mean is None or var is None):
        raise b.unsupported("inference batch norm without running statistics")
    out, stats = _stat_slots(b, n, 3)
    # In inference torch returns empty placeholders for the statistics.
    if not training and any(s is not None for s in stats):
        raise b.unsupported("the (empty) saved statistics of inference batch norm are read")
    stat_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    b.emit(N.BatchNormNode(x=b.tensor(x), weight=_optional(b, args["weight"], dtype),
                           bias=_optional(b, args["bias"], dtype), mean=_optional(b, mean, stat_dtype),
                           var=_optional(b, var, stat_dtype), eps=_eps(b, args["eps"]), out=out,
                           out_mean=stats[0], out_rstd=stats[1]))


# ----------------------------------------------------------------- vector norm
@register(aten.linalg_vector_norm.default)
def vector_norm(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    x, ord_ = args["self"], args["ord"]
    if isinstance(ord_, bool) or not isinstance(ord_, (int, float)):
        raise b.unsupported(f"ord must be a number known when lowering, got {ord_!r}")
    dtype = float_dtype(b, n)
    dims = args["dim"]
    axes = [] if dims is None else list(dims)
    if not all(isinstance(a, int) for a in axes):
        raise b.unsupported(f"dim must be ints, got {dims!r}")
    b.emit(N.VectorNormNode(x=b.operand(x, dtype), ord=float(ord_), axes=axes, keepdims=bool(args["keepdim"]),
                            out=b.out(n)))
