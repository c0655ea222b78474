"""Models quantized the PT2E way ExecuTorch documents (XNNPACKQuantizer, prepare_pt2e / convert_pt2e),
lowered with only MLXPartitioner and run by the stock runtime: the whole program is delegated (before,
the quantize / dequantize ops stayed outside and to_executorch refused the program: they have no
out variants there), the int8 weights are dequantized once at lowering (`fold_dequantized_weights`),
and the results match eager's run of the converted model."""

from __future__ import annotations

import pytest
import torch
from executorch.exir import to_edge_transform_and_lower
from executorch.runtime import Runtime
from torch import nn

from mlx_delegate import MLXPartitioner
from mlx_delegate.ir import nodes as N
from mlx_delegate.testing import assert_close, delegate_summary

pt2e = pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e")
xnnpack_quantizer = pytest.importorskip("executorch.backends.xnnpack.quantizer.xnnpack_quantizer")


class SmallNet(nn.Module):
    """Convolutions (one with BatchNorm, one strided, one depthwise), pooling, and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 24, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(24, 24, 3, padding=1, groups=24), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(24, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def constants_by_dtype(edge) -> dict[str, int]:
    """Constant dtypes in the delegate payloads (int8 ones would be weights dequantized per call)."""
    gm, counts = edge.exported_program().graph_module, {}
    for n in gm.graph.nodes:
        if n.op == "get_attr" and n.target.startswith("lowered_module"):
            for c in N.deserialize(getattr(gm, n.target).processed_bytes).constants:
                counts[c.dtype] = counts.get(c.dtype, 0) + 1
    return counts


@pytest.mark.parametrize("config", ["per-tensor", "per-channel", "dynamic"])
def test_pt2e_quantized_model_lowers_whole(config):
    torch.manual_seed(0)
    model = SmallNet().eval()
    x = torch.randn(2, 3, 24, 24)
    quantizer = xnnpack_quantizer.XNNPACKQuantizer().set_global(
        xnnpack_quantizer.get_symmetric_quantization_config(is_per_channel=config != "per-tensor",
                                                            is_dynamic=config == "dynamic"))
    converted = pt2e.prepare_pt2e(torch.export.export(model, (x,)).module(), quantizer)
    converted(x)  # calibration
    converted = pt2e.convert_pt2e(converted)
    edge = to_edge_transform_and_lower(torch.export.export(converted, (x,)), partitioner=[MLXPartitioner()])
    assert delegate_summary(edge) == (1, [])
    assert N.DType.i8 not in constants_by_dtype(edge)
    buffer = edge.to_executorch().buffer  # the program reads from it: keep it alive
    method = Runtime.get().load_program(buffer).load_method("forward")
    for inputs in ((x,), (torch.randn(2, 3, 24, 24) * 2,)):
        with torch.no_grad():
            expected = converted(*inputs)
        # The same codes as eager but for a rare tie flipped by the float sum order: one output quantum.
        assert_close(method.execute(list(inputs)), expected, rtol=0, atol=2e-2 * expected.abs().max().item())
