"""Next-token choice: greedy, temperature, top-k, nucleus (top-p), seeded.

Two forms of one rule:

- `sample_next` is the sampler written for export: the LLM program runs it after the
  last position's logits and returns the token id (see `llm.export`). Its settings
  (temperature, top_k, top_p) and a uniform draw `u` are inputs, so one program
  serves every setting and the host only draws one number per token.
- `Sampler` holds the settings and the seeded generator on the host. It makes
  those inputs (`device_inputs`), and still samples host-side from logits
  (`__call__`) for programs that return logits; `Sampler.probs` is the exact
  distribution both forms draw from (the reference of the tests).

The rule: temperature 0 is greedy (argmax). Otherwise the logits are divided by
the temperature, only the `top_k` most likely tokens are kept (0: all), then of
those the most likely whose renormalised mass first reaches `top_p` (at least
one), and a token is drawn in proportion to the kept probabilities.
"""

from __future__ import annotations

import torch
from torch import Tensor


def sample_next(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, u: Tensor) -> Tensor:
    """Token ids [B] (int64) from logits [B, V]; temperature, top_k (int64), top_p: [1];
    u: [B] uniform draws in [0, 1).

    Inverse-CDF draw over the probabilities sorted in descending order: the kept
    tokens are then a prefix, on which the cumulative sum is the same with or
    without the nucleus cut, so one cumsum serves both. The draw is the number of
    cumulative masses <= u times the kept mass (capped to the kept count against
    rounding).
    """
    logits = logits.float()
    greedy = logits.argmax(-1)
    sampling = temperature > 0
    scaled = logits / torch.where(sampling, temperature, torch.ones_like(temperature))
    values, order = torch.sort(scaled, dim=-1, descending=True)  # the delegate sorts stably
    probs = torch.softmax(values, dim=-1)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab, device=logits.device)
    in_top_k = (rank < top_k) | (top_k <= 0)
    probs = torch.where(in_top_k, probs, torch.zeros_like(probs))
    cum = probs.cumsum(-1)
    # Nucleus over the top-k mass: keep a token while the mass ranked above it is < top_p.
    keep = in_top_k & (cum - probs < top_p * cum[:, -1:])
    kept = keep.sum(-1, keepdim=True)
    kept_mass = torch.where(keep, probs, torch.zeros_like(probs)).sum(-1, keepdim=True)
    drawn = torch.minimum((cum <= u[:, None] * kept_mass).sum(-1, keepdim=True), kept - 1)
    token = order.gather(-1, drawn).squeeze(-1)
    return torch.where(sampling, token, greedy)


class Sampler:
    """Sampling settings and a seeded generator; temperature 0 (the default) is greedy."""

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 top_k: int = 0) -> None:
        if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
            raise ValueError(f"need temperature >= 0, 0 < top_p <= 1 and top_k >= 0 (0: all tokens), "
                             f"got temperature {temperature}, top_p {top_p}, top_k {top_k}")
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()
        # The settings' tensors are made once: per token the host only draws `u`.
        self._settings = [torch.tensor([float(temperature)]), torch.tensor([int(top_k)]),
                          torch.tensor([float(top_p)])]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def device_inputs(self) -> list[Tensor]:
        """The sampler's inputs of an LLM program that samples on device: temperature, top_k,
        top_p and this token's uniform draw."""
        return [*self._settings, torch.rand(1, generator=self.generator)]

    def probs(self, logits: Tensor) -> Tensor:
        """The distribution a token is drawn from ([V], float32); one-hot at the argmax when greedy."""
        logits = logits.float().reshape(-1)
        if self.greedy:
            return torch.nn.functional.one_hot(logits.argmax(), logits.numel()).float()
        probs = torch.softmax(logits / self.temperature, dim=-1)
        if 0 < self.top_k < probs.numel():
            kept = torch.zeros_like(probs)
            top = torch.topk(probs, self.top_k)
            probs = kept.scatter_(-1, top.indices, top.values) / top.values.sum()
        if self.top_p < 1:
            probs = top_p_filter(probs, self.top_p)
        return probs

    def __call__(self, logits: Tensor) -> int:
        """A token id drawn on the host from a logits vector."""
        if self.greedy:
            return int(torch.argmax(logits.float().reshape(-1)))
        return int(torch.multinomial(self.probs(logits), 1, generator=self.generator))


def top_p_filter(probs: Tensor, top_p: float) -> Tensor:
    """Keep the most likely tokens whose mass first reaches top_p (at least one), renormalised."""
    sorted_probs, order = torch.sort(probs, descending=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the tokens ranked above
    sorted_probs[before >= top_p] = 0
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum()
