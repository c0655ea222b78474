"""`mlx_delegate::kv_cache_update_at`: a cache write at a tensor position, lowered to
`DynamicSliceUpdateNode` (an MLX slice update at an array offset). One program serves every
position; the cache is a resident buffer; a write past the end is refused with a named error."""

import pytest
import torch

from mlx_delegate import _runtime
from mlx_delegate.custom_ops import kv_cache_update, kv_cache_update_at
from mlx_delegate.ir import nodes as N
from mlx_delegate.testing import assert_close, lower

CACHE = (1, 2, 16, 4)  # [B, H, S, D]


class CacheWriter(torch.nn.Module):
    """Writes `update` at `pos` into a resident cache and returns the whole cache."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(CACHE, dtype=dtype), persistent=False)

    def forward(self, update: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.cache.copy_(kv_cache_update_at(self.cache, update, pos))
        return self.cache + 0


def update(length: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(CACHE[0], CACHE[1], length, CACHE[3]).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_writes_at_each_position_with_one_program(dtype, compile_on):
    lowered = lower(CacheWriter(dtype), (update(1, dtype, 0), torch.tensor([0])))
    assert lowered.summary == (1, [])
    eager, method = CacheWriter(dtype), lowered.method()
    before = _runtime.compile_stats()
    for step, pos in enumerate([0, 3, 1, 15, 7, 8, 2]):
        u, p = update(1, dtype, step), torch.tensor([pos])
        assert_close(method.execute([u, p]), eager(u, p), 0, 0, exact=True)
    stats = {k: v - before[k] for k, v in _runtime.compile_stats().items()}
    # Positions are values, not shapes: one signature, traced once and replayed.
    assert stats == {"interpreted_calls": 1, "compiled_calls": 6, "traces": 1, "rejected": 0}


def test_lowers_to_a_dynamic_slice_update():
    lowered = lower(CacheWriter(torch.float32), (update(2, torch.float32, 0), torch.tensor([0])))
    call = next(n for n in lowered.edge.exported_program().graph.nodes if n.op == "call_function")
    module = getattr(lowered.edge.exported_program().graph_module, call.args[0].target)
    program = N.deserialize(module.processed_bytes)
    kinds = [type(i.node).__name__ for i in program.instructions]
    assert "DynamicSliceUpdateNode" in kinds and "SliceUpdateNode" not in kinds


@pytest.mark.parametrize("compiled", [False, True], ids=["nodes", "compiled"])
def test_write_past_the_end_is_refused(compiled):
    """A position outside [0, S - L] is a named error, node by node and on a compiled replay (the
    runtime checks the input on the host; MLX would clamp it), and the cache is left as it was."""
    was = _runtime.compile_enabled()
    _runtime.set_compile(compiled)
    try:
        method = lower(CacheWriter(torch.float32), (update(3, torch.float32, 0), torch.tensor([0]))).method()
        eager = CacheWriter(torch.float32)
        for pos in (0, 5, 2):  # the same signature three times: compiled, the last runs a traced graph
            u, p = update(3, torch.float32, pos), torch.tensor([pos])
            assert torch.equal(method.execute([u, p])[0], eager(u, p))
        for bad in (CACHE[2] - 2, -1, 1 << 40):
            with pytest.raises(RuntimeError):
                method.execute([update(3, torch.float32, 9), torch.tensor([bad])])
            assert "slice update start" in _runtime.last_error() and str(bad) in _runtime.last_error()
            with pytest.raises(IndexError):
                eager(update(3, torch.float32, 9), torch.tensor([bad]))
        u, p = update(3, torch.float32, 7), torch.tensor([CACHE[2] - 3])  # the last valid start
        assert torch.equal(method.execute([u, p])[0], eager(u, p))
    finally:
        _runtime.set_compile(was)


class IntPositionWriter(CacheWriter):
    """The int-position form (`kv_cache_update` at `pos.item()`), still lowered to a SliceUpdateNode."""

    def forward(self, update: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        start = pos.item()
        torch._check(start >= 0)
        torch._check(start + update.shape[2] <= CACHE[2])
        self.cache.copy_(kv_cache_update(self.cache, update, start))
        return self.cache + 0


def test_int_position_form_matches_eager():
    lowered = lower(IntPositionWriter(torch.float32), (update(2, torch.float32, 0), torch.tensor([0])))
    assert lowered.summary == (1, [])
    eager, method = IntPositionWriter(torch.float32), lowered.method()
    for step, pos in enumerate([0, 5, 14]):
        u, p = update(2, torch.float32, step), torch.tensor([pos])
        assert_close(method.execute([u, p]), eager(u, p), 0, 0, exact=True)
