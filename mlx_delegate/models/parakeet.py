"""Parakeet CTC (FastConformer encoder + CTC head) on the MLX delegate.

One method, `forward(features [1, T, n_mels], length [1]) -> logits [1, T / 8, V]`,
exported with a dynamic frame count. The subsampling stack (three stride-2
convolutions) only exports for frame counts of the form `8k - 4`, so features are
zero-padded up to one and `length` masks the padding exactly as `transformers`
does for a padded batch. Decoding is greedy CTC: argmax, merge repeats, drop blanks.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from .. import audio as A

SUBSAMPLING = 8
class CTCLogits(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, features: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        mask = (torch.arange(features.shape[1], device=features.device)[None] < length[:, None]).long()
        return self.model(input_features=features, attention_mask=mask).logits


def padded_frames(frames: int) -> int:
    """The smallest exportable frame count (8k - 4) that holds `frames`."""
    k = max(1, -(-(frames + 4) // SUBSAMPLING))
    return SUBSAMPLING * k - 4


def output_frames(frames: int) -> int:
    """Encoder frames for `frames` valid input frames (stride-2, kernel-3, padding-1 convolutions, thrice)."""
    for _ in range(3):
        frames = (frames - 1) // 2 + 1
    return frames


def example_inputs(model: nn.Module, frames: int = 8 * 25 - 4) -> tuple[torch.Tensor, torch.Tensor]:
    n_mels = model.config.encoder_config.num_mel_bins
    return torch.zeros(1, frames, n_mels), torch.tensor([frames])


def export(model: nn.Module, max_frames: int = 8 * 1000 - 4,
           static: bool = False) -> torch.export.ExportedProgram:
    """Export with frames = 8k - 4 for 1 <= k <= (max_frames + 4) / 8 (10 ms frames: 80 s by default).

    `static` fixes the frame count at `padded_frames(max_frames)` instead: the runner then takes input
    that pads to exactly that count (the padding masked as usual).
    """
    if static:
        inputs, shapes = example_inputs(model, padded_frames(max_frames)), None
    else:
        k = torch.export.Dim("k", min=2, max=(max_frames + 4) // SUBSAMPLING)
        inputs, shapes = example_inputs(model), {"features": {1: SUBSAMPLING * k - 4}, "length": None}
    with torch.no_grad():
        return torch.export.export(CTCLogits(model).eval(), inputs, dynamic_shapes=shapes, strict=False)


@dataclass
class Lowering:
    buffer: bytes
    fallback: dict[str, list[str]]
    segments: dict[str, int]


def lower(model: nn.Module, max_frames: int = 8 * 1000 - 4, partitioner: Any = None,
          static: bool = False) -> Lowering:
    """Export and lower `forward` (`MLXPartitioner` unless given another, e.g. XNNPACK's for comparison)."""
    from executorch.exir import to_edge_transform_and_lower

    from ..partitioner import MLXPartitioner
    from ..testing import delegate_summary

    partitioner = partitioner or MLXPartitioner()
    edge = to_edge_transform_and_lower(export(model, max_frames, static), partitioner=[partitioner])
    segments, fallback = delegate_summary(edge)
    return Lowering(edge.to_executorch().buffer, {"forward": fallback}, {"forward": segments})


def ctc_collapse(ids: list[int], blank: int) -> list[int]:
    """Greedy CTC: merge repeated ids, then drop blanks."""
    return [i for i, _ in itertools.groupby(ids) if i != blank]


@dataclass
class Transcript:
    text: str
    tokens: list[int]
    audio_seconds: float
    seconds: float

    @property
    def real_time_factor(self) -> float:
        return self.seconds / self.audio_seconds if self.audio_seconds else float("nan")


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
