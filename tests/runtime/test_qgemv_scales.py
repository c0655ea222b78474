"""Quantized linears whose scales / biases are stored in a dtype of their own (a GGUF file's fp16 d
and m under fp32 activations; see `models.gguf`): the CPU kernel reads fp32, fp16 and bf16 scales as
stored, MLX's kernels (kernels off, and Metal / CUDA) get them widened once per loaded program. Each
(activation dtype, scales dtype) program matches eager torch, the kernels-off path and the portable
loop (a subprocess), at K not a multiple of 64, odd output counts (one thread, and split across the
cores) and 1 to 9 rows (the AVX2 kernel's row blocks of 8 and a partial one). One row in groups of 32
takes the kernel's eight-groups-at-a-time path (11 groups: one step of eight and three on their own),
also checked against the general per-group loop."""

import pytest
import torch
from executorch.runtime import Runtime
from torch.export import Dim

from mlx_delegate import MLXPartitioner, _runtime
from mlx_delegate import quantization as Q
from mlx_delegate.pipelines.llm import export as llm_export
from mlx_delegate.testing import (
    QUANTIZED_TOLERANCE,
    assert_close,
    cpu_kernels_active,
    delegate_summary,
    on_cpu_device,
    run_in_subprocess,
    runtime_switches,
)

K = 352  # 11 groups of 32: not a multiple of 64
LAYOUTS = ((4, 37), (8, 37), (4, 389), (8, 389))  # (bits, outputs): odd; 389 x 160 is split across the cores
ROWS = tuple(range(1, 10))
# (activation dtype, scales dtype): the GGUF default (fp32 / fp16), bf16 scales, and half activations.
PAIRS = ((torch.float32, torch.float16), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16),
         (torch.float16, torch.float16), (torch.float16, torch.float32))


def packed(bits: int, n: int, dtype: torch.dtype, gen: torch.Generator) -> Q.MLXQuantized:
    """Random unsigned values with scales / biases representable in `dtype` (as GGUF's fp16 d / m are);
    biases near -2^(bits-1) scales (Q4_0's -8 d, Q8_0's -128 d), so the weights are centred like real ones."""
    u = torch.randint(0, 2**bits, (n, K), generator=gen)
    groups = (n, K // 32)
    scales = (torch.rand(groups, generator=gen) + 0.5) * 0.16 / 2**bits  # weights of a Linear's size
    biases = -(2 ** (bits - 1) + torch.randn(groups, generator=gen)) * scales
    scales, biases = scales.to(dtype), biases.to(dtype)
    return Q.MLXQuantized(Q.pack_words(u, bits), scales, biases, 32, bits)


class Linears(torch.nn.Module):
    def __init__(self, act: torch.dtype, scales: torch.dtype) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.linears = torch.nn.ModuleList(Q.QuantizedLinear(packed(bits, n, scales, gen)) for bits, n in LAYOUTS)
        self.to(act).eval()

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [linear(x) for linear in self.linears]


def lower(act: torch.dtype, scales: torch.dtype) -> tuple[Linears, bytes]:
    module = Linears(act, scales)
    assert all(m.scales.dtype == scales for m in module.linears)  # .to(act) keeps the stored dtype
    ep = torch.export.export(module, (torch.randn(1, 2, K, dtype=act),),
                             dynamic_shapes=({1: Dim("L", min=1, max=16)},), strict=True)
    edge = llm_export.lower(ep, partitioner=MLXPartitioner(disable={"fuse_linears"}))  # one call per width
    assert delegate_summary(edge) == (1, [])
    return module, edge.to_executorch().buffer


@pytest.fixture(scope="module")
def programs() -> dict[tuple[torch.dtype, torch.dtype], tuple[Linears, bytes, list[torch.Tensor]]]:
    torch.manual_seed(1)
    return {pair: (*lower(*pair), [torch.randn(1, rows, K, dtype=pair[0]) for rows in ROWS]) for pair in PAIRS}


@pytest.fixture(scope="module")
def portable(programs, tmp_path_factory) -> dict:
    return run_in_subprocess({pair: (buffer, inputs) for pair, (_, buffer, inputs) in programs.items()},
                             {"MLX_DELEGATE_CPU_KERNELS": "portable"}, tmp_path_factory.mktemp("qgemv_scales"))


def test_reference_dequantizes_narrow_scales_exactly():
    """The eager reference computes in the wider dtype: fp16 scales give the float32 products exactly."""
    q = packed(4, 5, torch.float16, torch.Generator().manual_seed(0))
    wide = Q.dequantize_mlx(q.w, q.scales.float(), q.biases.float(), 32, 4)
    assert torch.equal(Q.dequantize_mlx(q.w, q.scales, q.biases, 32, 4, dtype=torch.float32), wide)


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"x-{p[0]}-scales-{p[1]}".replace("torch.", ""))
def test_stored_scales_match_eager_kernels_off_and_portable(pair, programs, portable):
    module, buffer, inputs = programs[pair]
    tol = QUANTIZED_TOLERANCE[pair[0]]
    program = Runtime.get().load_program(buffer)  # alive while its method runs
    method = program.load_method("forward")
    conversions = _runtime.constant_conversions()
    for x, plain in zip(inputs, portable["outputs"][pair]):
        with torch.no_grad():
            expected = module(x)
        before = _runtime.cpu_kernel_calls()
        for _ in range(3):  # node by node, traced, replayed
            got = method.execute([x])
        assert _runtime.cpu_kernel_calls() - before == 3 * len(LAYOUTS) * cpu_kernels_active()
        assert_close(got, expected, *tol)
        assert_close(got, plain, *tol)
        with runtime_switches(compile=False, cpu_kernels=False):  # a compiled graph keeps its kernels
            before = _runtime.cpu_kernel_calls()
            for _ in range(3):
                off = method.execute([x])
            assert _runtime.cpu_kernel_calls() == before
        assert_close(off, expected, *tol)
        assert_close(got, off, *tol)
        if x.shape[1] == 1:
            _runtime.set_qgemv_group32_path(False)
            try:
                general = method.execute([x])
            finally:
                _runtime.set_qgemv_group32_path(True)
            assert_close(got, general, *tol)
    # MLX's kernels (kernels off) compute in float32 on the CPU, in x's dtype on a GPU: stored scales and
    # biases of another dtype were converted once per loaded program, not per call (27+ calls above).
    target = torch.float32 if on_cpu_device() else pair[0]
    widened = 2 * len(LAYOUTS) if pair[1] != target else 0
    assert _runtime.constant_conversions() - conversions == widened


# One row in groups of 64 and 128 (the layouts `--quantize int4` and torchao write): the eight-groups path
# sums each group over two or four 32-element steps. 11 groups: one step of eight and three on their own.
WIDE_GROUPS = (64, 128)


def packed_groups(bits: int, n: int, group_size: int, gen: torch.Generator) -> Q.MLXQuantized:
    k = 11 * group_size
    u = torch.randint(0, 2**bits, (n, k), generator=gen)
    scales = (torch.rand(n, 11, generator=gen) + 0.5) * 0.16 / 2**bits
    biases = -(2 ** (bits - 1) + torch.randn(n, 11, generator=gen)) * scales
    return Q.MLXQuantized(Q.pack_words(u, bits), scales, biases, group_size, bits)


@pytest.mark.parametrize("group_size", WIDE_GROUPS)
def test_one_row_wide_groups_match_eager_and_the_per_group_loop(group_size: int) -> None:
    gen = torch.Generator().manual_seed(group_size)
    module = torch.nn.ModuleList(Q.QuantizedLinear(packed_groups(bits, n, group_size, gen)) for bits, n in LAYOUTS)
    model = type("Wide", (torch.nn.Module,), {"forward": lambda self, x: [m(x) for m in self.linears]})()
    model.linears = module
    x = torch.randn(1, 1, 11 * group_size, generator=gen)
    ep = torch.export.export(model.eval(), (x,), strict=True)
    edge = llm_export.lower(ep, partitioner=MLXPartitioner(disable={"fuse_linears"}))
    assert delegate_summary(edge) == (1, [])
    program = Runtime.get().load_program(edge.to_executorch().buffer)  # alive while its method runs
    method = program.load_method("forward")
    with torch.no_grad():
        expected = model(x)
    before = _runtime.cpu_kernel_calls()
    got = method.execute([x])
    assert _runtime.cpu_kernel_calls() - before == len(LAYOUTS) * cpu_kernels_active()
    _runtime.set_qgemv_group32_path(False)
    try:
        general = method.execute([x])
    finally:
        _runtime.set_qgemv_group32_path(True)
    tol = QUANTIZED_TOLERANCE[torch.float32]
    assert_close(got, expected, *tol)
    assert_close(got, general, *tol)
