"""The CPU kernels' helper pool under jobs of changing part counts (cpp/kernels/cpu_parallel.cpp):
split products (one part per pool thread) alternating with row kernels (four parts per thread), call
after call, every output against eager torch. A helper still claiming from the last job once took a
part of the next one against the old job's counts; the next job's count then overshot and the call
never returned (a demo-block loop hung after ~4000 pool jobs), so this runs in a child process under
a time limit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHILD = r"""
import sys
import torch
import mlx_delegate
from mlx_delegate import _blas, _runtime
from mlx_delegate.testing import assert_close, lower

torch.manual_seed(0)


class Chain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(4))
        self.norm = torch.nn.ModuleList(torch.nn.LayerNorm(256) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for fc, norm in zip(self.fc, self.norm):
            x = torch.softmax(norm(fc(x)), dim=-1) * 16.0
        return x


model = Chain().eval()
x = torch.randn(128, 256)
with torch.no_grad():
    expected = model(x)
method = lower(model, (x,)).method()


def products() -> int:  # products cut over the pool: by the BLAS front, or by the fp32 linear kernel
    return _blas.split_calls() + _runtime.cpu_kernel_call_counts().get("linear_f32", 0)


def row_kernels() -> int:
    return sum(n for name, n in _runtime.cpu_kernel_call_counts().items() if name != "linear_f32")


calls, splits, kernels = int(sys.argv[1]), products(), row_kernels()
for _ in range(calls):
    assert_close(method.execute([x]), [expected], 1e-4, 1e-4)
print("split products", products() - splits, "row kernels", row_kernels() - kernels)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="the split products use the Linux BLAS route")
def test_jobs_of_changing_part_counts() -> None:
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, "1500"], capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("1500 calls alternating split products and row kernels did not finish in 240 s: a pool job hung")
    assert out.returncode == 0, out.stderr[-3000:]
    words = out.stdout.split()
    split, rows = int(words[words.index("products") + 1]), int(words[words.index("kernels") + 1])
    # Both job shapes ran on the pool, call after call (unless the process has one core).
    if len(os.sched_getaffinity(0)) > 1:
        assert split >= 1500 * 4 and rows >= 1500 * 8, out.stdout
