"""The CPU convolution's Winograd paths (cpp/kernels/winograd_cpu.cpp) for 3x3 stride-1 convolutions.

With the switch forced to F(2x2) and to F(4x4) (`_runtime.set_conv_winograd`), each config runs the
parity harness (node by node, compiled and replayed, kernels off) against eager torch, then the same
program with the switch off (im2col + sgemm) against the Winograd result, and the kernel's call
counters prove which path ran. Shapes: odd map sizes (tiles crossing the edges), odd channel counts,
padding 1, 0 and an asymmetric pad (a folded zero pad), batch 1 and 3, bias / residual / ReLU /
hard-swish epilogues, weights as a program input (transformed on each call) and as a constant
(transformed and laid out for the own gemm's tile once), a map large enough for the per-thread tile groups, and the half types."""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mlx_delegate import _blas, _runtime
from mlx_delegate.testing import (
    FLOATS, assert_close, cases, cpu_kernels_active, fp32_tolerance, lower, lower_and_compare,
)

FP32 = (torch.float32,)
HALF_LOOSE = {torch.float16: (3e-2, 3e-2), torch.bfloat16: (3e-2, 3e-2)}


@contextmanager
def winograd(mode: int) -> Iterator[None]:
    was = _runtime.set_conv_winograd(mode)
    try:
        yield
    finally:
        _runtime.set_conv_winograd(was)


class ConvBlock(nn.Module):
    """conv (+ BatchNorm, folded) (+ residual) then an activation: the node's whole epilogue."""

    def __init__(self, cin: int, cout: int, padding: int | str = 1, bias: bool = True, residual: bool = False,
                 act: type[nn.Module] | None = nn.ReLU, pad: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.pad = nn.ZeroPad2d(pad) if pad else nn.Identity()
        self.conv = nn.Conv2d(cin, cout, 3, padding=padding, bias=bias)
        self.bn = nn.BatchNorm2d(cout)
        self.residual = residual
        self.act = act() if act else nn.Identity()
        g = torch.Generator().manual_seed(cin * 31 + cout)
        with torch.no_grad():
            self.bn.running_mean.copy_(torch.randn(cout, generator=g) * 0.2)
            self.bn.running_var.copy_(torch.rand(cout, generator=g) + 0.5)

    def forward(self, x: torch.Tensor, *r: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.conv(self.pad(x)))
        return self.act(y + r[0] if self.residual else y)


def calls(kernel: str) -> int:
    return _runtime.cpu_kernel_call_counts().get(kernel, 0)


def randn(*shapes: tuple[int, ...]):
    return lambda: tuple(torch.randn(*s) for s in shapes)


def tol(k: int) -> dict:
    return dict(tolerance={torch.float32: fp32_tolerance(k), **HALF_LOOSE})


# (name, module factory, input shapes, dtypes)
# Five input channels or more: up to four take the direct path (test_conv_direct.py).
ROWS = [
    ("odd_map_odd_channels_relu", lambda: ConvBlock(5, 7), [(1, 5, 9, 11)], FLOATS),
    ("pad0_no_bias_batch3", lambda: ConvBlock(6, 4, padding=0, bias=False, act=None), [(3, 6, 10, 7)], FP32),
    ("residual_relu", lambda: ConvBlock(8, 8, residual=True), [(1, 8, 13, 6), (1, 8, 13, 6)], FP32),
    ("hardswish_batch3", lambda: ConvBlock(5, 9, act=nn.Hardswish), [(3, 5, 7, 5)], FP32),
    # A zero pad folded into the convolution: padding 1 on the low side, 0 on the high side.
    ("asymmetric_pad", lambda: ConvBlock(6, 6, padding=0, pad=(1, 0, 1, 0)), [(2, 6, 8, 9)], FP32),
    # Enough tile rows for the per-thread tile groups (the small maps above run the phases split
    # over the cores).
    ("tile_groups_residual", lambda: ConvBlock(32, 32, residual=True), [(1, 32, 230, 30)] * 2, FP32),
]

CASES = [c for name, make, shapes, dtypes in ROWS
         for c in cases(name, make, randn(*shapes), dtypes, is_module=True, **tol(9 * shapes[0][1]))]
# The weight as a program input: not a constant, so the kernel transforms it on each call.
CASES += cases("weight_input", lambda x, w, b: F.relu(F.conv2d(x, w, b, padding=1)),
               randn((2, 5, 6, 7), (3, 5, 3, 3), (3,)), (torch.float32,), **tol(45))


@pytest.mark.parametrize("tile", [2, 4])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_winograd_parity(case, tile: int) -> None:
    if tile == 4 and case.atol is not None and case.dtype == torch.float32:
        # F(4x4)'s transforms scale by up to 8 and sum 6x6 tiles: float32 rounding grows ~4x over a
        # direct sum's (random inputs put an output near cancellation now and then).
        case = dataclasses.replace(case, atol=4 * case.atol)
    before = _runtime.cpu_kernel_call_counts()
    with winograd(tile):
        lowered = lower_and_compare(case)
        ran = calls(f"conv_winograd{tile}") - before.get(f"conv_winograd{tile}", 0)
        packed = calls("conv_packed_weights") - before.get("conv_packed_weights", 0)
        inputs = case.inputs()
        got = lowered.fresh_method().execute(list(inputs))
    if cpu_kernels_active():
        assert ran > 0, "the Winograd path did not run"
        # A constant weight's products run on it laid out once for the own gemm's tile (not on MKL, and
        # not for a weight given as an input).
        assert (packed > 0) == (_blas.sgemm_kind() != "mkl" and not case.name.startswith("weight_input")), packed
    with winograd(0):  # the same program on im2col + sgemm
        before = _runtime.cpu_kernel_call_counts()
        expected = lowered.fresh_method().execute(list(inputs))
        assert calls(f"conv_winograd{tile}") == before.get(f"conv_winograd{tile}", 0)
    rtol, atol = (case.rtol, case.atol) if case.rtol is not None else fp32_tolerance(1)
    assert_close(got, expected, rtol, atol)


def test_tile_groups_and_phases_both_run() -> None:
    """The large map runs per-thread tile groups, a small one the phases split over the cores."""
    if not cpu_kernels_active():
        pytest.skip("the CPU kernels are off")
    big = next(c for c in CASES if c.name == "tile_groups_residual-float32")
    small = next(c for c in CASES if c.name == "odd_map_odd_channels_relu-float32")
    for case, counter in ((big, "conv_winograd_groups"), (small, "conv_winograd_phases")):
        with winograd(4):
            before = calls(counter)
            lower(case.module().eval(), case.inputs()).method().execute(list(case.inputs()))
            assert calls(counter) > before, counter


def test_auto_gate_takes_resnet_shape_and_leaves_others() -> None:
    """Mode 1 (the default) runs Winograd on a ResNet-sized 3x3 convolution and im2col on a tiny one
    and on a strided one."""
    if not cpu_kernels_active():
        pytest.skip("the CPU kernels are off")
    def ran(module: nn.Module, x: torch.Tensor) -> int:
        counts = lambda: calls("conv_winograd2") + calls("conv_winograd4")  # noqa: E731
        before = counts()
        lowered = lower(module.eval(), (x,))
        got = lowered.method().execute([x])[0]
        with torch.no_grad():
            assert_close([got], module(x), *fp32_tolerance(9 * x.shape[1]))
        return counts() - before

    with winograd(1):
        assert ran(ConvBlock(64, 64), torch.randn(1, 64, 28, 28)) > 0
        assert ran(ConvBlock(3, 4), torch.randn(1, 3, 8, 8)) == 0
        strided = nn.Sequential(nn.Conv2d(64, 64, 3, stride=2, padding=1), nn.ReLU())
        assert ran(strided, torch.randn(1, 64, 28, 28)) == 0


def test_bad_mode_is_an_error() -> None:
    with pytest.raises(ValueError, match="mode must be"):
        _runtime.set_conv_winograd(3)
    assert _runtime.conv_winograd() in (0, 1, 2, 4)
