"""Mutated buffers stay inside the delegate: a 30-layer cache model's delegate call
takes only the user inputs and returns only the user outputs."""

import torch

from mlx_delegate.testing import assert_close, lower

LAYERS = 30


class CacheStack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        for i in range(LAYERS):
            self.register_buffer(f"cache{i}", torch.full((4, 8), float(i)))

    def forward(self, x):
        for i in range(LAYERS):
            cache = getattr(self, f"cache{i}")
            cache.mul_(0.5).add_(x)
            x = torch.tanh(x + cache)
        return x


def test_thirty_cache_buffers_are_resident_in_the_delegate():
    x = torch.randn(4, 8)
    lowered = lower(CacheStack(), (x,))
    assert lowered.summary == (1, [])
    ep = lowered.edge.exported_program()
    call = next(n for n in ep.graph.nodes if n.target is torch.ops.higher_order.executorch_call_delegate)
    assert len(call.args) == 2, [a.name for a in call.args[1:]]  # lowered module + x
    assert len(call.users) == 1  # only the user output comes back
    assert len(ep.graph_signature.buffers_to_mutate) == 0
    method, eager = lowered.method(), CacheStack()
    for step in range(3):
        inp = torch.randn(4, 8)
        assert_close(method.execute([inp]), eager(inp), 1e-5, 1e-5)
