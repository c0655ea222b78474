"""The huge-page constant arena (cpp/loader.cpp, `load_arena`): with huge pages on, all of a method's
constants are copied into one MLX buffer and each is a view of its slice. The values must be the file's
bit for bit, whatever their dtype, size and alignment; constants must outlive the method and program that
loaded them where an output still needs them; methods that share weights each get their own copy; and
the switch-off path loads the same values."""

from __future__ import annotations

import gc
import sys

import mlx.core as mx
import pytest
import torch
from executorch.exir import to_edge_transform_and_lower
from executorch.runtime import Runtime

import mlx_delegate
from mlx_delegate import _runtime
from mlx_delegate.testing import lower

# Sizes in elements: odd ones put the next constant off a 64-byte boundary in the file; the big ones
# (2 MiB in float32) are each under the old 4 MiB cut-off, together above it (an arena of 7 MiB).
SIZES = (3, 1, 17, 524288, 5, 524288, 1000, 524288, 524288, 33)
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float32, torch.float16)


class ManyConstants(torch.nn.Module):
    """Adds x (zeros) to every constant: the outputs are the constants, exactly."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        for i, n in enumerate(SIZES):
            dtype = DTYPES[i % len(DTYPES)]
            self.register_buffer(f"c{i}", torch.randn(n, generator=gen).to(dtype))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(x.to(c.dtype) + c for c in self.buffers())


@pytest.fixture
def huge_pages():
    was, arena = _runtime.huge_page_constants(), _runtime.constant_arena()
    yield _runtime.set_huge_page_constants
    _runtime.set_huge_page_constants(was)
    _runtime.set_constant_arena(arena)


def run(buffer: bytes, x: torch.Tensor) -> list[list[torch.Tensor]]:
    method = Runtime.get().load_program(buffer).load_method("forward")
    return [list(method.execute([x])) for _ in range(3)]  # node by node, traced, replayed


@pytest.mark.parametrize("on, arena", [(True, True), (True, False), (False, True)])
def test_constants_are_the_files_bit_for_bit(huge_pages, on: bool, arena: bool) -> None:
    module = ManyConstants().eval()
    x = torch.zeros(1)
    buffer = lower(module, (x,)).buffer
    huge_pages(on)
    _runtime.set_constant_arena(arena)
    expected = list(module.buffers())
    for outs in run(buffer, x):
        assert len(outs) == len(expected)
        for got, want in zip(outs, expected):
            assert got.dtype == want.dtype
            assert torch.equal(got, want)


def test_constants_outlive_their_program(huge_pages) -> None:
    """Outputs read after the method and program are gone, and the arena is released with them."""
    huge_pages(True)
    module = ManyConstants().eval()
    x = torch.zeros(1)
    buffer = lower(module, (x,)).buffer
    gc.collect()
    before = mx.get_active_memory()
    program = Runtime.get().load_program(buffer)
    method = program.load_method("forward")
    outs = method.execute([x])
    loaded = mx.get_active_memory() - before
    assert loaded >= sum(b.numel() * b.element_size() for b in module.buffers())
    del method, program
    gc.collect()
    for got, want in zip(outs, module.buffers()):
        assert torch.equal(got, want)
    del outs
    gc.collect()
    assert mx.get_active_memory() - before < loaded


class Shared(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(1)
        self.lin = torch.nn.Linear(512, 1024)  # 2 MiB of weight: with the bias, an arena of two huge pages
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(1024, 512, generator=gen) * 0.05)
        self.extra = torch.nn.Linear(1024, 1024)  # 4 MiB more, one method only

    def first(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)

    def second(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.extra(self.lin(x)))


class Method(torch.nn.Module):
    def __init__(self, shared: Shared, name: str) -> None:
        super().__init__()
        self.shared, self.name = shared, name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self.shared, self.name)(x)


@pytest.mark.parametrize("on", [True, False])
def test_methods_sharing_constants(huge_pages, on: bool) -> None:
    shared = Shared().eval()
    x = torch.randn(2, 512)
    methods = {name: Method(shared, name).eval() for name in ("first", "second")}
    eps = {name: torch.export.export(m, (x,), strict=False) for name, m in methods.items()}
    pte = to_edge_transform_and_lower(eps, partitioner=[mlx_delegate.MLXPartitioner()]).to_executorch()
    huge_pages(on)
    program = Runtime.get().load_program(pte.buffer)
    loaded = {name: program.load_method(name) for name in methods}
    with torch.no_grad():
        expected = {name: m(x) for name, m in methods.items()}
    for name, method in loaded.items():
        for _ in range(3):
            torch.testing.assert_close(method.execute([x])[0], expected[name], rtol=1e-4, atol=1e-4)
    del loaded["first"]  # the other method's copy stays valid
    gc.collect()
    torch.testing.assert_close(loaded["second"].execute([x])[0], expected["second"], rtol=1e-4, atol=1e-4)



def arenas() -> int:
    return _runtime.cpu_kernel_call_counts().get("constant_arena", 0)


@pytest.mark.parametrize("on, arena, small, built", [(True, True, False, True), (True, False, False, False),
                                                     (False, True, False, False), (True, True, True, False)])
def test_when_the_arena_is_built(huge_pages, on: bool, arena: bool, small: bool, built: bool) -> None:
    """With huge pages and the arena on, constants of 4 MiB and more in all (each under it) go to one
    arena; not with either switch off, nor for a program whose constants are smaller than that."""
    if sys.platform != "linux" or mx.default_device() != mx.cpu:
        pytest.skip("huge pages are for the CPU on Linux")
    module = torch.nn.Linear(64, 64).eval() if small else ManyConstants().eval()
    x = torch.zeros(1, 64) if small else torch.zeros(1)
    buffer = lower(module, (x,)).buffer
    huge_pages(on)
    _runtime.set_constant_arena(arena)
    before = arenas()
    Runtime.get().load_program(buffer).load_method("forward").execute([x])
    assert (arenas() - before == 1) == built and arenas() - before in (0, 1)
