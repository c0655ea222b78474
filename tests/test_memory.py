"""mlx_delegate.memory: the process's and the system's memory figures the benchmarks print and act on."""

import mmap
import sys
import time

import pytest

from mlx_delegate.memory import available_mb, peak_rss_mb, rss_mb

BLOCK = 512 * 2**20


@pytest.mark.skipif(sys.platform != "linux", reason="procfs")
def test_available_memory_falls_as_the_process_takes_memory() -> None:
    """MemAvailable lies between zero and MemTotal, and drops by about what a touched anonymous mapping
    takes (its own pages, returned to the system when it is closed, unlike a freed heap block)."""
    total = int(next(line for line in open("/proc/meminfo") if line.startswith("MemTotal:")).split()[1]) / 1024
    drops = []
    for _ in range(10):  # another process may free memory meanwhile: one clean try of ten suffices
        before = available_mb()
        assert before is not None and 0 < before <= total
        block = mmap.mmap(-1, BLOCK)
        for i in range(0, BLOCK, mmap.PAGESIZE):  # touch every page
            block[i] = 1
        after = available_mb()
        assert after is not None
        drops.append(before - after)
        assert rss_mb() <= peak_rss_mb() and rss_mb() > BLOCK / 2**20
        block.close()
        if drops[-1] > BLOCK / 2**20 / 2:
            break
        time.sleep(0.3)
    assert drops[-1] > BLOCK / 2**20 / 2, drops
