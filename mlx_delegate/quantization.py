"""Weight-only int8/int4 quantization in MLX's affine format.

torchao stores a quantized weight as signed integers q in [qmin, qmax] with a
scale and an integer zero point per group along the last axis (w = (q - zp) *
scale; `torchao.dequantize_affine` in an exported graph). MLX's
`quantized_matmul` / `dequantize` read unsigned `bits`-bit values packed into
32-bit words with a scale and a bias per group (w = scale * u + bias). With
u = q - qmin the two agree exactly when bias = scale * (qmin - zp).

`to_mlx` repacks at lowering time (the `quantized_linear` pattern calls it);
the `mlx_delegate::quantized_linear` / `quantized_embedding` ops carry the
packed form to the delegate. `quantize_model` applies torchao to a model's
linear and embedding layers (the LLM path's `--quantize`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

MLX_GROUP_SIZES = (128, 64, 32)  # the affine group sizes MLX's kernels take
PACKABLE_BITS = (2, 4, 8)  # widths that tile a 32-bit word exactly
MODES = {"int8": 8, "int4": 4}
DEFAULT_GROUP_SIZE = {"int8": None, "int4": 64}  # None: one group per output channel


# MLX's microscaling modes: (group size, bits) of each; their scales are uint8 codes and they have no biases.
MICROSCALED = {"nvfp4": (16, 4), "mxfp8": (32, 8), "mxfp4": (32, 4)}
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of the 3 low bits; bit 3 is the sign


@dataclass
class MLXQuantized:
    """One weight in an MLX quantization mode: w [N, K * bits / 32] int32 words, scales (and for affine
    biases) [N, K / group_size]; `global_scale` multiplies the product (nvfp4's per-tensor scale)."""

    w: Tensor
    scales: Tensor
    biases: Tensor | None
    group_size: int
    bits: int
    mode: str = "affine"
    global_scale: float = 1.0


def bits_for_range(qmin: int, qmax: int) -> int | None:
    """The narrowest packable width holding qmax - qmin + 1 levels."""
    return next((b for b in PACKABLE_BITS if qmax - qmin < 2**b), None) if qmax >= qmin else None


def mlx_group_size(group: int) -> int | None:
    """The largest MLX group size that divides torchao's group (a group of 256 or a whole row splits exactly)."""
    return next((g for g in MLX_GROUP_SIZES if group % g == 0), None)


def pack_words(u: Tensor, bits: int) -> Tensor:
    """Pack unsigned values [N, K] into int32 words [N, K * bits / 32], value i at bits * (i % per_word)."""
    per_word = 32 // bits
    n, k = u.shape
    lanes = u.to(torch.int64).reshape(n, k // per_word, per_word)
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    words = (lanes << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # same bits as uint32


def unpack_words(w: Tensor, bits: int) -> Tensor:
    """Inverse of `pack_words`: int32 words [N, W] -> unsigned values [N, W * 32 / bits] (int64)."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    lanes = (w.to(torch.int64)[..., None] >> shifts) & (2**bits - 1)
    return lanes.reshape(*w.shape[:-1], -1)


def to_mlx(q: Tensor, scale: Tensor, zero_point: Tensor | None, group_size: int, qmin: int, qmax: int,
           dtype: torch.dtype) -> MLXQuantized | None:
    """Repack torchao's [N, K] integers with [N, K / group_size] scales / zero points; None when MLX cannot take it.

    scales and biases come out in `dtype` (the activations' dtype, which MLX's kernels require).
    """
    bits, g = bits_for_range(qmin, qmax), mlx_group_size(group_size)
    if q.dim() != 2 or bits is None or g is None or q.shape[1] % group_size:
        return None
    n, k = q.shape
    groups = k // group_size
    if scale.numel() != n * groups or (zero_point is not None and zero_point.numel() != n * groups):
        return None
    q32 = q.to(torch.int32)
    if q32.numel() and (int(q32.min()) < qmin or int(q32.max()) > qmax):
        return None
    scale = scale.reshape(n, groups).float()
    zp = zero_point.reshape(n, groups).float() if zero_point is not None else torch.zeros_like(scale)
    split = group_size // g  # MLX groups per torchao group
    scales = scale.repeat_interleave(split, dim=1)
    biases = (scale * (qmin - zp)).repeat_interleave(split, dim=1)
    return MLXQuantized(pack_words(q32 - qmin, bits), scales.to(dtype), biases.to(dtype), g, bits)


def int4_tensor_to_mlx(qdata: Tensor, scale: Tensor, zero_point: Tensor, group_size: int,
                       dtype: torch.dtype) -> MLXQuantized | None:
    """Repack torchao's `Int4Tensor` layout (`dequantize_int4_tensor`): qdata [N, K / 2] uint8, two unsigned
    nibbles a byte (even index low), scale / zero_point [K / group_size, N], w = (q - zero_point) * scale.
    Affine with bias = -scale * zero_point (the zero point may be fractional); None when MLX cannot take it."""
    if qdata.dim() != 2 or scale.dim() != 2 or zero_point.shape != scale.shape or qdata.dtype not in (
            torch.uint8, torch.int8):
        return None
    p = qdata.view(torch.uint8).to(torch.int32)
    q = torch.stack([p & 0x0F, p >> 4], dim=-1).reshape(p.shape[0], -1)
    return to_mlx(q, scale.t(), zero_point.t(), group_size, 0, 15, dtype)


def nvfp4_to_mlx(qdata: Tensor, scale: Tensor, per_tensor_scale: Tensor, block_size: int) -> MLXQuantized | None:
    """torchao's NVFP4 (`dequantize_nvfp4`: qdata [N, K / 8] words of e2m1 nibbles, value i at bits 4i; e4m3
    block scales [N, K / 16] as bytes; a float per-tensor scale) is MLX's nvfp4 bit for bit: a view."""
    if block_size != MICROSCALED["nvfp4"][0] or qdata.dim() != 2 or per_tensor_scale.numel() != 1 \
            or qdata.element_size() * qdata.shape[1] * 2 != scale.shape[-1] * block_size:
        return None
    w = qdata.contiguous().view(torch.uint8).view(torch.int32)
    return MLXQuantized(w, scale.contiguous().view(torch.uint8), None, block_size, 4, "nvfp4",
                        float(per_tensor_scale.detach()))


def mx_to_mlx(qdata: Tensor, scale: Tensor, elem_dtype: torch.dtype, block_size: int) -> MLXQuantized | None:
    """torchao's MX (`dequantize_mx`: qdata [N, K] in `elem_dtype`, e8m0 scales [N, K / block]) as MLX's mxfp8
    (e4m3 bytes packed four a word, byte i at bits 8i): exact. MLX has no e5m2 elements, hence None for those."""
    if elem_dtype != torch.float8_e4m3fn or block_size != MICROSCALED["mxfp8"][0] or qdata.dim() != 2 \
            or qdata.shape[1] % block_size or scale.numel() != qdata.numel() // block_size:
        return None
    u = qdata.contiguous().view(torch.uint8)
    return MLXQuantized(pack_words(u, 8), scale.contiguous().view(torch.uint8).reshape(qdata.shape[0], -1),
                        None, block_size, 8, "mxfp8")


def _microscaled_values(u: Tensor, mode: str) -> Tensor:
    """Element codes -> fp32 values (e2m1 for the fp4 modes, e4m3 for mxfp8)."""
    if mode == "mxfp8":
        return u.to(torch.uint8).view(torch.float8_e4m3fn).float()
    mag = torch.tensor(FP4_E2M1)[u & 7]
    return torch.where(u & 8 != 0, -mag, mag)


def _microscaled_scales(scales: Tensor, mode: str) -> Tensor:
    """Scale codes -> fp32: e4m3 for nvfp4, e8m0 (2^(e - 127)) for the mx modes."""
    if mode == "nvfp4":
        return scales.view(torch.float8_e4m3fn).float()
    return scales.view(torch.float8_e8m0fnu).float()


def dequantize_mlx(w: Tensor, scales: Tensor, biases: Tensor | None, group_size: int, bits: int,
                   mode: str = "affine", dtype: torch.dtype | None = None) -> Tensor:
    """Reference for MLX's `dequantize`: [N, K] in `dtype` (default: the scales' dtype for affine, fp32 else).
    Affine computes in the wider of the scales' dtype and `dtype` (fp16 scales into fp32: exact)."""
    u = unpack_words(w, bits)
    n, k = u.shape
    u = u.reshape(n, k // group_size, group_size)
    if mode == "affine":
        compute = scales.dtype if dtype is None else torch.promote_types(scales.dtype, dtype)
        u = u.to(compute)
        out = (scales.to(compute)[..., None] * u + biases.to(compute)[..., None]).reshape(n, k)
    elif mode in MICROSCALED:
        out = (_microscaled_values(u, mode) * _microscaled_scales(scales, mode)[..., None]).reshape(n, k)
    else:
        raise ValueError(f"unknown MLX quantization mode {mode!r}")
    return out if dtype is None else out.to(dtype)


# ------------------------------------------------------------ fused custom ops
# Reference kernels (eager runs) and fake kernels (export) for the nodes the
# `quantized_linear` pattern emits; the delegate lowers them to MLX.

@torch.library.custom_op("mlx_delegate::quantized_linear", mutates_args=())
def quantized_linear(x: Tensor, w: Tensor, scales: Tensor, biases: Tensor | None, bias: Tensor | None,
                     group_size: int, bits: int, mode: str = "affine", global_scale: float = 1.0,
                     residual: Tensor | None = None, norm: Tensor | None = None, norm_eps: float = 0.0) -> Tensor:
    """(x @ W.T) * global_scale (+ bias) (+ residual), W the dequantized [N, K] weight (in x's dtype);
    `residual` is a residual connection fused into the product, `norm` an RMSNorm's weight applied to
    x first (patterns/quantized_epilogue.py)."""
    x = _rms_normed(x, norm, norm_eps)
    weight = dequantize_mlx(w, scales, biases, group_size, bits, mode, x.dtype)
    y = torch.nn.functional.linear(x, weight)
    y = y * global_scale if global_scale != 1.0 else y
    y = y + bias if bias is not None else y
    return y + residual if residual is not None else y


@quantized_linear.register_fake
def _(x: Tensor, w: Tensor, scales: Tensor, biases: Tensor | None, bias: Tensor | None, group_size: int,
      bits: int, mode: str = "affine", global_scale: float = 1.0, residual: Tensor | None = None,
      norm: Tensor | None = None, norm_eps: float = 0.0) -> Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]))


def _rms_normed(x: Tensor, norm: Tensor | None, eps: float) -> Tensor:
    """`mlx_delegate::rms_norm(x, norm, eps)`'s values (x itself without a norm)."""
    if norm is None:
        return x
    xf = x.float()
    return (norm * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)).to(x.dtype)


@torch.library.custom_op("mlx_delegate::dequantize", mutates_args=())
def dequantize(w: Tensor, scales: Tensor, biases: Tensor | None, group_size: int, bits: int, mode: str,
               global_scale: float, dtype: torch.dtype) -> Tensor:
    """The [N, K] weight in `dtype` (times global_scale): a dequantize that feeds no linear / embedding."""
    return (dequantize_mlx(w, scales, biases, group_size, bits, mode, torch.float32) * global_scale).to(dtype)


@dequantize.register_fake
def _(w: Tensor, scales: Tensor, biases: Tensor | None, group_size: int, bits: int, mode: str,
      global_scale: float, dtype: torch.dtype) -> Tensor:
    return w.new_empty((w.shape[0], w.shape[1] * 32 // bits), dtype=dtype)


@torch.library.custom_op("mlx_delegate::quantized_linear_group", mutates_args=())
def quantized_linear_group(x: Tensor, ws: list[Tensor], scales: list[Tensor], biases: list[Tensor],
                           bias: list[Tensor | None], group_size: int, bits: int, norm: Tensor | None = None,
                           norm_eps: float = 0.0) -> list[Tensor]:
    """`quantized_linear` for several weights of one layout reading the same x (q/k/v, gate/up),
    which the delegate computes as one product over the stacked packed weights (`norm`: as there)."""
    x = _rms_normed(x, norm, norm_eps)
    return [quantized_linear(x, *parts, group_size, bits) for parts in zip(ws, scales, biases, bias)]


@quantized_linear_group.register_fake
def _(x: Tensor, ws: list[Tensor], scales: list[Tensor], biases: list[Tensor], bias: list[Tensor | None],
      group_size: int, bits: int, norm: Tensor | None = None, norm_eps: float = 0.0) -> list[Tensor]:
    return [x.new_empty((*x.shape[:-1], w.shape[0])) for w in ws]


@torch.library.custom_op("mlx_delegate::quantized_linear_glu", mutates_args=())
def quantized_linear_glu(x: Tensor, ws: list[Tensor], scales: list[Tensor], biases: list[Tensor],
                         bias: list[Tensor | None], group_size: int, bits: int, norm: Tensor | None = None,
                         norm_eps: float = 0.0) -> Tensor:
    """silu(gate) * up of a `quantized_linear_group` over [gate, up] (a SwiGLU MLP's first half), which
    the delegate computes as that one product with the gate applied while it is written."""
    gate, up = quantized_linear_group(x, ws, scales, biases, bias, group_size, bits, norm, norm_eps)
    return torch.nn.functional.silu(gate) * up


@quantized_linear_glu.register_fake
def _(x: Tensor, ws: list[Tensor], scales: list[Tensor], biases: list[Tensor], bias: list[Tensor | None],
      group_size: int, bits: int, norm: Tensor | None = None, norm_eps: float = 0.0) -> Tensor:
    return x.new_empty((*x.shape[:-1], ws[0].shape[0]))


@torch.library.custom_op("mlx_delegate::quantized_embedding", mutates_args=())
def quantized_embedding(w: Tensor, scales: Tensor, biases: Tensor | None, indices: Tensor, group_size: int,
                        bits: int, mode: str = "affine", global_scale: float = 1.0,
                        dtype: torch.dtype | None = None) -> Tensor:
    """Rows `indices` of the dequantized [N, K] table (times global_scale), in `dtype` (default for affine:
    the scales'). An index outside [0, N) is an IndexError, as for torch's embedding."""
    if mode == "affine":
        table = dequantize_mlx(w, scales, biases, group_size, bits, dtype=dtype)
    else:
        table = dequantize(w, scales, biases, group_size, bits, mode, global_scale, dtype)
    return torch.nn.functional.embedding(indices, table)


@quantized_embedding.register_fake
def _(w: Tensor, scales: Tensor, biases: Tensor | None, indices: Tensor, group_size: int, bits: int,
      mode: str = "affine", global_scale: float = 1.0, dtype: torch.dtype | None = None) -> Tensor:
    return scales.new_empty((*indices.shape, w.shape[1] * 32 // bits), dtype=dtype or scales.dtype)


# ------------------------------------------------------------ modules on packed weights
class _PackedModule(torch.nn.Module):
    """Holds a weight in MLX's affine format. Its scales and biases are part of the format and keep
    their dtype when the model moves to another (`.to(dtype)`): GGUF's fp16 d / m stay fp16 (exact),
    and the runtime reads or widens them. `dtype` follows the model: the activations' dtype."""

    def __init__(self, packed: MLXQuantized) -> None:
        super().__init__()
        self.register_buffer("w", packed.w)
        self.register_buffer("scales", packed.scales)
        self.register_buffer("biases", packed.biases)
        self.group_size, self.bits = packed.group_size, packed.bits
        self.dtype = torch.float32

    def _apply(self, fn: Any, recurse: bool = True) -> _PackedModule:
        kept = {name: self._buffers[name] for name in ("scales", "biases")}
        super()._apply(fn, recurse)
        probe = fn(torch.zeros((), dtype=self.dtype))  # what the call does to a float tensor
        self.dtype = probe.dtype
        for name, t in kept.items():
            self._buffers[name] = t.to(probe.device) if t is not None else None
        return self


class QuantizedLinear(_PackedModule):
    """A linear layer on a weight already in MLX's affine format (e.g. a GGUF file's own blocks):
    calls `mlx_delegate::quantized_linear`, which the delegate runs on MLX's quantized kernels."""

    def __init__(self, packed: MLXQuantized, bias: Tensor | None = None) -> None:
        super().__init__(packed)
        self.bias = torch.nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def forward(self, x: Tensor) -> Tensor:
        return quantized_linear(x, self.w, self.scales, self.biases, self.bias, self.group_size, self.bits)


class QuantizedEmbedding(_PackedModule):
    """An embedding table in MLX's affine format; `attend` is the tied output projection on the same table."""

    def forward(self, indices: Tensor) -> Tensor:
        return quantized_embedding(self.w, self.scales, self.biases, indices, self.group_size, self.bits,
                                   dtype=self.dtype)

    def attend(self, x: Tensor) -> Tensor:
        return quantized_linear(x, self.w, self.scales, self.biases, None, self.group_size, self.bits)


def install_packed(model: torch.nn.Module, weights: dict[str, MLXQuantized]) -> torch.nn.Module:
    """Replace the nn.Linear / nn.Embedding whose weight `weights` names ("a.b.weight") by
    `QuantizedLinear` / `QuantizedEmbedding` on the packed form (a linear keeps its bias); returns `model`."""
    for key, packed in weights.items():
        path, _, leaf = key.rpartition(".")
        module = model.get_submodule(path) if leaf == "weight" else None
        rows, cols = packed.scales.shape[0], packed.w.shape[1] * 32 // packed.bits
        if isinstance(module, torch.nn.Linear) and (module.out_features, module.in_features) == (rows, cols):
            new: torch.nn.Module = QuantizedLinear(packed, module.bias.data if module.bias is not None else None)
        elif isinstance(module, torch.nn.Embedding) and tuple(module.weight.shape) == (rows, cols):
            new = QuantizedEmbedding(packed)
        else:
            raise ValueError(f"{key}: a packed [{rows}, {cols}] weight fits no Linear / Embedding of that shape")
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, new)
    return model


# ------------------------------------------------------------ model quantization
def torchao_config(mode: str, group_size: int | None = None) -> object:
    """torchao's weight-only config for `mode` (int8 / int4); group_size None is per output channel."""
    from torchao.quantization import IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerAxis, PerGroup

    if mode not in MODES:
        raise ValueError(f"quantization mode {mode!r} is not one of {', '.join(MODES)}")
    if group_size is not None and group_size not in MLX_GROUP_SIZES:
        raise ValueError(f"group size {group_size} is not one of {', '.join(map(str, MLX_GROUP_SIZES))}")
    granularity = PerAxis(0) if group_size is None else PerGroup(group_size)
    return IntxWeightOnlyConfig(weight_dtype=getattr(torch, mode), granularity=granularity)


def quantize_model(model: torch.nn.Module, mode: str, group_size: int | None = None, *,
                   embeddings: bool = True) -> torch.nn.Module:
    """Quantize `model`'s Linear (and Embedding) weights in place with torchao; returns `model`.

    group_size defaults to 64 for int4 and per-channel for int8. Layers whose
    input size is not a multiple of the group (or of 32, per channel) stay in
    floating point. A tied embedding / lm_head weight is quantized once and
    serves both.
    """
    from torchao.quantization import quantize_

    group_size = DEFAULT_GROUP_SIZE.get(mode) if group_size is None else group_size
    config = torchao_config(mode, group_size)
    kinds = (torch.nn.Linear, torch.nn.Embedding) if embeddings else (torch.nn.Linear,)

    def eligible(module: torch.nn.Module, fqn: str) -> bool:
        weight = getattr(module, "weight", None)
        return (isinstance(module, kinds) and isinstance(weight, Tensor) and type(weight) in (Tensor, torch.nn.Parameter)
                and weight.shape[-1] % (group_size or MLX_GROUP_SIZES[-1]) == 0)

    quantize_(model, config, filter_fn=eligible)
    return model
