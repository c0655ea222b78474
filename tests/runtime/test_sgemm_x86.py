"""The BLAS front's own fp32 gemm (cpp/sgemm_x86.cpp, its AVX2 and AVX-512 tiles) against float64
numpy and against MKL, and whole models with their products on it against eager torch."""

import sys

import numpy as np
import pytest
import torch

import mlx_delegate  # noqa: F401  (must precede mlx: installs the BLAS route)
from mlx_delegate import _blas
from mlx_delegate.testing import assert_close, lower

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux CPU BLAS route")


@pytest.fixture(params=["avx2", "avx512"])
def own(request):
    previous = _blas.set_sgemm_kind(request.param)
    if _blas.sgemm_kind() != request.param:
        _blas.set_sgemm_kind(previous)
        pytest.skip(f"this processor does not run the {request.param} tile")
    yield
    _blas.set_sgemm_kind(previous)


def _operands(rng, m, n, k, ta, tb, pad):
    """op(a) [m, k] and op(b) [k, n] stored transposed where asked, as views into wider arrays
    (leading dimensions past the row length) when `pad`."""
    a = rng.standard_normal((k, m + pad) if ta else (m, k + pad)).astype(np.float32)
    b = rng.standard_normal((n, k + pad) if tb else (k, n + pad)).astype(np.float32)
    a = a[:, :m] if ta else a[:, :k]
    b = b[:, :k] if tb else b[:, :n]
    return a, b, (a.T if ta else a).astype(np.float64), (b.T if tb else b).astype(np.float64)


# Edge tiles (m not a multiple of 6 / 8, n not of 16 / 32), k below / at / past one k block (256,
# 384), k below the 8-wide transpose, n past a 1024-column block, one-element products, and few
# columns under many rows (64 x 17, 256 x 49: computed transposed, c^T into scratch; 49, 98, 14 and 13
# columns: on the AVX-512 tile's seven-row form there, 13 with an edge tile of six). Edge panels of at
# most half the tile's width run the half tile: written in place where the rows fill it (16 x 112 and
# 21 x 80 on the AVX-512 tiles, 12 x 40 on the AVX2 one; k past a block, so the second block adds to
# the first), else through scratch.
SHAPES = [(1, 1, 1), (5, 7, 3), (6, 16, 8), (7, 17, 9), (8, 32, 256), (9, 33, 257), (13, 33, 520), (73, 1030, 1025),
          (130, 96, 771), (64, 40, 1), (150, 100, 60), (64, 17, 40), (256, 49, 300), (512, 98, 70), (64, 14, 33),
          (40, 13, 19), (16, 112, 300), (21, 80, 40), (12, 40, 400)]


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("ta", [False, True])
@pytest.mark.parametrize("tb", [False, True])
def test_matches_float64_at_odd_shapes_and_strides(own, m, n, k, ta, tb):
    rng = np.random.default_rng(m * 7919 + n * 31 + k)
    a, b, a64, b64 = _operands(rng, m, n, k, ta, tb, pad=3)
    out = _blas.serial_sgemm(a, b, ta, tb)
    np.testing.assert_allclose(out, a64 @ b64, rtol=1e-5, atol=2e-6 * np.sqrt(k) * 8)


@pytest.mark.parametrize("alpha,beta", [(0.75, 0.0), (1.0, 1.0), (-2.0, 0.5), (0.0, 0.5)])
@pytest.mark.parametrize("m,n", [(19, 45), (256, 17)])  # 256 x 17: computed transposed
def test_alpha_beta_and_an_unread_output_when_beta_is_zero(own, alpha, beta, m, n):
    rng = np.random.default_rng(3)
    k = 600  # two k blocks: the second adds to the first's alpha-scaled result
    a, b, a64, b64 = _operands(rng, m, n, k, False, True, pad=0)
    wide = np.full((m, n + 5), np.nan if beta == 0 else 1.5, np.float32)
    if beta != 0:
        wide[:, :n] = rng.standard_normal((m, n))
    c = wide[:, :n]
    expected = alpha * (a64 @ b64) + (beta * c.astype(np.float64) if beta != 0 else 0.0)
    _blas.serial_sgemm(a, b, False, True, alpha=alpha, beta=beta, c=c)
    np.testing.assert_allclose(c, expected, rtol=1e-5, atol=1e-3)
    # Only c's own columns are written.
    if beta == 0:
        assert np.isnan(wide[:, n:]).all()
    else:
        assert (wide[:, n:] == 1.5).all()


# An untransposed b's whole panels are read where they lie in products of up to 256 rows, except where
# its rows lie a multiple of 1 KiB apart (packed then): row strides of 203 and 257 floats, of 256 and
# 512; k past one block, an edge panel (n 70) and edge rows (m 13, 261: packed).
@pytest.mark.parametrize("ldb", [203, 256, 257, 512])
@pytest.mark.parametrize("m", [13, 261])
def test_b_read_in_place_or_packed_by_its_row_stride(own, ldb, m):
    rng = np.random.default_rng(ldb)
    n, k = 70, 300
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, ldb)).astype(np.float32)[:, :n]
    np.testing.assert_allclose(_blas.serial_sgemm(a, b), a.astype(np.float64) @ b.astype(np.float64),
                               rtol=1e-5, atol=2e-6 * np.sqrt(k) * 8)


def test_empty_inner_dimension_scales_the_output(own):
    c = np.full((4, 20), 2.0, np.float32)
    _blas.serial_sgemm(np.zeros((4, 0), np.float32), np.zeros((0, 20), np.float32), beta=0.5, c=c)
    assert (c == 1.0).all()


def test_same_products_as_mkl(own):
    rng = np.random.default_rng(5)
    a, b, _, _ = _operands(rng, 197, 2304, 768, False, True, pad=0)  # a ViT-B/16 QKV product
    mine = _blas.serial_sgemm(a, b, False, True)
    _blas.set_sgemm_kind("mkl")
    mkl = _blas.serial_sgemm(a, b, False, True)
    np.testing.assert_allclose(mine, mkl, rtol=1e-4, atol=1e-4)


# Weights laid out once (the convolutions' per-image products): as the tile's rows, or, where the hinted
# products have few columns, as the columns of the transposed product (64 x 17); k past one block; row
# ranges from panel boundaries, as the channel blocks use them. 256 and 64 rows in the AVX2 tile's panels
# of 6 take 258 and 66 rows of the pack (its size once rounded to 32 only: written past its end).
@pytest.mark.parametrize("m,n,k,hints", [(37, 45, 300, (37, 45)), (256, 49, 600, (128, 49)),
                                         (130, 1030, 771, (130, 1030)), (64, 17, 40, (64, 17)), (5, 3, 1, (5, 3)),
                                         (64, 300, 70, (64, 300))])
@pytest.mark.parametrize("tb", [False, True])
def test_packed_weights_match_float64_over_row_ranges(own, m, n, k, hints, tb):
    rng = np.random.default_rng(m * 31 + k)
    a, b, a64, b64 = _operands(rng, m, n, k, False, tb, pad=3)
    pack = _blas.pack_a(a, hints)
    align = _blas.pack_align(pack)
    split = m // 2 // align * align
    for r0, r1 in [(0, m), (0, split), (split, m)]:
        if r1 <= r0:
            continue
        wide = np.full((r1 - r0, n + 4), np.nan, np.float32)
        c = wide[:, :n]
        assert _blas.packed_sgemm(pack, r0, b, tb, c=c)
        np.testing.assert_allclose(c, a64[r0:r1] @ b64, rtol=1e-5, atol=2e-6 * np.sqrt(k) * 8)
        assert np.isnan(wide[:, n:]).all()  # only c's own columns are written


# Packs for products written across (the pixel-major blocks' expand: ct [n, rows] = (a b)^T): the
# transposed form wherever its wasted tile work costs less than the other form's transposing pass (240 x
# 196, 100 x 196 at k 80, 49 x 960-shaped), the plain one through scratch where it costs clearly more (100
# x 196 at k 1200 and 37 x 45 on the AVX-512 tile, 96 x 7 on the AVX2 one), each over row ranges from panel
# boundaries, only ct's own columns written, beta adding to what ct held.
@pytest.mark.parametrize("m,n,k", [(240, 196, 80), (100, 196, 80), (100, 196, 1200), (480, 49, 160), (37, 45, 300),
                                   (96, 7, 300)])
@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_packed_weights_written_across(own, m, n, k, beta):
    rng = np.random.default_rng(m * 13 + n)
    a, b, a64, b64 = _operands(rng, m, n, k, False, False, pad=0)
    pack = _blas.pack_a(a, (m, n), across=True)
    align = _blas.pack_align(pack)
    split = m // 2 // align * align
    for r0, r1 in [(0, m), (0, split), (split, m)]:
        if r1 <= r0:
            continue
        wide = np.full((n, r1 - r0 + 5), np.nan, np.float32)
        ct = wide[:, :r1 - r0]
        ct[:] = rng.standard_normal(ct.shape).astype(np.float32)
        expected = (a64[r0:r1] @ b64).T + beta * ct.astype(np.float64)
        assert _blas.packed_sgemm_ct(pack, r0, r1 - r0, b, ct, beta=beta)
        np.testing.assert_allclose(ct, expected, rtol=1e-5, atol=2e-6 * np.sqrt(k) * 8)
        assert np.isnan(wide[:, r1 - r0:]).all()


@pytest.mark.parametrize("alpha,beta", [(0.75, 0.0), (1.0, 1.0), (-2.0, 0.5), (0.0, 0.5)])
@pytest.mark.parametrize("hints", [(19, 45), (256, 17)])  # (256, 17): packed for the transposed product
def test_packed_weights_alpha_beta(own, alpha, beta, hints):
    rng = np.random.default_rng(4)
    m, n, k = hints[0], hints[1], 600
    a, b, a64, b64 = _operands(rng, m, n, k, False, False, pad=0)
    c = rng.standard_normal((m, n)).astype(np.float32)
    expected = alpha * (a64 @ b64) + beta * c.astype(np.float64)
    assert _blas.packed_sgemm(_blas.pack_a(a, hints), 0, b, alpha=alpha, beta=beta, c=c)
    np.testing.assert_allclose(c, expected, rtol=1e-5, atol=1e-3)


def test_a_pack_that_does_not_fit_is_refused_untouched(own):
    """Row ranges outside the pack or off a panel boundary, another k, a buffer that is not a pack, and a pack
    made for another tile than the one serving products now (the kind switched since): refused,
    c untouched, so the caller runs the plain weights."""
    rng = np.random.default_rng(6)
    a, b = rng.standard_normal((40, 64)).astype(np.float32), rng.standard_normal((64, 20)).astype(np.float32)
    pack = _blas.pack_a(a, (40, 20))
    c = np.full((8, 20), 7.0, np.float32)
    assert not _blas.packed_sgemm(pack, 1, b, c=c)  # off a panel boundary (panels of 6, 8, 16 or 32)
    assert not _blas.packed_sgemm(pack, 32, b, c=c, rows=16)  # past the pack's 40 rows
    assert not _blas.packed_sgemm(np.zeros_like(pack), 0, b, c=c)  # no header
    assert not _blas.packed_sgemm(pack, 0, b[:48], c=c)  # another k
    other = "avx2" if _blas.sgemm_kind() == "avx512" else "mkl"
    previous = _blas.set_sgemm_kind(other)
    try:
        assert not _blas.packed_sgemm(pack, 0, b, c=c)
    finally:
        _blas.set_sgemm_kind(previous)
    assert (c == 7.0).all()
    assert _blas.packed_sgemm(pack, 0, b, c=c)  # its own tile again
    np.testing.assert_allclose(c, a[:8].astype(np.float64) @ b, rtol=1e-5, atol=1e-4)


def test_rejects_operands_it_cannot_describe():
    with pytest.raises(ValueError, match="float32"):
        _blas.serial_sgemm(np.zeros((3, 4)), np.zeros((4, 5), np.float32))
    with pytest.raises(ValueError, match="inner dimensions"):
        _blas.serial_sgemm(np.zeros((3, 4), np.float32), np.zeros((5, 5), np.float32))
    with pytest.raises(ValueError, match="sgemm kind"):
        _blas.set_sgemm_kind("fast")


@pytest.fixture(scope="module")
def encoder_layer():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(96, 4, 200, dropout=0.0, batch_first=True).eval()
    x = torch.randn(2, 150, 96)
    return layer, x, lower(layer, (x,)).buffer  # lowered once for both kinds


@pytest.mark.parametrize("kind", ["avx2", "avx512", "mkl"])
def test_encoder_layer_through_the_stock_runtime(encoder_layer, kind):
    """nn.TransformerEncoderLayer exported the standard way, loaded by the stock runtime from
    bytes: its linears (the runtime's linear kernel) and attention products run on the chosen
    gemm's blocks and match eager."""
    from executorch.runtime import Runtime

    layer, x, buffer = encoder_layer
    previous = _blas.set_sgemm_kind(kind)
    try:
        if _blas.sgemm_kind() != kind:
            pytest.skip(f"this processor does not run {kind}")
        program = Runtime.get().load_program(buffer)
        method = program.load_method("forward")
        before = _blas.fast_calls()
        for _ in range(3):  # the third call runs the compiled graph
            assert_close(method.execute([x]), layer(x), 1e-4, 1e-4)
        assert _blas.fast_calls() > before
    finally:
        _blas.set_sgemm_kind(previous)
