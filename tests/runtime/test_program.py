"""Whole-program behaviour: fallback, dynamic shapes, mutable buffers."""

import torch
from torch.export import Dim

from mlx_delegate import MLXPartitioner
from mlx_delegate.testing import assert_close, lower


class Chain(torch.nn.Module):
    def forward(self, x, y):
        a = torch.sigmoid(x * y + 1.0)
        b = torch.exp(a) - y
        return torch.tanh(b) * a


def test_unsupported_op_falls_back_and_mixed_program_runs():
    x, y = torch.randn(4, 5), torch.randn(4, 5)
    lowered = lower(Chain(), (x, y), partitioner=MLXPartitioner(exclude={"exp"}))
    segments, leftover = lowered.summary
    assert leftover == ["exp"]
    assert segments == 2
    out = lowered.method().execute([x, y])
    assert_close(out, Chain()(x, y), rtol=1e-5, atol=1e-6)


def test_float64_is_left_to_executorch():
    class M(torch.nn.Module):
        def forward(self, x):
            return (x.double() * 2).float() + x

    x = torch.randn(3)
    lowered = lower(M(), (x,))
    assert "mul" in lowered.summary[1]
    assert_close(lowered.method().execute([x]), M()(x), 1e-6, 1e-6)


def test_dynamic_dim_runs_at_several_sizes():
    n = Dim("n", min=1, max=64)
    x, y = torch.randn(8, 5), torch.randn(8, 5)
    lowered = lower(Chain(), (x, y), dynamic_shapes=({0: n}, {0: n}))
    assert lowered.summary == (1, [])
    method = lowered.method()
    for rows in (2, 3, 8, 64):  # export specialises sizes 0 and 1
        x, y = torch.randn(rows, 5), torch.randn(rows, 5)
        assert_close(method.execute([x, y]), Chain()(x, y), 1e-5, 1e-6)


class Counter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.full((3,), 10.0))

    def forward(self, x):
        self.total.add_(x)
        return self.total * 2


def test_mutable_buffer_keeps_initial_value_and_updates_across_calls():
    x = torch.ones(3)
    lowered = lower(Counter(), (x,))
    assert lowered.summary == (1, [])
    method = lowered.method()
    eager = Counter()
    for step in range(3):
        inp = torch.full((3,), float(step + 1))
        out = method.execute([inp])
        assert_close(out, eager(inp), 0, 0)
    # The buffer lives in the delegate: the delegate call takes only the user input.
    graph = lowered.edge.exported_program().graph
    call = next(n for n in graph.nodes if n.target is torch.ops.higher_order.executorch_call_delegate)
    assert len(call.args) == 2  # lowered module + x
