"""A 110M-parameter Llama-shaped stack, fp32, batch 1, sequence lengths 1 and 64.

Hidden 768, 12 layers, 12 heads, SwiGLU MLP with intermediate 2048, vocabulary
32000 with the LM head tied to the embedding (the stories110M shape). Attention
is written out as matmul + softmax + additive causal mask and RMSNorm as
pow/mean/rsqrt/mul, so the delegate sees plain ATen ops rather than fused ones.
There is no KV cache and no RoPE: every call processes the whole sequence, so
sequence 1 is a decode-sized call and sequence 64 a prefill-sized one.
The same model is written again in MLX Python, with the torch weights copied in.

    python benchmarks/stack.py [--quick] [--json out.json]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from common import Workload, main  # first: it loads mlx_delegate before mlx (see common.py)
import mlx.core as mx  # noqa: I001
import mlx.nn as mnn
import torch
from torch import nn


@dataclass(frozen=True)
class Config:
    vocab: int = 32000
    hidden: int = 768
    layers: int = 12
    heads: int = 12
    intermediate: int = 2048
    max_seq: int = 64
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


FULL = Config()
QUICK = Config(vocab=4096, hidden=256, layers=2, heads=4, intermediate=512)
SEQ_LENS = (1, 64)


# ---------------------------------------------------------------- torch

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.heads, self.head_dim = c.heads, c.head_dim
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(c.hidden, c.hidden, bias=False) for _ in range(4))

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self._split(self.wq(x)), self._split(self.wk(x)), self._split(self.wv(x))
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim) + mask
        out = torch.matmul(torch.softmax(scores, dim=-1), v)
        b, _, t, _ = out.shape
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.w1 = nn.Linear(c.hidden, c.intermediate, bias=False)  # gate
        self.w3 = nn.Linear(c.hidden, c.intermediate, bias=False)  # up
        self.w2 = nn.Linear(c.intermediate, c.hidden, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(c.hidden, c.eps), Attention(c)
        self.ffn_norm, self.feed_forward = RMSNorm(c.hidden, c.eps), MLP(c)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), mask)
        return x + self.feed_forward(self.ffn_norm(x))


def causal_mask(n: int) -> torch.Tensor:
    # The most negative float rather than -inf: no engine can turn a fully masked row into NaN.
    return torch.full((n, n), torch.finfo(torch.float32).min).triu(1)


class Stack(nn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(c.vocab, c.hidden)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.hidden, c.eps)
        self.output = nn.Linear(c.hidden, c.vocab, bias=False)
        self.output.weight = self.tok_embeddings.weight  # tied, as in stories110M
        self.register_buffer("mask", causal_mask(c.max_seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        mask = self.mask[:t, :t]
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, mask)
        return self.output(self.norm(x))


# ---------------------------------------------------------------- MLX Python mirror

class MxRMSNorm(mnn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = mx.ones((dim,))

    def __call__(self, x: mx.array) -> mx.array:
        return x * mx.rsqrt(mx.mean(mx.power(x, 2), axis=-1, keepdims=True) + self.eps) * self.weight


class MxAttention(mnn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.heads, self.head_dim = c.heads, c.head_dim
        self.wq, self.wk, self.wv, self.wo = (mnn.Linear(c.hidden, c.hidden, bias=False) for _ in range(4))

    def _split(self, x: mx.array) -> mx.array:
        b, t, _ = x.shape
        return x.reshape(b, t, self.heads, self.head_dim).transpose(0, 2, 1, 3)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        q, k, v = self._split(self.wq(x)), self._split(self.wk(x)), self._split(self.wv(x))
        scores = mx.matmul(q, k.transpose(0, 1, 3, 2)) / math.sqrt(self.head_dim) + mask
        out = mx.matmul(mx.softmax(scores, axis=-1), v)
        b, _, t, _ = out.shape
        return self.wo(out.transpose(0, 2, 1, 3).reshape(b, t, -1))


class MxMLP(mnn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.w1 = mnn.Linear(c.hidden, c.intermediate, bias=False)
        self.w3 = mnn.Linear(c.hidden, c.intermediate, bias=False)
        self.w2 = mnn.Linear(c.intermediate, c.hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.w2(mnn.silu(self.w1(x)) * self.w3(x))


class MxBlock(mnn.Module):
    def __init__(self, c: Config) -> None:
        super().__init__()
        self.attention_norm, self.attention = MxRMSNorm(c.hidden, c.eps), MxAttention(c)
        self.ffn_norm, self.feed_forward = MxRMSNorm(c.hidden, c.eps), MxMLP(c)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        x = x + self.attention(self.attention_norm(x), mask)
        return x + self.feed_forward(self.ffn_norm(x))


class MxStack(mnn.Module):
    """Same parameter names as `Stack`, so the torch state dict loads as is."""

    def __init__(self, c: Config) -> None:
        super().__init__()
        self.tok_embeddings = mnn.Embedding(c.vocab, c.hidden)
        self.layers = [MxBlock(c) for _ in range(c.layers)]
        self.norm = MxRMSNorm(c.hidden, c.eps)
        self._mask = mx.array(causal_mask(c.max_seq).numpy())  # leading _: not a parameter

    def __call__(self, tokens: mx.array) -> mx.array:
        t = tokens.shape[1]
        mask = self._mask[:t, :t]
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, mask)
        return self.tok_embeddings.as_linear(self.norm(x))  # tied LM head


def mlx_mirror(model: Stack, c: Config) -> Callable[[], Callable[..., Any]]:
    def build() -> Callable[..., Any]:
        mirror = MxStack(c)
        # The tied LM head is the embedding in MLX; the mask is a buffer, not a weight.
        weights = [(k, mx.array(v.detach().numpy())) for k, v in model.state_dict().items()
                   if k != "output.weight"]
        mirror.load_weights(weights, strict=True)
        mx.eval(mirror.parameters())
        return mirror

    return build


# ---------------------------------------------------------------- workloads

def parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights count once


def workloads(quick: bool) -> Iterator[Workload]:
    c = QUICK if quick else FULL
    torch.manual_seed(0)
    model = Stack(c).eval()
    params = sum(p.numel() for p in model.parameters())
    name = f"stack {params / 1e6:.0f}M"
    for t in SEQ_LENS:
        tokens = torch.randint(0, c.vocab, (1, t))
        yield Workload(f"{name} T={t}", model, (tokens,), mlx_mirror(model, c), tokens=t,
                       weight_bytes=parameter_bytes(model))


if __name__ == "__main__":
    main(__doc__.splitlines()[0], [workloads])
