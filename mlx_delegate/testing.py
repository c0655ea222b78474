"""Parity harness: export a module, lower it through `MLXPartitioner`, run it with
the stock ExecuTorch runtime and compare with eager PyTorch.

A test config is one `OpCase`; `cases(...)` expands a declarative row over
dtypes. Every config asserts the number of delegate segments and that no op
was left outside the delegate (unless the row says which may be).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

import torch
from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower
from executorch.runtime import Runtime

from .partitioner import MLXPartitioner
from .registry import base_name

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
# (rtol, atol) per dtype the module computes in.
TOLERANCE = {
    torch.float32: (1e-4, 1e-5), torch.float16: (1e-2, 1e-2), torch.bfloat16: (5e-2, 5e-2),
}
# Weight-only int4/int8 products: on the CPU the quantized GEMV rounds the
# activations to int16 per block of <= 128 (cpp/kernels/qgemv_cpu.cpp; at most
# 2^-16 of the block's largest |x|), which shows as absolute errors of ~5e-5 on
# float32 outputs of order 1: still far below the weights' own rounding.
QUANTIZED_TOLERANCE = {**TOLERANCE, torch.float32: (1e-4, 2e-4)}


class Lambda(torch.nn.Module):
    """Wraps a function (of tensors) as a module for export."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


@dataclass
class OpCase:
    name: str
    module: Callable[[], torch.nn.Module]
    inputs: Callable[[], tuple]
    dtype: torch.dtype | None = None
    dynamic_shapes: Any = None
    # More input tuples to run the same program with (dynamic shapes).
    more_inputs: Callable[[], list[tuple]] | None = None
    segments: int = 1
    allowed_fallback: frozenset[str] = frozenset()
    rtol: float | None = None
    atol: float | None = None
    exact: bool = False

    def __str__(self) -> str:
        return self.name


def _cast(x: Any, dtype: torch.dtype | None) -> Any:
    if dtype is not None and isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.to(dtype)
    return x


def cases(name: str, fn: Callable[..., Any] | Callable[[], torch.nn.Module],
          inputs: Callable[[], tuple] | tuple, dtypes: Iterable[torch.dtype | None] = (torch.float32,),
          *, is_module: bool = False, **kw: Any) -> list[OpCase]:
    """Expand one declarative row into a config per dtype.

    `fn` is a function of the inputs (or, with is_module=True, a module factory);
    floating-point inputs (and module parameters) are cast to each dtype.
    """
    make_inputs = inputs if callable(inputs) else (lambda: inputs)
    out = []
    for dt in dtypes:
        def module(dt: Any = dt) -> torch.nn.Module:
            m = fn() if is_module else Lambda(fn)
            return m.to(dt) if dt is not None and is_module else m

        def gen(dt: Any = dt) -> tuple:
            torch.manual_seed(0)
            return tuple(_cast(x, dt) for x in make_inputs())

        suffix = "" if dt is None else "-" + str(dt).removeprefix("torch.")
        out.append(OpCase(f"{name}{suffix}", module, gen, dtype=dt, **kw))
    return out


@dataclass
class Lowered:
    edge: Any
    buffer: bytes
    program: Any = field(repr=False)  # keep referenced while methods run
    summary: tuple[int, list[str]] = (0, [])  # (delegate calls, ops left outside), before to_executorch

    def method(self, name: str = "forward") -> "BoundMethod":
        return BoundMethod(self.program, self.program.load_method(name))


@dataclass
class BoundMethod:
    """A loaded method that keeps its Program alive (the runtime frees the program otherwise)."""

    program: Any = field(repr=False)
    method: Any = field(repr=False)

    def execute(self, inputs: Sequence[Any]) -> list[Any]:
        return self.method.execute(list(inputs))


def lower(module: torch.nn.Module, inputs: tuple, dynamic_shapes: Any = None,
          partitioner: MLXPartitioner | None = None, keep_ops: Sequence[Any] = ()) -> Lowered:
    """Export, lower through MLXPartitioner, serialize and load with the stock runtime.

    `keep_ops`: non-core ATen ops to keep whole in the Edge graph instead of decomposing them.
    """
    ep = torch.export.export(module, inputs, dynamic_shapes=dynamic_shapes, strict=False)
    config = EdgeCompileConfig(_core_aten_ops_exception_list=list(keep_ops)) if keep_ops else None
    edge = to_edge_transform_and_lower(ep, partitioner=[partitioner or MLXPartitioner()], compile_config=config)
    summary = delegate_summary(edge)
    buffer = edge.to_executorch().buffer
    return Lowered(edge, buffer, Runtime.get().load_program(buffer), summary)


def delegate_summary(edge: Any) -> tuple[int, list[str]]:
    """(number of delegate calls, names of ops left outside the delegate)."""
    graph = edge.exported_program().graph
    segments, leftover = 0, []
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is torch.ops.higher_order.executorch_call_delegate:
            segments += 1
        elif n.target is not operator.getitem:
            leftover.append(base_name(n.target))
    return segments, leftover


def _flatten(x: Any) -> list[Any]:
    if isinstance(x, (list, tuple)):
        return [y for e in x for y in _flatten(e)]
    return [x]


def assert_close(actual: Sequence[Any], expected: Any, rtol: float, atol: float, exact: bool = False) -> None:
    exp = _flatten(expected)
    assert len(actual) == len(exp), f"{len(actual)} outputs, expected {len(exp)}"
    for i, (a, e) in enumerate(zip(actual, exp)):
        if not isinstance(e, torch.Tensor):
            assert a == e, f"output {i}: {a} != {e}"
            continue
        assert a.shape == e.shape, f"output {i}: shape {tuple(a.shape)} != {tuple(e.shape)}"
        assert a.dtype == e.dtype, f"output {i}: dtype {a.dtype} != {e.dtype}"
        if exact or not e.is_floating_point():
            torch.testing.assert_close(a, e, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"output {i}: {m}")
        else:
            torch.testing.assert_close(a, e, rtol=rtol, atol=atol, equal_nan=True,
                                       msg=lambda m: f"output {i}: {m}")


def lower_and_compare(case: OpCase, keep_ops: Sequence[Any] = ()) -> Lowered:
    """Run one config end to end; raises AssertionError on any mismatch."""
    module = case.module().eval()
    inputs = case.inputs()
    lowered = lower(module, inputs, case.dynamic_shapes, keep_ops=keep_ops)
    segments, leftover = lowered.summary
    unexpected = [op for op in leftover if op not in case.allowed_fallback]
    assert not unexpected, f"ops left outside the delegate: {unexpected}"
    assert segments == case.segments, f"{segments} delegate segments, expected {case.segments}"
    method = lowered.method()
    rtol, atol = TOLERANCE.get(case.dtype or torch.float32, TOLERANCE[torch.float32])
    rtol, atol = case.rtol if case.rtol is not None else rtol, case.atol if case.atol is not None else atol
    runs = [inputs] + (case.more_inputs() if case.more_inputs else [])
    for run_inputs in runs:
        with torch.no_grad():
            expected = module(*run_inputs)
        actual = method.execute([x for x in run_inputs])
        assert_close(actual, expected, rtol, atol, case.exact)
    return lowered


def with_inputs(case: OpCase, **changes: Any) -> OpCase:
    return replace(case, **changes)


def hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    """`n` greedy tokens from a `transformers` causal LM (no early stop), the reference for generation."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def hf_next_logits(hf: Any, tokens: list[int]) -> torch.Tensor:
    """A `transformers` causal LM's logits for the token after `tokens`."""
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1]


def assert_steps_match_hf(gen: Any, hf: Any, prompt: list[int], steps: int, tol: float = 1e-4) -> None:
    """Prefill `prompt`, then decode `steps` greedy tokens, checking each step's logits against HF."""
    tokens = list(prompt)
    logits = gen.step(tokens)
    for _ in range(steps):
        torch.testing.assert_close(logits, hf_next_logits(hf, tokens), rtol=tol, atol=tol)
        tokens.append(int(logits.argmax()))
        logits = gen.step(tokens[-1:])


# Runs saved programs on saved inputs in a fresh process (switches such as
# MLX_DELEGATE_CPU_KERNELS are read once per process) and saves what came out.
_RUN_SAVED = """
import sys, torch
from executorch.runtime import Runtime
from mlx_delegate import _blas, _runtime
saved, out = sys.argv[1:]
outputs = [[Runtime.get().load_program(buffer).load_method("forward").execute([x]) for x in inputs]
           for buffer, inputs in torch.load(saved)]
torch.save({"outputs": outputs, "counts": _runtime.cpu_kernel_call_counts(),
            "qgemv_calls": _runtime.cpu_kernel_calls(), "blas": _blas.lowp_gemm_ready()}, out)
"""


def run_in_subprocess(programs: dict[Any, tuple[bytes, Sequence[torch.Tensor]]], env: dict[str, str],
                      tmp_dir: Any) -> dict[str, Any]:
    """Runs each program (.pte bytes) on each of its single inputs in a new process with `env` added.

    Returns {"outputs": {key: [outputs per input]}, "counts": cpu_kernel_call_counts(),
    "qgemv_calls": cpu_kernel_calls(), "blas": whether the low-precision BLAS route was ready}.
    """
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    fd, name = tempfile.mkstemp(suffix=".pt", dir=tmp_dir)
    os.close(fd)
    saved, out = Path(name), Path(name).with_suffix(".out.pt")
    torch.save([programs[k] for k in programs], saved)
    done = subprocess.run([sys.executable, "-c", _RUN_SAVED, str(saved), str(out)], env={**os.environ, **env},
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    result = torch.load(out)
    return {**result, "outputs": dict(zip(programs, result["outputs"]))}


def delegate_payload(edge: Any) -> tuple[bytes, dict[str, bytes]]:
    """The IR payload and named data (name -> bytes) of the program's only mlx_delegate segment,
    as `_runtime.run_payload` takes them; constants spilled to files while lowering are read back."""
    gm = edge.exported_program().graph_module
    (mod,) = [m for _, m in gm.named_children() if hasattr(m, "processed_bytes")]
    store = mod.named_data_store_output
    if store is None:
        return mod.processed_bytes, {}
    data = (store.buffers[e.buffer_index] for e in store.pte_data.values())
    return mod.processed_bytes, {k: b if isinstance(b, bytes) else b.to_bytes() for k, b in zip(store.pte_data, data)}
