"""The KV-cache write pattern (`patterns/kv_cache.py`): `cache.index_copy_(2, positions, new)` at
consecutive positions becomes one DynamicSliceUpdateNode (no scatter) under a plain
`MLXPartitioner` lowering; the cache stays resident and matches eager PyTorch step by step, node
by node and compiled; a position read through transformers' `cumulative_length.copy_(pos[0])` is
traced to the input, so a write past the end is a named error, not a silent clamp. Also the
transformers 5 static-cache export of a tiny Llama: RMSNorm, RoPE and the cache writes fused
(RoPE and the writes of a layer into one RopeKvWriteNode) without `MLXPatternPass`, logits equal to the model run without a cache."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.export import Dim

from mlx_delegate import _runtime
from mlx_delegate.testing import assert_close, lower, runtime_switches

from .test_rope_at import payload_nodes

H, S, D = 2, 8, 4


class IndexCopyCache(torch.nn.Module):
    """A [1, H, S, D] cache written in place at `pos`.. (`form`: how the positions are written)."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.register_buffer("cache", torch.zeros(1, H, S, D), persistent=False)
        self.register_buffer("length", torch.zeros((), dtype=torch.long), persistent=False)

    def forward(self, new: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if self.form == "arange":  # pos + arange(L)
            index = pos + torch.arange(new.shape[2])
        elif self.form == "index":  # the one position itself (L = 1)
            index = pos
        else:  # "hf": transformers 5's StaticCache, through its cumulative_length buffer
            self.length.copy_(pos[0])
            index = self.length + torch.arange(new.shape[2])
        self.cache.index_copy_(2, index, new)
        return self.cache * 2.0


def nodes_of(lowered) -> set[str]:
    return {type(n).__name__ for n in payload_nodes(lowered.edge)}


STEPS = {"arange": [(2, 0), (1, 2), (3, 3), (1, 7)], "index": [(1, 0), (1, 5), (1, 7)],
         "hf": [(2, 0), (1, 2), (3, 3), (1, 7)]}


@pytest.mark.parametrize("form", list(STEPS))
def test_index_copy_at_positions_becomes_a_slice_update(form: str) -> None:
    module = IndexCopyCache(form).eval()
    length, _ = STEPS[form][0]
    shapes = None if form == "index" else ({2: Dim("L", min=1, max=S)}, None)
    lowered = lower(module, (torch.randn(1, H, length, D), torch.tensor([0])), dynamic_shapes=shapes)
    assert lowered.summary == (1, [])
    kinds = nodes_of(lowered)
    assert "DynamicSliceUpdateNode" in kinds and "ScatterNode" not in kinds, kinds
    for compiled in (False, True):
        with runtime_switches(compile=compiled):
            method, eager = lowered.fresh_method(), copy.deepcopy(IndexCopyCache(form).eval())
            before = _runtime.compile_stats()["compiled_calls"]
            for step, (n, pos) in enumerate(STEPS[form] * 3):  # repeated: compiled graphs replay
                torch.manual_seed(step)
                new, p = torch.randn(1, H, n, D), torch.tensor([pos])
                assert_close(method.execute([new, p]), eager(new, p), 0, 0, exact=True)
            if compiled:
                assert _runtime.compile_stats()["compiled_calls"] > before
    # Past the end: torch's index_copy_ refuses it, and so does the delegate (the position is an input).
    method = lowered.fresh_method()
    with pytest.raises(RuntimeError):
        method.execute([torch.randn(1, H, 1, D), torch.tensor([S])])


def test_other_index_copies_stay_scatters() -> None:
    """Positions that are not consecutive (pos + 2 * arange(L)) keep the scatter."""

    class Strided(IndexCopyCache):
        def forward(self, new: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            self.cache.index_copy_(2, pos + 2 * torch.arange(new.shape[2]), new)
            return self.cache * 2.0

    module = Strided("arange").eval()
    new, pos = torch.randn(1, H, 2, D), torch.tensor([1])
    lowered = lower(module, (new, pos))
    assert "ScatterNode" in nodes_of(lowered) and "DynamicSliceUpdateNode" not in nodes_of(lowered)
    assert_close(lowered.method().execute([new, pos]), copy.deepcopy(Strided("arange").eval())(new, pos), 0, 0,
                 exact=True)


@pytest.fixture(scope="module")
def static_cache_llama():
    """transformers 5's ExecuTorch recipe on a tiny Llama, exported strict, lowered once."""
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    import mlx_delegate
    from mlx_delegate.testing import Lowered, delegate_summary

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(use_cache=True, cache_implementation="static")
    recipe = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=8)
    with torch.no_grad():
        ep = recipe.export(input_ids=torch.tensor([[1]]), cache_position=torch.tensor([0]))
    edge = to_edge_transform_and_lower(ep, partitioner=[mlx_delegate.MLXPartitioner()])
    buffer = edge.to_executorch().buffer
    return model, Lowered(edge, buffer, Runtime.get().load_program(buffer), delegate_summary(edge), True)


def test_transformers_static_cache_fuses_and_matches(static_cache_llama) -> None:
    model, lowered = static_cache_llama
    assert lowered.summary == (1, [])
    kinds = nodes_of(lowered)
    # RoPE and both cache writes of each layer as one node (fuse_rope_kv_write)
    assert {"RmsNormNode", "RopeKvWriteNode", "SdpaNode"} <= kinds, kinds
    assert not kinds & {"ScatterNode", "ReduceNode", "ConcatNode", "RopeNode", "DynamicSliceUpdateNode"}, kinds
    tokens = [3, 17, 5, 42, 9, 1]
    with torch.no_grad():
        want = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0]
    for compiled in (False, True):
        with runtime_switches(compile=compiled):
            method = lowered.fresh_method()
            for pos, t in enumerate(tokens):
                (got,) = method.execute([torch.tensor([[t]]), torch.tensor([pos])])
                assert_close([got[0, -1]], want[pos], 1e-4, 1e-4)
    with pytest.raises(RuntimeError):  # past the cache: a named error, as the eager recipe raises
        lowered.fresh_method().execute([torch.tensor([[1]]), torch.tensor([8])])
