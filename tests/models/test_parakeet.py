"""ParakeetForCTC (random weights) through the MLX delegate against eager `transformers`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import (
    ParakeetCTCConfig, ParakeetEncoderConfig, ParakeetFeatureExtractor, ParakeetForCTC, ParakeetProcessor,
    ParakeetTokenizer,
)

from mlx_delegate import audio as A
from mlx_delegate.models import parakeet as PM
from mlx_delegate.pipelines import cache as C
from mlx_delegate.pipelines import parakeet as P
from mlx_delegate.testing import shared_lowering

MAX_FRAMES = 8 * 150 - 4
CHARS = list("abcdefghijklmnopqrstuvwxyz") + ["\u2581", "'", "<unk>", "<pad>"]  # blank = pad = last


def tiny_parakeet() -> ParakeetForCTC:
    enc = ParakeetEncoderConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                subsampling_conv_channels=16, num_mel_bins=80, conv_kernel_size=9, dropout=0.0,
                                layerdrop=0.0, activation_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    model = ParakeetForCTC(ParakeetCTCConfig(encoder_config=enc.to_dict(), vocab_size=len(CHARS),
                                             pad_token_id=len(CHARS) - 1)).eval()
    with torch.no_grad():  # a larger head spreads the random logits, so argmax has no near-ties
        model.ctc_head.weight.mul_(20)
    return model


def char_processor() -> ParakeetProcessor:
    from tokenizers import Tokenizer, decoders, models

    tk = Tokenizer(models.WordLevel({c: i for i, c in enumerate(CHARS)}, unk_token="<unk>"))
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tokenizer = ParakeetTokenizer(tokenizer_object=tk, pad_token="<pad>", unk_token="<unk>")
    return ParakeetProcessor(feature_extractor=ParakeetFeatureExtractor(), tokenizer=tokenizer)


@pytest.fixture(scope="module")
def lowered(tmp_path_factory: pytest.TempPathFactory) -> tuple[ParakeetForCTC, P.Lowering]:
    model = tiny_parakeet()
    return model, shared_lowering(tmp_path_factory, "tiny-parakeet", lambda: P.lower(model, MAX_FRAMES))


def test_fully_delegated_one_segment(lowered) -> None:
    _, low = lowered
    assert low.fallback == {"forward": []}, f"ops left outside the delegate: {low.fallback}"
    assert low.segments == {"forward": 1}


def test_frame_count_helpers() -> None:
    assert [PM.padded_frames(n) for n in (1, 4, 5, 12, 13, 196)] == [4, 4, 12, 12, 20, 196]
    assert all((PM.padded_frames(n) + 4) % 8 == 0 for n in range(1, 100))
    assert [PM.output_frames(n) for n in (4, 12, 100, 101, 196)] == [1, 2, 13, 13, 25]


@pytest.mark.parametrize("frames", [9, 100, 196, 333, MAX_FRAMES])
def test_logits_match_eager_at_any_length(lowered, frames: int, runtime_path: str) -> None:
    """Any frame count: padded to 8k - 4 and masked by length, equal to eager on the unpadded input."""
    model, low = lowered
    runner = P.ParakeetRunner(low.buffer, None, model.config.pad_token_id)
    features = torch.randn(1, frames, 80)
    with torch.no_grad():
        expected = model(input_features=features).logits
    torch.testing.assert_close(runner.logits(features), expected, rtol=1e-4, atol=1e-4)


def test_static_export_masks_padding() -> None:
    """`static=True` fixes the frame count (benchmarks/speech.py's XNNPACK rows); the padded frames are masked."""
    model = tiny_parakeet()
    low = P.lower(model, 8 * 20 - 4, static=True)
    runner = P.ParakeetRunner(low.buffer, None, model.config.pad_token_id)
    assert runner.max_frames == 8 * 20 - 4
    features = torch.randn(1, 8 * 20 - 6, 80)  # padded by 2 frames to the exported count
    with torch.no_grad():
        expected = model(input_features=features).logits
    torch.testing.assert_close(runner.logits(features), expected, rtol=1e-4, atol=1e-4)


def test_too_long_is_a_clear_error(lowered) -> None:
    model, low = lowered
    runner = P.ParakeetRunner(low.buffer, None, model.config.pad_token_id)
    with pytest.raises(ValueError, match="exceed"):
        runner.logits(torch.zeros(1, MAX_FRAMES + 1, 80))


def test_ctc_collapse() -> None:
    assert P.ctc_collapse([5, 5, 9, 1, 1, 9, 5, 9, 9], blank=9) == [5, 1, 5]
    assert P.ctc_collapse([9, 9], blank=9) == [] and P.ctc_collapse([], blank=0) == []


def test_transcribe_matches_eager_generate(lowered) -> None:
    model, low = lowered
    processor = char_processor()
    runner = P.load(model, processor, buffer=low.buffer)
    assert runner.max_frames == MAX_FRAMES
    rng = np.random.default_rng(0)
    audio = (0.1 * rng.standard_normal(16000 * 7 // 2)).astype(np.float32)  # 3.5 s
    result = runner.transcribe(audio)
    inputs = processor.feature_extractor(audio, sampling_rate=16000, return_tensors="pt")
    with torch.no_grad():
        eager_ids = model.generate(input_features=inputs.input_features)[0].tolist()
    assert result.tokens == P.ctc_collapse(eager_ids, model.config.pad_token_id)
    assert result.tokens, "random weights should emit some non-blank tokens"
    assert result.text == processor.tokenizer.decode(eager_ids, skip_special_tokens=True).strip()
    assert result.real_time_factor > 0


def test_cli_transcribe_parakeet_directory(lowered, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture) -> None:
    """`mlx-delegate transcribe --model DIR` with a saved transformers ParakeetForCTC (program from the cache)."""
    import soundfile as sf
    from mlx_delegate.cli import main
    from mlx_delegate.cli import transcribe as T

    model, low = lowered
    model_dir = tmp_path / "parakeet"
    model.save_pretrained(model_dir)
    char_processor().save_pretrained(model_dir)
    monkeypatch.setenv("MLX_DELEGATE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(C, "code_fingerprint", lambda: "fixed")
    source = T.resolve_model(str(model_dir))
    assert source.kind == "hf-parakeet"
    T.cache_key(source).path().write_bytes(low.buffer)
    rng = np.random.default_rng(1)
    audio = (0.1 * rng.standard_normal(22050 * 2)).astype(np.float32)
    sf.write(tmp_path / "a.wav", audio, 22050)
    assert main(["transcribe", str(tmp_path / "a.wav"), "--model", str(model_dir), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    expected = P.load(model, char_processor(), buffer=low.buffer).transcribe(A.load_audio(tmp_path / "a.wav"))
    assert out["text"] == expected.text and out["real_time_factor"] > 0
