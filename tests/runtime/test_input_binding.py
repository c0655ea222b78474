"""Inputs are read where the caller's tensor lies (no copy on MLX's CPU allocator, interpreter.cpp's
wrap_caller_memory). Checked through the stock runtime: results at data addresses on and off a page's
first bytes (where the runtime falls back to a copy), channels-last inputs, and a mutable buffer set
from an input, which must not keep pointing at the input's memory once the call has returned."""

import pytest
import torch
from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
from executorch.exir.passes import MemoryPlanningPass
from executorch.runtime import Runtime

from mlx_delegate import MLXPartitioner, _runtime
from mlx_delegate.testing import assert_close, lower


class Mix(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ y.transpose(-1, -2)) + x.sum(-1, keepdim=True)


class Conv(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x).relu()


def load_unplanned(module: torch.nn.Module, inputs: tuple):
    """The program exported with its inputs not memory-planned: the stock runtime then hands the caller's
    own tensors to the delegate, so the test controls their addresses."""
    ep = torch.export.export(module, inputs)
    edge = to_edge_transform_and_lower(ep, partitioner=[MLXPartitioner()])
    config = ExecutorchBackendConfig(memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False))
    program = Runtime.get().load_program(edge.to_executorch(config).buffer)
    return program, program.load_method("forward")


def at_offset(shape: tuple[int, ...], offset_bytes: int) -> torch.Tensor:
    """A float32 tensor whose data starts `offset_bytes` after a 4096-byte boundary."""
    n = 1
    for s in shape:
        n *= s
    pad = 4096 // 4
    base = torch.empty(n + 2 * pad)
    shift = (-base.data_ptr() // 4) % pad + offset_bytes // 4
    t = base[shift:shift + n].view(shape)
    assert t.data_ptr() % 4096 == offset_bytes
    t.copy_(torch.randn(shape))
    return t


@pytest.mark.parametrize("compiled", [False, True], ids=["node_by_node", "compiled"])
@pytest.mark.parametrize("offset", [0, 4, 8, 64], ids=lambda o: f"page+{o}")
def test_inputs_at_any_address_match_eager(offset: int, compiled: bool):
    was = _runtime.compile_enabled()
    _runtime.set_compile(compiled)
    try:
        x, y = at_offset((5, 33), offset), at_offset((7, 33), 64)
        program, method = load_unplanned(Mix(), (torch.randn(5, 33), torch.randn(7, 33)))
        for _ in range(3):
            assert_close(method.execute([x, y]), Mix()(x, y), 1e-5, 1e-5)
            x.copy_(torch.randn(5, 33))  # new values in the same memory: nothing kept from the last call
    finally:
        _runtime.set_compile(was)


def test_channels_last_input_read_in_place():
    torch.manual_seed(0)
    module = Conv().eval()
    x = torch.randn(2, 3, 10, 12)
    program, method = load_unplanned(module, (x,))
    for _ in range(2):
        xl = torch.randn(2, 3, 10, 12)
        assert_close(method.execute([xl]), module(xl), 1e-4, 1e-5)
    lowered = lower(module, (x.contiguous(memory_format=torch.channels_last),))
    xl = torch.randn(2, 3, 10, 12).contiguous(memory_format=torch.channels_last)
    assert_close(lowered.method().execute([xl]), module(xl), 1e-4, 1e-5)


class Latch(torch.nn.Module):
    """Returns the state, then keeps this call's input as the next call's state (a reshape: a view of the
    input's memory in MLX; the input itself as the update does not pass export's verifier)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("state", torch.zeros(4, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.state * 2.0
        self.state.copy_(x.view(4, 16))
        return out


@pytest.mark.parametrize("planned", [True, False], ids=["planned_input", "caller_tensor"])
def test_buffer_set_from_an_input_keeps_its_value(planned: bool):
    x1, x2, x3 = torch.randn(64), torch.randn(64), torch.randn(64)
    if planned:
        method = lower(Latch(), (x1,)).method()
    else:
        program, method = load_unplanned(Latch(), (x1,))
    assert_close(method.execute([x1]), torch.zeros(4, 16), 0, 0, exact=True)
    # The runtime's input memory (or the caller's tensor) now holds other values: the state must not.
    x1_values = x1.clone()
    x1.copy_(x3)
    assert_close(method.execute([x2]), x1_values.view(4, 16) * 2.0, 0, 0, exact=True)
    assert_close(method.execute([x3]), x2.view(4, 16) * 2.0, 0, 0, exact=True)
