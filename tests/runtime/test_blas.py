"""MLX's CPU matmuls are served by the fast BLAS that mlx_delegate routes them to."""

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
