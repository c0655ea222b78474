"""The CPU max pooling (cpp/kernels/pool_cpu.cpp, counter "max_pool"): 1-D and 2-D max pooling without
indices matches eager torch and the composed kernels-off path (MLX_DELEGATE_CPU_KERNELS=0) in
float32, bfloat16 and float16, node by node and compiled, at odd sizes, strides, padding, dilation
and ceil mode, with NaN propagated. Pooling whose indices are read stays on the composed path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mlx_delegate import _runtime
from mlx_delegate.testing import CALLS_TO_REPLAY, assert_close, cpu_kernels_active, lower, runtime_switches

# keyword arguments of F.max_pool2d
POOLS = [
    dict(kernel_size=3, stride=2, padding=1),  # ResNet's stem
    dict(kernel_size=2),
    dict(kernel_size=(3, 2), stride=(1, 2), padding=(1, 0), dilation=(2, 1)),
    dict(kernel_size=3, stride=2, ceil_mode=True),  # the last window hangs over the edge
]


class Pools(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        out = [F.max_pool2d(x, **kw) for kw in POOLS]
        out.append(F.max_pool1d(x.flatten(2), 4, stride=3, padding=2))
        values, indices = F.max_pool2d(x, 2, return_indices=True)  # indices read: composed path
        return [*out, values, indices]


def calls() -> int:
    return _runtime.cpu_kernel_call_counts().get("max_pool", 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_max_pool_cpu(dtype: torch.dtype) -> None:
    x = torch.randn(2, 3, 11, 9, generator=torch.Generator().manual_seed(0)).to(dtype)
    x[1, 2, 4, 4] = float("nan")
    lowered = lower(Pools(), (x,))
    assert lowered.summary[1] == [], lowered.summary
    expected = Pools()(x.float())  # max is exact: the same values in any float type
    expected = [e.to(dtype) if e.is_floating_point() else e for e in expected]
    before = calls()
    method = lowered.fresh_method()
    for _ in range(CALLS_TO_REPLAY):
        got = method.execute([x])
        assert_close(got, expected, 0, 0, exact=True)
    if cpu_kernels_active():
        assert calls() - before >= (len(POOLS) + 1) * CALLS_TO_REPLAY
    with runtime_switches(cpu_kernels=False):
        off = lowered.fresh_method().execute([x])
    assert_close(got, off, 0, 0, exact=True)
