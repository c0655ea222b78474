"""Kernel chains (cpp/kernel_chain.cpp): a traced graph's runs of the runtime's own CPU kernels folded
into one MLX primitive each. Through the stock runtime, the compiled calls (which run the chains) match
eager torch, and equal bit for bit the node-by-node calls and the compiled calls with chains off: with
a run split by a view and an MLX op, member results read inside and outside their run, results that
are program outputs, a mutable buffer updated from a chain, and float32 / bfloat16 / float16."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from mlx_delegate import _runtime
from mlx_delegate.testing import (
    CALLS_TO_REPLAY, TOLERANCE, assert_close, cpu_kernels_active, lower, runtime_switch, runtime_switches,
)




class Mixed(torch.nn.Module):
    """Linears with GELU and a residual, LayerNorm, softmax (kernels), then a transpose and MLX ops."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = torch.nn.Linear(48, 64)
        self.b = torch.nn.Linear(64, 48)
        self.c = torch.nn.Linear(48, 40)
        self.d = torch.nn.Linear(40, 48)
        self.ln = torch.nn.LayerNorm(48)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = F.gelu(self.a(x))
        y = self.b(h) + x  # read by the norm (in the run) and returned
        z = self.ln(y)  # read twice in the run
        s = torch.softmax(self.c(z), dim=-1)
        k = F.silu(z)
        t = torch.tanh(s.transpose(-1, -2)) * 2  # a view and MLX ops split the run
        u = self.ln(F.silu(self.d(t.transpose(-1, -2)) + y))  # a second run reading the first's
        return y, s, u, k


class Accumulate(torch.nn.Module):
    """A mutable buffer updated from a run's result every call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)
        self.ln = torch.nn.LayerNorm(32)
        self.register_buffer("state", torch.zeros(4, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.state.add_(torch.relu(self.lin(self.ln(x + self.state))))
        return torch.softmax(self.state, dim=-1)


def run(lowered, calls: list[torch.Tensor], compile: bool, chain: bool) -> list[list[torch.Tensor]]:
    with runtime_switches(compile=compile), runtime_switch("kernel_chains", chain):
        method = lowered.fresh_method()
        return [[o.clone() for o in method.execute([x.clone()])] for x in calls]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_chains_match_eager_node_by_node_and_unchained(dtype: torch.dtype) -> None:
    model = Mixed().eval().to(dtype)
    x = torch.randn(3, 5, 48, generator=torch.Generator().manual_seed(1)).to(dtype)
    lowered = lower(model, (x,))
    assert lowered.summary[1] == [], lowered.summary
    with torch.no_grad():
        expected = list(model(x))
    rtol, atol = TOLERANCE[dtype]
    calls = [x] * CALLS_TO_REPLAY

    before = _runtime.kernel_chain_stats()
    chained = run(lowered, calls, compile=True, chain=True)
    built = {k: v - before[k] for k, v in _runtime.kernel_chain_stats().items()}
    if cpu_kernels_active() and dtype == torch.float32:  # half types: MLX's bias adds split the runs
        assert built["chains"] >= 2 and built["members"] >= 6, built
    for got in chained:
        assert_close(got, expected, rtol, atol)
    before = _runtime.kernel_chain_stats()
    unchained = run(lowered, calls, compile=True, chain=False)
    assert _runtime.kernel_chain_stats() == before
    nodes = run(lowered, calls[:1], compile=False, chain=True)
    assert_close(chained[-1], unchained[-1], 0, 0, exact=True)
    assert_close(chained[-1], nodes[0], 0, 0, exact=True)


def test_buffer_updated_from_a_chain() -> None:
    model = Accumulate().eval()
    g = torch.Generator().manual_seed(2)
    calls = [torch.randn(4, 32, generator=g) for _ in range(2 * CALLS_TO_REPLAY)]
    lowered = lower(model, (calls[0],))
    with torch.no_grad():
        reference = Accumulate().eval()
        reference.load_state_dict(model.state_dict())
        expected = [[reference(x.clone())] for x in calls]
    rtol, atol = TOLERANCE[torch.float32]
    chained = run(lowered, calls, compile=True, chain=True)
    unchained = run(lowered, calls, compile=True, chain=False)
    for got, want, off in zip(chained, expected, unchained):
        assert_close(got, want, rtol, atol)
        assert_close(got, off, 0, 0, exact=True)
