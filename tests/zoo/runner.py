"""One shared runner for every zoo model: export the way the model's users do,
lower through `MLXPartitioner`, load with the stock `executorch.runtime` and
compare each run size with eager PyTorch.

A model's `ZooModel` row says how to build it, how to export it and what is
reviewed as a fallback; `check` asserts everything the row promises and
returns the figures `docs/models.md` reports.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from executorch.exir import to_edge_transform_and_lower
from executorch.runtime import Runtime
from torch.utils._pytree import tree_leaves

from mlx_delegate import MLXPartitioner, _runtime
from mlx_delegate.testing import delegate_summary

# Whole models stack dozens of layers: fp32 gets fp32-sized room, scaled to the
# output's magnitude; bf16 is compared with eager bf16 and with the fp32 result.
FP32_TOL = dict(rtol=1e-4, atol=1e-4)
BF16_TOL = dict(rtol=5e-2, atol=5e-2)
FP32_FOR_LOWP = dict(rtol=1e-1, atol=1e-1)


@dataclass
class Case:
    """A built model: the example it is exported with and the inputs it is run on."""

    module: torch.nn.Module
    example: dict[str, Any]
    runs: list[dict[str, Any]]
    dynamic_shapes: dict[str, Any] | None = None
    # What eager computes for a run, when not `module(**run)` (e.g. a decode step checked
    # against the whole sequence run without a cache).
    reference: Callable[[dict[str, Any]], Any] | None = None

    def expected(self, run: dict[str, Any]) -> list[torch.Tensor]:
        with torch.no_grad():
            return _flat(self.reference(run) if self.reference else self.module(**run))


@dataclass(frozen=True)
class ZooModel:
    name: str
    family: str
    source: str
    build: Callable[[torch.dtype], Case]  # the module and inputs in that dtype, same seed -> same weights
    strict: bool = False  # export strict where the model's own export path documents it
    dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    segments: int = 1
    fallback: dict[str, str] = field(default_factory=dict)  # op -> why it stays on ExecuTorch
    tol: dict[str, float] = field(default_factory=dict)  # fp32 overrides, with the reason in the row
    gap: str = ""  # why the standard export does not lower yet, and the issue tracking it

    def __str__(self) -> str:
        return self.name


@dataclass
class Result:
    segments: int
    leftover: list[str]
    max_error: float
    compiled: bool  # the repeated run went through an mx::compile'd graph
    eager_ms: float = 0.0
    delegate_ms: float = 0.0


def _flat(out: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]


def lower(model: ZooModel, case: Case) -> tuple[Any, Any, tuple[int, list[str]]]:
    """(program, edge manager, delegate summary): keep the program referenced while its methods run."""
    with torch.no_grad():
        ep = torch.export.export(case.module, (), kwargs=case.example, dynamic_shapes=case.dynamic_shapes,
                                 strict=model.strict)
    edge = to_edge_transform_and_lower(ep, partitioner=[MLXPartitioner()])
    summary = delegate_summary(edge)
    return Runtime.get().load_program(edge.to_executorch().buffer), edge, summary


def _time(fn: Callable[[], Any], repeat: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def check(model: ZooModel, dtype: torch.dtype = torch.float32, timed: bool = False) -> Result:
    """Lower `model` in `dtype`, assert its segments and fallbacks, compare every run with eager
    (and, below fp32, with the fp32 model too)."""
    torch.manual_seed(0)
    case = model.build(dtype)
    exact = None
    if dtype != torch.float32:
        torch.manual_seed(0)
        exact = model.build(torch.float32)
    program, _, (segments, leftover) = lower(model, case)
    unexpected = sorted(set(leftover) - set(model.fallback))
    assert not unexpected, f"ops left outside the delegate: {unexpected}"
    assert segments == model.segments, f"{segments} delegate segments, expected {model.segments}"
    method = program.load_method("forward")
    tol = {**FP32_TOL, **model.tol} if dtype == torch.float32 else BF16_TOL
    worst = 0.0
    for i, run in enumerate(case.runs):
        actual = method.execute(_inputs(run))
        worst = max(worst, _compare(actual, case.expected(run), tol, f"run {i}"))
        if exact is not None:
            # A low-precision program must not drift from the true result.
            _compare(actual, exact.expected(exact.runs[i]), FP32_FOR_LOWP, f"run {i} against fp32")
    last = case.runs[-1]
    expected = case.expected(last)
    # The last size again: its second sighting runs compiled, then once with MLX's own
    # primitives in place of the CPU kernels.
    before = _runtime.compile_stats()["compiled_calls"]
    for repeat in range(2):
        worst = max(worst, _compare(method.execute(_inputs(last)), expected, tol, f"repeat {repeat}"))
    compiled = _runtime.compile_stats()["compiled_calls"] > before
    was = _runtime.cpu_kernels_enabled()
    _runtime.set_cpu_kernels(False)
    try:
        worst = max(worst, _compare(method.execute(_inputs(last)), expected, tol, "CPU kernels off"))
    finally:
        _runtime.set_cpu_kernels(was)
    timings = (0.0, 0.0)
    if timed:
        timings = (_time(lambda: case.expected(last)), _time(lambda: method.execute(_inputs(last))))
    return Result(segments, leftover, worst, compiled, *timings)


def _inputs(run: dict[str, Any]) -> list[torch.Tensor]:
    return [x for x in tree_leaves(list(run.values())) if isinstance(x, torch.Tensor)]


def _compare(actual: list[torch.Tensor], expected: list[torch.Tensor], tol: dict[str, float], what: str) -> float:
    """Asserts outputs match (absolute tolerance scaled to each output's magnitude); the worst
    scaled error."""
    assert len(actual) == len(expected), f"{what}: {len(actual)} outputs, expected {len(expected)}"
    worst = 0.0
    for j, (a, e) in enumerate(zip(actual, expected)):
        assert a.shape == e.shape, f"{what} output {j}: shape {tuple(a.shape)} != {tuple(e.shape)}"
        if not e.is_floating_point():
            assert a.dtype == e.dtype, f"{what} output {j}: dtype {a.dtype} != {e.dtype}"
            torch.testing.assert_close(a, e, rtol=0, atol=0, msg=lambda m: f"{what} output {j}: {m}")
            continue
        # A vanishing or constant reference would pass whatever the delegate computed.
        peak = float(e.float().abs().max()) if e.numel() else 1.0
        assert peak > 1e-3 and (e.numel() < 2 or float(e.float().std()) > 1e-4), \
            f"{what} output {j}: eager output is degenerate (max {peak:.1e}): the model's config needs fixing"
        scale = max(1.0, peak)
        torch.testing.assert_close(a.float(), e.float(), rtol=tol["rtol"], atol=tol["atol"] * scale,
                                   msg=lambda m: f"{what} output {j}: {m}")
        worst = max(worst, float((a.float() - e.float()).abs().max()) / scale)
    return worst
