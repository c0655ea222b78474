"""The CPU kernels' helper pool is sized by the cores the process may run on (its CPU affinity:
`taskset`, a container's cpuset), not by the machine's core count: restricted to one core, a
kernel starts no helper thread (which would only take turns with the caller on that core)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Runs in a fresh process: the pool starts on the first kernel call, after the affinity is set.
CHILD = r"""
import os, sys
cores = sys.argv[1]
if cores != "all":
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
import torch
import mlx_delegate
from mlx_delegate import _runtime
from mlx_delegate.testing import lower

x = torch.randn(1 << 18)
method = lower(torch.nn.SiLU(), (x,)).method()
before_calls = sum(_runtime.cpu_kernel_call_counts().values())
got = method.execute([x])[0]
assert sum(_runtime.cpu_kernel_call_counts().values()) > before_calls, "no CPU kernel ran"
torch.testing.assert_close(got, torch.nn.functional.silu(x), rtol=1e-5, atol=1e-6)
names = []
for t in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{t}/comm") as f:
        names.append(f.read().strip())
print(names.count("mlxd-pool"))
"""


def pool_helpers(cores: str) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD, cores], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and at least two usable cores")
def test_pool_has_no_helpers_on_one_core() -> None:
    if os.environ.get("MLX_DELEGATE_CPU_KERNELS") == "0":
        pytest.skip("CPU kernels off")
    helpers = min(len(os.sched_getaffinity(0)), 8) - 1
    assert (pool_helpers("one"), pool_helpers("all")) == (0, helpers)
