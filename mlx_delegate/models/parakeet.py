"""Parakeet CTC (FastConformer encoder + CTC head) on the MLX delegate.

One method, `forward(features [1, T, n_mels], length [1]) -> logits [1, T / 8, V]`,
exported with a dynamic frame count. The subsampling stack (three stride-2
convolutions) only exports for frame counts of the form `8k - 4`, so features are
zero-padded up to one and `length` masks the padding exactly as `transformers`
does for a padded batch. Lowering and CTC decoding are in `mlx_delegate.pipelines.parakeet`.
"""

from __future__ import annotations

import torch
from torch import nn

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
