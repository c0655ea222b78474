"""Sum, mean, max and min over trailing axes on the CPU kernel (cpp/kernels/reduce_cpu.cpp), through the
stock runtime: against eager torch and MLX's own op (kernels off) in fp32 / bf16 / fp16, over the last
axis, a map's H and W and all axes, with keepdims, odd lengths (the vector body's tail), rows long
enough to be cut into chunks for the pool, a transposed input, and NaN / infinities (max and min
propagate NaN as amax / amin do, wherever it lies). Reductions over leading axes stay MLX's."""

import pytest
import torch

from mlx_delegate import _runtime
from mlx_delegate.testing import Lambda, assert_close, cpu_kernels_active, lower, runtime_switches

NAN, INF = float("nan"), float("inf")


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def special() -> torch.Tensor:
    """Rows of 37 (two vectors of sixteen and a tail of five) and a long chunked row, with NaN and infinities."""
    x = randn(6, 37, seed=1)
    x[0, 5] = NAN  # in the vector body
    x[1, 35] = NAN  # in the tail
    x[2, 7], x[2, 33] = INF, -INF
    x[3, :] = -INF
    x[4, 36] = 50.0  # the extreme in the tail's last element
    return x


def long_rows() -> torch.Tensor:
    x = randn(1, 3, 40000, seed=2)  # three rows of 40000, fewer than two a pool thread: each cut in two
    x[0, 2, 39000] = NAN  # in a later chunk
    return x


OPS = {
    "sum": lambda dims, keep: lambda x: x.sum(dims, keepdim=keep),
    "mean": lambda dims, keep: lambda x: x.mean(dims, keepdim=keep),
    "max": lambda dims, keep: lambda x: x.amax(dims, keepdim=keep),
    "min": lambda dims, keep: lambda x: x.amin(dims, keepdim=keep),
}
SHAPES = [  # name, input, dims, keepdim
    ("last", lambda: randn(3, 5, 1000), -1, False),
    ("map-hw", lambda: randn(2, 24, 14, 14), (2, 3), True),
    ("map-hw-odd", lambda: randn(1, 3, 37, 29), (-1, -2), False),
    ("all", lambda: randn(4, 9, 11), (0, 1, 2), False),
    ("long-row", lambda: randn(1, 100003), -1, True),
    ("chunked", long_rows, -1, False),
    ("special", special, -1, False),
]
CASES = [(f"{op}-{name}", op, make, dims, keep) for op in OPS for name, make, dims, keep in SHAPES]
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 2e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name, op, make, dims, keep", CASES, ids=[c[0] for c in CASES])
def test_matches_eager_and_kernels_off(name, op, make, dims, keep, dtype):
    if dtype == torch.float16 and op == "sum" and name.endswith(("chunked", "long-row")):
        pytest.skip("the sum of 40000 normal samples is past what eager's float16 accumulation resolves")
    x = make().to(dtype)
    fn = OPS[op](dims, keep)
    # Eager in float64, rounded to the dtype: torch's own half sums round differently at every length.
    want = fn(x.double()).to(dtype)
    lowered = lower(Lambda(fn), (x,))
    before = _runtime.cpu_kernel_call_counts()
    for _ in range(3):  # node by node, traced, replayed
        got = lowered.method().execute([x])[0]
        assert got.dtype == dtype and got.shape == want.shape
        assert_close([got], want, *TOLERANCE[dtype])
    if cpu_kernels_active():
        assert _runtime.cpu_kernel_call_counts().get(op, 0) == before.get(op, 0) + 3
    # MLX's own op adds float32 one element at a time: its error grows with the row (2.7e-5 over 40000).
    rtol, atol = TOLERANCE[dtype]
    with runtime_switches(cpu_kernels=False):
        assert_close(lowered.fresh_method().execute([x]), want, max(rtol, 1e-4), max(atol, 1e-4))


def test_max_and_min_propagate_nan_exactly():
    x = special()
    for fn in (lambda t: t.amax(-1), lambda t: t.amin(-1)):
        got = lower(Lambda(fn), (x,)).method().execute([x])[0]
        assert torch.equal(got.isnan(), fn(x).isnan())
        assert torch.equal(got[~got.isnan()], fn(x)[~got.isnan()])  # the extremes themselves, exactly


def test_transposed_input_is_read_in_its_order():
    x = randn(33, 6, seed=3)
    fn = lambda t: t.transpose(0, 1).sum(-1)  # noqa: E731
    got = lower(Lambda(fn), (x,)).method().execute([x])[0]
    assert_close([got], fn(x.double()).float(), 1e-5, 1e-5)


def test_leading_axes_stay_on_mlx():
    x = randn(64, 48, seed=4)
    fn = lambda t: t.sum(0)  # noqa: E731
    lowered = lower(Lambda(fn), (x,))
    before = _runtime.cpu_kernel_call_counts().get("sum", 0)
    assert_close(lowered.method().execute([x]), fn(x), 1e-5, 1e-5)
    assert _runtime.cpu_kernel_call_counts().get("sum", 0) == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
def test_variance_over_trailing_axes_takes_the_kernel(dtype):
    x = (3 * randn(6, 5, 300, seed=5)).to(dtype)
    fn = lambda t: t.var((-2, -1), correction=1)  # noqa: E731
    lowered = lower(Lambda(fn), (x,))
    before = _runtime.cpu_kernel_call_counts()
    got = lowered.method().execute([x])
    assert_close(got, fn(x.double()).to(dtype), *TOLERANCE[dtype])
    if cpu_kernels_active():  # its mean, then its sum of squares
        after = _runtime.cpu_kernel_call_counts()
        assert (after.get("mean", 0) - before.get("mean", 0), after.get("sum", 0) - before.get("sum", 0)) == (1, 1)
