"""View ops lower to MLX views (no copy nodes); results stay right when the source
is mutated after the view was taken, because MLX only reuses a buffer in place
once nothing else references it."""

from collections import Counter

import torch

from mlx_delegate.ir import nodes as N
from mlx_delegate.testing import assert_close, lower


def ir_nodes(lowered) -> Counter:
    ep = lowered.edge.exported_program()
    counts = Counter()
    for _, mod in ep.graph_module.named_children():
        if hasattr(mod, "processed_bytes"):
            counts.update(type(i.node).__name__ for i in N.deserialize(mod.processed_bytes).instructions)
    return counts


class SliceThenMutate(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.arange(12.0).reshape(3, 4))

    def forward(self, x):
        head = self.buf[:2]          # a view of the buffer...
        self.buf.add_(x)             # ...taken before the buffer is mutated
        return head * 2, self.buf.clone()


class SliceNoMutate(torch.nn.Module):
    def forward(self, x):
        return x[1:, ::2].permute(1, 0) * 3


def test_view_of_mutated_buffer_keeps_old_values():
    x = torch.ones(3, 4)
    lowered = lower(SliceThenMutate(), (x,))
    assert lowered.summary == (1, [])
    method, eager = lowered.method(), SliceThenMutate()
    for _ in range(3):
        assert_close(method.execute([x]), eager(x), 0, 0)


def test_views_lower_without_copies():
    x = torch.randn(4, 6)
    lowered = lower(SliceNoMutate(), (x,))
    counts = ir_nodes(lowered)
    assert counts["SliceNode"] >= 1 and counts["TransposeNode"] == 1
    assert "IdentityNode" not in counts  # no copy materialised for slice/permute
    assert_close(lowered.method().execute([x]), SliceNoMutate()(x), 0, 0)
