"""A GGUF file's weights with their own quantization, read with `gguf.GGUFReader`.

Q4_0, Q4_1, Q8_0 and Q4_K blocks are MLX affine quantization with groups of 32
(w = scale * u + bias, u unsigned), so they are repacked, never dequantized:

    Q4_0  w = d * (q - 8)                       scale d,       bias -8 d
    Q4_1  w = d * q + m                         scale d,       bias m
    Q8_0  w = d * q, q int8                     u = q + 128,   scale d, bias -128 d
    Q4_K  w = d * sc_j * q - dmin * m_j         per 32-value sub-block j: scale d * sc_j, bias -dmin * m_j

d, m, dmin are fp16 and sc_j, m_j 6-bit integers, so every product above is
exact in float32 and MLX's dequantize gives the same float32 values as
gguf's own dequantizer. Scales and biases are stored fp16 wherever that is
exact (Q4_0, Q4_1, Q8_0: d, m, -8 d, -128 d; Q4_K's d * sc_j usually is not):
half the bytes of fp32, which a memory-bound decode step reads once per token. Other types (Q5_*, Q6_K, Q2_K, Q3_K, IQ*, ...) use
5/6/3-bit values or groups of 16, which MLX's kernels or this packing do not
take: they are dequantized to float (`docs/quantization.md`).

Tensor names follow `transformers`' GGUF -> HF mapping, and llama.cpp's Q/K
row permutation for RoPE is undone as `transformers` does (llama architecture
only); it moves whole rows, so it applies to packed rows, scales and biases alike.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..quantization import MLXQuantized

GROUP = 32  # MLX group size every repacked type uses
Unpacked = tuple[np.ndarray, np.ndarray, np.ndarray, int]  # u [N, K] uint8, scale / bias [N, K / 32], bits


def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian fp16 from the last axis' 2 bytes, as float32 (drops that axis)."""
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] values: the low nibbles are values 0-15, the high ones 16-31."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _q4_0(b: np.ndarray) -> Unpacked:
    d = _f16(b[..., 0:2])
    return _nibbles(b[..., 2:18]), d, -8 * d, 4


def _q4_1(b: np.ndarray) -> Unpacked:
    return _nibbles(b[..., 4:20]), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 4


def _q8_0(b: np.ndarray) -> Unpacked:
    d = _f16(b[..., 0:2])
    u = (np.ascontiguousarray(b[..., 2:34]).view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return u, d, -128 * d, 8


def _q4_k(b: np.ndarray) -> Unpacked:
    """256-value super-blocks: d, dmin, 12 bytes of 6-bit scales / mins for 8 sub-blocks of 32, 128 bytes of nibbles."""
    n, blocks = b.shape[:2]
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    lo, hi, mixed = b[..., 4:8], b[..., 8:12], b[..., 12:16]
    sc = np.concatenate([lo & 63, (mixed & 15) | ((lo >> 2) & 48)], axis=-1)
    mn = np.concatenate([hi & 63, (mixed >> 4) | ((hi >> 2) & 48)], axis=-1)
    qs = b[..., 16:144].reshape(n, blocks, 4, 32)  # chunk c: sub-block 2c in the low nibbles, 2c + 1 in the high
    u = np.stack([qs & 15, qs >> 4], axis=-2).reshape(n, blocks, 8, 32)
    return u, d * sc.astype(np.float32), -(dmin * mn.astype(np.float32)), 4


# type name -> (values per block, bytes per block, unpack [N, blocks, bytes] -> Unpacked)
REPACKABLE: dict[str, tuple[int, int, Callable[[np.ndarray], Unpacked]]] = {
    "Q4_0": (32, 18, _q4_0), "Q4_1": (32, 20, _q4_1), "Q8_0": (32, 34, _q8_0), "Q4_K": (256, 144, _q4_k),
}


def pack(u: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned values [N, K] -> MLX's int32 words [N, K * bits / 32] (value i at bits * (i % (32 / bits)))."""
    u = np.ascontiguousarray(u, dtype=np.uint8)
    if bits == 4:
        u = np.ascontiguousarray(u[:, 0::2] | (u[:, 1::2] << 4))
    elif bits != 8:
        raise ValueError(f"cannot pack {bits}-bit values into bytes")
    return u.view("<i4").astype(np.int32)


def _stored(scale: np.ndarray, bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Scales and biases in fp16 when both survive the round trip exactly, else float32."""
    half = scale.astype(np.float16), bias.astype(np.float16)
    exact = all(np.array_equal(h.astype(np.float32), f) for h, f in zip(half, (scale, bias)))
    return half if exact else (scale, bias)


def repack(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> MLXQuantized:
    """A 2-D GGUF tensor's raw blocks ([N, bytes per row] uint8) in MLX's affine format; scales / biases
    fp16 where exact (see `_stored`), else float32."""
    per_block, nbytes, unpack = REPACKABLE[type_name]
    n, k = shape
    if k % per_block or raw.shape != (n, k // per_block * nbytes):
        raise ValueError(f"{type_name} data {raw.shape} does not hold a [{n}, {k}] weight")
    u, scale, bias, bits = unpack(raw.reshape(n, k // per_block, nbytes))
    scale, bias = _stored(scale, bias)
    return MLXQuantized(torch.from_numpy(pack(u.reshape(n, k), bits)),
                        torch.from_numpy(np.ascontiguousarray(scale.reshape(n, k // GROUP))),
                        torch.from_numpy(np.ascontiguousarray(bias.reshape(n, k // GROUP))), GROUP, bits)


def unpermute_rows(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order (rotary pairs interleaved per head) on the first axis."""
    rows = t.shape[0]
    return t.reshape(n_head, rows // n_head // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return field.contents() if field is not None else None


def read(path: str | Path, *, dequantize: bool = False
         ) -> tuple[Any, dict[str, torch.Tensor], dict[str, MLXQuantized]]:
    """(HF config, float32 HF state dict, repacked quantized weights by HF name) from a GGUF file.

    With `dequantize`, every tensor comes back in the float state dict (gguf's dequantizer)."""
    import gguf
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    from .loading import hf_class

    if sys.byteorder != "little":
        raise ValueError("reading GGUF blocks needs a little-endian host")
    path = Path(path)
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    with torch.device("meta"):  # only names the tensors; no memory
        skeleton = hf_class(config)(config)
    names = get_gguf_hf_weights_map(skeleton, TensorProcessor())
    reader = gguf.GGUFReader(path)
    heads = {".attn_q.": config.num_attention_heads,
             ".attn_k.": config.num_key_value_heads or config.num_attention_heads}
    permute = _field(reader, "general.architecture") == "llama"  # as transformers' LlamaTensorProcessor
    floats: dict[str, torch.Tensor] = {}
    quantized: dict[str, MLXQuantized] = {}
    for t in reader.tensors:
        name = names.get(t.name)
        if name is None:
            continue
        n_head = next((h for key, h in heads.items() if key in t.name), None) if permute else None
        type_name = t.tensor_type.name
        if not dequantize and type_name in REPACKABLE and len(t.shape) == 2:
            q = repack(np.asarray(t.data), type_name, (int(t.shape[1]), int(t.shape[0])))
            if n_head is not None:
                q.w, q.scales, q.biases = (unpermute_rows(x, n_head) for x in (q.w, q.scales, q.biases))
            quantized[name] = q
            continue
        w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        floats[name] = unpermute_rows(w, n_head) if n_head is not None else w
    return config, floats, quantized
