"""Long runs: resident memory stays flat over many calls (no per-call leak in the
delegate, the stock runtime or MLX).

Growth is VmRSS growth minus the growth of MLX's buffer cache: freed MLX buffers
are kept for reuse by size, and a decode step at a new position needs new sizes,
so the cache (bounded by MLX's cache limit) grows with the positions visited.
With `mx.set_cache_limit(0)` the raw RSS of the decode run is flat as well."""

import mlx_delegate  # noqa: F401  (before mlx)
import mlx.core as mx  # noqa: I001
import torch
from transformers import LlamaConfig

from mlx_delegate.pipelines.llm import export as llm_export
from mlx_delegate.pipelines.llm.generate import Generator
from mlx_delegate.memory import rss_mb
from mlx_delegate.models import loading
from mlx_delegate.testing import assert_close, lower

# Growth allowed after warm-up: 4 MB over 10,000 calls is 400 B per call and
# 8 MB over 2,000 decode steps is 4 KB per step, less than the MLX graph one
# call builds (tens of arrays, each with its own descriptor and buffer), so a
# call that leaked its graph or an output would fail.
SMALL_MODEL_GROWTH_MB = 4.0
DECODE_GROWTH_MB = 8.0


def held_mb() -> float:
    """Resident memory not held by MLX's reuse cache."""
    return rss_mb() - mx.get_cache_memory() / 2**20


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 16))

    def forward(self, x):
        return torch.softmax(torch.tanh(x @ self.w) * x, dim=-1) + 1.0


def test_ten_thousand_calls_keep_memory_flat():
    m = Block().eval()
    x = torch.randn(4, 16)
    method = lower(m, (x,)).method()
    expected = method.execute([x])[0].clone()
    for _ in range(500):  # warm-up: allocator caches and pools reach their steady size
        method.execute([x])
    before = held_mb()
    for _ in range(10_000):
        out = method.execute([x])[0]
    growth = held_mb() - before
    assert torch.equal(out, expected)
    assert_close([out], m(x), 1e-5, 1e-5)
    assert growth < SMALL_MODEL_GROWTH_MB, f"RSS grew {growth:.1f} MB over 10,000 calls"


DECODE_STEPS = 2000


def test_two_thousand_decode_steps_keep_memory_flat():
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=DECODE_STEPS + 128,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = loading.from_config(config, max_seq_len=DECODE_STEPS + 128, seed=0).model
    pte = llm_export.lower(llm_export.export_model(model, max_len=8),
                           constant_methods=llm_export.metadata(model)).to_executorch().buffer
    gen = Generator(pte)
    first = [gen.step([1, 2, 3])]
    token = int(first[0].argmax())
    for _ in range(63):  # warm-up
        token = int(gen.step([token]).argmax())
    before = held_mb()
    for _ in range(DECODE_STEPS):
        logits = gen.step([token])
        token = int(logits.argmax())
    growth = held_mb() - before
    assert torch.isfinite(logits).all()
    assert gen.pos == 3 + 63 + DECODE_STEPS
    # A fresh cache reproduces the first step exactly: no state leaked across the run.
    gen.reset()
    assert torch.equal(gen.step([1, 2, 3]), first[0])
    assert growth < DECODE_GROWTH_MB, f"RSS grew {growth:.1f} MB over {DECODE_STEPS} decode steps"
