"""Outputs that are views (transposed, broadcast, sliced, an input itself):
the runtime no longer adds a Contiguous node to the graph and copies such
results in row-major order itself. Each case runs node by node and through a
compiled graph, and must match eager PyTorch exactly both ways."""

from collections.abc import Iterator

import pytest
import torch

from mlx_delegate import _runtime
from mlx_delegate.testing import assert_close, lower


@pytest.fixture(autouse=True)
def compile_restored() -> Iterator[None]:
    was = _runtime.compile_enabled()
    yield
    _runtime.set_compile(was)


class Transposed(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x + y).transpose(0, 1)


class Broadcast(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x * y)[:, :1].expand(3, 4)


class StridedSlice(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x - y)[:, ::2]


class InputThroughAndView(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.transpose(0, 1), (x + y) * y


@pytest.mark.parametrize("module", [Transposed(), Broadcast(), StridedSlice(), InputThroughAndView()],
                         ids=lambda m: type(m).__name__)
def test_view_outputs_match_eager_node_by_node_and_compiled(module: torch.nn.Module):
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    expected = module(x, y)
    method = lower(module, (x, y)).method()
    _runtime.set_compile(False)
    assert_close(method.execute([x, y]), expected, 0, 0, exact=True)
    _runtime.set_compile(True)
    before = _runtime.compile_stats()["compiled_calls"]
    for _ in range(3):  # the second sighting traces, the third replays
        assert_close(method.execute([x, y]), expected, 0, 0, exact=True)
    assert _runtime.compile_stats()["compiled_calls"] - before == 2
    # New input values through the same compiled graph: nothing kept from the previous call.
    x2, y2 = torch.randn(3, 4), torch.randn(3, 4)
    assert_close(method.execute([x2, y2]), module(x2, y2), 0, 0, exact=True)
