"""The fused fake-quantize kernel (cpp/kernels/fake_quant_cpu.cpp, `mlx_delegate::fake_quantize`: a PT2E
activation's quantize_per_tensor -> dequantize_per_tensor pair, with a clamp before it): equal to eager
bit for bit at odd lengths (vector tails), on a transposed view and past the size a second thread takes,
compiled and node by node, with ties rounded to even. MLX's own ops (kernels off), the portable code and
the AVX2 code run the same program in subprocesses and must agree to the bit."""

import math

import pytest
import torch
from torch.export import Dim

from mlx_delegate import _runtime
from mlx_delegate.testing import assert_close, cpu_kernels_active, lower, on_cpu_device, run_in_subprocess

fq = torch.ops.mlx_delegate.fake_quantize.default
INF = math.inf
# (scale, zero_point, quant_min, quant_max, lo, hi): int8 with an odd zero point, ReLU and ReLU6 clamps,
# uint8's range, and a scale of 0.5 whose reciprocal 2 turns quarter steps into ties.
PARAMS = [(0.037, -3, -128, 127, -INF, INF), (0.05, -128, -128, 127, 0.0, INF), (0.0235, -128, -128, 127, 0.0, 6.0),
          (0.11, 128, 0, 255, -INF, INF), (0.5, 0, -128, 127, -INF, INF)]
COLUMNS = 8195  # 3 x 8195 elements: vector tails, and several tasks past the kernel's grain


class Pairs(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        outs = [fq(x, float(torch.tensor(1 / s, dtype=torch.float32)), s, zp, qmin, qmax, lo, hi)
                for s, zp, qmin, qmax, lo, hi in PARAMS]
        return [*outs, fq(x.t(), 27.0, 1 / 27, 5, -128, 127, -INF, INF)]  # a transposed (strided) input


def inputs(rows: int, columns: int = COLUMNS) -> torch.Tensor:
    x = 6 * torch.randn(rows, columns)
    x[0, :8] = torch.tensor([0.25, 0.75, 1.25, -0.25, -0.75, 64.5, -300.0, 300.0])  # ties, saturation
    return x


@pytest.fixture(scope="module")
def lowered():
    low = lower(Pairs(), (inputs(3),), dynamic_shapes=({0: Dim("rows", min=1, max=8)},))
    assert low.summary == (1, [])
    return low


@pytest.mark.parametrize("compile", [True, False], ids=["compiled", "nodes"])
def test_matches_eager_bit_for_bit(lowered, compile):
    was = _runtime.compile_enabled()
    _runtime.set_compile(compile)
    try:
        method = lowered.method()
        before = _runtime.cpu_kernel_call_counts().get("fake_quantize", 0)
        for rows in (3, 1, 3):
            x = inputs(rows)
            with torch.no_grad():
                assert_close(method.execute([x]), Pairs()(x), 0, 0, exact=True)
        calls = _runtime.cpu_kernel_call_counts().get("fake_quantize", 0) - before
        assert calls == (3 * (len(PARAMS) + 1) if cpu_kernels_active() else 0)
    finally:
        _runtime.set_compile(was)


def test_other_paths_agree(lowered, tmp_path):
    x = inputs(3)
    with torch.no_grad():
        expected = Pairs()(x)
    for kernels in ("0", "portable", "avx2"):
        run = run_in_subprocess({"p": (lowered.buffer, [x])}, {"MLX_DELEGATE_CPU_KERNELS": kernels}, tmp_path)
        assert_close(run["outputs"]["p"][0], expected, 0, 0, exact=True)
        ran = run["counts"].get("fake_quantize", 0)
        assert ran == (0 if kernels == "0" or not on_cpu_device() else len(PARAMS) + 1), (kernels, ran)
