"""The float32 GEMV (cpp/kernels/gemm_lowp_cpu.cpp, counter "gemv_f32"): linear / mm /
addmm / matmul by a weight stored [N, K] with up to 8 rows (batch axes folded) match eager
torch and MLX's own matmul (MLX_DELEGATE_CPU_KERNELS=0), in the AVX-512F, AVX2 (=avx2)
and portable (=portable) kernels, the last ones in subprocesses; 9 rows, a [K, N] weight
and zero-size products stay on MLX's matmul. One row reads the weight rows one at a time in
32-wide steps: K = 200 ends in a masked tail, K = 80 in a full 16-wide one, K = 1 is a tail
alone; more rows take blocks of 2-4 outputs, N odd the single-output loop after them."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from executorch.runtime import Runtime
from torch.export import Dim

from mlx_delegate import _runtime
from mlx_delegate.pipelines.llm import export as llm_export
from mlx_delegate.testing import assert_close, cpu_kernels_active, delegate_summary, lower, on_cpu_device, run_in_subprocess

RTOL, ATOL = 1e-5, 1e-5  # of values of magnitude ~1 (inputs scaled by 1/sqrt(K))
ROWS = (1, 3, 8, 9)  # 9: more than the GEMV takes


def gemv_calls() -> int:
    return _runtime.cpu_kernel_call_counts().get("gemv_f32", 0)


class Products(torch.nn.Module):
    """float32 products on x [1, M, K], no two sharing operands (a compiled graph would
    merge them). TAKEN of them are read by the GEMV at M <= 8."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(k, 37)  # bias, N odd
        self.bare = torch.nn.Linear(k, 64, bias=False)
        self.w3 = torch.nn.Parameter(torch.randn(33, k) / k**0.5)
        self.w4 = torch.nn.Parameter(torch.randn(21, k) / k**0.5)
        self.b4 = torch.nn.Parameter(torch.randn(21))
        self.b5 = torch.nn.Parameter(torch.randn(k, 19) / k**0.5)  # [K, N]: not in place

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        y = x[0]  # [M, K]
        return [
            self.linear(x),  # 3-D x: batch axes folded
            self.bare(2 * y),
            torch.mm(y + 1, self.w3.t()),
            torch.addmm(self.b4, y - 1, self.w4.t(), beta=0.5, alpha=2.0),
            torch.mm(y * 3, self.b5),
        ]


TAKEN = 4


@dataclass
class Case:
    module: Products
    buffer: bytes  # the loaded program reads from it: keep it alive
    inputs: list[torch.Tensor]


def make_case(k: int) -> Case:
    torch.manual_seed(k)
    module = Products(k).eval()
    example = torch.randn(1, 3, k)
    ep = torch.export.export(module, (example,), dynamic_shapes=({1: Dim("M", min=1, max=16)},), strict=True)
    edge = llm_export.lower(ep)
    assert delegate_summary(edge) == (1, [])
    return Case(module, edge.to_executorch().buffer, [torch.randn(1, rows, k) for rows in ROWS])


KS = (200, 1, 80)


@pytest.fixture(scope="module")
def cases() -> dict[int, Case]:
    return {k: make_case(k) for k in KS}


def expected_calls(rows: int) -> int:
    return TAKEN if rows <= 8 else 0


@pytest.fixture(params=(True, False), ids=("compiled", "node-by-node"))
def compile_mode(request):
    was = _runtime.compile_enabled()
    _runtime.set_compile(request.param)
    yield
    _runtime.set_compile(was)


@pytest.mark.parametrize("k", KS)
def test_products_match_eager(k, cases, compile_mode):
    case = cases[k]
    method = Runtime.get().load_program(case.buffer).load_method("forward")
    for x in case.inputs:
        before = gemv_calls()
        for _ in range(3):  # compiled: the later calls replay the traced graph
            got = method.execute([x])
        assert gemv_calls() - before == 3 * expected_calls(x.shape[1]) * cpu_kernels_active(), x.shape
        with torch.no_grad():
            assert_close(got, case.module(x), RTOL, ATOL)


PATHS = {
    "mlx": {"MLX_DELEGATE_CPU_KERNELS": "0"},
    "portable": {"MLX_DELEGATE_CPU_KERNELS": "portable"},
    "avx2": {"MLX_DELEGATE_CPU_KERNELS": "avx2"},
}


@pytest.fixture(scope="module")
def other_paths(cases, tmp_path_factory) -> dict[str, dict]:
    tmp_dir = tmp_path_factory.mktemp("gemv_f32")
    programs = {k: (c.buffer, c.inputs) for k, c in cases.items()}
    return {name: run_in_subprocess(programs, env, tmp_dir) for name, env in PATHS.items()}


@pytest.mark.parametrize("name", PATHS)
@pytest.mark.parametrize("k", KS)
def test_products_match_other_paths(k, name, cases, other_paths):
    case = cases[k]
    method = Runtime.get().load_program(case.buffer).load_method("forward")
    other = other_paths[name]
    # The subprocess runs on this machine's default device: no CPU kernels on a GPU.
    want = 0 if name == "mlx" else sum(expected_calls(x.shape[1]) for c in cases.values() for x in c.inputs)
    want *= on_cpu_device()
    assert other["counts"].get("gemv_f32", 0) == want
    for x, theirs in zip(case.inputs, other["outputs"][k]):
        assert_close(method.execute([x]), theirs, RTOL, ATOL)


def test_kernels_off_in_process_falls_back():
    torch.manual_seed(0)
    model = torch.nn.Linear(96, 45).eval()
    x = torch.randn(2, 96)
    lowered = lower(model, (x,))
    _runtime.set_cpu_kernels(False)
    try:
        before = gemv_calls()
        got = lowered.method().execute([x])
        assert gemv_calls() == before
    finally:
        _runtime.set_cpu_kernels(True)
    with torch.no_grad():
        assert_close(got, model(x), RTOL, ATOL)
    before = gemv_calls()
    assert_close(lowered.method().execute([x]), got, RTOL, ATOL)
    assert gemv_calls() - before == cpu_kernels_active()


@pytest.mark.parametrize("shapes", [((0, 40), (24, 40)), ((5, 0), (24, 0)), ((3, 0, 40), (24, 40))], ids=str)
def test_zero_size_products_fall_back(shapes):
    x_shape, w_shape = shapes
    x, w = torch.randn(x_shape), torch.randn(w_shape)

    class Product(torch.nn.Module):
        def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.linear(x, w)

    lowered = lower(Product(), (x, w))
    before = gemv_calls()
    got = lowered.method().execute([x, w])
    assert gemv_calls() == before
    assert_close(got, torch.nn.functional.linear(x, w), RTOL, ATOL)


@pytest.mark.parametrize("isa", ("best", "avx2"))
def test_one_row_streams_agree(isa, tmp_path):
    """One row of x read 1, 2 or 4 weight rows at a time, each its own stream (MLX_DELEGATE_GEMV_STREAMS; 4
    on Intel, 1 elsewhere), fp32 and bf16, N 389 (split across the cores, steps of 4 leave tails): every
    output sums in the same order whatever the streams, so they are bitwise equal, and they match eager."""
    torch.manual_seed(7)
    programs, modules = {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        module = torch.nn.Linear(200, 389, bias=False).eval().to(dtype)
        x = torch.randn(1, 200, dtype=dtype)
        edge = llm_export.lower(torch.export.export(module, (x,), strict=True))
        programs[str(dtype)] = (edge.to_executorch().buffer, [x])
        modules[str(dtype)] = (module, x)
    env = {} if isa == "best" else {"MLX_DELEGATE_CPU_KERNELS": "avx2"}
    runs = {s: run_in_subprocess(programs, {**env, "MLX_DELEGATE_GEMV_STREAMS": str(s)}, tmp_path) for s in (1, 2, 4)}
    for key, (module, x) in modules.items():
        outs = {s: runs[s]["outputs"][key][0] for s in runs}
        for s in (2, 4):
            assert all(torch.equal(a, b) for a, b in zip(outs[s], outs[1])), f"{key}: {s} streams differ from 1"
        with torch.no_grad():
            tol = (RTOL, ATOL) if key == str(torch.float32) else (2e-2, 2e-2)
            assert_close(outs[4], module(x), *tol)
    for r in runs.values():  # each product read by the GEMV
        assert r["counts"].get("gemv_f32", 0) == r["counts"].get("gemm_lowp_gemv", 0) == on_cpu_device(), r["counts"]
