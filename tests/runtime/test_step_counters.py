"""The per-step counters (`_runtime.set_step_counters`, benchmarks/decode_split.py) and the pool hold of
a large call (`_runtime.set_pool_hold_in_call`, cpp/stream_wait.cpp): two decode-shaped quantized
products with a ReLU between them, in a graph of more than 32 nodes (a chain of adds), so the call
takes the large-graph path that opens a hold. The counters add up to what the program reads and runs;
the outputs are bitwise the same with the hold on and off, and match eager torch."""

from __future__ import annotations

import pytest
import torch

from mlx_delegate import _runtime
from mlx_delegate import quantization as Q
from mlx_delegate.testing import QUANTIZED_TOLERANCE, assert_close, cpu_kernels_active, lower

K, N = 512, 384


def packed(n: int, k: int, gen: torch.Generator) -> Q.MLXQuantized:
    u = torch.randint(0, 16, (n, k), generator=gen)
    scales = (torch.rand(n, k // 64, generator=gen) + 0.5) * 0.01
    return Q.MLXQuantized(Q.pack_words(u, 4), scales, -8 * scales, 64, 4)


class TwoProducts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.a = Q.QuantizedLinear(packed(N, K, gen))
        self.b = Q.QuantizedLinear(packed(K, N, gen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.b(torch.relu(self.a(x)))
        for i in range(40):  # more than 32 nodes: the large-graph path
            y = y + 0.01 * i
        return y


@pytest.fixture(scope="module")
def lowered():
    module = TwoProducts().eval()
    return module, lower(module, (torch.randn(1, 1, K),)).method()


def product_bytes(module: TwoProducts) -> int:
    """Packed words, scales and biases of both products: what each call's products read."""
    return sum(t.numel() * t.element_size() for lin in (module.a, module.b) for t in lin.buffers())


@pytest.mark.skipif(not cpu_kernels_active(), reason="the counters time the CPU kernels")
def test_counters_add_up_and_hold_keeps_results(lowered):
    module, method = lowered
    x = torch.randn(1, 1, K)
    with torch.no_grad():
        expected = module(x)
    was = _runtime.pool_hold_in_call()
    outs = {}
    try:
        for hold in (True, False):
            _runtime.set_pool_hold_in_call(hold)
            for _ in range(3):  # node by node, traced, replayed
                method.execute([x])
            _runtime.set_step_counters(True)
            _runtime.reset_step_counters()
            steps = 4
            for _ in range(steps):
                _runtime.step_counters_begin()
                outs[hold] = method.execute([x])
            _runtime.set_step_counters(False)
            c = _runtime.step_counters()
            assert c["qgemv_calls"] == 2 * steps
            assert c["qgemv_bytes"] == steps * product_bytes(module)
            assert c["qgemv_gaps"] == steps  # between the two products of each call, never across calls
            assert 0 < c["qgemv_parallel_ns"] <= c["qgemv_wall_ns"]
            assert c["qgemv_gap_cpu_ns"] <= c["qgemv_gap_wall_ns"] + 1_000_000  # thread CPU vs wall, clock slack
            if _runtime.cpu_vector_kernels():  # parts = 4 per thread when the pool has helpers
                assert c["pool_caller_parts"] + c["pool_helper_parts"] >= c["pool_jobs"]
            _runtime.reset_step_counters()
            method.execute([x])  # counters off: nothing counted
            assert _runtime.step_counters()["qgemv_calls"] == 0
    finally:
        _runtime.set_step_counters(False)
        _runtime.set_pool_hold_in_call(was)
    assert torch.equal(outs[True][0], outs[False][0])
    assert_close(outs[True], [expected], *QUANTIZED_TOLERANCE[torch.float32])


class Wide(torch.nn.Module):
    """One 16384 x 512 int4 product: packed words of 4 MiB, a constant the loader puts in huge-page memory
    (K stays small: x rounded to int16 is the kernel's error, summed over K)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = Q.QuantizedLinear(packed(16384, 512, torch.Generator().manual_seed(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x)


def test_huge_page_constants_load_the_same_values():
    """Programs loaded with the huge-page copy (the default) and without it give bitwise equal results,
    node by node and compiled, and match eager torch."""
    from executorch.runtime import Runtime

    module = Wide().eval()
    x = torch.randn(1, 1, 512)
    with torch.no_grad():
        expected = module(x)
    buffer = lower(module, (x,)).buffer
    was = _runtime.huge_page_constants()
    outs = {}
    try:
        for on in (False, True):
            _runtime.set_huge_page_constants(on)
            method = Runtime.get().load_program(buffer).load_method("forward")
            outs[on] = [method.execute([x])[0] for _ in range(3)]  # node by node, traced, replayed
    finally:
        _runtime.set_huge_page_constants(was)
    for a, b in zip(outs[False], outs[True]):
        assert torch.equal(a, b)
    assert_close(outs[True][-1:], [expected], *QUANTIZED_TOLERANCE[torch.float32])
