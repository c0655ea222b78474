"""`fuse_inverted_residual`: MobileNet-style blocks (1x1 expand + BatchNorm + ReLU6, depthwise + BatchNorm +
ReLU6, 1x1 project + BatchNorm, + the input) become one InvertedResidualNode, run on the CPU by one
kernel (kernels/block_cpu.cpp; its 1x1 products on the weights laid out once for the own gemm's tile)
and elsewhere as three convolutions; matched against eager torch on every
runtime path (node by node, compiled, CPU kernels off) in float32, bfloat16 and float16: stride 1 with
the residual, stride 2 without, a block without the expand (MobileNetV2's first), a 5x5 ReLU block,
odd H / W and channel counts that are not multiples of 8. A look-alike whose expanded activation is
also read elsewhere keeps its expand convolution out of the block. MobileNetV3 / EfficientNet blocks
(hard-swish and SiLU stages, squeeze-excite gates with hard-sigmoid or sigmoid, 3x3 and 5x5, strides 1
and 2, with and without the residual and the expand) fuse whole, batch 2 (a gate per image); a gate
that is also read elsewhere keeps the block as convolutions."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn
from torch.export import Dim

from mlx_delegate import _blas, _runtime
from mlx_delegate.ir import nodes as N
from mlx_delegate.testing import cases, cpu_kernels_active, delegate_payload, fp32_tolerance, lower, lower_and_compare


def conv_bn(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1,
            act: type[nn.Module] | None = nn.ReLU6) -> nn.Sequential:
    layers = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    return nn.Sequential(*layers, *([act()] if act else []))


def nontrivial_batchnorms(net: nn.Module, seed: int) -> nn.Module:
    """Random BatchNorm statistics and affine terms (folded into the block's weights), net in eval mode."""
    g = torch.Generator().manual_seed(seed)
    for bn in net.modules():
        if isinstance(bn, nn.BatchNorm2d):
            bn.running_mean.copy_(torch.randn(bn.num_features, generator=g) * 0.1)
            bn.running_var.copy_(torch.rand(bn.num_features, generator=g) + 0.5)
            bn.weight.data.copy_(torch.rand(bn.num_features, generator=g) + 0.5)
            bn.bias.data.copy_(torch.randn(bn.num_features, generator=g) * 0.1)
    return net.eval()


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int, k: int = 3,
                 act: type[nn.Module] = nn.ReLU6) -> None:
        super().__init__()
        hidden = cin * expand
        self.residual = stride == 1 and cin == cout
        layers = [conv_bn(cin, hidden, 1, act=act)] if expand != 1 else []
        layers += [conv_bn(hidden, hidden, k, stride, hidden, act=act), conv_bn(hidden, cout, 1, act=None)]
        self.body = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x) if self.residual else self.body(x)


class Shared(nn.Module):
    """A block whose expanded activation is also returned: the expand stays a convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.expand = conv_bn(5, 15, 1)
        self.rest = nn.Sequential(conv_bn(15, 15, 3, 1, 15), conv_bn(15, 5, 1, act=None))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        e = self.expand(x)
        return [x + self.rest(e), e]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            Block(5, 5, 1, 1),            # no expand, residual
            Block(5, 7, 2, 6),            # stride 2, 5 -> 30 -> 7
            Block(7, 7, 1, 6),            # stride 1 with the residual
            Block(7, 9, 1, 3, k=5, act=nn.ReLU),  # 5x5 depthwise, ReLU, no residual
        )
        self.shared = Shared()
        nontrivial_batchnorms(self, seed=0)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [self.blocks(x), *self.shared(x)]


def _net() -> nn.Module:
    torch.manual_seed(0)
    return Net().eval()


# bf16 / fp16: the fused kernel keeps the expanded and depthwise activations in float32, eager rounds
# them between convolutions; fp32: sums of up to 5 * 6 + 25 + 30 terms.
CASES = cases("mobilenet_blocks", _net, lambda: (torch.randn(2, 5, 13, 11),),
              (torch.float32, torch.bfloat16, torch.float16), is_module=True,
              tolerance={torch.float32: fp32_tolerance(64), torch.bfloat16: (8e-2, 1e-1),
                         torch.float16: (2e-2, 2e-2)})


# A batch size known only at run time (the kernel reads N per call), in the default schedules.
DYNAMIC = cases("mobilenet_blocks_dynamic_batch", _net, lambda: (torch.randn(2, 5, 13, 11),), (torch.float32,),
                is_module=True, tolerance={torch.float32: fp32_tolerance(64)},
                dynamic_shapes=({0: Dim("batch", min=1, max=8)},), more_inputs=lambda: [(torch.randn(3, 5, 13, 11),)])


def node_kinds(lowered) -> Counter:
    data, _ = delegate_payload(lowered.edge)
    kinds = Counter()
    for i in N.deserialize(data).instructions:
        node = i.node
        kinds[type(node).__name__] += 1
        if type(node).__name__ == "InvertedResidualNode":
            kinds["expand"] += node.expand_weight is not None
            kinds["residual"] += node.residual is not None
    return kinds


# The kernel's two schedules: small maps whole, split over channels (the default at these sizes), and
# row bands in tiles; 1 KiB tiles hold one output row, so every tile after the first reuses the
# expanded rows it shares with the one before.
TILINGS = {"channels": (1 << 20, 1024), "rows": (0, 1)}


# "channel-rows": the whole-map schedule with its pixel-major form off (MLX_DELEGATE_BLOCK_PIXELS=0), so
# small maps run channel by channel (the depthwise's rows of up to eight columns) as larger ones do.
RUNS = ([(case, tiling) for case in CASES for tiling in (*TILINGS, "channel-rows")] +
        [(DYNAMIC[0], "channels")])


def set_schedule(monkeypatch: pytest.MonkeyPatch, tiling: str) -> tuple[int, int]:
    """Selects a schedule (TILINGS, or "channel-rows"); returns the tiling to restore."""
    if tiling == "channel-rows":
        monkeypatch.setenv("MLX_DELEGATE_BLOCK_PIXELS", "0")
    return _runtime.set_block_tiling(*TILINGS[tiling.replace("channel-rows", "channels")])


@pytest.mark.parametrize("case,tiling", RUNS, ids=[f"{c}-{t}" for c, t in RUNS])
def test_inverted_residual_blocks(case, tiling: str, monkeypatch: pytest.MonkeyPatch) -> None:
    counter = "inverted_residual_" + tiling.replace("channel-rows", "channels")
    before = _runtime.cpu_kernel_call_counts().get(counter, 0)
    packed = _runtime.cpu_kernel_call_counts().get("inverted_residual_packed_weights", 0)
    pixels = _runtime.cpu_kernel_call_counts().get("inverted_residual_pixels", 0)
    previous = set_schedule(monkeypatch, tiling)
    try:
        lowered = lower_and_compare(case)
    finally:
        _runtime.set_block_tiling(*previous)
    kinds = node_kinds(lowered)
    # Four blocks plus Shared's depthwise + project; Shared's expand stays a ConvNode.
    assert kinds["InvertedResidualNode"] == 5 and kinds["ConvNode"] == 1
    assert kinds["expand"] == 3 and kinds["residual"] == 3
    assert kinds["BatchNormNode"] == 0
    if cpu_kernels_active():
        assert _runtime.cpu_kernel_call_counts().get(counter, 0) > before
        # The 1x1 products ran on the weights laid out once for the own gemm's tile (none on MKL).
        ran = _runtime.cpu_kernel_call_counts().get("inverted_residual_packed_weights", 0) > packed
        assert ran == (_blas.sgemm_kind() != "mkl")
        # These maps are small: the whole-map schedule runs them pixel by pixel unless switched off.
        ran_pixels = _runtime.cpu_kernel_call_counts().get("inverted_residual_pixels", 0) > pixels
        assert ran_pixels == (tiling == "channels")


def _wide_net() -> nn.Module:
    torch.manual_seed(3)
    net = nn.Sequential(Block(16, 16, 1, 4), Block(16, 24, 1, 4, k=5, act=nn.ReLU))
    for bn in net.modules():
        if isinstance(bn, nn.BatchNorm2d):
            bn.running_var.uniform_(0.5, 1.5)
    return net.eval()


# Channels enough for two parts of every product (E 64, O 16 / 24) and a map wide enough (16 x 12) for
# the project's column blocks: on packed weights, the expand's channel blocks start on panel boundaries
# and the project runs in blocks of columns.
WIDE = cases("wide_blocks", _wide_net, lambda: (torch.randn(1, 16, 16, 12),), (torch.float32,), is_module=True,
             tolerance={torch.float32: fp32_tolerance(96)})


@pytest.mark.parametrize("case", WIDE, ids=str)
def test_wide_blocks_split_their_products_over_the_pool(case) -> None:
    before = _runtime.cpu_kernel_call_counts().get("inverted_residual_packed_weights", 0)
    lower_and_compare(case)
    if cpu_kernels_active():
        ran = _runtime.cpu_kernel_call_counts().get("inverted_residual_packed_weights", 0) > before
        assert ran == (_blas.sgemm_kind() != "mkl")


def _long_rows_net() -> nn.Module:
    torch.manual_seed(5)
    net = nn.Sequential(Block(4, 4, 1, 3), Block(4, 6, 2, 3, k=5), Block(6, 6, 1, 2), Block(6, 6, 1, 2, k=7))
    for bn in net.modules():
        if isinstance(bn, nn.BatchNorm2d):
            bn.running_var.uniform_(0.5, 1.5)
    return net.eval()


# Maps wider than one block of depthwise vectors (64 columns; 32 where AVX-512 reads each row once for 3x3,
# 5x5 and 7x7 windows): 140 columns at stride 1 (64 + 64 + 12, or four blocks of 32 and 12: a tail of one
# vector), 70 at stride 2 with a 5x5 window (35 outputs: 32 + 3), then a 7x7 window over 35 columns; 9 and 5
# rows (blocks of 4 rows and 1), in both schedules.
LONG_ROWS = cases("long_row_blocks", _long_rows_net, lambda: (torch.randn(1, 4, 9, 140),), (torch.float32,),
                  is_module=True)


@pytest.mark.parametrize("case,tiling", [(c, t) for c in LONG_ROWS for t in TILINGS], ids=str)
def test_depthwise_rows_across_column_blocks(case, tiling: str) -> None:
    previous = _runtime.set_block_tiling(*TILINGS[tiling])
    try:
        lowered = lower_and_compare(case)
    finally:
        _runtime.set_block_tiling(*previous)
    assert node_kinds(lowered)["InvertedResidualNode"] == 4


class SqueezeExcite(nn.Module):
    def __init__(self, c: int, mid: int, act: type[nn.Module], gate: type[nn.Module]) -> None:
        super().__init__()
        self.gate = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(c, mid, 1), act(), nn.Conv2d(mid, c, 1), gate())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gate(x)


class SEBlock(Block):
    """Block with squeeze-excite between the depthwise and the project (MobileNetV3, EfficientNet)."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int, k: int, act: type[nn.Module],
                 se_act: type[nn.Module] = nn.ReLU, gate: type[nn.Module] = nn.Hardsigmoid) -> None:
        super().__init__(cin, cout, stride, expand, k, act)
        hidden = cin * expand
        layers = list(self.body)
        self.body = nn.Sequential(*layers[:-1], SqueezeExcite(hidden, max(2, hidden // 4), se_act, gate), layers[-1])


def _v3_net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(
        Block(5, 5, 1, 3, act=nn.Hardswish),                 # hard-swish, residual, no squeeze-excite
        SEBlock(5, 7, 2, 3, k=5, act=nn.Hardswish),          # 5x5 stride 2, hard-swish, squeeze-excite
        SEBlock(7, 7, 1, 4, k=5, act=nn.ReLU),               # 5x5 stride 1, ReLU, squeeze-excite, residual
        SEBlock(7, 6, 1, 1, k=3, act=nn.SiLU, se_act=nn.SiLU, gate=nn.Sigmoid),  # EfficientNet's: no expand
    )
    return nontrivial_batchnorms(net, seed=1)


# Batch 2: one gate per image. 27 columns, then 14 after the stride: the depthwise's sixteen-lane rows
# (one and two vectors, 3x3 and 5x5) where the CPU has AVX-512, eight-lane ones elsewhere. bf16 / fp16 as
# above (eager also rounds the gate's mean and products).
V3_CASES = cases("mobilenet_v3_blocks", _v3_net, lambda: (torch.randn(2, 5, 13, 27),),
                 (torch.float32, torch.bfloat16, torch.float16), is_module=True,
                 tolerance={torch.float32: fp32_tolerance(64), torch.bfloat16: (8e-2, 1e-1),
                            torch.float16: (2e-2, 2e-2)})
V3_RUNS = [(case, "channels") for case in V3_CASES] + [(V3_CASES[0], "rows")]


@pytest.mark.parametrize("case,tiling", V3_RUNS, ids=[f"{c}-{t}" for c, t in V3_RUNS])
def test_hardswish_and_squeeze_excite_blocks(case, tiling: str) -> None:
    """Hard-swish / SiLU stages and squeeze-excite gates fuse into the block (a squeeze-excite block runs
    whole whatever the tiling; the hard-swish one in row bands under "rows")."""
    before = _runtime.cpu_kernel_call_counts().get("inverted_residual", 0)
    previous = _runtime.set_block_tiling(*TILINGS[tiling])
    try:
        lowered = lower_and_compare(case)
    finally:
        _runtime.set_block_tiling(*previous)
    data, _ = delegate_payload(lowered.edge)
    blocks = [i.node for i in N.deserialize(data).instructions if type(i.node).__name__ == "InvertedResidualNode"]
    kinds = node_kinds(lowered)
    assert len(blocks) == 4 and kinds["ConvNode"] == 0 and kinds["PoolNode"] == 0 and kinds["ReduceNode"] == 0
    assert [b.se_reduce_weight is not None for b in blocks] == [False, True, True, True]
    assert [b.expand_weight is not None for b in blocks] == [True, True, True, False]
    acts = N.BlockActivation
    assert [(b.expand_act, b.dw_act) for b in blocks] == [(acts.Hardswish,) * 2, (acts.Hardswish,) * 2,
                                                         (acts.Clamp,) * 2, (acts.Clamp, acts.Silu)]
    assert [(b.se_reduce_act, b.se_expand_act) for b in blocks[1:]] == [(acts.Clamp, acts.Hardsigmoid)] * 2 + [
        (acts.Silu, acts.Sigmoid)]
    if cpu_kernels_active():
        assert _runtime.cpu_kernel_call_counts().get("inverted_residual", 0) > before


def _small_maps_net() -> nn.Module:
    torch.manual_seed(7)
    net = nn.Sequential(
        SEBlock(24, 40, 2, 3, k=5, act=nn.Hardswish),   # 11x11 -> 6x6, E 72 (four groups of 16 and one of 8)
        SEBlock(40, 40, 1, 3, k=5, act=nn.Hardswish),   # E 120, the gate scales the depthwise rows (P 36 < O)
        Block(40, 24, 1, 4, act=nn.ReLU6),              # E 160, no squeeze-excite
        SEBlock(24, 24, 1, 4, k=3, act=nn.ReLU),        # E 96
    )
    return nontrivial_batchnorms(net, seed=2)


# MobileNetV3's late stages in small: expanded channels in several groups of sixteen with a partial last
# one, 5x5 windows at strides 2 and 1 on a 6x6 map, batch 2, with and without squeeze-excite; run
# pixel by pixel (the default for small maps) and channel by channel, against eager and each other.
SMALL_MAPS = cases("small_map_blocks", _small_maps_net, lambda: (torch.randn(2, 24, 11, 11),),
                   (torch.float32, torch.bfloat16, torch.float16), is_module=True,
                   tolerance={torch.float32: fp32_tolerance(128), torch.bfloat16: (8e-2, 1e-1),
                              torch.float16: (2e-2, 2e-2)})


def _stride2_from_28_net() -> nn.Module:
    torch.manual_seed(8)
    net = nn.Sequential(
        Block(16, 24, 2, 6, act=nn.Hardswish),          # 28x28 -> 14x14, E 96: a 29 x 33 plane (61 KiB)
        SEBlock(24, 24, 1, 3, k=3, act=nn.Hardswish),   # E 72 at 14x14
    )
    return nontrivial_batchnorms(net, seed=3)


# A stride-2 block from a 28x28 map (MobileNetV3-Large's features[7] in small), whose plane fits the
# pixel-major form's L2 budget.
STRIDE2_FROM_28 = cases("stride2_from_28x28", _stride2_from_28_net, lambda: (torch.randn(1, 16, 28, 28),),
                        (torch.float32, torch.bfloat16, torch.float16), is_module=True,
                        tolerance={torch.float32: fp32_tolerance(128), torch.bfloat16: (8e-2, 1e-1),
                                   torch.float16: (2e-2, 2e-2)})


@pytest.mark.parametrize("case", SMALL_MAPS + STRIDE2_FROM_28, ids=str)
def test_small_maps_pixel_by_pixel_match_channel_by_channel(case, monkeypatch: pytest.MonkeyPatch) -> None:
    before = _runtime.cpu_kernel_call_counts().get("inverted_residual_pixels", 0)
    lowered = lower_and_compare(case)
    blocks = 2 if case in STRIDE2_FROM_28 else 4
    assert node_kinds(lowered)["InvertedResidualNode"] == blocks
    if not cpu_kernels_active():
        return
    assert _runtime.cpu_kernel_call_counts().get("inverted_residual_pixels", 0) > before
    inputs, method = case.inputs(), lowered.fresh_method()
    method.execute(inputs)
    start = _runtime.cpu_kernel_call_counts().get("inverted_residual_pixels", 0)
    pixels = [o.float() for o in method.execute(inputs)]
    if case in STRIDE2_FROM_28:  # both blocks pixel by pixel, the 28x28 one too
        assert _runtime.cpu_kernel_call_counts().get("inverted_residual_pixels", 0) - start == blocks
    monkeypatch.setenv("MLX_DELEGATE_BLOCK_PIXELS", "0")
    channels = [o.float() for o in method.execute(inputs)]
    for a, b in zip(pixels, channels):
        torch.testing.assert_close(a, b, rtol=case.rtol, atol=case.atol)


class GateElsewhere(nn.Module):
    """Squeeze-excite whose gate is also returned: the block keeps its gate and project outside."""

    def __init__(self) -> None:
        super().__init__()
        self.block = SEBlock(5, 5, 1, 3, k=3, act=nn.Hardswish)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        body = self.block.body
        h = body[1](body[0](x))
        g = body[2].gate(h)
        return [body[3](h * g), g]


LOOKALIKE = cases("se_gate_read_elsewhere", lambda: GateElsewhere().eval(), lambda: (torch.randn(1, 5, 9, 11),),
                  (torch.float32,), is_module=True, tolerance={torch.float32: fp32_tolerance(64)})


@pytest.mark.parametrize("case", LOOKALIKE, ids=str)
def test_gate_read_elsewhere_stays_outside(case) -> None:
    kinds = node_kinds(lower_and_compare(case))
    assert kinds["InvertedResidualNode"] == 0 and kinds["ConvNode"] == 5


def test_squeeze_excite_means_as_accurate_as_eager() -> None:
    """A 14x14 squeeze-excite block (40 -> 240 -> 40) on large activations, run pixel by pixel: its
    output within twice eager float32's own distance from float64. One float32 running sum per channel
    over the 196 pixels was 3x eager's distance here (4-8x on MobileNetV3's blocks): the channel means
    feed the gate."""
    torch.manual_seed(11)
    block = SEBlock(40, 40, 1, 6, k=3, act=nn.Hardswish).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in block.modules():  # He-initialised convolutions, BatchNorms near identity (a trained net's scale)
            if isinstance(m, nn.Conv2d):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * (2.0 / m.weight[0].numel()) ** 0.5)
            elif isinstance(m, nn.BatchNorm2d):
                n = m.num_features
                m.running_mean.copy_(torch.rand(n, generator=g) * 0.2 - 0.1)
                m.running_var.copy_(torch.rand(n, generator=g) + 0.5)
                m.weight.copy_(torch.rand(n, generator=g) + 0.5)
                m.bias.copy_(torch.rand(n, generator=g) * 0.2 - 0.1)
        x = torch.randn(1, 40, 14, 14, generator=g) * 300 + 100
        exact = block.double()(x.double())
        eager = block.float()(x)
    if not cpu_kernels_active():
        pytest.skip("the CPU kernels are off: MLX's ops run the block (their mean: 4.3x eager's distance here)")
    before = _runtime.cpu_kernel_call_counts().get("inverted_residual_pixels", 0)
    out = lower(block, (x,)).method().execute([x])[0]
    assert _runtime.cpu_kernel_call_counts().get("inverted_residual_pixels", 0) > before
    ours, theirs = (out.double() - exact).abs().max().item(), (eager.double() - exact).abs().max().item()
    assert ours <= 2 * theirs, (ours, theirs)
