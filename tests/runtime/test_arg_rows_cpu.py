"""Argmax / argmin over the last axis on the CPU kernel (cpp/kernels/arg_rows_cpu.cpp), through the stock
runtime: equal to eager torch and to MLX's own op (kernels off) in fp32 / bf16 / fp16, with NaN (in the
vector body and in the tail), ties, -0.0 against 0.0, infinities, odd row lengths, keepdims, a transposed
input, and a squeezed one (read from the array it squeezes, as an LLM's argmax over its last logits)."""

import pytest
import torch

from mlx_delegate import _runtime
from mlx_delegate.testing import Lambda, cpu_kernels_active, lower, runtime_switches

NAN, INF = float("nan"), float("inf")


def rows(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def special() -> torch.Tensor:
    """Rows of 37 (four vectors of eight and a tail of five) exercising the rules."""
    x = rows(8, 37, seed=1)
    x[0, 5] = NAN  # a NaN in the vector body wins, argmin too
    x[1, 35] = NAN  # ... and in the tail
    x[2, [3, 20]] = 9.0  # ties: the first
    x[3] = 0.0
    x[3, [2, 30]] = -0.0  # zeros of both signs are equal
    x[4, 7], x[4, 33] = INF, -INF
    x[5, :] = -INF
    x[6, 36] = 50.0  # the extreme in the last lane of the tail
    x[7, 0] = NAN  # the very first element
    return x


CASES = [
    ("max", lambda x: x.argmax(-1), lambda: rows(3, 5, 1000)),
    ("min-keepdim", lambda x: x.argmin(-1, keepdim=True), lambda: rows(4, 129)),
    ("max-long-row", lambda x: x.argmax(-1), lambda: rows(1, 49157)),
    ("max-special", lambda x: x.argmax(-1), special),
    ("min-special", lambda x: x.argmin(-1), special),
    ("max-transposed", lambda x: x.transpose(0, 1).argmax(-1), lambda: rows(33, 6)),
    ("max-squeezed", lambda x: x[:, -1:, :].squeeze(1).argmax(-1), lambda: rows(2, 3, 300)),
    ("max-flat", lambda x: x.argmax(), lambda: rows(5, 7)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name, fn, make", CASES, ids=[c[0] for c in CASES])
def test_matches_eager_and_kernels_off(name, fn, make, dtype):
    x = make().to(dtype)
    want = fn(x)
    lowered = lower(Lambda(fn), (x,))
    before = _runtime.cpu_kernel_call_counts()
    for _ in range(3):  # node by node, traced, replayed
        got = lowered.method().execute([x])[0]
        assert got.dtype == torch.int64 and torch.equal(got, want), (got, want)
    if cpu_kernels_active():
        counter = "argmin" if name.startswith("min") else "argmax"
        assert _runtime.cpu_kernel_call_counts().get(counter, 0) > before.get(counter, 0)
    with runtime_switches(cpu_kernels=False):
        assert torch.equal(lowered.fresh_method().execute([x])[0], want)
