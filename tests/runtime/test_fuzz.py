"""A bounded run of the payload fuzzer (fuzz/fuzz_payload.py) in a subprocess, so
that a crash or hang fails this test instead of killing pytest."""

import subprocess
import sys
from pathlib import Path

import atheris  # noqa: F401  (requirements-dev.txt: the fuzzer needs it, a missing one fails here)

from mlx_delegate.memory import rss_mb

FUZZER = Path(__file__).resolve().parents[2] / "fuzz" / "fuzz_payload.py"
FUZZ_SECONDS = 45
# Memory the fuzzer may grow by. libFuzzer's RSS figure is the process's peak RSS, which on
# Linux starts at this (forking) process's RSS, not at zero: an xdist worker that ran model
# tests before would otherwise trip libFuzzer's default 2 GB limit at start-up.
FUZZ_RSS_GROWTH_MB = 4096


def test_fuzzed_payloads_are_rejected_cleanly(tmp_path):
    # Artifacts (crash-*, timeout-*) land in tmp_path; a finding exits non-zero.
    rss_limit = int(rss_mb()) + FUZZ_RSS_GROWTH_MB
    proc = subprocess.run(
        [sys.executable, str(FUZZER), f"-max_total_time={FUZZ_SECONDS}", "-timeout=30",
         f"-rss_limit_mb={rss_limit}", f"-artifact_prefix={tmp_path}/"],
        cwd=tmp_path, capture_output=True, text=True, timeout=FUZZ_SECONDS + 240)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "6 seeds ok" in log  # every seed ran and matched eager PyTorch first
    assert "Done " in log and " runs in " in log
    outcomes = [line for line in log.splitlines() if line.startswith("fuzz_payload outcomes")][-1]
    # The mutants reach both the loader's checks and execution.
    assert "'rejected at load'" in outcomes and ("'ran'" in outcomes or "'failed at run'" in outcomes), outcomes
