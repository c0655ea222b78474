"""Convolution, resampling (upsample_*) and pixel (un)shuffle parity."""

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

from mlx_delegate.testing import FLOATS, cases, fp32_tolerance, lower_and_compare

# Convolutions accumulate many products: half types get a little more room.
HALF_LOOSE = {torch.float16: (3e-2, 3e-2), torch.bfloat16: (3e-2, 3e-2)}


def loose(k):
    """Per-dtype tolerances for outputs that sum k products: float32's grows with k
    (fp32_tolerance), the half types keep HALF_LOOSE."""
    return dict(tolerance={torch.float32: fp32_tolerance(k), **HALF_LOOSE})


def reduction_length(make):
    """K of a convolution layer: input channels per group times the kernel volume (a
    transposed convolution's output sums at most that many products)."""
    m = make()
    w = m.weight
    if m.transposed:
        return w.shape[0] // m.groups * w[0, 0].numel()
    return w[0].numel()
# Export specialises sizes 0 and 1, so dynamic ranges start at 2.
batch = Dim("batch", min=2, max=8)
side = Dim("side", min=4, max=32)
height, width = Dim("height", min=3, max=32), Dim("width", min=3, max=32)


def randn(*shapes):
    return lambda: tuple(torch.randn(*s) for s in shapes)


def dyn(*specs):
    """dynamic_shapes for a `Lambda` (its inputs arrive as one *args tuple)."""
    return (specs,)


# (name, module factory, input shape) -- nn layers cover weight layouts for every rank.
CONV_LAYERS = [
    ("conv1d", lambda: torch.nn.Conv1d(4, 6, 3), (2, 4, 10)),
    ("conv1d_stride_pad_dil", lambda: torch.nn.Conv1d(4, 6, 3, stride=2, padding=2, dilation=2), (2, 4, 11)),
    ("conv1d_groups", lambda: torch.nn.Conv1d(4, 8, 3, groups=2, bias=False), (2, 4, 9)),
    ("conv2d", lambda: torch.nn.Conv2d(3, 5, 3), (2, 3, 8, 8)),
    ("conv2d_asym", lambda: torch.nn.Conv2d(3, 5, (3, 1), stride=(2, 1), padding=(1, 0), dilation=(1, 2)),
     (1, 3, 9, 7)),
    ("conv2d_depthwise", lambda: torch.nn.Conv2d(6, 6, 3, padding=1, groups=6), (2, 6, 7, 7)),
    ("conv2d_groups", lambda: torch.nn.Conv2d(4, 6, 3, padding=1, groups=2), (1, 4, 6, 6)),
    # Depthwise widths that reach each part of the CPU kernel's AVX2 rows (32- and 8-column blocks,
    # scalar edges), stride 2, a channel multiplier, dilation, and stride 3 (the row-loop fallback).
    ("conv2d_depthwise_wide", lambda: torch.nn.Conv2d(3, 3, 3, padding=1, groups=3), (2, 3, 5, 60)),
    ("conv2d_depthwise_s2", lambda: torch.nn.Conv2d(4, 4, (3, 5), stride=2, padding=(1, 2), groups=4, bias=False),
     (1, 4, 9, 70)),
    ("conv2d_depthwise_5x5_dil_mult", lambda: torch.nn.Conv2d(3, 6, 5, padding=4, dilation=2, groups=3),
     (1, 3, 11, 45)),
    # Three images of 552 output columns: the CPU kernel's batched sgemm takes two, then one.
    ("conv2d_batched_groups", lambda: torch.nn.Conv2d(4, 6, 3, padding=1, groups=2), (3, 4, 23, 24)),
    ("conv2d_depthwise_s3", lambda: torch.nn.Conv2d(2, 2, 3, stride=3, groups=2), (1, 2, 7, 40)),
    # 5x5 depthwise (MobileNetV3, EfficientNet) with padding 2: stride 1 on a small map (the padded
    # grid) and a wide one (AVX2 rows and scalar edges), stride 2 on a small map and a wide one.
    ("conv2d_depthwise_5x5_small", lambda: torch.nn.Conv2d(5, 5, 5, padding=2, groups=5), (2, 5, 9, 7)),
    ("conv2d_depthwise_5x5_wide", lambda: torch.nn.Conv2d(3, 3, 5, padding=2, groups=3), (1, 3, 6, 45)),
    ("conv2d_depthwise_5x5_s2_small", lambda: torch.nn.Conv2d(4, 4, 5, stride=2, padding=2, groups=4),
     (2, 4, 13, 11)),
    ("conv2d_depthwise_5x5_s2_wide",
     lambda: torch.nn.Conv2d(3, 3, 5, stride=2, padding=2, groups=3, bias=False), (1, 3, 9, 83)),
    # Square windows on maps of 28+ columns, where AVX-512 reads each input row once per block of four
    # output rows: 3x3 at stride 2 (32 + 6 columns, 5 rows), 7x7 (ConvNeXt's) at strides 1 and 2, a
    # channel multiplier.
    ("conv2d_depthwise_3x3_s2_wide", lambda: torch.nn.Conv2d(3, 3, 3, stride=2, padding=1, groups=3),
     (1, 3, 10, 75)),
    ("conv2d_depthwise_7x7_wide", lambda: torch.nn.Conv2d(2, 2, 7, padding=3, groups=2), (1, 2, 9, 37)),
    ("conv2d_depthwise_7x7_s2_mult",
     lambda: torch.nn.Conv2d(2, 4, 7, stride=2, padding=3, groups=2, bias=False), (1, 2, 11, 64)),
    ("conv2d_same", lambda: torch.nn.Conv2d(3, 4, 3, padding="same"), (1, 3, 7, 7)),
    ("conv2d_1x1", lambda: torch.nn.Conv2d(8, 4, 1), (2, 8, 5, 5)),
    ("conv3d", lambda: torch.nn.Conv3d(2, 4, 3, padding=1), (1, 2, 5, 5, 5)),
    ("conv3d_groups_stride", lambda: torch.nn.Conv3d(4, 6, (1, 3, 3), stride=(1, 2, 2), groups=2), (1, 4, 3, 7, 7)),
    ("conv_transpose1d", lambda: torch.nn.ConvTranspose1d(4, 3, 3, stride=2, padding=1, output_padding=1),
     (2, 4, 6)),
    ("conv_transpose2d", lambda: torch.nn.ConvTranspose2d(4, 3, 3, stride=2), (1, 4, 5, 5)),
    ("conv_transpose2d_pad_outpad", lambda: torch.nn.ConvTranspose2d(4, 6, 4, stride=2, padding=1, output_padding=1,
                                                                     groups=2), (2, 4, 5, 5)),
    ("conv_transpose2d_dilation", lambda: torch.nn.ConvTranspose2d(3, 2, 3, dilation=2, padding=1), (1, 3, 5, 6)),
    # padding beyond dilation*(k-1) crops the result
    ("conv_transpose2d_crop", lambda: torch.nn.ConvTranspose2d(3, 2, 1, stride=2, padding=1), (1, 3, 5, 5)),
    ("conv_transpose3d", lambda: torch.nn.ConvTranspose3d(2, 4, 3, stride=2, padding=1, output_padding=1, groups=2),
     (1, 2, 3, 4, 3)),
]

CASES = [
    # float32 atol scaled with each layer's K (reduction_length).
    *(c for name, make, shape in CONV_LAYERS
      for c in cases(name, make, randn(shape), FLOATS, is_module=True, **loose(reduction_length(make)))),
    *cases("conv2d_fn_noncontig", lambda x, w: F.conv2d(x.transpose(2, 3), w, padding=1),
           randn((1, 3, 6, 8), (4, 3, 3, 3)), FLOATS, **loose(3 * 3 * 3)),
    *cases("conv2d_empty_batch", lambda x, w: F.conv2d(x, w), randn((0, 3, 6, 6), (4, 3, 3, 3)), FLOATS),
    *cases("conv2d_dynamic", lambda: torch.nn.Conv2d(3, 4, 3, padding=1), randn((2, 3, 8, 8)), (torch.float32,),
           is_module=True, dynamic_shapes=({0: batch, 2: side, 3: side},),
           more_inputs=lambda: [(torch.randn(5, 3, 12, 12),), (torch.randn(2, 3, 4, 4),)]),
    *cases("conv_transpose2d_dynamic", lambda: torch.nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1),
           randn((2, 3, 6, 6)), (torch.float32,), is_module=True, dynamic_shapes=({0: batch},),
           more_inputs=lambda: [(torch.randn(4, 3, 6, 6),)]),
]

# (name, fn, input shape)
RESAMPLES = [
    ("nearest_scale2", lambda x: F.interpolate(x, scale_factor=2, mode="nearest"), (1, 3, 4, 5)),
    ("nearest_size", lambda x: F.interpolate(x, size=(7, 9), mode="nearest"), (2, 2, 4, 5)),
    ("nearest_downsample", lambda x: F.interpolate(x, size=(3, 2), mode="nearest"), (1, 2, 7, 5)),
    ("nearest_frac_scale", lambda x: F.interpolate(x, scale_factor=1.7, mode="nearest"), (1, 2, 5, 6)),
    ("nearest_1d", lambda x: F.interpolate(x, scale_factor=3, mode="nearest"), (2, 3, 5)),
    ("nearest_3d", lambda x: F.interpolate(x, size=(3, 4, 5), mode="nearest"), (1, 2, 2, 3, 3)),
    ("nearest_exact", lambda x: F.interpolate(x, size=(7, 3), mode="nearest-exact"), (1, 3, 4, 5)),
    ("nearest_exact_scale", lambda x: F.interpolate(x, scale_factor=1.5, mode="nearest-exact"), (1, 2, 4, 4)),
    ("bilinear", lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"), (1, 3, 4, 5)),
    ("bilinear_size", lambda x: F.interpolate(x, size=(7, 3), mode="bilinear"), (2, 2, 5, 6)),
    ("bilinear_align_corners", lambda x: F.interpolate(x, size=(9, 6), mode="bilinear", align_corners=True),
     (1, 3, 4, 5)),
    ("bilinear_align_corners_scale", lambda x: F.interpolate(x, scale_factor=1.5, mode="bilinear",
                                                             align_corners=True), (1, 2, 4, 4)),
    ("bilinear_down", lambda x: F.interpolate(x, size=(2, 3), mode="bilinear"), (1, 2, 6, 7)),
    ("linear_1d", lambda x: F.interpolate(x, scale_factor=2.5, mode="linear"), (2, 3, 4)),
    ("trilinear", lambda x: F.interpolate(x, size=(3, 5, 4), mode="trilinear", align_corners=True),
     (1, 2, 2, 3, 3)),
    ("upsample_noncontig", lambda x: F.interpolate(x.transpose(2, 3), scale_factor=2, mode="bilinear"),
     (1, 2, 3, 5)),
]

CASES += [c for name, fn, shape in RESAMPLES for c in cases(name, fn, randn(shape), FLOATS)]
CASES += [
    *cases("nearest_uint8", lambda x: F.interpolate(x, scale_factor=2, mode="nearest"),
           lambda: (torch.randint(0, 255, (1, 2, 3, 3), dtype=torch.uint8),), (None,)),
    *cases("nearest_dynamic_scale", lambda x: F.interpolate(x, scale_factor=2, mode="nearest"),
           randn((2, 3, 4, 6)), (torch.float32,), dynamic_shapes=dyn({0: batch, 2: height, 3: width}),
           more_inputs=lambda: [(torch.randn(3, 3, 5, 9),)]),
    *cases("bilinear_dynamic_scale", lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"),
           randn((2, 3, 4, 6)), (torch.float32,), dynamic_shapes=dyn({2: height, 3: width}),
           more_inputs=lambda: [(torch.randn(2, 3, 7, 5),)]),
    # the non-.vec overloads, called directly
    *cases("upsample_nearest2d_default", lambda x: torch.ops.aten.upsample_nearest2d.default(x, [7, 9]),
           randn((1, 2, 4, 5)), FLOATS),
    *cases("upsample_bilinear2d_default_scales",
           lambda x: torch.ops.aten.upsample_bilinear2d.default(x, [6, 8], False, 1.5, 2.0), randn((1, 2, 4, 4)),
           FLOATS),
    *cases("nearest_empty_batch", lambda x: F.interpolate(x, scale_factor=2, mode="nearest"),
           randn((0, 2, 3, 3)), (torch.float32,)),
]

# pixel (un)shuffle: pure data movement, so exact for every dtype.
CASES += [
    *cases("pixel_shuffle", lambda x: F.pixel_shuffle(x, 2), randn((2, 8, 3, 4)), FLOATS, exact=True),
    *cases("pixel_shuffle_r3_unbatched", lambda x: F.pixel_shuffle(x, 3), randn((9, 2, 2)), FLOATS, exact=True),
    *cases("pixel_unshuffle", lambda x: F.pixel_unshuffle(x, 2), randn((2, 3, 4, 6)), FLOATS, exact=True),
    *cases("pixel_roundtrip_5d", lambda x: F.pixel_unshuffle(F.pixel_shuffle(x, 2), 2), randn((2, 2, 4, 3, 3)),
           (torch.float32,), exact=True),
    *cases("pixel_shuffle_int", lambda x: F.pixel_shuffle(x, 2), lambda: (torch.randint(0, 99, (1, 4, 2, 3)),),
           (None,)),
    *cases("pixel_shuffle_dynamic", lambda x: F.pixel_shuffle(x, 2), randn((2, 8, 3, 4)), (torch.float32,),
           dynamic_shapes=dyn({0: batch, 2: height}), more_inputs=lambda: [(torch.randn(3, 8, 5, 4),)]),
]

@pytest.mark.parametrize("case", CASES, ids=str)
def test_conv(case):
    lower_and_compare(case)
