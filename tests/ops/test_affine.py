"""Parity tests for torchao's affine quantization primitives run inside the delegate (ops/affine.py):
choose_qparams_affine, quantize_affine and dequantize_affine, as torchao's dynamic activation
quantization (8da4w) runs them on every call. Integer results and the dequantized floats are
compared with eager bit for bit."""

import pytest
import torch
from torch.export import Dim

pytest.importorskip("torchao")
import torchao.quantization.quant_primitives  # noqa: E402,F401  (defines the ops)

from mlx_delegate.testing import FLOATS, cases, dyn, lower_and_compare  # noqa: E402

ao = torch.ops.torchao
TOKENS = Dim("tokens", min=1, max=64)
# A half-type row quantizes its own rounded inputs, so its codes and scales are not float32's.
EXACT = dict(exact=True, fp32_reference=False)


def fake_quant(mapping, block, qdtype=torch.int8, qmin=None, qmax=None, keepdim=False, zero_point=True):
    """The activation path of 8da4w: qparams per block, quantize, dequantize; every stage is an output."""
    def fn(x):
        scale, zp = ao.choose_qparams_affine(x, mapping, block, qdtype, qmin, qmax, None, None, None, keepdim)
        q = ao.quantize_affine(x, block, scale, zp, qdtype, qmin, qmax)
        dq_zp = zp if zero_point else None  # symmetric int8's zero point is 0: dequantize may omit it
        return scale, zp, q, ao.dequantize_affine(q, block, scale, dq_zp, qdtype, qmin, qmax, output_dtype=x.dtype)
    return fn


def activations(*shape):
    """Rows of different ranges, one all positive (its minimum clamps to 0) and one all zero (eps)."""
    def make():
        x = torch.randn(*shape) * torch.linspace(0.1, 8, shape[-2]).unsqueeze(-1)
        x[..., 0, :] = x[..., 0, :].abs() + 0.5
        x[..., 1, :] = 0
        return (x,)
    return make


CASES = [
    # Per token, as Int8DynamicActivationIntxWeightConfig quantizes a linear's input: tokens dynamic.
    *cases("per-token-asym", fake_quant("ASYMMETRIC", [1, 1, 96]), activations(2, 5, 96), FLOATS,
           dynamic_shapes=dyn({1: TOKENS}), more_inputs=lambda: [activations(2, 17, 96)()], **EXACT),
    *cases("per-token-sym", fake_quant("SYMMETRIC", [1, 64]), activations(7, 64), FLOATS,
           dynamic_shapes=dyn({0: TOKENS}), more_inputs=lambda: [activations(3, 64)()], **EXACT),
    *cases("per-token-sym-no-clipping", fake_quant("SYMMETRIC_NO_CLIPPING_ERR", [1, 64], qmin=-8, qmax=7),
           activations(6, 64), FLOATS, **EXACT),
    # Blocks that split a dimension (groups of 16 along the rows, and 2 x 16 tiles), kept dims.
    *cases("groups-keepdim", fake_quant("ASYMMETRIC", [1, 16], keepdim=True), activations(6, 64), FLOATS, **EXACT),
    *cases("tiles", fake_quant("ASYMMETRIC", [2, 16], qdtype=torch.uint8), activations(6, 64), (torch.float32,),
           **EXACT),
    # A whole-tensor scale, a 4-bit range held in int8, and no zero point passed to dequantize.
    *cases("per-tensor", fake_quant("SYMMETRIC", [6, 64]), activations(6, 64), (torch.float32,), **EXACT),
    *cases("int4-range", fake_quant("ASYMMETRIC", [1, 32], qmin=-8, qmax=7), activations(4, 64), (torch.float32,),
           **EXACT),
    *cases("no-zero-point", fake_quant("SYMMETRIC", [1, 32], zero_point=False), activations(4, 64),
           (torch.float32, torch.bfloat16), **EXACT),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_affine(case):
    # Whole in the delegate: ExecuTorch's runtime has no kernels for these ops.
    assert lower_and_compare(case).summary == (1, [])


# ------------------------------------------------------------- torch's quantized_decomposed (PT2E)
qd = torch.ops.quantized_decomposed


def per_tensor(scale, zp, qmin, qmax, qdtype, out_dtype=None):
    def fn(x):
        q = qd.quantize_per_tensor(x, scale, zp, qmin, qmax, qdtype)
        return q, qd.dequantize_per_tensor(q, scale, zp, qmin, qmax, qdtype, out_dtype=out_dtype)
    return fn


def per_channel(axis, zero_point=True, out_dtype=None):
    def fn(x):
        channels = x.shape[axis]
        scales = torch.linspace(0.01, 0.2, channels)
        zps = torch.arange(channels, dtype=torch.int64) % 7 - 3
        q = qd.quantize_per_channel(x, scales, zps, axis, -128, 127, torch.int8)
        return q, qd.dequantize_per_channel(q, scales, zps if zero_point else None, axis, -128, 127, torch.int8,
                                            out_dtype=out_dtype)
    return fn


def dynamic_per_tensor(x):
    """XNNPACK's dynamic quantization of a linear's input: qparams from each call's values."""
    scale, zp = qd.choose_qparams.tensor(x, -128, 127, torch.finfo(torch.float32).eps, torch.int8)
    q = qd.quantize_per_tensor.tensor(x, scale, zp, -128, 127, torch.int8)
    return zp, q, qd.dequantize_per_tensor.tensor(q, scale, zp, -128, 127, torch.int8)


def wide(*shape):
    return lambda: (torch.randn(*shape) * 4,)


QD_CASES = [
    # Half-type inputs are quantized from float32 (the op converts them first).
    *cases("qd-per-tensor", per_tensor(0.05, 3, -128, 127, torch.int8), wide(2, 3, 9, 11), FLOATS, **EXACT),
    *cases("qd-per-tensor-uint8-bf16-out", per_tensor(0.037, 128, 0, 255, torch.uint8, torch.bfloat16),
           wide(4, 33), (torch.float32,), **EXACT),
    *cases("qd-per-channel-axis0", per_channel(0), wide(8, 3, 3, 3), (torch.float32, torch.bfloat16), **EXACT),
    *cases("qd-per-channel-axis1", per_channel(1, zero_point=False), wide(2, 6, 5, 5), (torch.float32,), **EXACT),
    *cases("qd-per-channel-last-fp16-out", per_channel(-1, out_dtype=torch.float16), wide(5, 12), (torch.float32,),
           **EXACT),
    *cases("qd-dynamic-per-tensor", dynamic_per_tensor, activations(2, 7, 40), FLOATS,
           dynamic_shapes=dyn({1: TOKENS}), more_inputs=lambda: [activations(2, 3, 40)()], **EXACT),
]


@pytest.mark.parametrize("case", QD_CASES, ids=str)
def test_quantized_decomposed(case):
    assert lower_and_compare(case).summary == (1, [])
