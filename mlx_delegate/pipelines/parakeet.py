"""Parakeet CTC transcription on the MLX delegate: lowering `models.parakeet`'s `forward` and
greedy CTC decoding (argmax, merge repeats, drop blanks).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from .. import audio as A
from ..models.parakeet import export, output_frames, padded_frames
from .lowering import Lowering, lower_methods
from .transcript import Transcript


def lower(model: nn.Module, max_frames: int = 8 * 1000 - 4, partitioner: Any = None,
          static: bool = False) -> Lowering:
    """Export (see `models.parakeet.export`) and lower `forward` (`MLXPartitioner` unless given
    another, e.g. XNNPACK's for comparison)."""
    return lower_methods(export(model, max_frames, static), partitioner)


def ctc_collapse(ids: list[int], blank: int) -> list[int]:
    """Greedy CTC: merge repeated ids, then drop blanks."""
    return [i for i, _ in itertools.groupby(ids) if i != blank]


class ParakeetRunner:
    def __init__(self, buffer: bytes, processor: Any, blank: int) -> None:
        from executorch.runtime import Runtime

        self.program = Runtime.get().load_program(buffer)  # keep referenced while the method runs
        self.method = self.program.load_method("forward")
        self.processor, self.blank = processor, blank
        # A dynamic input's recorded size is its upper bound.
        self.max_frames = int(self.method.metadata.input_tensor_meta(0).sizes()[1])

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """[1, valid output frames, V] for features [1, T, n_mels] of any T up to `max_frames`."""
        frames = features.shape[1]
        if frames > self.max_frames:
            raise ValueError(f"{frames} feature frames exceed the exported maximum of {self.max_frames}")
        padded = torch.nn.functional.pad(features, (0, 0, 0, padded_frames(frames) - frames))
        out = self.method.execute([padded.contiguous(), torch.tensor([frames])])[0]
        return out[:, :output_frames(frames)]

    def features(self, audio: np.ndarray) -> torch.Tensor:
        fe = getattr(self.processor, "feature_extractor", self.processor)
        return fe(audio, sampling_rate=A.SAMPLE_RATE, return_tensors="pt").input_features

    def transcribe(self, audio: np.ndarray) -> Transcript:
        start = time.perf_counter()
        ids = ctc_collapse(self.logits(self.features(audio))[0].argmax(-1).tolist(), self.blank)
        tokenizer = getattr(self.processor, "tokenizer", None)
        text = ""
        if tokenizer is not None:  # repeats are merged already: grouping again would undo blank separators
            text = tokenizer.decode(ids, group_tokens=False, skip_special_tokens=True).strip()
        return Transcript(text, ids, len(audio) / A.SAMPLE_RATE, time.perf_counter() - start)


def load(model: nn.Module, processor: Any, buffer: bytes | None = None,
         max_frames: int = 8 * 1000 - 4) -> ParakeetRunner:
    """A runner for `model` lowered for up to `max_frames` feature frames (or for a lowered `buffer`)."""
    buffer = buffer if buffer is not None else lower(model, max_frames).buffer
    return ParakeetRunner(buffer, processor, model.config.pad_token_id)
