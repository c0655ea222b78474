"""Early release and in-place reuse: with them, a long element-wise chain peaks at a
few activations; keeping intermediates alive (the debug switch) costs one per op."""

import torch

from mlx_delegate import MLXPartitioner, _runtime
from mlx_delegate.testing import assert_close, lower

N_OPS = 24


class Chain(torch.nn.Module):
    def forward(self, x):
        for i in range(N_OPS // 2):
            x = torch.tanh(x * (1.0 + 0.01 * i))
        return x


def peak_bytes(method, x) -> int:
    method.execute([x])  # warm up the allocator cache
    _runtime.reset_peak_memory()
    method.execute([x])
    return _runtime.peak_memory()


def test_peak_memory_falls_with_early_release():
    x = torch.randn(256, 1024)  # 1 MiB per activation
    on = lower(Chain(), (x,)).method()
    off = lower(Chain(), (x,), partitioner=MLXPartitioner(disable={"early_release"})).method()
    expected = Chain()(x)
    assert_close(on.execute([x]), expected, 1e-5, 1e-5)
    assert_close(off.execute([x]), expected, 1e-5, 1e-5)
    act = x.numel() * 4
    peak_on, peak_off = peak_bytes(on, x), peak_bytes(off, x)
    assert peak_on <= 4 * act, peak_on / act
    assert peak_off >= N_OPS // 2 * act, peak_off / act
