"""The CPU quantized GEMV kernel (cpp/kernels/qgemv_cpu.cpp): decode-sized
quantized linears (1 and 4 rows) in int4/int8, groups of 32/64/128, fp32 and
bf16 activations match eager torch of the same quantized model, MLX's own
quantized_matmul (MLX_DELEGATE_CPU_KERNELS=0) and the portable non-AVX2 code
(=portable), each in a subprocess; the call counter proves which one ran."""

from dataclasses import dataclass, replace

import pytest
import torch
from executorch.runtime import Runtime
from torch.export import Dim
from torchao.quantization import MappingType, quantize_

from mlx_delegate import MLXPartitioner, _runtime
from mlx_delegate import quantization as Q
from mlx_delegate.pipelines.llm import export as llm_export
from mlx_delegate.patterns import MLXPatternPass
from mlx_delegate.testing import (QUANTIZED_TOLERANCE, assert_close, cpu_kernels_active, delegate_summary, on_cpu_device,
                                  run_in_subprocess)

K = 256
# (mode, group size, torchao mapping); asymmetric int4 gives non-zero biases.
LAYOUTS = [("int4", 32, "symmetric"), ("int4", 64, "symmetric"), ("int4", 128, "asymmetric"),
           ("int8", 32, "symmetric"), ("int8", 64, "symmetric"), ("int8", 128, "asymmetric")]
ROWS = (1, 4)  # decode-sized products: the kernel takes up to 8 rows
# Outputs of 48 (one thread), 384 (split across the cores) and 51 (not a whole
# number of the kernel's 4-output blocks) per layout.
WIDTHS = (48, 384, 51)


class Layouts(torch.nn.Module):
    """Linears of every width and layout, each quantized as its row says."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.ModuleList(torch.nn.Linear(K, n, bias=n == WIDTHS[0]) for n in WIDTHS) for _ in LAYOUTS)
        self.to(dtype).eval()
        for block, (mode, group_size, mapping) in zip(self.blocks, LAYOUTS):
            config = replace(Q.torchao_config(mode, group_size), mapping_type=MappingType[mapping.upper()])
            quantize_(block, config, filter_fn=lambda m, _: isinstance(m, torch.nn.Linear))

    def forward(self, x):
        return [linear(x) for block in self.blocks for linear in block]


LINEARS = len(LAYOUTS) * len(WIDTHS)

DTYPES = (torch.float32, torch.bfloat16)


@dataclass
class Case:
    """One dtype's quantized module, its lowered program and the decode-sized inputs."""

    module: Layouts
    buffer: bytes  # the loaded program reads from it: keep it alive
    inputs: list[torch.Tensor]


def make_case(dtype: torch.dtype) -> Case:
    torch.manual_seed(0)
    module = Layouts(dtype)
    example = torch.randn(1, 2, K, dtype=dtype)
    ep = torch.export.export(module, (example,), dynamic_shapes=({1: Dim("L", min=1, max=16)},), strict=True)
    pattern_pass = MLXPatternPass()
    # Linears kept apart (no fuse_linears): each width is its own kernel call.
    edge = llm_export.lower(ep, pattern_pass=pattern_pass, partitioner=MLXPartitioner(disable={"fuse_linears"}))
    assert pattern_pass.counts["quantized"] == LINEARS and delegate_summary(edge) == (1, [])
    return Case(module, edge.to_executorch().buffer, [torch.randn(1, rows, K, dtype=dtype) for rows in ROWS])


@pytest.fixture(scope="module")
def cases() -> dict[torch.dtype, Case]:
    return {dtype: make_case(dtype) for dtype in DTYPES}


@pytest.fixture(scope="module")
def other_paths(cases, tmp_path_factory) -> dict[str, dict]:
    """The kernel off (MLX's quantized_matmul) and the portable loop, each in its own process."""
    tmp_path = tmp_path_factory.mktemp("cpu_kernels")
    programs = {dtype: (c.buffer, c.inputs) for dtype, c in cases.items()}
    return {kernels: run_in_subprocess(programs, {"MLX_DELEGATE_CPU_KERNELS": kernels}, tmp_path)
            for kernels in ("0", "portable")}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantized_gemv_matches_eager(dtype, cases):
    case = cases[dtype]
    method = Runtime.get().load_program(case.buffer).load_method("forward")
    for x in case.inputs:
        before = _runtime.cpu_kernel_calls()
        for _ in range(2):  # the second call runs the compiled graph
            got = method.execute([x])
        assert _runtime.cpu_kernel_calls() - before == 2 * LINEARS * cpu_kernels_active()
        with torch.no_grad():
            assert_close(got, case.module(x), *QUANTIZED_TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantized_gemv_matches_mlx_and_portable_loop(dtype, cases, other_paths):
    case = cases[dtype]
    method = Runtime.get().load_program(case.buffer).load_method("forward")
    off, portable = other_paths["0"], other_paths["portable"]
    runs = len(DTYPES) * len(ROWS)
    # The subprocesses run on this machine's default device: no CPU kernels on a GPU.
    assert off["qgemv_calls"] == 0 and portable["qgemv_calls"] == runs * LINEARS * on_cpu_device()
    for x, mlx, plain in zip(case.inputs, off["outputs"][dtype], portable["outputs"][dtype]):
        got = method.execute([x])
        assert_close(got, mlx, *QUANTIZED_TOLERANCE[dtype])  # bf16 rounds the outputs
        assert_close(got, plain, *QUANTIZED_TOLERANCE[dtype])


def test_many_rows_run_in_row_blocks(cases):
    """Several rows below kQgemmMinRows (12; from there the quantized GEMM takes them): with AVX2 the
    kernel takes them 8 rows at a time (9 and 11 rows: a partial second block); the portable loop leaves
    them to dequantize + the BLAS matmul."""
    case = cases[torch.float32]
    method = Runtime.get().load_program(case.buffer).load_method("forward")
    for rows in (9, 11):
        x = torch.randn(1, rows, K)
        before = _runtime.cpu_kernel_calls()
        got = method.execute([x])
        vector = _runtime.cpu_vector_kernels() and cpu_kernels_active()
        assert _runtime.cpu_kernel_calls() - before == (LINEARS if vector else 0)
        with torch.no_grad():
            assert_close(got, case.module(x), *QUANTIZED_TOLERANCE[torch.float32])
