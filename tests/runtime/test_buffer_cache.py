"""MLX's buffer cache grows to a call's working set (cpp/buffer_cache.h): MLX's CPU allocator keeps
only 32 MB of freed buffers by default, so a call with more intermediates than that got fresh pages
for them on every call (ResNet-50 at batch 8: ~80k page faults a call). Here a graph whose
intermediates peak near 100 MB runs through the stock runtime: after a call the cache limit covers
the working set and the freed intermediates stay cached, up to the cap, and a cap of 0 leaves MLX's
limit alone. The results match eager every time."""

from collections.abc import Iterator

import mlx.core as mx
import pytest
import torch

from mlx_delegate import _runtime
from mlx_delegate.testing import assert_close, lower

MB = 1 << 20


class Widen(torch.nn.Module):
    """Concatenations are materialised on every path (compiled or not), so each is a buffer of its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.cat([x, x + 1])  # 2x the input
        b = torch.cat([a, a * 2])  # 4x
        return b.sum(0)


def cache_limit() -> int:
    limit = mx.set_cache_limit(1 << 62)
    mx.set_cache_limit(limit)
    return limit


@pytest.fixture(scope="module")
def lowered():
    x = torch.randn(4, 1024, 1024)  # 16 MB: a and b hold 96 MB together
    return lower(Widen(), (x,)), x, Widen()(x)


@pytest.fixture
def small_cache() -> Iterator[None]:
    cap, limit = _runtime.buffer_cache_cap(), cache_limit()
    mx.set_cache_limit(32 * MB)
    yield
    _runtime.set_buffer_cache_cap(cap)
    mx.set_cache_limit(limit)


def call_working_set(lowered) -> int:
    """Runs one call; returns what it needed above what was live before it."""
    low, x, expected = lowered
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    assert_close(low.method().execute([x]), expected, rtol=1e-5, atol=1e-4)
    return mx.get_peak_memory() - before


def test_cache_grows_to_the_working_set(lowered, small_cache) -> None:
    _runtime.set_buffer_cache_cap(1 << 40)
    intermediates = 6 * lowered[1].nbytes  # a (2x) and b (4x), live together
    assert call_working_set(lowered) >= intermediates
    assert cache_limit() >= intermediates
    call_working_set(lowered)
    assert mx.get_cache_memory() >= 64 * MB  # the freed intermediates stayed for the next call


def test_cap_bounds_the_limit(lowered, small_cache) -> None:
    _runtime.set_buffer_cache_cap(48 * MB)
    call_working_set(lowered)
    assert cache_limit() == 48 * MB


def test_cap_zero_leaves_mlx_alone(lowered, small_cache) -> None:
    _runtime.set_buffer_cache_cap(0)
    call_working_set(lowered)
    assert cache_limit() == 32 * MB
