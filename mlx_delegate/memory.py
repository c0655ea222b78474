"""This process's resident memory, for progress lines, benchmarks and leak tests.

Linux reads /proc/self (VmHWM starts afresh at exec, unlike ru_maxrss, which a
forked worker inherits from its parent); elsewhere getrusage's peak stands in.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

_STATUS = Path("/proc/self/status")


def _status_mb(field: str) -> float | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return None


def peak_rss_mb() -> float:
    """Peak resident memory of this process (since exec, or since `reset_peak_rss`)."""
    peak = _status_mb("VmHWM")
    if peak is not None:
        return peak
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss / 2**20 if sys.platform == "darwin" else maxrss / 2**10  # bytes on macOS, KiB on Linux


def rss_mb() -> float:
    """Current resident memory (the peak where there is no procfs, e.g. macOS)."""
    rss = _status_mb("VmRSS")
    return rss if rss is not None else peak_rss_mb()


def available_mb() -> float | None:
    """Memory the system can still give without swapping (Linux's MemAvailable); None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def reset_peak_rss() -> bool:
    """Restart the peak from the current RSS (Linux >= 4.0); False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False
