"""The CPU quantized GEMM for prefill-sized products (cpp/kernels/qgemm_cpu.cpp): from
kQgemmMinRows (12) rows of x, quantized linears run on the BLAS front's own tile with w dequantized
straight into its panels, or (MLX_DELEGATE_QGEMM=chunks) dequantize chunks of w and run the serial
sgemm. int4/int8, groups of 32/64/128, fp32 and bf16 activations, a strided input, output counts that
are not a whole number of panels or chunks, k cut into blocks across group boundaries and rows in
several row blocks match eager torch, each other and the integer GEMV (MLX_DELEGATE_QGEMM=0); the
portable dequantization (MLX_DELEGATE_CPU_KERNELS=portable) matches too; fewer rows stay on the GEMV."""

from dataclasses import dataclass, replace

import pytest
import torch
from executorch.runtime import Runtime
from torch.export import Dim
from torchao.quantization import MappingType, quantize_

import mlx_delegate
from mlx_delegate import MLXPartitioner, _runtime
from mlx_delegate import quantization as Q
from mlx_delegate.patterns import MLXPatternPass
from mlx_delegate.pipelines.llm import export as llm_export
from mlx_delegate.testing import QUANTIZED_TOLERANCE, assert_close, cpu_kernels_active, run_in_subprocess

K = 256
MIN_ROWS = 12  # kQgemmMinRows in cpp/kernels/qgemm_cpu.h
# (mode, group size, torchao mapping, outputs): 200 outputs end in a partial chunk of w's rows.
LAYOUTS = [("int4", 32, "asymmetric", 200), ("int4", 128, "symmetric", 48), ("int8", 64, "asymmetric", 200)]
DTYPES = (torch.float32, torch.bfloat16)


class Linears(torch.nn.Module):
    """One quantized linear per layout on x, and the first one again on every other row of x
    (a strided view reaches the kernel)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.linears = torch.nn.ModuleList(torch.nn.Linear(K, n, bias=i == 0) for i, (*_, n) in enumerate(LAYOUTS))
        self.to(dtype).eval()
        for linear, (mode, group_size, mapping, _) in zip(self.linears, LAYOUTS):
            config = replace(Q.torchao_config(mode, group_size), mapping_type=MappingType[mapping.upper()])
            quantize_(linear, config, filter_fn=lambda m, _: isinstance(m, torch.nn.Linear))

    def forward(self, x):
        return [linear(x) for linear in self.linears] + [self.linears[0](x[:, ::2])]


CALLS = {MIN_ROWS - 1: 0, MIN_ROWS: len(LAYOUTS), 2 * MIN_ROWS + 5: len(LAYOUTS) + 1}  # rows -> qgemm calls


@dataclass
class Case:
    module: Linears
    buffer: bytes
    inputs: list[torch.Tensor]


@pytest.fixture(scope="module")
def cases() -> dict[torch.dtype, Case]:
    out = {}
    for dtype in DTYPES:
        torch.manual_seed(0)
        module = Linears(dtype)
        example = torch.randn(1, 4, K, dtype=dtype)
        ep = torch.export.export(module, (example,), dynamic_shapes=({1: Dim("L", min=4, max=64)},), strict=True)
        edge = llm_export.lower(ep, pattern_pass=MLXPatternPass(), partitioner=MLXPartitioner(disable={"fuse_linears"}))
        out[dtype] = Case(module, edge.to_executorch().buffer, [torch.randn(1, r, K, dtype=dtype) for r in CALLS])
    return out


def qgemm_calls() -> int:
    return _runtime.cpu_kernel_call_counts().get("qgemm", 0)


def served() -> bool:
    return cpu_kernels_active() and mlx_delegate._blas.mode() == "torch"


ROUTES = ("1", "chunks")  # MLX_DELEGATE_QGEMM: w into the own tile's panels, float32 chunks of w


def run(case: Case, x: torch.Tensor, qgemm: bool | str, monkeypatch) -> list[torch.Tensor]:
    """Node by node (the switch is read while a graph is built); qgemm True / False, or a route."""
    monkeypatch.setenv("MLX_DELEGATE_QGEMM", qgemm if isinstance(qgemm, str) else "1" if qgemm else "0")
    was = _runtime.compile_enabled()
    _runtime.set_compile(False)
    try:
        return Runtime.get().load_program(case.buffer).load_method("forward").execute([x])
    finally:
        _runtime.set_compile(was)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_qgemm_matches_eager_and_gemv(dtype, cases, monkeypatch):
    case = cases[dtype]
    for x in case.inputs:
        routes = {}
        for route in ROUTES:
            before = qgemm_calls()
            routes[route] = got = run(case, x, route, monkeypatch)
            assert qgemm_calls() - before == CALLS[x.shape[1]] * served()
            with torch.no_grad():
                assert_close(got, case.module(x), *QUANTIZED_TOLERANCE[dtype])
        assert_close(routes["1"], routes["chunks"], *QUANTIZED_TOLERANCE[dtype])
        before = qgemm_calls()
        gemv = run(case, x, False, monkeypatch)
        assert qgemm_calls() == before
        assert_close(routes["1"], gemv, *QUANTIZED_TOLERANCE[dtype])


def test_qgemm_k_blocks_and_row_blocks(monkeypatch):
    """k of 640 runs as k blocks of 216, 216 and 208 (groups of 64 and 128 straddle them), 150 rows as
    two row blocks reusing the panels, 70 and 45 outputs end in part and half panels."""
    torch.manual_seed(1)
    k = 640
    layers = torch.nn.ModuleList([torch.nn.Linear(k, 70, bias=True), torch.nn.Linear(k, 45, bias=False)]).eval()
    for linear, (mode, group_size) in zip(layers, (("int4", 64), ("int8", 128))):
        quantize_(linear, Q.torchao_config(mode, group_size), filter_fn=lambda m, _: isinstance(m, torch.nn.Linear))

    class Both(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linears = layers

        def forward(self, x):
            return [linear(x) for linear in self.linears]

    both = Both()
    x = torch.randn(1, 150, k)
    ep = torch.export.export(both, (x,), strict=True)
    buffer = llm_export.lower(ep, partitioner=MLXPartitioner(disable={"fuse_linears"})).to_executorch().buffer
    case = Case(both, buffer, [])
    with torch.no_grad():
        want = both(x)
    routes = {}
    for route in ROUTES:
        before = qgemm_calls()
        routes[route] = run(case, x, route, monkeypatch)
        assert qgemm_calls() - before == 2 * served()
        assert_close(routes[route], want, *QUANTIZED_TOLERANCE[torch.float32])
    assert_close(routes["1"], routes["chunks"], *QUANTIZED_TOLERANCE[torch.float32])


def test_qgemm_compiled(cases, compile_on):
    """Inside a compiled graph (traced on the second call, replayed after): same result."""
    case = cases[torch.float32]
    x = case.inputs[-1]
    method = Runtime.get().load_program(case.buffer).load_method("forward")
    before = qgemm_calls()
    for _ in range(3):
        got = method.execute([x])
    assert qgemm_calls() - before == 3 * CALLS[x.shape[1]] * served()
    with torch.no_grad():
        assert_close(got, case.module(x), *QUANTIZED_TOLERANCE[torch.float32])


# Other panel writers and tiles in a fresh process (each is chosen at start-up): the scalar
# dequantization, the AVX2 writer (AVX-512 capped), the AVX-512 writer with the AVX2 tile's 16-wide panels.
WRITERS = {"portable": {"MLX_DELEGATE_CPU_KERNELS": "portable"}, "avx2": {"MLX_DELEGATE_CPU_KERNELS": "avx2"},
           "avx2-tile": {"MLX_DELEGATE_SGEMM": "own-avx2"}}


@pytest.mark.parametrize("writer", WRITERS)
def test_qgemm_portable_dequantize(writer, cases, tmp_path):
    """Each panel writer / tile feeds the same product: eager torch's result."""
    programs = {dtype: (c.buffer, c.inputs[1:]) for dtype, c in cases.items()}
    portable = run_in_subprocess(programs, WRITERS[writer], tmp_path)
    runs = sum(CALLS[x.shape[1]] for c in cases.values() for x in c.inputs[1:])
    assert portable["counts"].get("qgemm", 0) == runs * served()
    for dtype, case in cases.items():
        for x, plain in zip(case.inputs[1:], portable["outputs"][dtype]):
            with torch.no_grad():
                assert_close(plain, case.module(x), *QUANTIZED_TOLERANCE[dtype])


@pytest.mark.parametrize("scales_dtype", (torch.float16, torch.bfloat16), ids=str)
def test_qgemm_reads_stored_half_scales(scales_dtype, monkeypatch):
    """Scales / biases stored in a half type under fp32 activations (a GGUF file's fp16 d and m) are
    widened inside the kernel: eager torch of the same stored values and the GEMV agree."""
    gen = torch.Generator().manual_seed(0)
    layers = []
    for bits, n in ((4, 37), (8, 130)):
        u = torch.randint(0, 2**bits, (n, K), generator=gen)
        scales = (torch.rand(n, K // 32, generator=gen) + 0.5) * 0.16 / 2**bits
        biases = -(2 ** (bits - 1) + torch.randn(n, K // 32, generator=gen)) * scales
        packed = Q.MLXQuantized(Q.pack_words(u, bits), scales.to(scales_dtype), biases.to(scales_dtype), 32, bits)
        layers.append(Q.QuantizedLinear(packed))
    class Both(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linears = torch.nn.ModuleList(layers)

        def forward(self, x):
            return [linear(x) for linear in self.linears]

    both = Both().eval()
    ep = torch.export.export(both, (torch.randn(1, 4, K),), dynamic_shapes=({1: Dim("L", min=2, max=64)},),
                             strict=True)
    buffer = llm_export.lower(ep, partitioner=MLXPartitioner(disable={"fuse_linears"})).to_executorch().buffer
    case = Case(both, buffer, [])
    x = torch.randn(1, 2 * MIN_ROWS, K)
    before = qgemm_calls()
    got = run(case, x, True, monkeypatch)
    assert qgemm_calls() - before == len(layers) * served()
    with torch.no_grad():
        assert_close(got, both(x), *QUANTIZED_TOLERANCE[torch.float32])
    assert_close(got, run(case, x, False, monkeypatch), *QUANTIZED_TOLERANCE[torch.float32])
