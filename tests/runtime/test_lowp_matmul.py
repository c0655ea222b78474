"""The CPU bf16/fp16 matmul (cpp/kernels/gemm_lowp_cpu.cpp): mm/linear/addmm/bmm/matmul
with row-major and transposed operands, batched, K not a multiple of 16/32, for 1, 3,
17 and 64 rows, match eager torch, MLX's own matmul (MLX_DELEGATE_CPU_KERNELS=0), the
portable GEMV (=portable), the AVX2 GEMV (=avx2) and the GEMV without MKL
(MLX_DELEGATE_BLAS=reference: blocks of 8 rows instead of MKL's gemm), each in a
subprocess; the call counters prove which path ran."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from executorch.runtime import Runtime
from torch.export import Dim

from mlx_delegate import _blas, _runtime
from mlx_delegate.pipelines.llm import export as llm_export
from mlx_delegate.testing import (TOLERANCE, assert_close, cpu_kernels_active, delegate_summary, lower, on_cpu_device,
                                  run_in_subprocess)

K = 200  # 3 * 64 + 8: the AVX-512 loop's 64-wide steps and a masked tail
INNER = 104  # 64 + 32 + 8: every step of that loop
ROWS = (1, 3, 17, 64)
DTYPES = (torch.bfloat16, torch.float16)
GEMV_ROWS = 8  # kGemmLowpGemvRows: more rows go to MKL when the BLAS shim offers it


class Products(torch.nn.Module):
    """Every product form and operand layout the delegate lowers, on x [1, M, K]. No two
    products share operands (a compiled graph would merge them, and the call counts with them)."""

    def __init__(self) -> None:
        super().__init__()
        self.b1 = torch.nn.Parameter(torch.randn(K, INNER) / K**0.5)  # [K, N]: b row-major
        self.linear = torch.nn.Linear(INNER, 40)  # [N, K]: read transposed in place
        self.w3 = torch.nn.Parameter(torch.randn(24, INNER) / INNER**0.5)
        self.w4 = torch.nn.Parameter(torch.randn(24, INNER) / INNER**0.5)
        self.b4 = torch.nn.Parameter(torch.randn(24))
        self.w5 = torch.nn.Parameter(torch.randn(3, INNER, 16) / INNER**0.5)
        self.w6 = torch.nn.Parameter(torch.randn(3, 16, INNER) / INNER**0.5)
        self.w7 = torch.nn.Parameter(torch.randn(3, 2, INNER, 8) / INNER**0.5)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        y = x[0] @ self.b1  # [M, INNER]
        z = torch.stack([y, -2 * y, 0.5 * y])  # [3, M, INNER]
        return [
            y,
            self.linear(y),
            torch.mm(y, self.w3.t()),  # b a transposed view
            torch.addmm(self.b4, y, self.w4.t(), beta=0.5, alpha=2.0),
            torch.mm((-y).t().contiguous().t(), self.w4.t()),  # a stored transposed (negated: not addmm's product)
            torch.mm(self.w3, y.t()),  # 24 rows whatever M is; b = y transposed
            torch.bmm(z, self.w5),
            torch.bmm(z, self.w6.transpose(1, 2)),
            torch.matmul(torch.stack([z, 0.25 * z], 1), self.w7),  # 4-D
        ]


PRODUCTS = 9  # products per call that take the kernel
FIXED_ROWS = 1  # of them, with 24 rows whatever M is (mm(w3, y^T))


@dataclass
class Case:
    module: Products
    buffer: bytes  # the loaded program reads from it: keep it alive
    inputs: list[torch.Tensor]


def make_case(dtype: torch.dtype) -> Case:
    torch.manual_seed(0)
    module = Products().to(dtype).eval()
    example = torch.randn(1, 3, K, dtype=dtype)
    ep = torch.export.export(module, (example,), dynamic_shapes=({1: Dim("M", min=1, max=64)},), strict=True)
    edge = llm_export.lower(ep)
    assert delegate_summary(edge) == (1, [])
    return Case(module, edge.to_executorch().buffer, [torch.randn(1, rows, K, dtype=dtype) for rows in ROWS])


@pytest.fixture(scope="module")
def cases() -> dict[torch.dtype, Case]:
    return {dtype: make_case(dtype) for dtype in DTYPES}


def lowp_calls() -> tuple[int, int]:
    """(GEMV, MKL) evaluations of the kernel so far."""
    counts = _runtime.cpu_kernel_call_counts()
    return counts.get("gemm_lowp_gemv", 0), counts.get("gemm_lowp_blas", 0)


def expected_calls(rows: int, blas: bool) -> tuple[int, int]:
    """(GEMV, MKL) evaluations for one call of Products on `rows` rows."""
    if not blas:
        return PRODUCTS, 0
    if rows > GEMV_ROWS:
        return 0, PRODUCTS
    return PRODUCTS - FIXED_ROWS, FIXED_ROWS


# The other paths, each in its own process (the switches are read once).
PATHS = {
    "mlx": {"MLX_DELEGATE_CPU_KERNELS": "0"},
    "portable": {"MLX_DELEGATE_CPU_KERNELS": "portable"},
    "avx2": {"MLX_DELEGATE_CPU_KERNELS": "avx2"},
    # The kernels on whatever the parent's environment says (only the BLAS route changes).
    "no-mkl": {"MLX_DELEGATE_BLAS": "reference", "MLX_DELEGATE_CPU_KERNELS": "1"},
}


@pytest.fixture(scope="module")
def other_paths(cases, tmp_path_factory) -> dict[str, dict]:
    tmp_path = tmp_path_factory.mktemp("lowp_matmul")
    programs = {dtype: (c.buffer, c.inputs) for dtype, c in cases.items()}
    return {name: run_in_subprocess(programs, env, tmp_path) for name, env in PATHS.items()}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_products_match_eager(dtype, cases):
    case = cases[dtype]
    method = Runtime.get().load_program(case.buffer).load_method("forward")
    blas = _blas.lowp_gemm_ready()[str(dtype).removeprefix("torch.")]
    for x in case.inputs:
        before = lowp_calls()
        for _ in range(2):  # the second call runs the compiled graph
            got = method.execute([x])
        after = lowp_calls()
        gemv, mkl = expected_calls(x.shape[1], blas)
        calls = 2 * cpu_kernels_active()  # none on a GPU default device
        assert (after[0] - before[0], after[1] - before[1]) == (calls * gemv, calls * mkl), x.shape
        with torch.no_grad():
            assert_close(got, case.module(x), *TOLERANCE[dtype])


@pytest.mark.parametrize("name", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_products_match_other_paths(dtype, name, cases, other_paths):
    case = cases[dtype]
    method = Runtime.get().load_program(case.buffer).load_method("forward")
    other = other_paths[name]
    gemv, mkl = other["counts"].get("gemm_lowp_gemv", 0), other["counts"].get("gemm_lowp_blas", 0)
    if name == "mlx":
        assert gemv == mkl == 0
    else:
        blas = other["blas"]
        want = [expected_calls(x.shape[1], blas[str(d).removeprefix("torch.")]) for d, c in cases.items()
                for x in c.inputs]
        # The subprocess runs on this machine's default device: no CPU kernels on a GPU.
        assert (gemv, mkl) == tuple(sum(w[i] for w in want) * on_cpu_device() for i in range(2))
        if name == "no-mkl":
            assert not any(blas.values()) and mkl == 0
    for x, theirs in zip(case.inputs, other["outputs"][dtype]):
        assert_close(method.execute([x]), theirs, *TOLERANCE[dtype])


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(96, 160)
        self.down = torch.nn.Linear(160, 72, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.silu(self.up(x)))


@pytest.mark.parametrize("rows", (1, 5, 33))
def test_bf16_linear_model_matches_eager(rows):
    torch.manual_seed(0)
    model = Mlp().to(torch.bfloat16).eval()
    x = torch.randn(2, rows, 96, dtype=torch.bfloat16)
    lowered = lower(model, (x,))
    assert lowered.summary == (1, [])
    before = sum(lowp_calls())
    got = lowered.method().execute([x])
    assert sum(lowp_calls()) - before == 2 * cpu_kernels_active()
    with torch.no_grad():
        assert_close(got, model(x), *TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("shapes", [((0, 40), (40, 24)), ((5, 0), (0, 24)), ((3, 5, 40), (3, 40, 0))], ids=str)
def test_zero_size_products_fall_back(shapes):
    a_shape, b_shape = shapes
    a, b = torch.randn(a_shape, dtype=torch.bfloat16), torch.randn(b_shape, dtype=torch.bfloat16)
    fn = torch.bmm if len(a_shape) == 3 else torch.mm

    class Product(torch.nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return fn(a, b)

    lowered = lower(Product(), (a, b))
    before = lowp_calls()
    got = lowered.method().execute([a, b])
    assert lowp_calls() == before
    assert_close(got, fn(a, b), *TOLERANCE[torch.bfloat16])
