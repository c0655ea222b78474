"""The standard export path's own failure modes, each named: what used to break
whole models on their way through `to_edge_transform_and_lower`."""

from __future__ import annotations

import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import to_edge_transform_and_lower
from executorch.runtime import Runtime
from torch import nn
from torch.export import Dim

from mlx_delegate import MLXPartitioner
from mlx_delegate.testing import delegate_summary

from .catalog import BY_NAME


def _run(edge, *inputs: torch.Tensor) -> list[torch.Tensor]:
    program = Runtime.get().load_program(edge.to_executorch().buffer)
    return program.load_method("forward").execute(list(inputs))


def test_sdpa_kept_whole_before_a_view():
    """SDPA kept whole (not decomposed) used to re-trace with other output strides and break the
    `view` after it: "Cannot view a tensor with shape [B, L, H, D] ...". """
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True).eval()
    x = torch.randn(2, 7, 32)
    ep = torch.export.export(layer, (x,))
    edge = to_edge_transform_and_lower(ep, partitioner=[MLXPartitioner()])
    assert delegate_summary(edge) == (1, [])
    ops = {str(n.target) for m in edge.exported_program().graph_module.modules()
           for n in getattr(m, "graph", torch.fx.Graph()).nodes if n.op == "call_function"}
    assert not any("scaled_dot_product" in o for o in ops), "SDPA must be inside the delegate"
    torch.testing.assert_close(_run(edge, x)[0], layer(x), rtol=1e-4, atol=1e-4)


def test_exported_program_survives_lowering_twice():
    """Lowering must not mutate the user's ExportedProgram: lowering it again (ours, then
    XNNPACK's) used to raise KeyError on a buffer (rotary_emb.inv_freq)."""
    torch.manual_seed(0)
    case = BY_NAME["llama"].build(torch.float32)
    ep = torch.export.export(case.module, (), kwargs=case.example, dynamic_shapes=case.dynamic_shapes)
    run = case.runs[-1]["input_ids"]
    expected = case.module(input_ids=run).logits
    for partitioner in (MLXPartitioner(), XnnpackPartitioner()):  # a second lowering, and a peer's
        edge = to_edge_transform_and_lower(ep, partitioner=[partitioner])
        torch.testing.assert_close(_run(edge, run)[0], expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ep.module()(input_ids=run).logits, expected)


def test_dynamic_dim_from_one_runs_at_one():
    """`Dim(min=1)`: export narrows the range to start at 2 (0/1 specialisation), but the user
    asked for 1 and the program must accept it."""

    class Pool(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.softmax(-1).sum(0)

    ep = torch.export.export(Pool(), (torch.randn(4, 5),), dynamic_shapes=({0: Dim("n", min=1, max=16)},))
    edge = to_edge_transform_and_lower(ep, partitioner=[MLXPartitioner()])
    for n in (1, 16):
        x = torch.randn(n, 5)
        torch.testing.assert_close(_run(edge, x)[0], Pool()(x))


def test_channels_last_inputs_and_outputs():
    """A caller's channels-last tensors are read and written in their own dim order (a
    `.contiguous(memory_format=channels_last)` at a model's output included)."""

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = self.conv(x).contiguous(memory_format=torch.channels_last)
            return y, y.mean(1)

    head = Head().eval()
    x = torch.randn(2, 3, 9, 7).to(memory_format=torch.channels_last)
    edge = to_edge_transform_and_lower(torch.export.export(head, (x,)), partitioner=[MLXPartitioner()])
    assert delegate_summary(edge) == (1, [])
    x = torch.randn(2, 3, 9, 7).to(memory_format=torch.channels_last)
    for got, want in zip(_run(edge, x), head(x)):
        assert got.stride() == want.stride()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
