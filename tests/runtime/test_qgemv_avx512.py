"""The quantized GEMV's AVX-512 VNNI kernels (cpp/kernels/qgemv_cpu.cpp, where the CPU has AVX-512 BW, VL
and VNNI): int4 / int8 in groups of 32, 64 and 128, fp32 / fp16 / bf16 scales, fp32 / bf16 / fp16
activations, K a multiple of 64 but not of 512 (groups of 32: one step of eight groups and four on their
own), odd output counts (one thread, and split across the cores), 1, 3 and 9 rows (9: row blocks of 8
and 1); one row of x at 1, 2 and 4 weight rows a step. Each program matches eager torch, MLX's own
kernels (CPU kernels off) and the AVX2 kernels (`set_qgemv_avx512_path(False)`) in one process; the call
counter proves the AVX-512 kernels ran.
K stays small: x rounded to int16 is both kernels' error, summed over K with the unsigned weights as
factors; at K = 640, int8 at 9 rows exceeds the fp32 tolerance by a hair on the AVX2 kernels too."""

import os
from pathlib import Path

import pytest
import torch
from executorch.runtime import Runtime
from torch.export import Dim

from mlx_delegate import MLXPartitioner, _runtime
from mlx_delegate import quantization as Q
from mlx_delegate.pipelines.llm import export as llm_export
from mlx_delegate.testing import QUANTIZED_TOLERANCE, assert_close, cpu_kernels_active, delegate_summary, runtime_switches

K = 384  # 12 groups of 32, 6 of 64, 3 of 128
LAYOUTS = ((4, 32, 389), (8, 32, 37), (4, 64, 389), (8, 64, 37), (4, 128, 37), (8, 128, 389))  # (bits, group, N)
ROWS = (1, 3, 9)
# (activation dtype, scales dtype): `--quantize int4`'s fp32 / fp32, GGUF's fp32 / fp16, and half activations.
PAIRS = ((torch.float32, torch.float32), (torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16),
         (torch.float16, torch.float32))


def packed(bits: int, group_size: int, n: int, dtype: torch.dtype, gen: torch.Generator,
           k: int = K) -> Q.MLXQuantized:
    """Random unsigned values; biases near -2^(bits-1) scales, so the weights are centred like real ones."""
    u = torch.randint(0, 2**bits, (n, k), generator=gen)
    groups = (n, k // group_size)
    scales = (torch.rand(groups, generator=gen) + 0.5) * 0.16 / 2**bits
    biases = -(2 ** (bits - 1) + torch.randn(groups, generator=gen)) * scales
    return Q.MLXQuantized(Q.pack_words(u, bits), scales.to(dtype), biases.to(dtype), group_size, bits)


class Linears(torch.nn.Module):
    def __init__(self, act: torch.dtype, scales: torch.dtype) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.linears = torch.nn.ModuleList(Q.QuantizedLinear(packed(b, g, n, scales, gen)) for b, g, n in LAYOUTS)
        self.to(act).eval()

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [linear(x) for linear in self.linears]


def avx512_vnni_runs() -> bool:
    """Whether the AVX-512 kernels should run here: vector kernels on, not capped at AVX2, and the CPU has
    the features."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "") \
        if cpuinfo.exists() else ""
    have = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= set(flags.split())
    capped = os.environ.get("MLX_DELEGATE_CPU_KERNELS") == "avx2"
    return have and not capped and _runtime.cpu_vector_kernels() and cpu_kernels_active()


@pytest.fixture(scope="module")
def programs() -> dict[tuple[torch.dtype, torch.dtype], tuple[Linears, bytes]]:
    torch.manual_seed(2)
    out = {}
    for act, scales in PAIRS:
        module = Linears(act, scales)
        ep = torch.export.export(module, (torch.randn(1, 2, K, dtype=act),),
                                 dynamic_shapes=({1: Dim("L", min=1, max=16)},), strict=True)
        edge = llm_export.lower(ep, partitioner=MLXPartitioner(disable={"fuse_linears"}))  # one call per layout
        assert delegate_summary(edge) == (1, [])
        out[(act, scales)] = module, edge.to_executorch().buffer
    return out


def avx512_calls() -> int:
    return _runtime.cpu_kernel_call_counts().get("qgemv_avx512", 0)


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"x-{p[0]}-scales-{p[1]}".replace("torch.", ""))
def test_avx512_matches_eager_avx2_and_kernels_off(pair, programs):
    module, buffer = programs[pair]
    act = pair[0]
    tol = QUANTIZED_TOLERANCE[act]
    method = Runtime.get().load_program(buffer).load_method("forward")
    for rows in ROWS:
        x = torch.randn(1, rows, K, dtype=act)
        with torch.no_grad():
            expected = module(x)
        before = avx512_calls()
        for _ in range(2):  # node by node, then the traced graph
            got = method.execute([x])
        # Rows > 1 in groups of 32 stay on the AVX2 kernels (their x layout); everything else is AVX-512's.
        taken = sum(1 for _, g, _ in LAYOUTS if rows == 1 or g > 32)
        assert avx512_calls() - before == (2 * taken if avx512_vnni_runs() else 0)
        _runtime.set_qgemv_avx512_path(False)
        try:
            before = avx512_calls()
            avx2 = method.execute([x])  # the compiled graph reads the switch when it runs
            assert avx512_calls() == before
        finally:
            _runtime.set_qgemv_avx512_path(True)
        # Same int16 x and exact integer sums: only the float accumulation order differs.
        assert_close(got, avx2, *((1e-5, 1e-5) if act == torch.float32 else tol))
        assert_close(got, expected, *tol)
        with runtime_switches(compile=False, cpu_kernels=False):  # MLX's own quantized matmul
            off = method.execute([x])
        assert_close(got, off, *tol)


def test_guided_split_matches_equal_parts(programs):
    """The decode GEMV's guided split (pieces claimed from one counter, shrinking to 32 rows) against four
    equal parts per thread: N 389 and 37 (neither a multiple of the 32-row piece nor of 4), 1 and 3 rows.
    Pieces start on multiples of 4 rows in both splits, so every row runs the same kernel block: the
    outputs are bitwise equal, and match eager torch."""
    module, buffer = programs[(torch.float32, torch.float32)]
    method = Runtime.get().load_program(buffer).load_method("forward")
    was = _runtime.qgemv_guided_split()
    for rows in (1, 3):
        x = torch.randn(1, rows, K)
        with torch.no_grad():
            expected = module(x)
        try:
            _runtime.set_qgemv_guided_split(True)
            guided = [method.execute([x]) for _ in range(2)][-1]  # node by node, then the traced graph
            _runtime.set_qgemv_guided_split(False)
            equal = method.execute([x])
        finally:
            _runtime.set_qgemv_guided_split(was)
        assert all(torch.equal(a, b) for a, b in zip(guided, equal))
        assert_close(guided, expected, *QUANTIZED_TOLERANCE[torch.float32])


@pytest.mark.parametrize("pair", PAIRS[:2], ids=lambda p: f"x-{p[0]}-scales-{p[1]}".replace("torch.", ""))
def test_one_row_blocks_agree(pair, programs):
    """One row of x with 1, 2 and 4 weight rows per kernel step (`set_qgemv_one_row_block`: Intel's default
    4, the others' 1), groups of 32, 64 and 128, N 389 and 37 (blocks of 4 and 2 leave tails): each output
    sums in the same order whatever the block, so the outputs are bitwise equal, and they match eager."""
    module, buffer = programs[pair]
    method = Runtime.get().load_program(buffer).load_method("forward")
    x = torch.randn(1, 1, K, dtype=pair[0])
    with torch.no_grad():
        expected = module(x)
    was = _runtime.set_qgemv_one_row_block(1)
    outs = {}
    try:
        for rows in (1, 2, 4):
            _runtime.set_qgemv_one_row_block(rows)
            before = avx512_calls()
            outs[rows] = [method.execute([x]) for _ in range(2)][-1]  # node by node, then the traced graph
            assert avx512_calls() - before == (2 * len(LAYOUTS) if avx512_vnni_runs() else 0)
    finally:
        _runtime.set_qgemv_one_row_block(was)
    for rows in (2, 4):
        assert all(torch.equal(a, b) for a, b in zip(outs[rows], outs[1])), f"{rows} rows a step differ from 1"
    assert_close(outs[4], expected, *QUANTIZED_TOLERANCE[pair[0]])


@pytest.mark.parametrize("bits,group_size", [(4, 64), (8, 64), (4, 128)])
def test_one_row_many_groups(bits, group_size):
    """One row of x with groups of 64 / 128 (the kernel that scales sixteen groups at a time): 17 groups, a
    full sixteen and one more, against the AVX2 kernels (the same int16 x) and eager torch."""
    gen = torch.Generator().manual_seed(bits + group_size)
    k = 17 * group_size
    module = Q.QuantizedLinear(packed(bits, group_size, 45, torch.float32, gen, k)).eval()
    x = torch.randn(1, 1, k) / 4
    lowered = lower_module(module, x)
    method = Runtime.get().load_program(lowered).load_method("forward")
    before = avx512_calls()
    got = method.execute([x])
    assert avx512_calls() - before == (1 if avx512_vnni_runs() else 0)
    _runtime.set_qgemv_avx512_path(False)
    try:
        avx2 = method.execute([x])
    finally:
        _runtime.set_qgemv_avx512_path(True)
    assert_close(got, avx2, 1e-5, 1e-5)
    with torch.no_grad():
        assert_close(got, module(x), *QUANTIZED_TOLERANCE[torch.float32])


def lower_module(module: torch.nn.Module, x: torch.Tensor) -> bytes:
    edge = llm_export.lower(torch.export.export(module, (x,), strict=True))
    assert delegate_summary(edge) == (1, [])
    return edge.to_executorch().buffer
