"""The caller's OpenMP team lent to the kernel pool for a call (`_runtime.set_pool_omp_team`,
cpp/kernels/cpu_parallel.cpp): a transformer encoder layer called alternately with eager torch (whose
OpenMP team is then warm), with the switch always, off and auto, every output against eager torch. A lent team
whose worker missed the end of a call would hang it, so this runs in a child process under a time
limit."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CHILD = r"""
import time

import torch
import mlx_delegate
from mlx_delegate import _runtime
from mlx_delegate.testing import assert_close, lower

torch.manual_seed(0)
layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, activation="gelu", batch_first=True)
model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
x = torch.randn(1, 128, 256)
with torch.no_grad():
    expected = model(x)
    method = lower(model, (x,)).method()
    calls = {}
    # always: every call lends; off: none; auto: the gap rule, then whichever mode measures faster.
    for mode in ("always", "off", "auto", "always"):
        _runtime.set_pool_omp_team(mode)
        before = _runtime.omp_team_stats()["calls"]
        outs = []
        for _ in range(30):  # the demo's alternation: each call follows an eager one
            outs += [method.execute([x])[0], model(x)]
        calls[mode] = calls.get(mode, 0) + _runtime.omp_team_stats()["calls"] - before
        for out in outs:
            assert_close([out], [expected], 1e-4, 1e-4)
    # Calls 60 ms apart (many evaluation times): auto does not lend the team, so its worker does not
    # spin between them.
    _runtime.set_pool_omp_team("auto")
    before = _runtime.omp_team_stats()["calls"]
    for _ in range(20):
        time.sleep(0.06)
        assert_close(method.execute([x]), [expected], 1e-4, 1e-4)
    sparse = _runtime.omp_team_stats()["calls"] - before
print("team calls always", calls["always"], "off", calls["off"], "auto", calls["auto"], "sparse", sparse, "parts", _runtime.omp_team_stats()["parts"],
      "threads", torch.get_num_threads())
"""


@pytest.mark.skipif(sys.platform != "linux", reason="torch's libgomp: the Linux wheel's OpenMP runtime")
def test_omp_team_modes_match_eager() -> None:
    try:
        out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail("140 encoder calls with the OpenMP team lent and not did not finish in 240 s: a call hung")
    assert out.returncode == 0, out.stderr[-3000:]
    words = out.stdout.split()
    count = lambda key: int(words[words.index(key) + 1])  # noqa: E731
    assert count("off") == 0, out.stdout
    assert count("sparse") <= 5, out.stdout  # the smoothed gap passes two evaluations within a few calls
    # Always lends on every call (but the first few, which time the evaluation) where the process may run
    # on more than one core (the pool then has helpers) and the child's torch allows more than one thread
    # (OpenMP's team size); auto's count depends on what the calls measure.
    if len(os.sched_getaffinity(0)) > 1 and count("threads") > 1:
        assert count("always") >= 50, out.stdout
    else:
        assert count("always") == count("auto") == 0, out.stdout


BURST_CHILD = r"""
import time

import torch
import mlx_delegate
from mlx_delegate import _runtime
from mlx_delegate.testing import assert_close, lower

torch.manual_seed(0)
# calls of several ms, so that a call's successor starts past the worker's warm span (4 ms)
layer = torch.nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.0, activation="gelu", batch_first=True)
model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
x = torch.randn(1, 512, 512)
lent, burst = [], []
with torch.no_grad():
    expected = model(x)
    lowered = lower(model, (x,))
    _runtime.set_pool_omp_team("auto")
    for _ in range(3):
        method = lowered.fresh_method()  # a new pace: its first lending calls fill the lent window
        for _ in range(2):  # the first call builds, the second times the evaluation
            assert_close(method.execute([x]), [expected], 1e-4, 1e-4)
        before = _runtime.omp_team_stats()["calls"]
        for _ in range(4):  # the caller works between calls (the demo's eager torch): these lend
            model(x)
            assert_close(method.execute([x]), [expected], 1e-4, 1e-4)
        lent.append(_runtime.omp_team_stats()["calls"] - before)
        before = _runtime.omp_team_stats()["calls"]
        # then calls back to back, nothing between them (a decode loop after its prefill), checked after
        outs = [method.execute([x])[0] for _ in range(8)]
        burst.append(_runtime.omp_team_stats()["calls"] - before)
        for out in outs:
            assert_close([out], [expected], 1e-4, 1e-4)
print("lent_max", max(lent), "burst_max", max(burst), "threads", torch.get_num_threads())
"""


@pytest.mark.skipif(sys.platform != "linux", reason="torch's libgomp: the Linux wheel's OpenMP runtime")
def test_omp_team_lent_only_after_work() -> None:
    """Auto lends calls that follow the caller's work, not the back-to-back calls after them: the smoothed
    gap alone kept those lending with the team's worker gone cold."""
    out = subprocess.run([sys.executable, "-c", BURST_CHILD], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    words = out.stdout.split()
    count = lambda key: int(words[words.index(key) + 1])  # noqa: E731
    if len(os.sched_getaffinity(0)) > 1 and count("threads") > 1:
        # Calls after the caller's work lend (in at least one of three rounds: "auto" lends where lending
        # measured faster, which another process taking both cores can undo for a round)
        assert count("lent_max") >= 1, out.stdout
        assert count("burst_max") <= 1, out.stdout  # back-to-back ones only within 4 ms of such a call
    else:
        assert count("lent_max") == count("burst_max") == 0, out.stdout


PAUSE_CHILD = r"""
import time

import torch
import mlx_delegate
from mlx_delegate import _runtime
from mlx_delegate.testing import assert_close, lower

torch.manual_seed(0)
# calls of several ms (long enough to pause for), however fast the machine
layer = torch.nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.0, activation="gelu", batch_first=True)
model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
x = torch.randn(1, 256, 512)
big = torch.randn(1, 1, 1 << 16)  # torch copies this on its OpenMP team (more than one grain)
threads = torch.get_num_threads()
team = _runtime.omp_team_stats


def calls(count, on, until_close=0):
    # Each call after a parallel op; its gap (from the last call's return to its own start, as Python sees it:
    # the runtime's gap is at least that long) and whether it paused. With until_close, calls go on (up to
    # count) until that many had gaps well inside the worker's spin, which a loaded machine may stretch.
    _runtime.set_pool_omp_pause(on)
    rows, outs, end = [], [], None
    while len(rows) < count and (not until_close or sum(g is not None and g < 1.5 for g, _ in rows) < until_close):
        copy = big.clone()  # a parallel op: the team's worker spins on into the call
        before, start = team()["pauses"], time.perf_counter()
        out = method.execute([x])[0]
        rows.append((None if end is None else (start - end) * 1e3, team()["pauses"] - before))
        end = time.perf_counter()
        assert torch.equal(copy, big)
        outs.append(out)
    for out in outs:  # checked after the calls, to keep their gaps short
        assert_close([out], [expected], 1e-4, 1e-4)
    return rows


with torch.no_grad():
    expected = model(x)
    method = lower(model, (x,)).method()
    _runtime.set_pool_omp_team("off")  # no call lends the team: each one may pause it
    on = calls(200, True, until_close=16)
    off = calls(20, False)
    late = []  # calls 10 ms after the last one's end: the worker has stopped spinning, so no pause
    for _ in range(5):
        time.sleep(0.01)
        late += calls(1, True)
    # eager torch after the pauses: the team starts again, same threads, same results
    assert_close([model(x)], [expected], 1e-5, 1e-5)
    assert torch.get_num_threads() == threads
close = [p for g, p in on if g is not None and g < 1.5]
print("close", len(close), "close_paused", sum(close), "far_paused", sum(p for g, p in on if g is not None and g > 4),
      "first_paused", on[0][1], "off", sum(p for _, p in off), "late", sum(p for _, p in late), "threads", threads,
      "default", int(_runtime.pool_omp_pause()))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="torch's libgomp: the Linux wheel's OpenMP runtime")
def test_omp_team_paused_before_long_calls() -> None:
    """A long call that does not lend the team first pauses it when it follows the last call closely (the
    team's worker would spin into it after the caller's parallel op), not when the worker has stopped
    spinning; off, it never does; eager torch runs on unchanged after the pauses."""
    out = subprocess.run([sys.executable, "-c", PAUSE_CHILD], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    words = out.stdout.split()
    count = lambda key: int(words[words.index(key) + 1])  # noqa: E731
    # never: switched off, after the worker stopped spinning, on a method's first call (which times it)
    assert count("off") == count("late") == count("far_paused") == count("first_paused") == 0, out.stdout
    assert count("default") == 1, out.stdout
    if len(os.sched_getaffinity(0)) > 1 and count("threads") > 1:
        # calls well inside the worker's 4 ms spin pause, but for the few a loaded machine delayed in between
        assert count("close") >= 16 and count("close_paused") >= 0.5 * count("close"), out.stdout
    else:
        assert count("close_paused") == 0, out.stdout
