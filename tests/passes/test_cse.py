"""CSE merges the per-layer recomputation of the same mask and casts."""

from collections import Counter

import torch

from mlx_delegate import MLXPartitioner
from mlx_delegate.ir import nodes as N
from mlx_delegate.testing import assert_close, lower


class Layered(torch.nn.Module):
    """Every layer rebuilds the same mask from the same positions, as HF models do."""

    def __init__(self, layers: int = 6):
        super().__init__()
        self.w = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(8, 8) * 0.3) for _ in range(layers))

    def forward(self, x, pos):
        for w in self.w:
            mask = pos.unsqueeze(1) >= pos.unsqueeze(0)
            scores = torch.where(mask, x @ w, torch.full_like(x, -1e4))
            x = torch.tanh(scores) + x * pos.float().unsqueeze(1)
        return x


def node_counts(lowered) -> Counter:
    ep = lowered.edge.exported_program()
    counts = Counter()
    for _, mod in ep.graph_module.named_children():
        if hasattr(mod, "processed_bytes"):
            program = N.deserialize(mod.processed_bytes)
            counts.update(type(i.node).__name__ for i in program.instructions)
    return counts


def test_cse_removes_repeated_mask_work_and_keeps_results():
    torch.manual_seed(0)
    m = Layered()
    x, pos = torch.randn(8, 8), torch.arange(8)
    on = lower(m, (x, pos))
    off = lower(m, (x, pos), partitioner=MLXPartitioner(disable={"cse"}))
    assert on.summary == off.summary == (1, [])
    n_on, n_off = sum(node_counts(on).values()), sum(node_counts(off).values())
    # Five of six layers' mask (2 expand_dims + compare) and cast+expand_dims are merged.
    assert n_on <= n_off - 5 * 4, (n_on, n_off)
    expected = m(x, pos)
    assert_close(on.method().execute([x, pos]), expected, 1e-5, 1e-5)
    assert_close(off.method().execute([x, pos]), expected, 1e-5, 1e-5)
