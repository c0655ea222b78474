"""Compiled graphs: a method whose input signature repeats runs through an
`mx::compile`d graph, with the same results (and buffer updates) as the
node-by-node path; programs MLX cannot trace fall back."""

from collections.abc import Iterator

import pytest
import torch
from torch.export import Dim

from mlx_delegate import _runtime
from mlx_delegate.pipelines.llm import export as llm_export
from mlx_delegate.models import loading
from mlx_delegate.testing import assert_close, lower
from executorch.runtime import Runtime
from transformers import LlamaConfig


@pytest.fixture(autouse=True)
def compile_on() -> Iterator[None]:
    """Compiled graphs on for each test (whatever MLX_DELEGATE_COMPILE says); the switch restored after."""
    was = _runtime.compile_enabled()
    _runtime.set_compile(True)
    yield
    _runtime.set_compile(was)


def delta(before: dict[str, int]) -> dict[str, int]:
    """Counter changes since `before`."""
    return {k: v - before[k] for k, v in _runtime.compile_stats().items()}


class Chain(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = torch.sigmoid(x * y + 1.0)
        return torch.tanh(torch.exp(a) - y) * a


def test_repeated_signature_is_compiled_and_matches_interpreter():
    x, y = torch.randn(4, 5), torch.randn(4, 5)
    method = lower(Chain(), (x, y)).method()
    before = _runtime.compile_stats()
    _runtime.set_compile(False)
    plain = method.execute([x, y])
    _runtime.set_compile(True)
    outs = [method.execute([x, y]) for _ in range(3)]
    d = delta(before)
    # 1 call with compile off, 1 first sighting (node by node), then traced once and replayed.
    assert d == {"interpreted_calls": 2, "compiled_calls": 2, "traces": 1, "rejected": 0}
    for out in outs:
        assert_close(out, plain, 0, 0)
    assert_close(outs[-1], Chain()(x, y), 1e-5, 1e-6)


def test_each_shape_compiles_on_its_second_sighting():
    n = Dim("n", min=1, max=64)
    x, y = torch.randn(8, 5), torch.randn(8, 5)
    method = lower(Chain(), (x, y), dynamic_shapes=({0: n}, {0: n})).method()
    before = _runtime.compile_stats()
    for rows in (3, 8, 3, 8, 3, 5):
        x, y = torch.randn(rows, 5), torch.randn(rows, 5)
        assert_close(method.execute([x, y]), Chain()(x, y), 1e-5, 1e-6)
    # 3 and 8 are traced on their second call; 5 is seen once and never traced.
    assert delta(before) == {"interpreted_calls": 3, "compiled_calls": 3, "traces": 2, "rejected": 0}


class Cache(torch.nn.Module):
    """A counter and a rolling cache: buffers read and written every call."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.full((3,), 10.0))
        self.register_buffer("cache", torch.zeros(4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.total.add_(x)
        self.cache.copy_(torch.cat([self.cache[1:], self.total[None]], dim=0))
        return self.cache.sum(0) * 2


def test_mutable_buffers_update_across_compiled_calls():
    x = torch.ones(3)
    method = lower(Cache(), (x,)).method()
    eager = Cache()
    before = _runtime.compile_stats()
    for step in range(6):
        inp = torch.full((3,), float(step + 1))
        assert_close(method.execute([inp]), eager(inp), 0, 0)
    d = delta(before)
    assert (d["traces"], d["compiled_calls"], d["interpreted_calls"]) == (1, 5, 1)


class IntDiv(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.div(x, y, rounding_mode="floor") + 1


def test_method_mlx_cannot_trace_falls_back():
    # Integer division checks its divisor for zeros by evaluating it: impossible while tracing.
    x, y = torch.randint(-20, 20, (6,)), torch.randint(1, 5, (6,))
    method = lower(IntDiv(), (x, y)).method()
    before = _runtime.compile_stats()
    for _ in range(4):
        assert_close(method.execute([x, y]), IntDiv()(x, y), 0, 0)
    assert delta(before) == {"interpreted_calls": 4, "compiled_calls": 0, "traces": 0, "rejected": 1}


def test_llm_kv_cache_steps_compiled_match_node_by_node():
    """A tiny Llama: prefill + greedy decode, once node by node and twice with compile on. Decode
    steps share one signature (the position is a tensor): the first runs node by node, the rest
    on one traced graph; the second round's prefill repeats its length and is traced too. Logits
    equal the node-by-node ones exactly, KV-cache updates included."""
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=32,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = loading.from_config(config, max_seq_len=32, seed=0).model
    program = Runtime.get().load_program(llm_export.to_pte(model))
    method = program.load_method("forward")

    def generate(steps: int = 5) -> list[torch.Tensor]:
        logits = method.execute([torch.tensor([[5, 17, 99, 3]]), torch.tensor([0])])[0][0, -1]
        out, pos = [logits], 4
        for _ in range(steps):
            token = int(logits.argmax())
            logits = method.execute([torch.tensor([[token]]), torch.tensor([pos])])[0][0, -1]
            out.append(logits)
            pos += 1
        return out

    _runtime.set_compile(False)
    plain = generate()
    _runtime.set_compile(True)
    before = _runtime.compile_stats()
    first = generate()  # every signature seen for the first time: node by node
    compiled = generate()
    assert delta(before) == {"interpreted_calls": 2, "compiled_calls": 10, "traces": 2, "rejected": 0}
    for a, b, c in zip(plain, first, compiled):
        assert torch.equal(a, b) and torch.equal(a, c)
    with torch.no_grad():
        model.reset_cache()
        eager = model(torch.tensor([[5, 17, 99, 3]]), torch.tensor([0]))[0, -1]
    assert_close([compiled[0]], eager, 1e-4, 1e-4)
