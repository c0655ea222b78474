"""RoPE at a tensor position: `pos + arange(L)` positions (as models/llama.py writes them) fuse
into `mlx_delegate::rope_at`, lowered to one RopeNode whose offset is an array (no host read),
matching eager PyTorch at several positions; one compiled graph serves every position."""


import copy

import pytest
import torch
from executorch.runtime import Runtime
from torch.export import Dim

from mlx_delegate import _runtime
from mlx_delegate.custom_ops import rope_at, rope_reference
from mlx_delegate.ir import nodes as N
from mlx_delegate.pipelines.llm.export import lower as lower_with_patterns
from mlx_delegate.models.llama import apply_rope
from mlx_delegate.patterns import MLXPatternPass
from mlx_delegate.testing import TOLERANCE, assert_close, compare_node_and_compiled, delegate_summary

HEAD, MAX_POS = 16, 64


def inv_freq(dim: int, base: float = 10000.0) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def scaled_freqs(dim: int) -> torch.Tensor:
    """Not base ** (-2i / D) (llama3-like): the frequencies travel as a tensor, no `base`."""
    f = inv_freq(dim, 500000.0)
    return torch.where(f < 1e-3, f / 8, f)


FREQS = {"standard": inv_freq, "scaled": scaled_freqs}


class TensorPositionRope(torch.nn.Module):
    """RoPE as the Llama model writes it: positions = input_pos + arange(L), no item()."""

    def __init__(self, freqs: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("inv_freq", freqs)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:  # x [B, H, L, D]
        positions = input_pos.reshape(1) + torch.arange(x.shape[2])
        f = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((f, f), dim=-1)
        return apply_rope(x, emb.cos().to(x.dtype), emb.sin().to(x.dtype))


class RopeAtOp(torch.nn.Module):
    """The fused op called directly (the pattern only produces the rotate-half form)."""

    def __init__(self, freqs: torch.Tensor, traditional: bool, base: float | None) -> None:
        super().__init__()
        self.register_buffer("inv_freq", freqs)
        self.traditional, self.base = traditional, base

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        return rope_at(x, self.inv_freq, input_pos, self.traditional, self.base)


def export_and_lower(module: torch.nn.Module, x: torch.Tensor, dynamic: bool = True,
                     disable: tuple[str, ...] = ()):
    """(edge program, pattern counts) for module(x, input_pos), L dynamic in [1, MAX_POS], with the
    patterns in `disable` left out."""
    shapes = ({2: Dim("L", min=1, max=MAX_POS)}, None) if dynamic else None
    ep = torch.export.export(module.eval(), (x, torch.tensor([0])), dynamic_shapes=shapes, strict=True)
    pattern_pass = MLXPatternPass(disable=disable)
    return lower_with_patterns(ep, pattern_pass=pattern_pass), pattern_pass.counts


def payload_nodes(edge) -> list:
    """The nodes of the (single) delegate payload."""
    ep = edge.exported_program()
    call = next(n for n in ep.graph.nodes if n.op == "call_function")
    program = N.deserialize(getattr(ep.graph_module, call.args[0].target).processed_bytes)
    return [i.node for i in program.instructions]


def rope_nodes(edge) -> list:
    return [n for n in payload_nodes(edge) if type(n).__name__ == "RopeNode"]


def load(edge):
    """(program, forward method): the program must stay referenced while the method runs."""
    program = Runtime.get().load_program(edge.to_executorch().buffer)
    return program, program.load_method("forward")


def runs(dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Lengths and positions: the start, a middle position, and the last L that fits."""
    return [(torch.randn(1, 4, n, HEAD).to(dtype), torch.tensor([p]))
            for n, p in ((3, 0), (1, 5), (5, 5), (4, MAX_POS - 4), (1, MAX_POS - 1))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("freqs", list(FREQS))
def test_tensor_position_rope_fuses(dtype, freqs):
    module = TensorPositionRope(FREQS[freqs](HEAD)).eval()
    edge, counts = export_and_lower(module, torch.randn(1, 4, 3, HEAD).to(dtype))
    assert counts["rope"] == 1 and delegate_summary(edge) == (1, [])
    # One RopeNode at an array offset, no cos/sin tables left.
    (node,) = rope_nodes(edge)
    assert node.offset_tensor is not None
    assert (node.inv_freq is None) == (freqs == "standard") and (node.base > 0) == (freqs == "standard")
    assert not any(type(n).__name__ == "UnaryNode" for n in payload_nodes(edge))
    compare_node_and_compiled(edge.to_executorch().buffer, runs(dtype), module, *TOLERANCE[dtype],
                              fp32_expected=copy.deepcopy(module).float())


def test_int_position_rope_still_uses_an_int_offset():
    """`arange(start, start + L)` with an int start keeps the `rope` op (int offset, no tensor)."""

    class IntPositionRope(TensorPositionRope):
        def forward(self, x, input_pos):
            start = input_pos.item()
            torch._check(start >= 0)
            torch._check(start < MAX_POS)
            f = torch.arange(start, start + x.shape[2])[:, None].float() * self.inv_freq[None, :]
            emb = torch.cat((f, f), dim=-1)
            return apply_rope(x, emb.cos(), emb.sin())

    ep = torch.export.export(IntPositionRope(inv_freq(HEAD)).eval(), (torch.randn(1, 2, 3, HEAD), torch.tensor([2])),
                             strict=True)
    edge = lower_with_patterns(ep)
    (node,) = rope_nodes(edge)
    assert node.offset_tensor is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("with_base", [True, False])
def test_rope_at_op_matches_eager(dtype, traditional, with_base):
    freqs = inv_freq(HEAD) if with_base else scaled_freqs(HEAD)
    module = RopeAtOp(freqs, traditional, 10000.0 if with_base else None)
    edge, _ = export_and_lower(module, torch.randn(1, 4, 3, HEAD).to(dtype))
    assert delegate_summary(edge) == (1, [])
    assert [n.traditional for n in rope_nodes(edge)] == [traditional]
    compare_node_and_compiled(edge.to_executorch().buffer, runs(dtype),
                              lambda x, pos: rope_reference(x, int(pos), freqs, traditional), *TOLERANCE[dtype],
                              fp32_expected=lambda x, pos: rope_reference(x, int(pos), freqs, traditional))


def test_one_compiled_graph_serves_every_position(compile_on):
    module = TensorPositionRope(inv_freq(HEAD)).eval()
    edge, counts = export_and_lower(module, torch.randn(1, 4, 1, HEAD), dynamic=False)
    assert counts["rope"] == 1
    _program, method = load(edge)
    before = _runtime.compile_stats()
    for pos in (0, 7, 3, MAX_POS - 1, 12):
        args = (torch.randn(1, 4, 1, HEAD), torch.tensor([pos]))
        with torch.no_grad():
            assert_close(method.execute(list(args)), module(*args), *TOLERANCE[torch.float32])
    stats = {k: v - before[k] for k, v in _runtime.compile_stats().items()}
    # The position is a value, not a shape: traced once, replayed at every other position.
    assert stats == {"interpreted_calls": 1, "compiled_calls": 4, "traces": 1, "rejected": 0}


def test_rope_at_switch_leaves_tensor_positions_composed():
    """`MLXPatternPass(disable={"rope_at"})` (the A/B switch of benchmarks/optimizations.py) keeps
    the cos/sin tables composed, still inside the delegate and still matching eager."""
    module = TensorPositionRope(inv_freq(HEAD)).eval()
    edge, counts = export_and_lower(module, torch.randn(1, 4, 3, HEAD), disable=("rope_at",))
    assert counts["rope"] == 0 and rope_nodes(edge) == [] and delegate_summary(edge) == (1, [])
    _program, method = load(edge)
    for args in runs(torch.float32):
        with torch.no_grad():
            assert_close(method.execute(list(args)), module(*args), *TOLERANCE[torch.float32])


def test_unknown_pattern_switch_is_named():
    with pytest.raises(ValueError, match="unknown patterns \\['rope_att'\\]"):
        MLXPatternPass(disable={"rope_att"})
