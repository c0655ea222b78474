"""Custom ops in the `mlx_delegate` namespace.

Models call `kv_cache_update` (an int position) or `kv_cache_update_at` (a
tensor position) directly; the pattern passes (`mlx_delegate.patterns`)
rewrite decomposed RoPE and RMSNorm subgraphs into `rope` / `rope_at` /
`rms_norm`. Each op
has a CPU reference implementation (eager runs and ExecuTorch-free checks) and
a fake kernel for export; the delegate lowers them to MLX's fused kernels.
"""

from __future__ import annotations

import torch
from torch import Tensor

SEQ_AXIS = 2  # caches are [B, H, S_max, D], the layout SDPA reads


@torch.library.custom_op("mlx_delegate::kv_cache_update", mutates_args=())
def kv_cache_update(cache: Tensor, update: Tensor, start_pos: int) -> Tensor:
    """`cache` with `update` ([B, H, L, D]) written at positions start_pos..start_pos+L-1.

    Functional on purpose: `buffer.copy_(kv_cache_update(buffer, ...))` exports
    as a buffer mutation whose new value is this op's result, which the delegate
    keeps resident and updates in place.
    """
    end = start_pos + update.shape[SEQ_AXIS]
    if start_pos < 0 or end > cache.shape[SEQ_AXIS]:
        raise IndexError(f"kv_cache_update: positions [{start_pos}, {end}) do not fit a cache of "
                         f"{cache.shape[SEQ_AXIS]}")
    out = cache.clone()
    out[:, :, start_pos:end] = update
    return out


@kv_cache_update.register_fake
def _(cache: Tensor, update: Tensor, start_pos: int) -> Tensor:
    return torch.empty_like(cache)


@torch.library.custom_op("mlx_delegate::kv_cache_update_at", mutates_args=())
def kv_cache_update_at(cache: Tensor, update: Tensor, start_pos: Tensor) -> Tensor:
    """`kv_cache_update` with the position as a one-element integer tensor.

    The exported graph then does not depend on the position's value: a decode
    step has the same shapes at every position, so the delegate serves all of
    them with one compiled graph. The delegate checks the position on the host
    (an input's value) and refuses a write past the end, as this reference does.
    """
    return kv_cache_update(cache, update, int(start_pos.reshape(-1)[0]))


@kv_cache_update_at.register_fake
def _(cache: Tensor, update: Tensor, start_pos: Tensor) -> Tensor:
    return torch.empty_like(cache)


def rope_reference(x: Tensor, offset: int, inv_freq: Tensor, traditional: bool) -> Tensor:
    """Rotary embedding of the last axis of x [..., L, D] at positions offset..offset+L-1."""
    length, dim = x.shape[-2], x.shape[-1]
    pos = torch.arange(offset, offset + length, dtype=torch.float32, device=x.device)
    angles = pos[:, None] * inv_freq.float()[None, :]  # [L, D/2]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    if traditional:  # pairs (x0, x1), (x2, x3), ...
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)
    x1, x2 = x[..., : dim // 2], x[..., dim // 2:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


@torch.library.custom_op("mlx_delegate::rope", mutates_args=())
def rope(x: Tensor, inv_freq: Tensor, offset: int, traditional: bool, base: float | None) -> Tensor:
    """RoPE over the whole last axis. `base`, when given, says inv_freq is the
    standard base ** (-2i / D) (MLX then computes it); otherwise inv_freq is used as is."""
    return rope_reference(x, offset, inv_freq, traditional)


@rope.register_fake
def _(x: Tensor, inv_freq: Tensor, offset: int, traditional: bool, base: float | None) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("mlx_delegate::rope_at", mutates_args=())
def rope_at(x: Tensor, inv_freq: Tensor, offset: Tensor, traditional: bool, base: float | None) -> Tensor:
    """`rope` with the first position held in a one-element integer tensor: the
    graph does not depend on its value, so one compiled graph serves every step."""
    return rope_reference(x, int(offset.reshape(-1)[0]), inv_freq, traditional)


@rope_at.register_fake
def _(x: Tensor, inv_freq: Tensor, offset: Tensor, traditional: bool, base: float | None) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("mlx_delegate::rope_kv_write", mutates_args=())
def rope_kv_write(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, inv_freq: Tensor,
                  rope_pos: Tensor, write_pos: Tensor, traditional: bool, base: float | None,
                  seq_first: bool) -> tuple[Tensor, Tensor, Tensor]:
    """One attention layer's RoPE and cache writes: (rope_at(q, rope_pos), the k cache with
    rope_at(k, rope_pos) written at write_pos, the v cache with v written there). q, k, v are
    [B, H, L, D], or [B, L, H, D] with seq_first (transposed here). The fusion
    `fuse_rope_kv_write` (`patterns/rope_kv.py`) builds it from those four ops (and the transposes)."""
    if seq_first:
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    return (rope_at(q, inv_freq, rope_pos, traditional, base),
            kv_cache_update_at(k_cache, rope_at(k, inv_freq, rope_pos, traditional, base), write_pos),
            kv_cache_update_at(v_cache, v, write_pos))


@rope_kv_write.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, inv_freq: Tensor, rope_pos: Tensor,
      write_pos: Tensor, traditional: bool, base: float | None, seq_first: bool) -> tuple[Tensor, Tensor, Tensor]:
    q = q.transpose(1, 2) if seq_first else q
    return q.new_empty(q.shape), torch.empty_like(k_cache), torch.empty_like(v_cache)


@torch.library.custom_op("mlx_delegate::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """x / sqrt(mean(x^2, -1) + eps) * weight, computed in float32, returned in x's dtype."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else (weight * y).to(x.dtype)


@rms_norm.register_fake
def _(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("mlx_delegate::linear_group", mutates_args=())
def linear_group(x: Tensor, weights: list[Tensor], biases: list[Tensor | None]) -> list[Tensor]:
    """[linear(x, w, b) for w, b in zip(weights, biases)]: the linears reading one input
    (q/k/v, gate/up), which the delegate computes as one product over the stacked weights."""
    return [torch.nn.functional.linear(x, w, b) for w, b in zip(weights, biases)]


@linear_group.register_fake
def _(x: Tensor, weights: list[Tensor], biases: list[Tensor | None]) -> list[Tensor]:
    return [x.new_empty([*x.shape[:-1], w.shape[0]]) for w in weights]


# The activations `linear_act` takes, by name (the `act` argument).
LINEAR_ACTIVATIONS = {
    "gelu": lambda y: torch.nn.functional.gelu(y),
    "gelu_tanh": lambda y: torch.nn.functional.gelu(y, approximate="tanh"),
    "silu": torch.nn.functional.silu,
    "hardswish": torch.nn.functional.hardswish,
    "hardsigmoid": torch.nn.functional.hardsigmoid,
}


@torch.library.custom_op("mlx_delegate::linear_act", mutates_args=())
def linear_act(x: Tensor, weight: Tensor, bias: Tensor | None, act: str) -> Tensor:
    """act(linear(x, weight, bias)) with act one of LINEAR_ACTIVATIONS: a linear with its activation
    fused (patterns/linear_activation.py)."""
    if act not in LINEAR_ACTIVATIONS:
        raise ValueError(f"linear_act: unknown activation {act!r}; known: {sorted(LINEAR_ACTIVATIONS)}")
    return LINEAR_ACTIVATIONS[act](torch.nn.functional.linear(x, weight, bias))


@linear_act.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None, act: str) -> Tensor:
    return x.new_empty([*x.shape[:-1], weight.shape[0]])


@torch.library.custom_op("mlx_delegate::linear_residual", mutates_args=())
def linear_residual(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor) -> Tensor:
    """linear(x, weight, bias) + residual, residual in the output's shape: a residual connection
    fused into the linear before it (patterns/linear_residual.py)."""
    return torch.nn.functional.linear(x, weight, bias) + residual


@linear_residual.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor) -> Tensor:
    return x.new_empty([*x.shape[:-1], weight.shape[0]])


def _conv_fused(x: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int], padding: list[int],
                padding_hi: list[int], dilation: list[int], groups: int) -> Tensor:
    # padding per spatial axis on the low side, padding_hi on the high side (F.pad lists the last axis first).
    pads = [p for lo, hi in zip(reversed(padding), reversed(padding_hi)) for p in (lo, hi)]
    return torch.ops.aten.convolution(torch.nn.functional.pad(x, pads), weight, bias, stride, [0] * len(stride),
                                      dilation, False, [0] * len(stride), groups)


# The activations `conv_fused` applies after its clamp, by name (the `act` argument; "none": no activation).
CONV_ACTIVATIONS = {
    "none": lambda y: y,
    "hardswish": torch.nn.functional.hardswish,
    "hardsigmoid": torch.nn.functional.hardsigmoid,
    "sigmoid": torch.sigmoid,
    **LINEAR_ACTIVATIONS,
}


@torch.library.custom_op("mlx_delegate::conv_fused", mutates_args=())
def conv_fused(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None, stride: list[int],
               padding: list[int], padding_hi: list[int], dilation: list[int], groups: int, lo: float,
               hi: float, act: str = "none", in_scale: Tensor | None = None) -> Tensor:
    """A convolution with what surrounds it fused (patterns/conv_fusions.py): its input multiplied by
    `in_scale` ([N, C, 1, ...]: a per-image, per-channel gate such as squeeze-excite's), zero padding of
    the input (asymmetric: `padding` low, `padding_hi` high side per axis), a residual added to its
    result, the bounds [lo, hi] (ReLU, ReLU6, hardtanh, clamp; -inf / inf: none), then `act` (one of
    CONV_ACTIVATIONS)."""
    if act not in CONV_ACTIVATIONS:
        raise ValueError(f"conv_fused: unknown activation {act!r}; known: {sorted(CONV_ACTIVATIONS)}")
    if in_scale is not None:
        x = x * in_scale
    y = _conv_fused(x, weight, bias, stride, padding, padding_hi, dilation, groups)
    if residual is not None:
        y = y + residual
    return CONV_ACTIVATIONS[act](y.clamp(lo, hi))


@conv_fused.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None, stride: list[int],
      padding: list[int], padding_hi: list[int], dilation: list[int], groups: int, lo: float,
      hi: float, act: str = "none", in_scale: Tensor | None = None) -> Tensor:
    return torch.empty_like(_conv_fused(x, weight, bias, stride, padding, padding_hi, dilation, groups))


# The squeeze-excite arguments of inverted_residual (after the block's own), in order.
SE_ARGS = ("se_reduce_weight", "se_reduce_bias", "se_reduce_lo", "se_reduce_hi", "se_reduce_act",
           "se_expand_weight", "se_expand_bias", "se_expand_lo", "se_expand_hi", "se_expand_act")


def _stage(y: Tensor, lo: float, hi: float, act: str) -> Tensor:
    if act not in CONV_ACTIVATIONS:
        raise ValueError(f"inverted_residual: unknown activation {act!r}; known: {sorted(CONV_ACTIVATIONS)}")
    return CONV_ACTIVATIONS[act](y.clamp(lo, hi))


def _inverted_residual(x: Tensor, expand_weight: Tensor | None, expand_bias: Tensor | None, dw_weight: Tensor,
                       dw_bias: Tensor | None, project_weight: Tensor, project_bias: Tensor | None,
                       residual: Tensor | None, stride: list[int], padding: list[int], padding_hi: list[int],
                       expand_lo: float, expand_hi: float, dw_lo: float, dw_hi: float, expand_act: str,
                       dw_act: str, se_reduce_weight: Tensor | None, se_reduce_bias: Tensor | None,
                       se_reduce_lo: float, se_reduce_hi: float, se_reduce_act: str,
                       se_expand_weight: Tensor | None, se_expand_bias: Tensor | None, se_expand_lo: float,
                       se_expand_hi: float, se_expand_act: str) -> Tensor:
    """A MobileNet-style inverted-residual block (patterns/inverted_residual.py): an optional 1x1
    expand convolution, a depthwise convolution (`stride`, `padding` low / `padding_hi` high side per
    spatial axis), optionally a squeeze-excite gate on its output (the per-channel mean, 1x1 reduce and
    1x1 expand convolutions; absent weights: none), a 1x1 project convolution, then `residual` added.
    Each stage's activation clamps to [lo, hi] (ReLU6: [0, 6]; -inf / inf: none), then applies `act`
    (one of CONV_ACTIVATIONS). Weights as torch's Conv2d holds them."""
    ones, zeros = [1, 1], [0, 0]
    conv1x1 = lambda h, w, b: _conv_fused(h, w, b, ones, zeros, zeros, ones, 1)
    h = x
    if expand_weight is not None:
        h = _stage(conv1x1(h, expand_weight, expand_bias), expand_lo, expand_hi, expand_act)
    h = _stage(_conv_fused(h, dw_weight, dw_bias, stride, padding, padding_hi, ones, h.shape[1]), dw_lo, dw_hi,
               dw_act)
    if (se_reduce_weight is None) != (se_expand_weight is None):
        raise ValueError("inverted_residual: squeeze-excite needs both its reduce and its expand weight")
    if se_reduce_weight is not None:
        s = _stage(conv1x1(h.mean([2, 3], keepdim=True), se_reduce_weight, se_reduce_bias), se_reduce_lo,
                   se_reduce_hi, se_reduce_act)
        h = h * _stage(conv1x1(s, se_expand_weight, se_expand_bias), se_expand_lo, se_expand_hi, se_expand_act)
    y = conv1x1(h, project_weight, project_bias)
    return y if residual is None else y + residual


# The op is the function above (its annotations give the schema); shapes come from running it on fake tensors.
inverted_residual = torch.library.custom_op("mlx_delegate::inverted_residual", mutates_args=())(_inverted_residual)
inverted_residual.register_fake(lambda *args: torch.empty_like(_inverted_residual(*args)))


@torch.library.custom_op("mlx_delegate::grouped_mm", mutates_args=())
def grouped_mm(x: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    """Mixture-of-experts product: x [S, K] (rows sorted by group) by weight [G, K, N]; offsets [G]
    holds the cumulative row count of each group; rows past the last offset are zero.

    `torch._grouped_mm` (2D x 3D) decomposes to this (passes/decompositions.py): the ATen op is not
    core and has no decomposition, so ExecuTorch's Edge verifier would reject it as it is.
    """
    out = x.new_zeros(x.shape[0], weight.shape[2])
    start = 0
    for g, end in enumerate(offsets.tolist()):
        out[start:end] = x[start:end] @ weight[g]
        start = end
    return out


@grouped_mm.register_fake
def _(x: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], weight.shape[2])


@torch.library.custom_op("mlx_delegate::fake_quantize", mutates_args=())
def fake_quantize(x: Tensor, inv_scale: float, scale: float, zero_point: int, quant_min: int,
                  quant_max: int, lo: float, hi: float) -> Tensor:
    """clamp(x, lo, hi), then quantize_per_tensor and dequantize_per_tensor (float32 in and out), with the
    reciprocal and scale as the float32 numbers torch multiplies by (patterns/fake_quantize.py)."""
    inv, s = torch.tensor(inv_scale, dtype=torch.float32), torch.tensor(scale, dtype=torch.float32)
    q = torch.clamp(torch.round(torch.clamp(x, lo, hi) * inv) + zero_point, quant_min, quant_max)
    return (q - zero_point) * s


@fake_quantize.register_fake
def _(x: Tensor, inv_scale: float, scale: float, zero_point: int, quant_min: int, quant_max: int, lo: float,
      hi: float) -> Tensor:
    return torch.empty_like(x)
