"""The direct convolution for few input channels (cpp/kernels/conv_direct_cpu.cpp, counter
"conv_direct"): stems of one to four input channels, at strides 1, 2 and 3 (the input split into
phases), 1x1 to 7x7 kernels, symmetric and one-sided padding, output channels that are not a
multiple of the register block, maps narrower and wider than a vector row, channel-sliced (strided)
inputs, 1-D convolutions and the fused epilogues (bias, residual, a clamp, hard-swish) match eager
torch, the im2col path (`set_conv_direct(False)`) and MLX's own convolution (kernels off) in float32,
bfloat16 and float16, node by node and compiled. One program per dtype holds every case."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from mlx_delegate import _runtime
from mlx_delegate.testing import (
    CALLS_TO_REPLAY, FP32_REFERENCE_TOLERANCE, assert_close, cpu_kernels_active, fp32_tolerance, lower,
    runtime_switch, runtime_switches,
)

# (weight shape [O, C, *k], keyword arguments of F.conv2d): C of the input's first channels.
CONV2D = [
    ((13, 3, 3, 3), dict(stride=2, padding=1)),  # a MobileNet stem: a register block and a one-channel rest
    ((16, 3, 7, 7), dict(stride=2, padding=3)),  # a ResNet stem
    ((5, 1, 3, 3), dict(padding=1)),  # grayscale, stride 1
    ((9, 4, 5, 5), dict(stride=3, padding=2)),  # three phases
    ((8, 2, 3, 1), dict(stride=(2, 1), padding=(1, 0))),  # row stride apart from the column stride
    ((6, 3, 4, 4), dict(padding="same")),  # one-sided padding (an even kernel)
    ((4, 3, 1, 1), dict()),  # 1x1
]
K_MAX = 3 * 7 * 7  # the longest dot product


class Stems(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weights = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(s, generator=g) / (s[1] * s[2] * s[3]) ** 0.5) for s, _ in CONV2D])
        self.biases = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(s[0], generator=g)) for s, _ in CONV2D])
        self.w1d = torch.nn.Parameter(torch.randn(7, 3, 5, generator=g) / 4)
        self.w_res = torch.nn.Parameter(torch.randn(8, 3, 3, 3, generator=g) / 5)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for i, ((shape, kw), w, b) in enumerate(zip(CONV2D, self.weights, self.biases)):
            out.append(F.conv2d(x[:, : shape[1]], w, b if i % 2 == 0 else None, **kw))
        out[0] = F.hardswish(out[0])
        out[1] = F.hardtanh(out[1], -0.5, 0.5)  # a clamp both of whose bounds cut
        narrow = x[:, :3, :9, :5]  # a map narrower than a vector row
        out.append(F.relu(F.conv2d(narrow, self.weights[0], self.biases[0], stride=2, padding=1)))
        # A residual added to a stem's result, then ReLU.
        res = F.conv2d(x[:, :3], self.w_res, padding=1)
        out.append(F.relu(F.conv2d(x[:, :3], self.w_res, self.biases[3][:8], padding=1) + res))
        out.append(F.conv1d(x[:, :3, 0], self.w1d, stride=2, padding=2))  # [N, 3, W] -> [N, 7, 19]
        return out




def direct_calls() -> int:
    return _runtime.cpu_kernel_call_counts().get("conv_direct", 0)


@pytest.fixture(scope="module")
def model() -> Stems:
    return Stems().eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_conv_direct_matches_eager_im2col_and_kernels_off(model: Stems, dtype: torch.dtype) -> None:
    x = torch.randn(2, 4, 23, 37, generator=torch.Generator().manual_seed(1))
    module = Stems().eval()
    module.load_state_dict({k: v.to(dtype) for k, v in model.state_dict().items()})
    module.to(dtype)
    lowered = lower(module, (x.to(dtype),))
    assert lowered.summary[1] == [], lowered.summary
    with torch.no_grad():  # the true result: float32 on the same (rounded) inputs and weights
        expected = Stems().eval()
        expected.load_state_dict({k: v.to(dtype).float() for k, v in model.state_dict().items()})
        reference = expected(x.to(dtype).float())
    rtol, atol = fp32_tolerance(K_MAX) if dtype == torch.float32 else FP32_REFERENCE_TOLERANCE[dtype]

    before = direct_calls()
    with runtime_switch("conv_direct", True):
        on = lowered.fresh_method()
        for _ in range(CALLS_TO_REPLAY):  # node by node, traced, replayed
            got = on.execute([x.to(dtype)])
            assert [g.dtype for g in got] == [dtype] * len(reference)
            assert_close([g.float() for g in got], reference, rtol, atol)
    if cpu_kernels_active() and _runtime.cpu_vector_kernels():  # every convolution but the residual's own
        assert direct_calls() - before >= CALLS_TO_REPLAY * (len(CONV2D) + 3)

    with runtime_switch("conv_direct", False):  # the im2col / sgemm path, same program
        before = direct_calls()
        im2col = lowered.fresh_method().execute([x.to(dtype)])
        assert direct_calls() == before
    assert_close([g.float() for g in got], [r.float() for r in im2col], rtol, atol)

    with runtime_switches(cpu_kernels=False):
        off = lowered.fresh_method().execute([x.to(dtype)])
    assert direct_calls() == before  # MLX's own convolution ran
    assert_close([g.float() for g in got], [o.float() for o in off], rtol, atol)
