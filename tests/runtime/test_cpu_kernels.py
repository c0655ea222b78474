"""The CPU quantized GEMV kernel (cpp/kernels/qgemv_cpu.cpp): decode-sized
quantized linears (1 and 4 rows) in int4/int8, groups of 32/64/128, fp32 and
bf16 activations match eager torch of the same quantized model and MLX's own
quantized_matmul (MLX_DELEGATE_CPU_KERNELS=0, in a subprocess), and the kernel
really runs (its call counter)."""

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from executorch.runtime import Runtime
from torch.export import Dim
from torchao.quantization import MappingType, quantize_

from mlx_delegate import _runtime
from mlx_delegate import quantization as Q
from mlx_delegate.llm import export as llm_export
from mlx_delegate.patterns import MLXPatternPass
from mlx_delegate.testing import TOLERANCE, assert_close, delegate_summary

K = 256
# (mode, group size, torchao mapping); asymmetric int4 gives non-zero biases.
LAYOUTS = [("int4", 32, "symmetric"), ("int4", 64, "symmetric"), ("int4", 128, "asymmetric"),
           ("int8", 32, "symmetric"), ("int8", 64, "symmetric"), ("int8", 128, "asymmetric")]
ROWS = (1, 4)  # decode-sized products: the kernel takes up to 8 rows
# Outputs of 48 (one thread) and 384 (split across the cores) per layout.
WIDTHS = (48, 384)


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

# Runs a saved program on saved inputs with the kernel off; saves the outputs and the kernel's call count.
KERNELS_OFF = """
import sys, torch
from executorch.runtime import Runtime
from mlx_delegate import _runtime
program, inputs, out = sys.argv[1:]
method = Runtime.get().load_program(open(program, "rb").read()).load_method("forward")
outputs = [method.execute([x]) for x in torch.load(inputs)]
torch.save({"outputs": outputs, "calls": _runtime.cpu_kernel_calls()}, out)
"""


def run_kernels_off(buffer: bytes, inputs: list[torch.Tensor], tmp_path: Path) -> dict:
    program, saved, out = tmp_path / "p.pte", tmp_path / "inputs.pt", tmp_path / "out.pt"
    program.write_bytes(buffer)
    torch.save(inputs, saved)
    env = {**__import__("os").environ, "MLX_DELEGATE_CPU_KERNELS": "0"}
    subprocess.run([sys.executable, "-c", KERNELS_OFF, str(program), str(saved), str(out)], env=env, check=True,
                   capture_output=True)
    return torch.load(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_quantized_gemv_matches_eager_and_mlx(dtype, tmp_path):
    torch.manual_seed(0)
    module = Layouts(dtype)
    example = torch.randn(1, 2, K, dtype=dtype)
    ep = torch.export.export(module, (example,), dynamic_shapes=({1: Dim("L", min=1, max=16)},), strict=True)
    pattern_pass = MLXPatternPass()
    edge = llm_export.lower(ep, pattern_pass=pattern_pass)
    assert pattern_pass.counts["quantized"] == LINEARS and delegate_summary(edge) == (1, [])
    buffer = edge.to_executorch().buffer
    method = Runtime.get().load_program(buffer).load_method("forward")
    inputs = [torch.randn(1, rows, K, dtype=dtype) for rows in ROWS]

    ours = []
    for x in inputs:
        before = _runtime.cpu_kernel_calls()
        for _ in range(2):  # the second call runs the compiled graph
            got = method.execute([x])
        assert _runtime.cpu_kernel_calls() - before == 2 * LINEARS
        with torch.no_grad():
            assert_close(got, module(x), *TOLERANCE[dtype])
        ours.append(got)

    off = run_kernels_off(buffer, inputs, tmp_path)
    assert off["calls"] == 0
    for got, mlx in zip(ours, off["outputs"]):
        assert_close(got, mlx, *TOLERANCE[dtype])  # both compute in fp32; bf16 rounds the outputs


def test_many_rows_do_not_use_the_kernel():
    """From 8 rows on the CPU dequantizes and runs the BLAS matmul instead."""
    module = Layouts(torch.float32)
    ep = torch.export.export(module, (torch.randn(1, 2, K),), dynamic_shapes=({1: Dim("L", min=1, max=16)},))
    buffer = llm_export.lower(ep, pattern_pass=MLXPatternPass()).to_executorch().buffer  # the program reads it
    method = Runtime.get().load_program(buffer).load_method("forward")
    x = torch.randn(1, 9, K)
    before = _runtime.cpu_kernel_calls()
    got = method.execute([x])
    assert _runtime.cpu_kernel_calls() == before
    with torch.no_grad():
        assert_close(got, module(x), *TOLERANCE[torch.float32])
