"""A one-token KV-cache write updates the resident cache in place on every runtime path: MLX's
slice update reuses the cache's buffer only when nothing but the graph holds it, so a step's
peak memory stays well under one cache (a copy would add a whole cache). Checked at the first,
a middle and the last slot, with the compiled graph replayed across them, node by node, with
the CPU kernels off and under the per-node profiler (which used to hold every cache and so
reported each write as a copy of it); logits against the eager model run the same steps. The writes
are RopeKvWriteNodes (a layer's RoPE and both writes, fuse_rope_kv_write): a primitive with three
outputs, which must still take its caches over in place, also as a member of a kernel chain (the chain
hands the write its cache's buffer; cpp/kernel_chain.cpp)."""

import copy
from collections.abc import Iterator

import pytest
import torch
from transformers import LlamaConfig

from mlx_delegate import _runtime
from mlx_delegate.models import loading
from mlx_delegate.pipelines.llm import export as llm_export
from mlx_delegate.pipelines.llm.generate import Generator
from mlx_delegate.testing import RUNTIME_PATHS, assert_close, cpu_kernels_active, runtime_switch, runtime_switches

MAX_SEQ_LEN = 2048  # one cache (2 kv heads x 16) is 256 KiB: far above a step's other memory
KV_HEADS, HEAD_DIM = 2, 16
CACHE_BYTES = KV_HEADS * MAX_SEQ_LEN * HEAD_DIM * 4
# Positions written, one token each: the first slot, the middle, up to the last slot. The first
# call makes the resident caches from their initial values (allocating them): it is not counted.
POSITIONS = [3, 0, 1, 2, MAX_SEQ_LEN // 2, MAX_SEQ_LEN // 2 + 1, MAX_SEQ_LEN - 2, MAX_SEQ_LEN - 1]
TOKENS = [11, 5, 17, 99, 3, 42, 7, 64]


@pytest.fixture(scope="module")
def tiny() -> tuple[torch.nn.Module, bytes]:
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=KV_HEADS, vocab_size=128, max_position_embeddings=MAX_SEQ_LEN,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = loading.from_config(config, max_seq_len=MAX_SEQ_LEN, seed=0).model
    edge = llm_export.lower(llm_export.export_model(model), constant_methods=llm_export.metadata(model))
    return model, edge.to_executorch().buffer


@pytest.fixture(scope="module")
def eager(tiny) -> list[torch.Tensor]:
    model = copy.deepcopy(tiny[0])
    with torch.no_grad():
        return [model(torch.tensor([[t]]), torch.tensor([p]))[0, -1] for t, p in zip(TOKENS, POSITIONS)]


@pytest.fixture
def profiling() -> Iterator[None]:
    was = _runtime.profile_enabled()
    _runtime.set_profile(True)
    yield
    _runtime.set_profile(was)
    _runtime.reset_profile()


def run_steps(pte: bytes) -> tuple[list[torch.Tensor], list[int]]:
    """Logits and the memory each step needed above what was live before it."""
    gen = Generator(pte, eos_token_ids=[])
    logits, extra = [], []
    for token, pos in zip(TOKENS, POSITIONS):
        gen.pos = pos
        _runtime.reset_peak_memory()
        live = _runtime.active_memory()
        logits.append(gen.step([token]).clone())
        extra.append(_runtime.peak_memory() - live)
    return logits, extra


@pytest.mark.parametrize("path", sorted(RUNTIME_PATHS))
def test_cache_write_is_in_place(tiny, eager, path):
    with runtime_switches(**RUNTIME_PATHS[path]):
        before = _runtime.compile_stats()
        logits, extra = run_steps(tiny[1])
        stats = {k: v - before[k] for k, v in _runtime.compile_stats().items()}
    for got, want in zip(logits, eager):
        assert_close([got], want, 1e-4, 1e-5)
    assert max(extra[1:]) < CACHE_BYTES // 2, (extra, CACHE_BYTES)
    if path != "compile-off":
        # The first step runs node by node, the second traces, the rest (middle, last slot) replay.
        assert stats["compiled_calls"] == len(POSITIONS) - 1 and stats["traces"] == 1, stats


def test_cache_write_in_a_chain_is_in_place(tiny, eager):
    """With the cache writes kept apart and as chain members (the default): the same logits, no copy."""
    members = {}
    for writes in (False, True):
        with runtime_switch("kernel_chain_writes", writes):
            before = _runtime.kernel_chain_stats()["members"]
            logits, extra = run_steps(tiny[1])
            members[writes] = _runtime.kernel_chain_stats()["members"] - before
        for got, want in zip(logits, eager):
            assert_close([got], want, 1e-4, 1e-5)
        assert max(extra[1:]) < CACHE_BYTES // 2, (writes, extra, CACHE_BYTES)
    if cpu_kernels_active():  # both layers' writes joined a chain in the traced step
        assert members[True] >= members[False] + 2, members


def test_cache_write_out_of_the_chain_outputs(tiny, eager):
    """Caches a chain writes in place and only the caller reads afterwards leave the chain's outputs
    (kernel_chain_states, the default): the same logits as eager and, bit for bit, as with every write
    among the outputs; still no copy of a cache."""
    logits, written = {}, {}
    for states in (False, True):
        with runtime_switch("kernel_chain_states", states):
            before = _runtime.kernel_chain_stats()["state_writes"]
            logits[states], extra = run_steps(tiny[1])
            written[states] = _runtime.kernel_chain_stats()["state_writes"] - before
        assert max(extra[1:]) < CACHE_BYTES // 2, (states, extra, CACHE_BYTES)
        for got, want in zip(logits[states], eager):
            assert_close([got], want, 1e-4, 1e-5)
    assert_close(logits[True], logits[False], 0, 0, exact=True)
    assert written[False] == 0
    if cpu_kernels_active():  # k and v of both layers
        assert written[True] == 4, written


def fail_profiled(gen: Generator) -> None:
    """A call that fails midway under the profiler: the handle restarts its caches from their initial values."""
    was = _runtime.profile_enabled()
    _runtime.set_profile(True)
    try:
        with pytest.raises(RuntimeError):
            gen.method.execute([torch.tensor([[1]]), torch.tensor([MAX_SEQ_LEN])])  # past the end
    finally:
        _runtime.set_profile(was)
        _runtime.reset_profile()


def test_cache_written_in_place_after_a_restart(tiny):
    """A replayed step whose chain writes the caches in place, right after they went back to their initial
    values: the handle copies them first (owned_buffer_copies), so a later restart still finds empty caches
    (slot 1, written after the first restart, must read as zero after the second)."""
    pte = tiny[1]
    want = {}
    for pos in (1, 2):
        fresh = Generator(pte, eos_token_ids=[])
        fresh.pos = pos
        want[pos] = fresh.step([TOKENS[pos]])
    gen = Generator(pte, eos_token_ids=[])
    for token in TOKENS[:3]:  # node by node, traced, replayed
        gen.step([token])
    before = _runtime.owned_buffer_copies()
    for pos in (1, 2):
        fail_profiled(gen)
        gen.pos = pos
        assert torch.equal(gen.step([TOKENS[pos]]), want[pos]), pos
    if cpu_kernels_active():  # each restart: k and v of both layers
        assert _runtime.owned_buffer_copies() - before == 2 * 4


def test_profiled_cache_write_is_in_place(tiny, eager, profiling):
    logits, extra = run_steps(tiny[1])
    for got, want in zip(logits, eager):
        assert_close([got], want, 1e-4, 1e-5)
    assert max(extra[1:]) < CACHE_BYTES // 2, (extra, CACHE_BYTES)
    rows = {key.split()[0]: calls for key, calls, _ in _runtime.profile_report()}
    # k and v of a layer are written by one RopeKvWriteNode (fuse_rope_kv_write): 2 layers per step
    assert rows["RopeKvWriteNode"] == 2 * len(POSITIONS), rows


def test_profiled_failure_restarts_the_cache(tiny):
    """The profiler consumes the old cache as it goes: a call that fails midway leaves the
    initial (zero) cache, never a half-written one."""
    pte = tiny[1]
    fresh = Generator(pte, eos_token_ids=[])
    fresh.pos = 1
    want = fresh.step([TOKENS[1]])  # slot 0 still zero
    gen = Generator(pte, eos_token_ids=[])
    filled = gen.step([TOKENS[0]])
    was = _runtime.profile_enabled()
    _runtime.set_profile(True)
    try:
        with pytest.raises(RuntimeError):
            gen.method.execute([torch.tensor([[1]]), torch.tensor([MAX_SEQ_LEN])])  # past the end
        assert "slice update start" in _runtime.last_error()
    finally:
        _runtime.set_profile(was)
        _runtime.reset_profile()
    gen.pos = 1
    got = gen.step([TOKENS[1]])
    assert torch.equal(got, want) and not torch.equal(filled, want)
