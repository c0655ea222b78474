"""RMSNorm and RoPE patterns: they fire on the forms models write, the fused
program matches eager PyTorch, and they stay off where the fused op would not
be lowered."""

import copy

import pytest
import torch
from torch.export import Dim

from mlx_delegate.custom_ops import rope_reference
from mlx_delegate.pipelines.llm.export import lower
from mlx_delegate.models.llama import RMSNorm, apply_rope
from mlx_delegate.patterns import MLXPatternPass, apply_patterns
from mlx_delegate.testing import TOLERANCE, compare_node_and_compiled, delegate_summary


def run_lowered(module, inputs, dynamic_shapes=None, runs=()):
    """Lower with the pattern pass; returns the pattern counts and checks every run against eager."""
    module, pattern_pass = module.eval(), MLXPatternPass()
    ep = torch.export.export(module, inputs, dynamic_shapes=dynamic_shapes, strict=True)
    edge = lower(ep, pattern_pass=pattern_pass)
    buffer = edge.to_executorch().buffer  # the program reads from it: keep it alive
    dtype = next((x.dtype for x in inputs if x.is_floating_point()), torch.float32)
    rtol, atol = TOLERANCE[dtype]
    compare_node_and_compiled(buffer, [inputs, *runs], module, rtol, atol,
                              fp32_expected=copy.deepcopy(module).float())
    return pattern_pass.counts, delegate_summary(edge)


class HFRMSNorm(RMSNorm):
    """The model's RMSNorm (upcast, rsqrt, downcast, weight)."""


class NoWeightNorm(torch.nn.Module):
    def forward(self, x):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_rms_norm_fuses(dtype):
    norm = HFRMSNorm(32, 1e-5)
    torch.nn.init.normal_(norm.weight)
    counts, summary = run_lowered(norm.to(dtype), (torch.randn(2, 5, 32, dtype=dtype),))
    assert counts["rms_norm"] == 1 and summary == (1, [])


def test_rms_norm_without_weight_and_x_squared():
    counts, summary = run_lowered(NoWeightNorm(), (torch.randn(3, 16),))
    assert counts["rms_norm"] == 1 and summary == (1, [])


def test_rms_norm_pass_counts():
    """The pass reports what fired; an RMSNorm over float64 is left alone (the delegate refuses it)."""
    fp32 = torch.export.export(NoWeightNorm(), (torch.randn(3, 16),)).run_decompositions({})
    assert apply_patterns(fp32)["rms_norm"] == 1
    x64 = torch.randn(3, 16, dtype=torch.float64)
    fp64 = torch.export.export(NoWeightNorm(), (x64,)).run_decompositions({})
    assert apply_patterns(fp64)["rms_norm"] == 0


def inv_freq(dim, base=10000.0):
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


class Rope(torch.nn.Module):
    """RoPE written as the Llama model does: positions from a start offset."""

    def __init__(self, freqs):
        super().__init__()
        self.register_buffer("inv_freq", freqs)

    def forward(self, x, input_pos):  # x [B, H, L, D]
        start = input_pos.item()
        torch._check(start >= 0)
        torch._check(start < 1000)
        pos = torch.arange(start, start + x.shape[2])
        f = pos[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((f, f), dim=-1)
        return apply_rope(x, emb.cos().to(x.dtype), emb.sin().to(x.dtype))


def llama3_freqs(dim):
    """A scaled variant: not base ** (-2i / D), so the frequencies travel as a tensor."""
    f = inv_freq(dim, 500000.0)
    return torch.where(f < 1e-3, f / 8, f)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("freqs", ["standard", "scaled"])
def test_rope_fuses(dtype, freqs):
    module = Rope(inv_freq(16) if freqs == "standard" else llama3_freqs(16))
    x = torch.randn(1, 4, 3, 16, dtype=dtype)
    runs = [(torch.randn(1, 4, n, 16, dtype=dtype), torch.tensor([p])) for n, p in ((1, 3), (5, 7))]
    counts, summary = run_lowered(module, (x, torch.tensor([0])), ({2: Dim("L", min=1, max=64)}, None), runs)
    assert counts["rope"] == 1 and summary == (1, [])


def test_rope_reference_matches_the_rotate_half_form():
    x, freqs = torch.randn(2, 3, 5, 8), inv_freq(8)
    pos = torch.arange(4, 9)[:, None].float() * freqs[None, :]
    emb = torch.cat((pos, pos), -1)
    torch.testing.assert_close(rope_reference(x, 4, freqs, False), apply_rope(x, emb.cos(), emb.sin()))


class WrongRotation(Rope):
    """cat(x2, -x1) is not RoPE's rotate-half: must not fuse, and still lowers element-wise."""

    def forward(self, x, input_pos):
        pos = torch.arange(x.shape[2])
        f = pos[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((f, f), dim=-1)
        half = x.shape[-1] // 2
        return x * emb.cos() + torch.cat((x[..., half:], -x[..., :half]), -1) * emb.sin()


def test_rope_lookalike_is_not_fused():
    counts, _ = run_lowered(WrongRotation(inv_freq(16)), (torch.randn(1, 2, 4, 16), torch.tensor([0])))
    assert counts["rope"] == 0
