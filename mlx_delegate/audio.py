"""Audio input for speech models: decoding, resampling and Whisper log-mel features.

`load_audio` gives 16 kHz mono float32 from WAV (any PCM/float layout) or FLAC
(and whatever else libsndfile reads when `soundfile` is installed; WAV works
without it). `log_mel_spectrogram` reproduces `WhisperFeatureExtractor` with
torch's STFT, without needing `transformers`.
"""

from __future__ import annotations

import functools
import math
import os
import struct
from pathlib import Path

import numpy as np
import torch

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
CHUNK_SECONDS = 30
N_SAMPLES = CHUNK_SECONDS * SAMPLE_RATE  # one Whisper window
N_FRAMES = N_SAMPLES // HOP_LENGTH


class AudioError(ValueError):
    """The audio cannot be used: unreadable, empty or not finite."""


# --- Reading ---------------------------------------------------------------------

def load_audio(path: str | os.PathLike, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Decode `path` to mono float32 at `sample_rate` (channels averaged)."""
    samples, rate = read_audio(path)
    return resample(to_mono(samples), rate, sample_rate)


def read_audio(path: str | os.PathLike) -> tuple[np.ndarray, int]:
    """(samples as float32 [frames, channels] in [-1, 1], sample rate) of a WAV or FLAC file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"audio file not found: {p}")
    try:
        import soundfile
    except ImportError:
        soundfile = None
    if soundfile is not None:
        try:
            data, rate = soundfile.read(str(p), dtype="float32", always_2d=True)
        except (RuntimeError, soundfile.LibsndfileError) as e:  # type: ignore[attr-defined]
            raise AudioError(f"{p}: not a readable audio file ({e})") from e
    elif p.read_bytes()[:4] == b"fLaC":
        raise AudioError(f"{p}: reading FLAC needs the soundfile package (pip install soundfile)")
    else:
        data, rate = read_wav(p)
    return _checked(data, rate, p)


def _checked(data: np.ndarray, rate: int, where: object) -> tuple[np.ndarray, int]:
    if rate <= 0:
        raise AudioError(f"{where}: invalid sample rate {rate}")
    if data.size == 0:
        raise AudioError(f"{where}: contains no audio samples")
    if not np.isfinite(data).all():
        raise AudioError(f"{where}: contains NaN or infinite samples")
    return data, rate


_WAVE_PCM, _WAVE_FLOAT, _WAVE_EXTENSIBLE = 1, 3, 0xFFFE


def read_wav(path: str | os.PathLike) -> tuple[np.ndarray, int]:
    """Minimal RIFF/WAVE reader (PCM 8/16/24/32-bit, float 32/64, extensible) for when soundfile is absent."""
    raw = Path(path).read_bytes()
    if len(raw) < 12 or raw[:4] != b"RIFF" or raw[8:12] != b"WAVE":
        raise AudioError(f"{path}: not a WAV file (no RIFF/WAVE header)")
    fmt, data, pos = None, None, 12
    while pos + 8 <= len(raw):
        cid, size = raw[pos:pos + 4], struct.unpack_from("<I", raw, pos + 4)[0]
        body = raw[pos + 8:pos + 8 + size]  # a streamed file may claim more than is there
        if cid == b"fmt ":
            fmt = body
        elif cid == b"data":
            data = body
            break
        pos += 8 + size + (size & 1)
    if fmt is None or len(fmt) < 16 or data is None:
        raise AudioError(f"{path}: WAV file without fmt/data chunks")
    tag, channels, rate, _, _, bits = struct.unpack_from("<HHIIHH", fmt)
    if tag == _WAVE_EXTENSIBLE and len(fmt) >= 26:
        tag = struct.unpack_from("<H", fmt, 24)[0]  # first two bytes of the sub-format GUID
    if channels == 0:
        raise AudioError(f"{path}: WAV file with 0 channels")
    samples = _decode_wav_samples(data, tag, bits, path)
    frames = len(samples) // channels
    return samples[:frames * channels].reshape(frames, channels), rate


def _decode_wav_samples(data: bytes, tag: int, bits: int, path: object) -> np.ndarray:
    width = bits // 8
    data = data[:len(data) - len(data) % width] if width else data
    if tag == _WAVE_FLOAT and bits in (32, 64):
        return np.frombuffer(data, dtype=f"<f{width}").astype(np.float32)
    if tag != _WAVE_PCM or bits not in (8, 16, 24, 32):
        raise AudioError(f"{path}: unsupported WAV encoding (format tag {tag}, {bits} bits)")
    if bits == 8:  # 8-bit WAV is unsigned
        return (np.frombuffer(data, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    if bits == 24:
        b = np.frombuffer(data, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        ints = (b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) << 8 >> 8  # sign-extend
        return ints.astype(np.float32) / float(1 << 23)
    return np.frombuffer(data, dtype=f"<i{width}").astype(np.float32) / float(1 << (bits - 1))


def to_mono(samples: np.ndarray) -> np.ndarray:
    """Average channels of [frames, channels] (or pass 1-D through) to float32 [frames]."""
    x = np.asarray(samples, dtype=np.float32)
    if x.ndim == 2:
        x = x.mean(axis=1, dtype=np.float32)
    if x.ndim != 1:
        raise AudioError(f"expected [frames] or [frames, channels] samples, got shape {x.shape}")
    return x


# --- Resampling ------------------------------------------------------------------

ZERO_CROSSINGS = 24  # filter half-width in zero crossings of the lower rate
ROLLOFF = 0.96  # cutoff as a fraction of the lower Nyquist frequency, leaves room for the transition band
KAISER_BETA = 9.0


def resample(x: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    """Band-limited (Kaiser-windowed sinc, polyphase) resampling of a 1-D float signal."""
    x = np.asarray(x, dtype=np.float32)
    if rate_in <= 0 or rate_out <= 0:
        raise AudioError(f"invalid sample rates {rate_in} -> {rate_out}")
    if rate_in == rate_out or x.size == 0:
        return x
    g = math.gcd(rate_in, rate_out)
    up, down = rate_out // g, rate_in // g
    filters, half = _polyphase_filters(up, down)
    n_out = -(-len(x) * up // down)
    padded = np.pad(x, (half, half + 1))
    windows = np.lib.stride_tricks.sliding_window_view(padded, filters.shape[1])
    out = np.empty(n_out, dtype=np.float32)
    step = 1 << 15  # bounds the gathered [step, taps] block
    for s in range(0, n_out, step):
        n = np.arange(s, min(s + step, n_out))
        base, phase = np.divmod(n * down, up)  # input index at or before each output instant, and its phase
        out[s:s + len(n)] = np.einsum("ij,ij->i", windows[base], filters[phase])
    return out


@functools.lru_cache(maxsize=16)
def _polyphase_filters(up: int, down: int) -> tuple[np.ndarray, int]:
    """[up, taps] filters: row p weighs input samples around an output at fractional offset p/up."""
    cutoff = ROLLOFF * min(1.0, up / down)  # in cycles per input sample x2 (1 = input Nyquist)
    half = int(math.ceil(ZERO_CROSSINGS / cutoff))
    taps = np.arange(-half, half + 1, dtype=np.float64)  # input offsets relative to `base`
    t = taps[None, :] - (np.arange(up, dtype=np.float64) / up)[:, None]
    window = np.i0(KAISER_BETA * np.sqrt(np.clip(1.0 - (t / (half + 1)) ** 2, 0.0, 1.0))) / np.i0(KAISER_BETA)
    return (cutoff * np.sinc(cutoff * t) * window).astype(np.float32), half


# --- Whisper log-mel features -------------------------------------------------------

def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney mel scale: linear below 1 kHz, logarithmic above."""
    f = np.asarray(f, dtype=np.float64)
    log_step = math.log(6.4) / 27.0
    return np.where(f >= 1000.0, 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / log_step, 3.0 * f / 200.0)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    log_step = math.log(6.4) / 27.0
    return np.where(m >= 15.0, 1000.0 * np.exp(log_step * (m - 15.0)), 200.0 * m / 3.0)


@functools.lru_cache(maxsize=8)
def mel_filters(n_mels: int = 80, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE,
                f_max: float = 8000.0) -> torch.Tensor:
    """[n_fft // 2 + 1, n_mels] Slaney-normalised triangular filters (as librosa / Whisper)."""
    fft_freqs = np.linspace(0, sample_rate // 2, n_fft // 2 + 1)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(f_max), n_mels + 2))
    slopes = edges[None, :] - fft_freqs[:, None]
    widths = np.diff(edges)
    rising, falling = -slopes[:, :-2] / widths[:-1], slopes[:, 2:] / widths[1:]
    fb = np.maximum(0.0, np.minimum(rising, falling))
    fb *= 2.0 / (edges[2:] - edges[:-2])  # equal area per filter
    return torch.from_numpy(fb.astype(np.float32))


def pad_or_trim(audio: np.ndarray, length: int = N_SAMPLES) -> np.ndarray:
    audio = np.asarray(audio, dtype=np.float32)
    return audio[:length] if len(audio) >= length else np.pad(audio, (0, length - len(audio)))


def log_mel_spectrogram(audio: np.ndarray | torch.Tensor, n_mels: int = 80,
                        pad_to: int | None = N_SAMPLES) -> torch.Tensor:
    """Whisper's [n_mels, frames] log-mel features of 16 kHz mono audio.

    With the default `pad_to`, audio is zero-padded or cut to one 30 s window
    (3000 frames), as `WhisperFeatureExtractor` does.
    """
    x = torch.as_tensor(np.asarray(audio, dtype=np.float32))
    if x.dim() != 1:
        raise AudioError(f"expected mono audio [samples], got shape {tuple(x.shape)}")
    if x.numel() == 0:
        raise AudioError("no audio samples")
    if pad_to is not None:
        x = torch.nn.functional.pad(x[:pad_to], (0, max(0, pad_to - x.numel())))
    stft = torch.stft(x, N_FFT, HOP_LENGTH, window=torch.hann_window(N_FFT), return_complex=True)
    power = (stft[:, :-1].abs() ** 2).contiguous()  # the last frame is dropped, as in Whisper
    mel = mel_filters(n_mels).T @ power
    log_spec = mel.clamp(min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0


def split_windows(audio: np.ndarray, seconds: int = CHUNK_SECONDS,
                  sample_rate: int = SAMPLE_RATE) -> list[np.ndarray]:
    """Consecutive `seconds`-long pieces of `audio` (the last one shorter)."""
    n = seconds * sample_rate
    return [audio[i:i + n] for i in range(0, max(len(audio), 1), n)]
