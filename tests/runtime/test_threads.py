"""Threading contract: one method may be called from several threads (calls are
serialised per method); separate programs run in parallel. Results must equal a
single-threaded run."""

from concurrent.futures import ThreadPoolExecutor

import torch

from mlx_delegate.testing import cpu_kernels_active, delegate_payload, lower


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
    payload, named = delegate_payload(lowered.edge)
    xs = _inputs()
    args = [[("f32", [4, 16], x.numpy().tobytes())] for x in xs]
    expected = [_runtime.run_payload(payload, named, a)[0][2] for a in args]

    def work(t):
        for i in range(RUNS // 5):
            k = (i + t) % len(xs)
            assert _runtime.run_payload(payload, named, args[k])[0][2] == expected[k]
        return True

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(work, range(4)))
    out = torch.frombuffer(bytearray(expected[0]), dtype=torch.float32).reshape(4, 16)
    torch.testing.assert_close(out, m(xs[0]), rtol=1e-5, atol=1e-5)


class KernelBlock(torch.nn.Module):
    """Big enough for the CPU kernels to split work across the helper pool: an fp32 GEMV
    (one row, 512 x 1024 weights), SiLU, softmax and LayerNorm over 32K elements."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(512, 1024)
        self.norm = torch.nn.LayerNorm(512)

    def forward(self, x, rows):
        y = torch.nn.functional.silu(self.proj(x))  # [1, 1024]; the SiLU fused into the linear (bias_act)
        return torch.softmax(rows * y[:, :512], dim=-1) + self.norm(rows)  # [64, 512]


def test_cpu_kernel_pool_from_four_threads_without_the_gil():
    """Four threads run programs whose CPU kernels use the shared helper pool at the same time
    (a busy pool runs a call on its own thread): results equal a single-threaded run and eager."""
    from mlx_delegate import _runtime

    m = KernelBlock().eval()
    x, rows = torch.randn(1, 512), torch.randn(64, 512)
    lowered = lower(m, (x, rows))
    payload, named = delegate_payload(lowered.edge)
    g = torch.Generator().manual_seed(2)
    cases = [[("f32", [1, 512], torch.randn(1, 512, generator=g).numpy().tobytes()),
              ("f32", [64, 512], torch.randn(64, 512, generator=g).numpy().tobytes())] for _ in range(4)]
    before = _runtime.cpu_kernel_call_counts()
    expected = [_runtime.run_payload(payload, named, a)[0][2] for a in cases]
    ran = {k: v - before.get(k, 0) for k, v in _runtime.cpu_kernel_call_counts().items()}
    if cpu_kernels_active():
        assert {"gemv_f32", "bias_act", "softmax", "layer_norm"} <= {k for k, v in ran.items() if v}
    else:  # a GPU default device: MLX's own primitives (the pool is still shared below)
        assert not any(ran.values())

    def work(t):
        for i in range(RUNS // 5):
            k = (i + t) % len(cases)
            assert _runtime.run_payload(payload, named, cases[k])[0][2] == expected[k]
        return True

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(work, range(4)))
    x0 = torch.frombuffer(bytearray(cases[0][0][2]), dtype=torch.float32).reshape(1, 512)
    r0 = torch.frombuffer(bytearray(cases[0][1][2]), dtype=torch.float32).reshape(64, 512)
    out = torch.frombuffer(bytearray(expected[0]), dtype=torch.float32).reshape(64, 512)
    torch.testing.assert_close(out, m(x0, r0), rtol=1e-5, atol=1e-5)
