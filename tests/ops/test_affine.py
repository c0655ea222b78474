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
    lower_and_compare(case)
