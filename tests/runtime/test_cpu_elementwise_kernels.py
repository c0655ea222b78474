"""The CPU element-wise and row kernels (cpp/kernels/unary_cpu.cpp, rows_cpu.cpp):
exp, sigmoid, SiLU, GELU (erf and tanh), erf, softmax, log-softmax, RMSNorm,
LayerNorm, sum and mean over the last axis in float32, bfloat16 and float16 over odd row lengths (1, 7, 33, 4097;
the longest is split across the cores) match eager torch, compiled graphs on and
off. MLX's own ops (MLX_DELEGATE_CPU_KERNELS=0), the portable libm code
(=portable) and the AVX2 code (=avx2: the vector code of CPUs without AVX-512,
where this one has it) run in subprocesses on the same programs and inputs and must agree;
the per-kernel call counters prove which code ran."""

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

from mlx_delegate import _runtime
from mlx_delegate.testing import (TOLERANCE, Lambda, Lowered, assert_close, cpu_kernels_active, lower, on_cpu_device,
                                  run_in_subprocess)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
COLUMNS = (1, 7, 33, 4097)
ROWS = (3, 5)  # 5 x 4097 elements is past the threshold where a second thread joins


class Ops(torch.nn.Module):
    """Every op with a kernel, plus two on transposed (non-contiguous) views."""

    def __init__(self, columns: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 2.0, columns, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.linspace(-1.0, 1.0, columns, dtype=dtype))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        n = x.shape[-1]
        return [
            torch.exp(x), torch.sigmoid(x), F.silu(x), F.gelu(x), F.gelu(x, approximate="tanh"), torch.erf(x),
            torch.softmax(x, -1), torch.log_softmax(x, -1),
            F.rms_norm(x, (n,), self.weight, 1e-5), F.rms_norm(x, (n,), None, 1e-6),
            F.layer_norm(x, (n,), self.weight, self.bias, 1e-5), x.sum(-1), x.mean(-1, keepdim=True),
            torch.softmax(x.t(), -1), F.silu(x.t()),
        ]


# Kernel calls one forward makes (the transposed views included).
CALLS = {"exp": 1, "sigmoid": 1, "silu": 2, "gelu_erf": 1, "gelu_tanh": 1, "erf": 1, "softmax": 2,
         "log_softmax": 1, "rms_norm": 2, "layer_norm": 1, "sum": 1, "mean": 1}


@dataclass
class Case:
    """One dtype and row length: the eager module, its lowered program and inputs."""

    module: Ops
    lowered: Lowered  # holds the loaded program
    inputs: list[torch.Tensor]


def make_case(dtype: torch.dtype, columns: int) -> Case:
    torch.manual_seed(columns)
    module = Ops(columns, dtype).eval()
    inputs = [(3 * torch.randn(rows, columns)).to(dtype) for rows in ROWS]
    lowered = lower(module, (inputs[0],), dynamic_shapes=({0: Dim("rows", min=2, max=64)},))
    assert lowered.summary == (1, []), lowered.summary
    return Case(module, lowered, inputs)


@pytest.fixture(scope="module")
def cases() -> dict[tuple[torch.dtype, int], Case]:
    return {(dtype, columns): make_case(dtype, columns) for dtype in DTYPES for columns in COLUMNS}


@pytest.fixture(params=[True, False], ids=["compiled", "nodes"])
def compile_mode(request) -> Iterator[bool]:
    was = _runtime.compile_enabled()
    _runtime.set_compile(request.param)
    yield request.param
    _runtime.set_compile(was)


def counts_since(before: dict[str, int]) -> dict[str, int]:
    now = _runtime.cpu_kernel_call_counts()
    return {k: now.get(k, 0) - before.get(k, 0) for k in CALLS}


def eager(module: Ops, x: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        return module(x)


@pytest.mark.parametrize("columns", COLUMNS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernels_match_eager(dtype, columns, cases, compile_mode):
    case = cases[dtype, columns]
    method = case.lowered.method()
    before = _runtime.cpu_kernel_call_counts()
    for x in case.inputs:
        for _ in range(2):  # with compile on, the second call runs the compiled graph
            got = method.execute([x])
            assert_close(got, eager(case.module, x), *TOLERANCE[dtype])
    calls = 2 * len(case.inputs) * cpu_kernels_active()  # none on a GPU default device
    assert counts_since(before) == {k: v * calls for k, v in CALLS.items()}


@pytest.fixture(scope="module")
def other_paths(cases, tmp_path_factory) -> dict[str, dict]:
    """MLX's own ops (kernels off), the portable code and the AVX2 code, each in its own process."""
    tmp_path = tmp_path_factory.mktemp("cpu_elementwise")
    programs = {key: (c.lowered.buffer, c.inputs) for key, c in cases.items()}
    return {kernels: run_in_subprocess(programs, {"MLX_DELEGATE_CPU_KERNELS": kernels}, tmp_path)
            for kernels in ("0", "portable", "avx2")}


def test_switch_selects_the_code(cases, other_paths):
    runs = len(cases) * len(ROWS)
    assert other_paths["0"]["counts"] == {}
    # The subprocess runs on this machine's default device: no CPU kernels on a GPU.
    want = {k: v * runs for k, v in CALLS.items()} if on_cpu_device() else {}
    assert other_paths["portable"]["counts"] == want
    assert other_paths["avx2"]["counts"] == want


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernels_match_mlx_and_portable_code(dtype, cases, other_paths):
    rtol, atol = TOLERANCE[dtype]
    for (case_dtype, columns), case in cases.items():
        if case_dtype != dtype:
            continue
        method = case.lowered.method()
        for i, x in enumerate(case.inputs):
            got = method.execute([x])
            assert_close(got, other_paths["0"]["outputs"][dtype, columns][i], rtol, atol)
            assert_close(got, other_paths["portable"]["outputs"][dtype, columns][i], rtol, atol)
            assert_close(got, other_paths["avx2"]["outputs"][dtype, columns][i], rtol, atol)


def test_empty_input_falls_back():
    """Zero rows: MLX's ops run (the kernels take non-empty arrays only)."""
    x = torch.randn(0, 7)
    fn = Lambda(lambda t: [torch.softmax(t, -1), F.silu(t), F.rms_norm(t, (7,), None, 1e-5), t.sum(-1)])
    method = lower(fn, (x,)).method()
    before = _runtime.cpu_kernel_call_counts()
    got = method.execute([x])
    assert counts_since(before) == dict.fromkeys(CALLS, 0)
    assert [tuple(t.shape) for t in got] == [(0, 7)] * 3 + [(0,)]


def test_special_values_follow_torch():
    """inf, -inf and NaN through exp / sigmoid / GELU (tanh) / softmax / erf, and a fully masked softmax row.
    (Eager GELU-erf gives NaN at +inf where the formula gives inf: not compared.)"""
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[0.0, 1.0, -inf, inf, 89.0, -89.0, -100.0, 1e-3, -5.0, nan, 3.0],
                      [-inf] * 11, [0.5] * 10 + [-inf]])
    fn = Lambda(lambda t: [torch.exp(t), torch.sigmoid(t), F.silu(t), F.gelu(t, approximate="tanh"),
                           torch.softmax(t, -1), torch.erf(t)])
    method = lower(fn, (x,)).method()
    got = method.execute([x])
    assert_close(got, fn(x), *TOLERANCE[torch.float32])


@pytest.mark.parametrize("spin_yield", [True, False])
def test_pool_wait_modes_match_eager(spin_yield):
    """The kernel pool's helpers yield the core while they wait (default) or pause on it
    (`set_pool_spin_yield`): work split across the cores gives eager's results in both, back to
    back (helpers still waiting from one call pick up the next)."""
    x = torch.randn(16, 4097)
    fn = Lambda(lambda t: [F.silu(t), torch.softmax(t, -1), F.rms_norm(t, (4097,), None, 1e-5)])
    method = lower(fn, (x,)).method()
    was = _runtime.pool_spin_yield()
    _runtime.set_pool_spin_yield(spin_yield)
    try:
        assert _runtime.pool_spin_yield() is spin_yield
        before = _runtime.cpu_kernel_call_counts()
        for _ in range(5):
            assert_close(method.execute([x]), fn(x), *TOLERANCE[torch.float32])
    finally:
        _runtime.set_pool_spin_yield(was)
    if cpu_kernels_active():
        calls = counts_since(before)
        assert calls["silu"] == calls["softmax"] == calls["rms_norm"] == 5, calls
