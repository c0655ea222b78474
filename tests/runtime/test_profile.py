"""Per-node profiling: with the profiler on, calls run node by node, every
node is timed on its own, and results are the same as without it."""

from collections.abc import Iterator

import pytest
import torch

from mlx_delegate import _runtime
from mlx_delegate.testing import assert_close, lower


class Chain(torch.nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.exp(x @ w).sum(-1) + 1.0


@pytest.fixture
def profiling() -> Iterator[None]:
    was = _runtime.profile_enabled()
    _runtime.set_profile(True)
    _runtime.reset_profile()
    yield
    _runtime.set_profile(was)
    _runtime.reset_profile()


def test_profile_times_every_node_without_changing_results(profiling: None):
    x, w = torch.randn(3, 4), torch.randn(4, 5)
    method = lower(Chain(), (x, w)).method()
    before = _runtime.compile_stats()
    outs = [method.execute([x, w]) for _ in range(3)]
    for out in outs:
        assert_close(out, Chain()(x, w), 1e-5, 1e-5)
    # Profiled calls never compile: each node must be evaluated on its own.
    assert _runtime.compile_stats()["traces"] == before["traces"]
    rows = _runtime.profile_report()
    kinds = {key.split()[0] for key, _, _ in rows}
    assert kinds == {"MatmulNode", "UnaryNode", "ReduceNode", "BinaryNode"}, kinds
    assert all(calls == 3 and seconds >= 0 for _, calls, seconds in rows)
    seconds = [s for _, _, s in rows]
    assert seconds == sorted(seconds, reverse=True)
    # The matmul's row names its dtype and output shape.
    assert any("float32 [3,5]" in key for key, _, _ in rows), rows


def test_reset_and_off(profiling: None):
    x, w = torch.randn(2, 4), torch.randn(4, 5)
    method = lower(Chain(), (x, w)).method()
    method.execute([x, w])
    assert _runtime.profile_report()
    _runtime.reset_profile()
    _runtime.set_profile(False)
    method.execute([x, w])
    assert _runtime.profile_report() == []
