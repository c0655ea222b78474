"""What a speech pipeline returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Transcript:
    text: str
    tokens: list[Any]  # token ids (CTC), or per 30 s window (Whisper; prompt and end token excluded)
    audio_seconds: float
    seconds: float  # features, encoder and decoding

    @property
    def real_time_factor(self) -> float:
        return self.seconds / self.audio_seconds if self.audio_seconds else float("nan")
