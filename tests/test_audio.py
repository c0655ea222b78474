"""Audio decoding, resampling and Whisper log-mel features."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf  # writes the test files
import torch
from scipy import signal
from transformers.models.whisper import feature_extraction_whisper as fe_mod

from mlx_delegate import audio as A

DATA = Path(__file__).parent / "data"


def _tone(freq: float, rate: int, seconds: float = 1.0, channels: int = 1) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    x = 0.5 * np.sin(2 * np.pi * freq * t)
    return np.stack([x * (c + 1) / channels for c in range(channels)], axis=1) if channels > 1 else x


@pytest.mark.parametrize("subtype", ["PCM_U8", "PCM_16", "PCM_24", "PCM_32", "FLOAT", "DOUBLE"])
@pytest.mark.parametrize("channels", [1, 2])
def test_builtin_wav_reader_matches_soundfile(tmp_path: Path, subtype: str, channels: int) -> None:
    path = tmp_path / "x.wav"
    sf.write(path, _tone(440, 8000, 0.25, channels), 8000, subtype=subtype)
    ours, rate = A.read_wav(path)
    ref, ref_rate = sf.read(path, dtype="float32", always_2d=True)
    assert rate == ref_rate == 8000 and ours.shape == ref.shape and ours.dtype == np.float32
    np.testing.assert_allclose(ours, ref, atol=1e-6)


def test_read_audio_without_soundfile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sf.write(tmp_path / "x.wav", _tone(300, 22050, 0.5, channels=2), 22050, subtype="PCM_16")
    sf.write(tmp_path / "x.flac", _tone(300, 22050, 0.5), 22050)
    monkeypatch.setitem(sys.modules, "soundfile", None)  # import soundfile -> ImportError
    x = A.load_audio(tmp_path / "x.wav")
    assert x.dtype == np.float32 and x.ndim == 1 and len(x) == 8000
    with pytest.raises(A.AudioError, match="soundfile"):
        A.load_audio(tmp_path / "x.flac")


@pytest.mark.parametrize("rate", [8000, 11025, 16000, 22050, 44100, 48000])
def test_load_audio_any_rate_stereo_to_16k_mono(tmp_path: Path, rate: int) -> None:
    path = tmp_path / "x.flac"
    sf.write(path, _tone(1000, rate, 1.0, channels=2), rate)  # channels 0.25 and 0.5 amplitude
    x = A.load_audio(path)
    assert x.dtype == np.float32 and x.shape == (16000,)
    ref = 0.375 * np.sin(2 * np.pi * 1000 * np.arange(16000) / 16000)
    np.testing.assert_allclose(x[400:-400], ref[400:-400], atol=2e-3)  # PCM_16 quantisation and edges aside


def test_resample_accuracy_and_anti_aliasing() -> None:
    x = _tone(1000, 44100, 2.0).astype(np.float32)
    y = A.resample(x, 44100, 16000)
    assert len(y) == 32000
    ref = 0.5 * np.sin(2 * np.pi * 1000 * np.arange(32000) / 16000)
    assert np.abs(y - ref)[300:-300].max() < 1e-4
    alias = A.resample(_tone(9000, 44100, 1.0), 44100, 16000)  # above the new Nyquist: must vanish
    assert np.abs(alias)[300:-300].max() < 1e-3
    up = A.resample(_tone(440, 8000, 1.0), 8000, 16000)
    ref = 0.5 * np.sin(2 * np.pi * 440 * np.arange(16000) / 16000)
    assert np.abs(up - ref)[300:-300].max() < 1e-4
    assert A.resample(x, 16000, 16000) is not None and len(A.resample(x[:3], 48000, 16000)) == 1


def test_resample_close_to_scipy() -> None:
    rng = np.random.default_rng(0)
    x = signal.lfilter(*signal.butter(8, 0.25), rng.standard_normal(22050)).astype(np.float32)  # < 2.7 kHz
    ours = A.resample(x, 22050, 16000)
    ref = signal.resample_poly(x.astype(np.float64), 320, 441)
    np.testing.assert_allclose(ours[200:-200], ref[200:-200], atol=2e-3 * np.abs(ref).max())


def test_mel_filters_match_transformers() -> None:
    for n in (80, 128):
        ref = fe_mod.WhisperFeatureExtractor(feature_size=n).mel_filters
        np.testing.assert_allclose(A.mel_filters(n).numpy(), ref, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("seconds", [0.01, 1.0, 7.3, 30.0, 41.0])
@pytest.mark.parametrize("n_mels", [80, 128])
def test_log_mel_matches_whisper_feature_extractor(seconds: float, n_mels: int) -> None:
    rng = np.random.default_rng(1)
    x = (0.1 * rng.standard_normal(int(16000 * seconds))).astype(np.float32)
    x[: len(x) // 2] *= np.linspace(0, 3, len(x) // 2, dtype=np.float32)  # a dynamic range for the max-8 clamp
    ref = fe_mod.WhisperFeatureExtractor(feature_size=n_mels)(x, sampling_rate=16000, return_tensors="pt")
    ours = A.log_mel_spectrogram(x, n_mels)
    assert ours.shape == (n_mels, A.N_FRAMES) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref.input_features[0], rtol=0, atol=1e-5)


def test_log_mel_without_padding_has_one_frame_per_hop() -> None:
    x = np.zeros(16000 * 3 + 57, dtype=np.float32)
    assert A.log_mel_spectrogram(x, pad_to=None).shape == (80, 300)


def test_speech_clip_loads() -> None:
    x = A.load_audio(DATA / "speech_en_11k.flac")
    info = sf.info(DATA / "speech_en_11k.flac")
    assert info.samplerate == 11025 and abs(len(x) / 16000 - info.duration) < 1e-3
    assert 0.05 < np.abs(x).max() <= 1.0


def test_split_windows() -> None:
    x = np.arange(16000 * 65, dtype=np.float32)
    pieces = A.split_windows(x)
    assert [len(p) for p in pieces] == [480000, 480000, 80000]
    assert np.array_equal(np.concatenate(pieces), x)


def test_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not found"):
        A.load_audio(tmp_path / "missing.wav")
    (tmp_path / "junk.wav").write_bytes(b"this is not audio at all" * 10)
    with pytest.raises(A.AudioError, match="not a"):
        A.load_audio(tmp_path / "junk.wav")
    with pytest.raises(A.AudioError, match="not a WAV"):
        A.read_wav(tmp_path / "junk.wav")
    sf.write(tmp_path / "empty.wav", np.zeros((0, 1)), 16000)
    with pytest.raises(A.AudioError, match="no audio samples"):
        A.load_audio(tmp_path / "empty.wav")
    sf.write(tmp_path / "nan.wav", np.array([0.0, np.nan, 0.1]), 16000, subtype="FLOAT")
    with pytest.raises(A.AudioError, match="NaN"):
        A.load_audio(tmp_path / "nan.wav")
    with pytest.raises(A.AudioError, match="no audio samples"):
        A.log_mel_spectrogram(np.zeros(0, dtype=np.float32))
    with pytest.raises(A.AudioError, match="mono"):
        A.log_mel_spectrogram(np.zeros((2, 100), dtype=np.float32))
    alaw = b"RIFF" + struct.pack("<I", 40) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 6, 1, 8000, 8000, 1, 8)
    (tmp_path / "alaw.wav").write_bytes(alaw + b"data" + struct.pack("<I", 4) + b"\0\0\0\0")
    with pytest.raises(A.AudioError, match="unsupported WAV encoding"):
        A.read_wav(tmp_path / "alaw.wav")
