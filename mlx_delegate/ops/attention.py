"""Attention and LLM building blocks: SDPA, KV-cache writes, RoPE, RMSNorm.

`aten.scaled_dot_product_attention` is kept whole (registering it keeps it out
of the core decompositions) and maps to `mx::fast::scaled_dot_product_attention`,
which handles grouped-query attention without repeating k/v. The
`mlx_delegate::*` custom ops (see `custom_ops.py`; models call
`kv_cache_update` / `kv_cache_update_at`, the pattern passes produce `rope` / `rope_at`
and `rms_norm`) map to a slice update of the resident cache (at an int or an
array offset), `mx::fast::rope` (at an int or an array offset) and
`mx::fast::rms_norm`.
"""

from __future__ import annotations

import math

import torch

from .. import custom_ops
from ..builder import ProgramBuilder
from ..ir import nodes as N
from ..registry import register
from .shape import same_dim

aten = torch.ops.aten
mlxd = torch.ops.mlx_delegate
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_sdpa(b: ProgramBuilder, args: dict) -> None:
    q, k, v, mask = args["query"], args["key"], args["value"], args["attn_mask"]
    shapes = [b.shape_of(x) for x in (q, k, v)]
    if any(len(s) != 4 for s in shapes):
        raise b.unsupported(f"q/k/v must be rank 4 ([B, H, L, E]), got ranks {[len(s) for s in shapes]}")
    dtype = b.dtype_of(q)
    if dtype not in FLOAT_DTYPES or b.dtype_of(k) != dtype or b.dtype_of(v) != dtype:
        raise b.unsupported(f"q/k/v dtypes {[str(b.dtype_of(x)) for x in (q, k, v)]}")
    (qb, hq, _, e), (kb, hk, s, ke), (vb, hv, vs, _) = shapes
    if not all(same_dim(qb, x) for x in (kb, vb)):
        raise b.unsupported("q, k and v must have the same batch size")
    if not (same_dim(hk, hv) and same_dim(s, vs) and same_dim(e, ke)):
        raise b.unsupported("k and v must agree on heads and length, q and k on head size")
    if not same_dim(hq, hk):
        if not args["enable_gqa"]:
            raise b.unsupported("different q and k head counts need enable_gqa=True")
        if not (isinstance(hq, int) and isinstance(hk, int) and hk > 0 and hq % hk == 0):
            raise b.unsupported(f"query heads {hq} are not a multiple of key heads {hk}")
    if args["dropout_p"] not in (0, 0.0, None):
        raise b.unsupported("dropout_p must be 0 (inference only)")
    if mask is not None:
        if args["is_causal"]:
            raise b.unsupported("attn_mask together with is_causal=True")
        if not isinstance(mask, torch.fx.Node) or len(b.shape_of(mask)) > 4:
            raise b.unsupported("attn_mask must be a tensor of rank <= 4")
        if b.dtype_of(mask) not in (torch.bool, dtype):
            raise b.unsupported(f"attn_mask dtype {b.dtype_of(mask)} (expected bool or {dtype})")
    scale = args["scale"]
    if scale is not None and not isinstance(scale, (int, float)):
        raise b.unsupported("scale must be a constant")
    if scale is None and not isinstance(e, int):
        raise b.unsupported("default scale needs a static head size")


@register(aten.scaled_dot_product_attention.default)
def sdpa(b: ProgramBuilder, n: torch.fx.Node) -> None:
    args = b.args(n)
    _check_sdpa(b, args)
    q, k, v, mask = args["query"], args["key"], args["value"], args["attn_mask"]
    scale = args["scale"] if args["scale"] is not None else 1.0 / math.sqrt(b.shape_of(q)[-1])
    b.emit(N.SdpaNode(q=b.tensor(q), k=b.tensor(k), v=b.tensor(v),
                      mask=b.tensor(mask) if mask is not None else None,
                      scale=float(scale), causal=bool(args["is_causal"]), out=b.out(n)))


def _static_int(b: ProgramBuilder, v: object, what: str) -> int:
    if isinstance(v, int) or (isinstance(v, torch.SymInt) and v.node.is_constant()):
        return int(v)
    raise b.unsupported(f"{what} must be static, got {v}")


def _check_position(b: ProgramBuilder, pos: torch.fx.Node) -> None:
    if b.dtype_of(pos) not in (torch.int32, torch.int64) or math.prod(
            _static_int(b, d, "the position's size") for d in b.shape_of(pos)) != 1:
        raise b.unsupported("the position must be a one-element int32/int64 tensor")


def _check_kv_update(b: ProgramBuilder, cache: torch.fx.Node, update: torch.fx.Node,
                     ushape: list | None = None) -> None:
    """`ushape`: the [B, H, L, D] shape `update` is read as (default: its own)."""
    cshape, ushape = b.shape_of(cache), ushape if ushape is not None else b.shape_of(update)
    if len(cshape) != 4 or len(ushape) != 4:
        raise b.unsupported("cache and update must be [B, H, S, D]")
    if b.dtype_of(cache) != b.dtype_of(update):
        raise b.unsupported(f"update dtype {b.dtype_of(update)} differs from the cache's {b.dtype_of(cache)}")
    axis = custom_ops.SEQ_AXIS
    if not all(same_dim(c, u) for i, (c, u) in enumerate(zip(cshape, ushape)) if i != axis):
        raise b.unsupported(f"update {ushape} does not match cache {cshape} outside the sequence axis")


@register(mlxd.kv_cache_update.default)
def kv_cache_update(b: ProgramBuilder, n: torch.fx.Node) -> None:
    cache, update, start_pos = n.args
    _check_kv_update(b, cache, update)
    # The runtime checks that the write fits (the slice is as long as the update).
    b.emit(N.SliceUpdateNode(x=b.tensor(cache), update=b.tensor(update), axis=custom_ops.SEQ_AXIS,
                             start=b.int_or_vid(start_pos), stop=None, step=1, out=b.out(n)))


@register(mlxd.kv_cache_update_at.default)
def kv_cache_update_at(b: ProgramBuilder, n: torch.fx.Node) -> None:
    cache, update, start_pos = n.args
    _check_kv_update(b, cache, update)
    _check_position(b, start_pos)
    # A slice update at an array offset (clamped to the cache): no value of the
    # position reaches the graph's shapes.
    b.emit(N.DynamicSliceUpdateNode(x=b.tensor(cache), update=b.tensor(update), start=b.tensor(start_pos),
                                    axis=custom_ops.SEQ_AXIS, out=b.out(n)))


def _emit_rope(b: ProgramBuilder, n: torch.fx.Node, offset: object, offset_tensor: torch.fx.Node | None) -> None:
    x, inv_freq, _, traditional, base = n.args
    shape = b.shape_of(x)
    if len(shape) < 2 or b.dtype_of(x) not in FLOAT_DTYPES:
        raise b.unsupported("rope needs a floating [..., L, D] input")
    dims = _static_int(b, shape[-1], "the head size")
    if dims % 2 or b.shape_of(inv_freq) != [dims // 2]:
        raise b.unsupported(f"inv_freq of shape {b.shape_of(inv_freq)} for head size {dims}")
    b.emit(N.RopeNode(x=b.tensor(x), dims=dims, traditional=bool(traditional),
                      base=float(base) if base is not None else 0.0, scale=1.0, offset=b.int_or_vid(offset),
                      inv_freq=b.tensor(inv_freq) if base is None else None, out=b.out(n),
                      offset_tensor=b.tensor(offset_tensor) if offset_tensor is not None else None))


@register(mlxd.rope.default)
def rope(b: ProgramBuilder, n: torch.fx.Node) -> None:
    _emit_rope(b, n, n.args[2], None)


@register(mlxd.rope_at.default)
def rope_at(b: ProgramBuilder, n: torch.fx.Node) -> None:
    """The first position stays an array (no host read): one graph for every position."""
    _check_position(b, n.args[2])
    _emit_rope(b, n, 0, n.args[2])


@register(mlxd.rope_kv_write.default)
def rope_kv_write(b: ProgramBuilder, n: torch.fx.Node) -> None:
    """RoPE of q and k and both cache writes of one attention layer as one node."""
    q, k, v, k_cache, v_cache, inv_freq, rope_pos, write_pos, traditional, base, seq_first = n.args

    def heads_first(x: torch.fx.Node) -> list:  # the [B, H, L, D] shape the node reads x as
        s = b.shape_of(x)
        return [s[0], s[2], s[1], s[3]] if seq_first and len(s) == 4 else s

    _check_kv_update(b, k_cache, k, heads_first(k))
    _check_kv_update(b, v_cache, v, heads_first(v))
    _check_position(b, rope_pos)
    _check_position(b, write_pos)
    qs, ks = heads_first(q), heads_first(k)
    if len(qs) != 4 or b.dtype_of(q) not in FLOAT_DTYPES or b.dtype_of(k) != b.dtype_of(q):
        raise b.unsupported("q must be a floating [B, H, L, D] tensor of k's dtype")
    dims = _static_int(b, qs[-1], "the head size")
    if not same_dim(ks[-1], qs[-1]) or not same_dim(ks[2], qs[2]) or dims % 2 or b.shape_of(inv_freq) != [dims // 2]:
        raise b.unsupported(f"q / k shapes {qs} / {ks} with inv_freq of shape {b.shape_of(inv_freq)}")
    out_q, out_k, out_v = b.outs(n, 3)
    b.emit(N.RopeKvWriteNode(q=b.tensor(q), k=b.tensor(k), v=b.tensor(v), k_cache=b.tensor(k_cache),
                             v_cache=b.tensor(v_cache), rope_pos=b.tensor(rope_pos), write_pos=b.tensor(write_pos),
                             dims=dims, traditional=bool(traditional),
                             base=float(base) if base is not None else 0.0,
                             inv_freq=b.tensor(inv_freq) if base is None else None,
                             out_q=out_q, out_k_cache=out_k, out_v_cache=out_v, seq_first=bool(seq_first)))


@register(mlxd.rms_norm.default)
def rms_norm(b: ProgramBuilder, n: torch.fx.Node) -> None:
    x, weight, eps = n.args
    dtype = b.dtype_of(x)
    if dtype not in FLOAT_DTYPES or not b.shape_of(x):
        raise b.unsupported("rms_norm needs a floating input of rank >= 1")
    if weight is not None and (b.dtype_of(weight) != dtype or len(b.shape_of(weight)) != 1):
        raise b.unsupported("weight must be 1-D in the input's dtype")
    b.emit(N.RmsNormNode(x=b.tensor(x), weight=b.tensor(weight) if weight is not None else None,
                         eps=float(eps), normalized_ndim=1, out=b.out(n)))
