"""Threading contract: one method may be called from several threads (calls are
serialised per method); separate programs run in parallel. Results must equal a
single-threaded run."""

from concurrent.futures import ThreadPoolExecutor

import torch

from mlx_delegate.testing import lower


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 16))

    def forward(self, x):
        return torch.tanh(x @ self.w) * x + 1.0


RUNS = 1000


def _inputs():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 16, generator=g) for _ in range(8)]


def test_one_program_from_four_threads():
    m = Block()
    lowered = lower(m, (torch.randn(4, 16),))
    method = lowered.method()
    xs = _inputs()
    expected = [method.execute([x])[0].clone() for x in xs]

    def work(t):
        for i in range(RUNS):
            k = (i + t) % len(xs)
            out = method.execute([xs[k]])[0]
            assert torch.equal(out, expected[k])
        return True

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(work, range(4)))


def test_four_programs_each_on_its_own_thread():
    m = Block()
    programs = [lower(m, (torch.randn(4, 16),)) for _ in range(4)]
    xs = _inputs()
    expected = [programs[0].method().execute([x])[0].clone() for x in xs]

    def work(t):
        method = programs[t].method()
        for i in range(RUNS):
            k = (i * 3 + t) % len(xs)
            assert torch.equal(method.execute([xs[k]])[0], expected[k])
        return True

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(work, range(4)))


def test_load_and_run_without_the_gil_from_four_threads():
    """`_runtime.run_payload` releases the GIL while it runs, so four threads load
    and execute the same payload truly in parallel (the stock runtime's Python
    binding may serialise calls on the GIL)."""
    from mlx_delegate import _runtime

    m = Block()
    lowered = lower(m, (torch.randn(4, 16),))
    gm = lowered.edge.exported_program().graph_module
    (mod,) = [c for _, c in gm.named_children() if hasattr(c, "processed_bytes")]
    store = mod.named_data_store_output
    named = {k: bytes(store.buffers[e.buffer_index]) for k, e in store.pte_data.items()}
    xs = _inputs()
    args = [[("f32", [4, 16], x.numpy().tobytes())] for x in xs]
    expected = [_runtime.run_payload(mod.processed_bytes, named, a)[0][2] for a in args]

    def work(t):
        for i in range(RUNS // 5):
            k = (i + t) % len(xs)
            assert _runtime.run_payload(mod.processed_bytes, named, args[k])[0][2] == expected[k]
        return True

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(work, range(4)))
    out = torch.frombuffer(bytearray(expected[0]), dtype=torch.float32).reshape(4, 16)
    torch.testing.assert_close(out, m(xs[0]), rtol=1e-5, atol=1e-5)
