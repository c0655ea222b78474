"""MLX's CPU matmuls are served by the fast BLAS that mlx_delegate routes them to."""

import os
import sys

import numpy as np
import pytest
import torch

import mlx_delegate  # noqa: F401  (must precede mlx: installs the BLAS route)
from mlx_delegate import _blas
from mlx_delegate.testing import assert_close, lower

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux CPU BLAS route")


def test_fast_blas_is_active():
    assert _blas.mode() == "torch"


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_mlx_matmul_uses_fast_blas_with_transposes(ta, tb):
    import mlx.core as mx

    rng = np.random.default_rng(0)
    a = rng.standard_normal((33, 17) if not ta else (17, 33)).astype(np.float32)
    b = rng.standard_normal((17, 9) if not tb else (9, 17)).astype(np.float32)
    xa, xb = mx.array(a), mx.array(b)
    xa, xb = (xa.T if ta else xa), (xb.T if tb else xb)
    before = _blas.fast_calls()
    out = xa @ xb
    mx.eval(out)
    assert _blas.fast_calls() > before
    ref = (a.T if ta else a) @ (b.T if tb else b)
    np.testing.assert_allclose(np.array(out), ref, rtol=1e-5, atol=1e-5)


def test_delegate_matmul_goes_through_fast_blas():
    class M(torch.nn.Module):
        def forward(self, x, y):
            return torch.matmul(x, y)

    x, y = torch.randn(16, 32), torch.randn(32, 8)
    method = lower(M(), (x, y)).method()
    before = _blas.fast_calls()
    assert_close(method.execute([x, y]), M()(x, y), 1e-5, 1e-5)
    assert _blas.fast_calls() > before


@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
@pytest.mark.parametrize("m,n,k", [(130, 771, 96), (997, 40, 257)])  # cut by columns; by rows
def test_large_products_split_over_the_pool(ta, tb, m, n, k):
    """Products of >= 1M multiply-adds are cut into single-threaded blocks on the runtime's
    pool (not MKL's OpenMP team): blocks at uneven sizes and transposed operands give the
    product numpy computes, and the same as one MKL call (split off)."""
    import mlx.core as mx

    from mlx_delegate import _runtime

    rng = np.random.default_rng(1)
    a = rng.standard_normal((m, k) if not ta else (k, m)).astype(np.float32)
    b = rng.standard_normal((k, n) if not tb else (n, k)).astype(np.float32)
    ref = (a.T if ta else a) @ (b.T if tb else b)

    def product() -> np.ndarray:
        xa, xb = mx.array(a), mx.array(b)
        out = (xa.T if ta else xa) @ (xb.T if tb else xb)
        mx.eval(out)
        return np.array(out)

    assert _runtime.set_blas_split(False) is False
    try:
        whole = product()
    finally:
        on = _runtime.set_blas_split(True)
    assert on
    previous = _blas.set_split_policy("always")
    try:
        before = _blas.split_calls()
        split = product()
        assert _blas.split_calls() > before
    finally:
        _blas.set_split_policy(previous)
    np.testing.assert_allclose(split, ref, rtol=1e-4, atol=1e-4)
    # The blocks may run on the AVX2 kernel (another summation order than MKL's): sums of 257
    # products of unit normals differ by a few 1e-5.
    np.testing.assert_allclose(split, whole, rtol=1e-5, atol=1e-4)


def test_measured_split_tries_both_ways_and_keeps_results():
    """Under the measured policy a product shape runs split and as one call (each timed, then
    the faster, the other retried now and then): both ways serve it, and give the same product."""
    import mlx.core as mx

    previous = _blas.set_split_policy("measured")
    rng = np.random.default_rng(2)
    a = rng.standard_normal((96, 200)).astype(np.float32)
    b = rng.standard_normal((200, 333)).astype(np.float32)  # a shape no other test uses
    xa, xb = mx.array(a), mx.array(b)
    split0, serial0 = _blas.split_calls(), _blas.serial_choices()
    outs = []
    try:
        for _ in range(20):
            out = xa @ xb
            mx.eval(out)
            outs.append(np.array(out))
    finally:
        assert _blas.set_split_policy(previous) == "measured"
    assert _blas.split_calls() > split0 and _blas.serial_choices() > serial0
    for out in outs:
        np.testing.assert_allclose(out, a @ b, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(out, outs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m,n,k", [(130, 771, 96), (997, 40, 257), (128, 1024, 256)])  # columns, rows, the demo
def test_balanced_split_sizes_the_callers_block_and_keeps_results(m, n, k):
    """The balanced policy always splits, the calling thread's block sized by the helpers'
    measured speed: over calls the share moves within [1 / threads, 0.9] (0.9: no helper
    joined), and every call gives the product numpy computes, whatever the cut."""
    import mlx.core as mx

    rng = np.random.default_rng(3)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    xa, xb = mx.array(a), mx.array(b)
    previous = _blas.set_split_policy("balanced")
    before, outs = _blas.split_calls(), []
    try:
        for _ in range(12):
            out = xa @ xb
            mx.eval(out)
            outs.append(np.array(out))
    finally:
        assert _blas.set_split_policy(previous) == "balanced"
    assert _blas.split_calls() - before == 12
    threads = min(len(os.sched_getaffinity(0)), 8)  # the pool's size: the usable cores, at most 8
    assert 1 / threads - 1e-3 <= _blas.balanced_share(m, n, k) <= 0.9 + 1e-3
    for out in outs:
        np.testing.assert_allclose(out, a @ b, rtol=1e-4, atol=1e-4)


def test_split_products_after_the_helpers_went_to_sleep():
    """Each product after an idle gap (the pool's helpers sleep 100 us after a job), so every split
    starts with a wake-up and the woken helper may land on the caller's core: the caller's part 0
    is reserved before the wake, and the product is whole and right every time, under both split
    policies."""
    import time

    import mlx.core as mx

    rng = np.random.default_rng(4)
    a = rng.standard_normal((128, 256)).astype(np.float32)
    b = rng.standard_normal((256, 272)).astype(np.float32)
    xa, xb = mx.array(a), mx.array(b)
    for policy in ("always", "balanced"):
        previous = _blas.set_split_policy(policy)
        before = _blas.split_calls()
        try:
            for _ in range(6):
                time.sleep(0.002)
                out = xa @ xb
                mx.eval(out)
                np.testing.assert_allclose(np.array(out), a @ b, rtol=1e-4, atol=1e-4)
        finally:
            _blas.set_split_policy(previous)
        assert _blas.split_calls() - before == 6


def test_balanced_split_through_the_stock_runtime():
    """A lowered MLP under the balanced policy against eager, call after call (the cut moves
    between calls; odd feature counts so blocks end off the 16-column grid)."""
    model = torch.nn.Sequential(torch.nn.Linear(200, 515), torch.nn.GELU(), torch.nn.Linear(515, 77)).eval()
    x = torch.randn(131, 200)
    method = lower(model, (x,)).method()
    previous = _blas.set_split_policy("balanced")
    try:
        with torch.no_grad():
            expected = model(x)
        for _ in range(6):
            assert_close(method.execute([x]), expected, 1e-4, 1e-4)
    finally:
        _blas.set_split_policy(previous)


def test_split_policy_rejects_unknown_names():
    with pytest.raises(ValueError, match="split policy"):
        _blas.set_split_policy("sometimes")
