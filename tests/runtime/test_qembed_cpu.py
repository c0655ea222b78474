"""The quantized embedding's CPU kernel (cpp/kernels/qembed_cpu.h): rows of an affine-packed table
gathered and dequantized in one primitive, through the stock runtime. Against the table dequantized in
torch (bit for bit where the scales are a half type: their products are exact in float32, as for GGUF's
blocks), against MLX's own ops (kernels off), in fp32 / bf16 / fp16, at 2 / 4 / 8 bits, groups 32 and
64, odd shapes and transposed indices. An index outside the table is a named error, not a clamped row."""

import pytest
import torch

from mlx_delegate import _runtime
from mlx_delegate.quantization import MLXQuantized, QuantizedEmbedding, dequantize_mlx
from mlx_delegate.testing import cpu_kernels_active, lower, runtime_switches

ROWS = 37


def packed_table(cols: int, bits: int, group: int, scale_dtype: torch.dtype, seed: int) -> MLXQuantized:
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(-(2**31), 2**31, (ROWS, cols * bits // 32), generator=g, dtype=torch.int64).to(torch.int32)
    scales = (torch.rand(ROWS, cols // group, generator=g) * 0.1 + 0.01).to(scale_dtype)
    biases = (torch.randn(ROWS, cols // group, generator=g) * 0.1).to(scale_dtype)
    return MLXQuantized(words, scales, biases, group, bits)


class Lookup(torch.nn.Module):
    def __init__(self, packed: MLXQuantized, transpose: bool) -> None:
        super().__init__()
        self.emb, self.transpose = QuantizedEmbedding(packed), transpose

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.emb(idx.t() if self.transpose else idx)


def expected(packed: MLXQuantized, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows dequantized in float32 (scale * q + bias), rounded once to `dtype`."""
    table = dequantize_mlx(packed.w, packed.scales.float(), packed.biases.float(), packed.group_size, packed.bits,
                           dtype=torch.float32)
    return table[idx].to(dtype)


# (scales' dtype, activations' dtype): same dtype, and GGUF's fp16 scales under fp32 / bf16 (float32_out)
DTYPES = [(torch.float32, torch.float32), (torch.float16, torch.float32), (torch.float16, torch.float16),
          (torch.bfloat16, torch.bfloat16), (torch.float16, torch.bfloat16), (torch.float32, torch.bfloat16)]


@pytest.mark.parametrize("scale_dtype, dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("bits, group, cols, idx_shape, transpose",
                         [(4, 32, 96, (3, 5), False), (8, 32, 96, (5, 3), True), (2, 64, 128, (1, 1), False),
                          (4, 64, 192, (300,), False)],
                         ids=["q4-g32-3x5", "q8-g32-transposed", "q2-g64-one", "q4-g64-300-rows"])
def test_rows_match_torch_and_kernels_off(scale_dtype, dtype, bits, group, cols, idx_shape, transpose):
    packed = packed_table(cols, bits, group, scale_dtype, seed=bits * 1000 + cols)
    module = Lookup(packed, transpose).to(dtype).eval()
    g = torch.Generator().manual_seed(7)
    shape = idx_shape[::-1] if transpose else idx_shape
    idx = torch.randint(0, ROWS, shape, generator=g)
    idx.view(-1)[0], idx.view(-1)[-1] = 0, ROWS - 1  # both ends of the table
    lowered = lower(module, (idx,))
    want = expected(packed, idx.t() if transpose else idx, dtype)
    # fp32 scales: the kernel may fuse the multiply-add (one rounding less than torch): 1 ulp apart
    tol = {} if scale_dtype != torch.float32 else {"rtol": 2e-7, "atol": 1e-8}

    before = _runtime.cpu_kernel_call_counts().get("qembed", 0)
    for _ in range(3):  # node by node, traced, replayed
        got = lowered.method().execute([idx])[0]
        assert got.dtype == dtype and got.shape == want.shape
        if tol:
            torch.testing.assert_close(got, want, **tol)
        else:
            assert torch.equal(got, want)
    if cpu_kernels_active():
        assert _runtime.cpu_kernel_call_counts().get("qembed", 0) > before

    with runtime_switches(cpu_kernels=False):
        off = lowered.fresh_method().execute([idx])[0]
    if dtype == scale_dtype and dtype != torch.float32:
        # MLX's own dequantize computes in the half type (two roundings)
        torch.testing.assert_close(off, got, rtol=1e-2, atol=1e-3)
    else:
        torch.testing.assert_close(off, got, rtol=2e-7, atol=1e-8)


@pytest.mark.parametrize("compiled", [False, True], ids=["nodes", "compiled"])
def test_index_outside_the_table_is_refused(compiled):
    """torch raises IndexError; the runtime names the index (MLX's gather would read a clamped row)."""
    packed = packed_table(64, 4, 32, torch.float16, seed=3)
    module = Lookup(packed, False).eval()
    method = lower(module, (torch.tensor([[1, 2]]),)).method()
    with runtime_switches(compile=compiled):
        for good in ([[1, 2]], [[0, ROWS - 1]], [[5, 6]]):
            idx = torch.tensor(good)
            assert torch.equal(method.execute([idx])[0], expected(packed, idx, torch.float32))
        for bad in (ROWS, -1, 1 << 40):
            with pytest.raises(RuntimeError):
                method.execute([torch.tensor([[3, bad]])])
            assert "embedding index" in _runtime.last_error() and str(bad) in _runtime.last_error()
            with pytest.raises(IndexError):
                module(torch.tensor([[3, bad]]))
