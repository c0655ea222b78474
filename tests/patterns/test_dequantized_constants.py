"""Models quantized the PT2E way ExecuTorch documents (XNNPACKQuantizer, prepare_pt2e / convert_pt2e),
lowered with only MLXPartitioner and run by the stock runtime: the whole program is delegated (before,
the quantize / dequantize ops stayed outside and to_executorch refused the program: they have no
out variants there), the int8 weights are dequantized once at lowering (`fold_dequantized_weights`),
each static activation's quantize -> dequantize pair is one fake-quantize pass (`fuse_fake_quantize`,
taking a ReLU6 before it and moving a zero pad after it, into the next convolution), and the results
match eager's run of the converted model."""

from __future__ import annotations

from collections import Counter

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
    """Convolutions (one with BatchNorm, one strided after an explicit zero pad, one depthwise with ReLU6),
    pooling, and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.ZeroPad2d(1), nn.Conv2d(16, 24, 3, stride=2), nn.ReLU(),
            nn.Conv2d(24, 24, 3, padding=1, groups=24), nn.ReLU6(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(24, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def payload(edge):
    gm = edge.exported_program().graph_module
    (program,) = [N.deserialize(getattr(gm, n.target).processed_bytes) for n in gm.graph.nodes
                  if n.op == "get_attr" and n.target.startswith("lowered_module")]
    return program


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
    program = payload(edge)
    assert N.DType.i8 not in {c.dtype for c in program.constants}  # no weight dequantized per call
    nodes = Counter(type(i.node).__name__ for i in program.instructions)
    assert nodes["ConvNode"] == 3 and "PadNode" not in nodes  # the pad folded into its convolution
    if config != "dynamic":  # every static pair is one FakeQuantizeNode (ReLU6 in it): no Round, no clip
        assert nodes["FakeQuantizeNode"] >= 4 and not {"UnaryNode", "ClipNode"} & set(nodes)
    buffer = edge.to_executorch().buffer  # the program reads from it: keep it alive
    method = Runtime.get().load_program(buffer).load_method("forward")
    for inputs in ((x,), (torch.randn(2, 3, 24, 24) * 2,)):
        with torch.no_grad():
            expected = converted(*inputs)
        # The same codes as eager but for a rare tie flipped by the float sum order: one output quantum.
        assert_close(method.execute(list(inputs)), expected, rtol=0, atol=2e-2 * expected.abs().max().item())
