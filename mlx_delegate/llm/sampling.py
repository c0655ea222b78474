"""Next-token choice: greedy, temperature, nucleus (top-p), seeded."""

from __future__ import annotations

import torch


class Sampler:
    """Picks a token id from a logits vector; temperature 0 is greedy (argmax)."""

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None) -> None:
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
        self.temperature, self.top_p = temperature, top_p
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        logits = logits.float().reshape(-1)
        if self.temperature == 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / self.temperature, dim=-1)
        if self.top_p < 1:
            probs = top_p_filter(probs, self.top_p)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the most likely tokens whose mass first reaches top_p (at least one), renormalised."""
    sorted_probs, order = torch.sort(probs, descending=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the tokens ranked above
    sorted_probs[before >= top_p] = 0
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum()
