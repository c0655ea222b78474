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

import torch
from torch import Tensor

MLX_GROUP_SIZES = (128, 64, 32)  # the affine group sizes MLX's kernels take
PACKABLE_BITS = (2, 4, 8)  # widths that tile a 32-bit word exactly
MODES = {"int8": 8, "int4": 4}
DEFAULT_GROUP_SIZE = {"int8": None, "int4": 64}  # None: one group per output channel


@dataclass
class MLXQuantized:
    """One weight in MLX's affine format: w [N, K * bits / 32] int32 words, scales and biases [N, K / group_size]."""

    w: Tensor
    scales: Tensor
    biases: Tensor
    group_size: int
    bits: int


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


def dequantize_mlx(w: Tensor, scales: Tensor, biases: Tensor, group_size: int, bits: int) -> Tensor:
    """Reference for MLX's `dequantize`: [N, K] in the scales' dtype."""
    u = unpack_words(w, bits)
    n, k = u.shape
    u = u.reshape(n, k // group_size, group_size).to(scales.dtype)
    return (scales[..., None] * u + biases[..., None]).reshape(n, k)


# ------------------------------------------------------------ fused custom ops
# Reference kernels (eager runs) and fake kernels (export) for the nodes the
# `quantized_linear` pattern emits; the delegate lowers them to MLX.

@torch.library.custom_op("mlx_delegate::quantized_linear", mutates_args=())
def quantized_linear(x: Tensor, w: Tensor, scales: Tensor, biases: Tensor, bias: Tensor | None,
                     group_size: int, bits: int) -> Tensor:
    """x @ W.T (+ bias), W the dequantized [N, K] weight."""
    return torch.nn.functional.linear(x, dequantize_mlx(w, scales, biases, group_size, bits).to(x.dtype), bias)


@quantized_linear.register_fake
def _(x: Tensor, w: Tensor, scales: Tensor, biases: Tensor, bias: Tensor | None, group_size: int,
      bits: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]))


@torch.library.custom_op("mlx_delegate::quantized_linear_group", mutates_args=())
def quantized_linear_group(x: Tensor, ws: list[Tensor], scales: list[Tensor], biases: list[Tensor],
                           bias: list[Tensor | None], group_size: int, bits: int) -> list[Tensor]:
    """`quantized_linear` for several weights of one layout reading the same x (q/k/v, gate/up),
    which the delegate computes as one product over the stacked packed weights."""
    return [quantized_linear(x, *parts, group_size, bits) for parts in zip(ws, scales, biases, bias)]


@quantized_linear_group.register_fake
def _(x: Tensor, ws: list[Tensor], scales: list[Tensor], biases: list[Tensor], bias: list[Tensor | None],
      group_size: int, bits: int) -> list[Tensor]:
    return [x.new_empty((*x.shape[:-1], w.shape[0])) for w in ws]


@torch.library.custom_op("mlx_delegate::quantized_embedding", mutates_args=())
def quantized_embedding(w: Tensor, scales: Tensor, biases: Tensor, indices: Tensor, group_size: int,
                        bits: int) -> Tensor:
    """Rows `indices` of the dequantized [N, K] table."""
    return dequantize_mlx(w, scales, biases, group_size, bits)[indices]


@quantized_embedding.register_fake
def _(w: Tensor, scales: Tensor, biases: Tensor, indices: Tensor, group_size: int, bits: int) -> Tensor:
    return scales.new_empty((*indices.shape, w.shape[1] * 32 // bits))


# ------------------------------------------------------------ modules on packed weights
class QuantizedLinear(torch.nn.Module):
    """A linear layer on a weight already in MLX's affine format (e.g. a GGUF file's own blocks):
    calls `mlx_delegate::quantized_linear`, which the delegate runs on MLX's quantized kernels."""

    def __init__(self, packed: MLXQuantized, bias: Tensor | None = None) -> None:
        super().__init__()
        self.register_buffer("w", packed.w)
        self.register_buffer("scales", packed.scales)
        self.register_buffer("biases", packed.biases)
        self.bias = torch.nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.group_size, self.bits = packed.group_size, packed.bits

    def forward(self, x: Tensor) -> Tensor:
        return quantized_linear(x, self.w, self.scales, self.biases, self.bias, self.group_size, self.bits)


class QuantizedEmbedding(torch.nn.Module):
    """An embedding table in MLX's affine format; `attend` is the tied output projection on the same table."""

    def __init__(self, packed: MLXQuantized) -> None:
        super().__init__()
        self.register_buffer("w", packed.w)
        self.register_buffer("scales", packed.scales)
        self.register_buffer("biases", packed.biases)
        self.group_size, self.bits = packed.group_size, packed.bits

    def forward(self, indices: Tensor) -> Tensor:
        return quantized_embedding(self.w, self.scales, self.biases, indices, self.group_size, self.bits)

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
