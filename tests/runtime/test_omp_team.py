"""The caller's OpenMP team lent to the kernel pool for a call (`_runtime.set_pool_omp_team`,
cpp/kernels/cpu_parallel.cpp): a transformer encoder layer called alternately with eager torch (whose
OpenMP team is then warm), with the switch on and off, every output against eager torch. A lent team
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
    for on in (True, False, True):
        _runtime.set_pool_omp_team(on)
        before = _runtime.omp_team_stats()["calls"]
        outs = []
        for _ in range(30):  # the demo's alternation: each call follows an eager one
            outs += [method.execute([x])[0], model(x)]
        calls[on] = calls.get(on, 0) + _runtime.omp_team_stats()["calls"] - before
        for out in outs:
            assert_close([out], [expected], 1e-4, 1e-4)
    # Calls 60 ms apart (many evaluation times): the team is not lent, so its worker does not spin
    # between them.
    _runtime.set_pool_omp_team(True)
    before = _runtime.omp_team_stats()["calls"]
    for _ in range(20):
        time.sleep(0.06)
        assert_close(method.execute([x]), [expected], 1e-4, 1e-4)
    sparse = _runtime.omp_team_stats()["calls"] - before
print("team calls on", calls[True], "off", calls[False], "sparse", sparse, "parts", _runtime.omp_team_stats()["parts"],
      "threads", torch.get_num_threads())
"""


@pytest.mark.skipif(sys.platform != "linux", reason="torch's libgomp: the Linux wheel's OpenMP runtime")
def test_omp_team_on_and_off_match_eager() -> None:
    try:
        out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("90 encoder calls with the OpenMP team lent on and off did not finish in 240 s: a call hung")
    assert out.returncode == 0, out.stderr[-3000:]
    words = out.stdout.split()
    on, off = int(words[words.index("on") + 1]), int(words[words.index("off") + 1])
    sparse = int(words[words.index("sparse") + 1])
    assert off == 0, out.stdout
    assert sparse <= 5, out.stdout  # the smoothed gap passes two evaluations within a few calls
    # On, most calls lend the team (not the first few, which time the evaluation, nor one that followed
    # an eager call longer than two of its evaluations), where the process may run on more than one core
    # (the pool then has helpers) and the child's torch allows more than one thread (OpenMP's team size).
    if len(os.sched_getaffinity(0)) > 1 and int(words[words.index("threads") + 1]) > 1:
        assert on >= 30, out.stdout
    else:
        assert on == 0, out.stdout
