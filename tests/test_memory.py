"""mlx_delegate.memory: the process's and the system's memory figures the benchmarks print and act on."""

import sys

import pytest
import torch

from mlx_delegate.memory import available_mb, peak_rss_mb, rss_mb


@pytest.mark.skipif(sys.platform != "linux", reason="procfs")
def test_available_memory_falls_as_the_process_takes_memory() -> None:
    """MemAvailable lies between zero and MemTotal, and drops by about what a touched allocation takes."""
    total = int(next(l for l in open("/proc/meminfo") if l.startswith("MemTotal:")).split()[1]) / 1024
    drops = []
    for _ in range(3):  # another process may free memory meanwhile: one clean try of three suffices
        before = available_mb()
        assert before is not None and 0 < before <= total
        block = torch.ones(256 * 2**20 // 4)  # 256 MB, touched
        after = available_mb()
        assert after is not None
        drops.append(before - after)
        assert rss_mb() <= peak_rss_mb() and rss_mb() > 256
        del block
        if drops[-1] > 128:
            break
    assert drops[-1] > 128, drops
