"""Parity harness: export a module, lower it through `MLXPartitioner`, run it with
the stock ExecuTorch runtime and compare with eager PyTorch.

A test config is one `OpCase`; `cases(...)` expands a declarative row over
dtypes. Every config asserts the number of delegate segments and that no op
was left outside the delegate (unless the row says which may be), then runs the
one lowered program on every path the runtime has (see `lower_and_compare`):
node by node, compiled (traced and replayed), and node by node with the CPU
kernels off (what Metal and CUDA run).
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower
from executorch.runtime import Runtime

from .partitioner import MLXPartitioner
from .pipelines.lowering import delegate_summary

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
# Half-type configs are also compared with the same module run in float32 on
# upcast inputs and parameters (the true result), to these bounds: a
# low-precision path must not drift from it unnoticed.
FP32_REFERENCE_TOLERANCE = {torch.float16: (3e-2, 3e-2), torch.bfloat16: (1e-1, 1e-1)}
# Calls per input signature on the compiled path: the runtime compiles a
# signature on its second sighting (kCompileAfter in cpp/interpreter.cpp), so
# the first call runs node by node, the second traces, the third replays.
COMPILE_AFTER = 2
CALLS_TO_REPLAY = COMPILE_AFTER + 1
# Calls `lower_and_compare` makes per input tuple of a stateless config with the CPU kernels
# switched as they were: one node by node, then CALLS_TO_REPLAY on the compiled path (the
# kernels-off call adds none).
CALLS_WITH_KERNELS = 1 + CALLS_TO_REPLAY


def fp32_tolerance(k: int = 1) -> tuple[float, float]:
    """float32 (rtol, atol) for outputs that sum `k` products: the default, with atol grown
    like the rounding error of a length-k float32 sum (~sqrt(k) ulps of the terms)."""
    rtol, atol = TOLERANCE[torch.float32]
    return rtol, atol * max(1.0, (k / 16) ** 0.5)


def on_cpu_device() -> bool:
    """Whether MLX's default device (the one the delegate runs on) is the CPU; a new process
    on this machine starts with the same default (the GPU where MLX has one)."""
    import mlx.core as mx

    return mx.default_device() == mx.cpu


# The runtime paths model tests run on (see the `runtime_path` fixture in tests/conftest.py):
# the default (compiled graphs, CPU kernels on the CPU), node by node, and MLX's own primitives in
# place of the CPU kernels (the path Metal and CUDA take, compiled there by default too).
RUNTIME_PATHS = {"default": {}, "compile-off": {"compile": False}, "kernels-off": {"cpu_kernels": False}}


@contextmanager
def runtime_switches(compile: bool | None = None, cpu_kernels: bool | None = None) -> Iterator[None]:
    """The runtime's process-wide compile / CPU-kernel switches set for a block (None: left as
    they are), restored afterwards. Programs loaded inside pick them up on their first calls."""
    from . import _runtime

    was = _runtime.compile_enabled(), _runtime.cpu_kernels_enabled()
    try:
        if compile is not None:
            _runtime.set_compile(compile)
        if cpu_kernels is not None:
            _runtime.set_cpu_kernels(cpu_kernels)
        yield
    finally:
        _runtime.set_compile(was[0])
        _runtime.set_cpu_kernels(was[1])


@contextmanager
def runtime_switch(name: str, value: Any) -> Iterator[None]:
    """One of the runtime's process-wide switches (`_runtime.<name>()` reads it, `_runtime.set_<name>(v)`
    sets it) at `value` for a block, restored afterwards."""
    from . import _runtime

    was = getattr(_runtime, name)()
    getattr(_runtime, f"set_{name}")(value)
    try:
        yield
    finally:
        getattr(_runtime, f"set_{name}")(was)


def cpu_kernels_active() -> bool:
    """Whether the delegate's own CPU kernels serve ops now: switched on (not
    MLX_DELEGATE_CPU_KERNELS=0, not `set_cpu_kernels(False)`) and MLX's default device is the CPU
    (cpp/kernels/cpu_parallel.cpp, cpu_kernels_active). On a GPU default device MLX's own
    primitives run, so assertions about CPU-kernel call counts expect none there."""
    from . import _runtime

    return _runtime.cpu_kernels_enabled() and on_cpu_device()


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
    # The compiled replay equals the node-by-node result bit for bit; False where MLX's
    # compiled (fused) kernels round differently, and then they agree to rtol/atol.
    compiled_exact: bool = True
    # False where the runtime keeps the method node by node for good: an item() reads a
    # computed tensor (found at load, e.g. integer division's zero-divisor check), or MLX
    # refuses the trace (compile_stats()["rejected"]). The harness then asserts that no call
    # was compiled, so a stale flag fails too.
    compiles: bool = True
    # Half-type configs: (rtol, atol) against the float32 reference (None: the dtype's
    # FP32_REFERENCE_TOLERANCE); fp32_reference=False where the half types legitimately
    # differ from float32 (overflow, ties), with the reason in the row.
    fp32_reference: bool = True
    fp32_rtol: float | None = None
    fp32_atol: float | None = None

    def __str__(self) -> str:
        return self.name


def _cast(x: Any, dtype: torch.dtype | None) -> Any:
    if dtype is not None and isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.to(dtype)
    return x


def cases(name: str, fn: Callable[..., Any] | Callable[[], torch.nn.Module],
          inputs: Callable[[], tuple] | tuple, dtypes: Iterable[torch.dtype | None] = (torch.float32,),
          *, is_module: bool = False, tolerance: dict[torch.dtype, tuple[float, float]] | None = None,
          **kw: Any) -> list[OpCase]:
    """Expand one declarative row into a config per dtype.

    `fn` is a function of the inputs (or, with is_module=True, a module factory);
    floating-point inputs (and module parameters) are cast to each dtype.
    `tolerance`: (rtol, atol) per dtype, for the dtypes it names (others keep TOLERANCE's).
    `more_inputs` (a callable giving a list of input tuples) is cast like `inputs`.
    """
    make_inputs = inputs if callable(inputs) else (lambda: inputs)
    more_inputs = kw.pop("more_inputs", None)
    out = []
    for dt in dtypes:
        def module(dt: Any = dt) -> torch.nn.Module:
            m = fn() if is_module else Lambda(fn)
            return m.to(dt) if dt is not None and is_module else m

        def gen(dt: Any = dt) -> tuple:
            torch.manual_seed(0)
            return tuple(_cast(x, dt) for x in make_inputs())

        def more(dt: Any = dt) -> list[tuple]:
            torch.manual_seed(1)
            return [tuple(_cast(x, dt) for x in run) for run in more_inputs()]

        suffix = "" if dt is None else "-" + str(dt).removeprefix("torch.")
        tol = dict(zip(("rtol", "atol"), tolerance[dt])) if tolerance and dt in tolerance else {}
        out.append(OpCase(f"{name}{suffix}", module, gen, dtype=dt, more_inputs=more if more_inputs else None,
                          **tol, **kw))
    return out


@dataclass
class Lowered:
    edge: Any
    buffer: bytes
    program: Any = field(repr=False)  # keep referenced while methods run
    summary: tuple[int, list[str]] = (0, [])  # (delegate calls, ops left outside), before to_executorch
    stateful: bool = False  # the program mutates buffers (its outputs depend on earlier calls)

    def method(self, name: str = "forward") -> "BoundMethod":
        return BoundMethod(self.program, self.program.load_method(name))

    def fresh_method(self, name: str = "forward") -> "BoundMethod":
        """The method of a newly loaded copy of the program: its own buffer states and compiled
        graphs (a Program caches the methods it loads, so `method()` returns the same one)."""
        program = Runtime.get().load_program(self.buffer)
        return BoundMethod(program, program.load_method(name))


@dataclass
class BoundMethod:
    """A loaded method that keeps its Program alive (the runtime frees the program otherwise)."""

    program: Any = field(repr=False)
    method: Any = field(repr=False)

    def execute(self, inputs: Sequence[Any]) -> list[Any]:
        return self.method.execute(list(inputs))


def typed(name: str, fn: Callable[..., Any], make: Callable[[torch.dtype], tuple],
          dtypes: Iterable[torch.dtype] = (torch.int32, torch.int64, torch.bool)) -> list[OpCase]:
    """One config per non-float value dtype: `make(dtype)` builds the inputs."""
    return [c for dt in dtypes for c in cases(f"{name}-{str(dt).removeprefix('torch.')}", fn,
                                               lambda dt=dt: make(dt), (None,))]


def dyn(*specs: Any) -> tuple:
    """dynamic_shapes for a `Lambda` (its inputs arrive as one *args tuple)."""
    return (specs,)


def shared_lowering(tmp_path_factory: Any, name: str, make: Callable[[], Any]) -> Any:
    """`make()` once per pytest run: xdist workers wait for whichever started first and unpickle its result."""
    import fcntl
    import os
    import pickle

    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id is None:
        return make()
    root = tmp_path_factory.getbasetemp().parent  # shared by the workers of one run
    path = root / f"{name}-{run_id}.pkl"
    with open(root / f"{name}-{run_id}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            path.write_bytes(pickle.dumps(make()))
        return pickle.loads(path.read_bytes())


def lower(module: torch.nn.Module, inputs: tuple, dynamic_shapes: Any = None,
          partitioner: MLXPartitioner | None = None, keep_ops: Sequence[Any] = ()) -> Lowered:
    """Export, lower through MLXPartitioner, serialize and load with the stock runtime.

    `keep_ops`: non-core ATen ops to keep whole in the Edge graph instead of decomposing them.
    """
    ep = torch.export.export(module, inputs, dynamic_shapes=dynamic_shapes, strict=False)
    # Before lowering rewrites the signature; export's graph may still hold the in-place ops
    # themselves (mutated buffers are listed only once functionalized).
    stateful = bool(ep.graph_signature.buffers_to_mutate) or any(
        n.op == "call_function" and getattr(getattr(n.target, "_schema", None), "is_mutable", False)
        for n in ep.graph.nodes)
    config = EdgeCompileConfig(_core_aten_ops_exception_list=list(keep_ops)) if keep_ops else None
    edge = to_edge_transform_and_lower(ep, partitioner=[partitioner or MLXPartitioner()], compile_config=config)
    summary = delegate_summary(edge)
    buffer = edge.to_executorch().buffer
    return Lowered(edge, buffer, Runtime.get().load_program(buffer), summary, stateful)


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


def _fresh(xs: Sequence[Any]) -> list[Any]:
    """Tensors cloned (strides kept): a program or module that writes its inputs in place,
    or a runtime that reuses output memory, cannot change another call's values."""
    return [x.clone() if isinstance(x, torch.Tensor) else x for x in xs]


def _execute(method: BoundMethod, inputs: Sequence[Any]) -> list[Any]:
    return _fresh(method.execute(_fresh(inputs)))


def _upcast(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        return x.float()
    return x


def _stats_delta(before: dict[str, int]) -> dict[str, int]:
    from . import _runtime

    return {k: v - before[k] for k, v in _runtime.compile_stats().items()}


def lower_and_compare(case: OpCase, keep_ops: Sequence[Any] = (),
                      partitioner: MLXPartitioner | None = None) -> Lowered:
    """Run one config end to end; raises AssertionError on any mismatch.

    `keep_ops` and `partitioner` are passed to `lower`.

    The program is lowered once and run on every input tuple along three paths, each a
    freshly loaded copy of it (its own compiled graphs and buffer states):

    1. node by node (compile off), compared with eager;
    2. compiled: each input signature `CALLS_TO_REPLAY` times, so that it is traced and then
       replayed. Every call matches eager, the replay is counted by `compile_stats()` as a
       compiled call, and it equals the node-by-node result bit for bit (`compiled_exact`,
       else to the tolerance). A program the runtime keeps node by node must be declared
       (`compiles=False`) and is then asserted to have no compiled call;
    3. node by node with the CPU kernels off (the path Metal and CUDA take), against eager.

    Half-type configs also compare the node-by-node outputs with the module run in float32.
    The runtime's compile and CPU-kernel switches are restored afterwards.
    """
    from . import _runtime

    module = case.module().eval()
    inputs = case.inputs()
    lowered = lower(module, inputs, case.dynamic_shapes, partitioner=partitioner, keep_ops=keep_ops)
    segments, leftover = lowered.summary
    unexpected = [op for op in leftover if op not in case.allowed_fallback]
    assert not unexpected, f"ops left outside the delegate: {unexpected}"
    assert segments == case.segments, f"{segments} delegate segments, expected {case.segments}"
    dtype = case.dtype or torch.float32
    rtol, atol = TOLERANCE.get(dtype, TOLERANCE[torch.float32])
    rtol, atol = case.rtol if case.rtol is not None else rtol, case.atol if case.atol is not None else atol
    runs = [inputs] + (case.more_inputs() if case.more_inputs else [])
    stateful = lowered.stateful
    lowp = dtype in FP32_REFERENCE_TOLERANCE and case.fp32_reference
    pristine = copy.deepcopy(module) if stateful or lowp else None

    def eager(calls: Sequence[Sequence[Any]], m: torch.nn.Module | None = None) -> list[Any]:
        # A stateful module starts each sequence from its initial buffers.
        m = m if m is not None else (copy.deepcopy(pristine) if stateful else module)
        with torch.no_grad():
            return [m(*_fresh(c)) for c in calls]

    # Calls per path: a stateless program needs one call per input tuple on the node paths;
    # a stateful one runs the compiled path's sequence everywhere, so states line up.
    compiled_calls = [r for r in runs for _ in range(CALLS_TO_REPLAY)]
    node_calls = compiled_calls if stateful else runs
    node_expected = eager(node_calls)
    compiled_expected = (eager(compiled_calls) if stateful
                         else [e for e in node_expected for _ in range(CALLS_TO_REPLAY)])

    was_compile, was_kernels = _runtime.compile_enabled(), _runtime.cpu_kernels_enabled()
    try:
        # 1. Node by node.
        _runtime.set_compile(False)
        method = lowered.fresh_method()
        node_outputs = []
        for i, (call, expected) in enumerate(zip(node_calls, node_expected)):
            actual = _execute(method, call)
            _check(actual, expected, rtol, atol, case.exact, f"node by node, call {i}")
            node_outputs.append(actual)

        # 2. Compiled: traced on a signature's second call, replayed on the third.
        _runtime.set_compile(True)
        method = lowered.fresh_method()
        start = _runtime.compile_stats()
        for i, (call, expected) in enumerate(zip(compiled_calls, compiled_expected)):
            before = _runtime.compile_stats()
            actual = _execute(method, call)
            _check(actual, expected, rtol, atol, case.exact, f"compiled, call {i}")
            if i % CALLS_TO_REPLAY != CALLS_TO_REPLAY - 1:
                continue
            # The replay: every delegate segment serves it from its compiled graph.
            if case.compiles:
                delta = _stats_delta(before)
                assert delta["compiled_calls"] == segments, f"call {i} was not served compiled: {delta}"
            node = node_outputs[i] if stateful else node_outputs[i // CALLS_TO_REPLAY]
            _check(actual, node, rtol, atol, case.exact or case.compiled_exact, f"compiled vs node by node, call {i}")
        delta = _stats_delta(start)
        if segments == 0:
            pass
        elif case.compiles:
            assert delta["rejected"] == 0, f"MLX could not trace the program: {delta}"
            assert delta["traces"] >= 1, f"nothing was traced: {delta}"
        else:
            assert delta["compiled_calls"] == 0, \
                f"the row says the runtime cannot trace this program (compiles=False), but: {delta}"

        # 3. Node by node with the CPU kernels off (MLX's own primitives).
        _runtime.set_compile(False)
        _runtime.set_cpu_kernels(False)
        method = lowered.fresh_method()
        for i, (call, expected) in enumerate(zip(node_calls, node_expected)):
            _check(_execute(method, call), expected, rtol, atol, case.exact, f"CPU kernels off, call {i}")
    finally:
        _runtime.set_compile(was_compile)
        _runtime.set_cpu_kernels(was_kernels)

    if lowp:
        # The true result: the module in float32 on upcast inputs.
        reference = eager([[_upcast(x) for x in c] for c in node_calls], pristine.float())
        fp32_rtol, fp32_atol = FP32_REFERENCE_TOLERANCE[dtype]
        fp32_rtol = case.fp32_rtol if case.fp32_rtol is not None else fp32_rtol
        fp32_atol = case.fp32_atol if case.fp32_atol is not None else fp32_atol
        for i, (actual, ref) in enumerate(zip(node_outputs, reference)):
            pairs = [(a.float(), e.float()) for a, e in zip(actual, _flatten(ref))
                     if isinstance(e, torch.Tensor) and e.is_floating_point()]
            _check([a for a, _ in pairs], [e for _, e in pairs], fp32_rtol, fp32_atol, False,
                   f"against float32, call {i}")
    return lowered


def compare_node_and_compiled(buffer: bytes, calls: Sequence[Sequence[Any]], expected: Callable[..., Any],
                              rtol: float, atol: float, fp32_expected: Callable[..., Any] | None = None) -> None:
    """Runs a stateless program (.pte bytes) on each input tuple node by node, then compiled (each
    `CALLS_TO_REPLAY` times: traced, then replayed), each a fresh load; every output must match
    `expected(*inputs)`, and some call must be served by a compiled graph. For programs checked
    outside `lower_and_compare` (pattern passes, custom lowering). `fp32_expected`: for half-type
    programs, the computation in float32, called on upcast inputs; the node-by-node outputs must also
    be within FP32_REFERENCE_TOLERANCE of it."""
    from . import _runtime

    half = next((x.dtype for c in calls for x in c if isinstance(x, torch.Tensor)
                 and x.dtype in FP32_REFERENCE_TOLERANCE), None)
    if fp32_expected is not None and half is not None:
        for i, call in enumerate(calls):
            with runtime_switches(compile=False):
                program = Runtime.get().load_program(buffer)
                actual = _execute(BoundMethod(program, program.load_method("forward")), call)
            with torch.no_grad():
                reference = _flatten(fp32_expected(*[_upcast(x) for x in _fresh(call)]))
            pairs = [(a.float(), e.float()) for a, e in zip(actual, reference)
                     if isinstance(e, torch.Tensor) and e.is_floating_point()]
            _check([a for a, _ in pairs], [e for _, e in pairs], *FP32_REFERENCE_TOLERANCE[half], False,
                   f"against float32, input {i}")

    for compiled in (False, True):
        with runtime_switches(compile=compiled):
            program = Runtime.get().load_program(buffer)
            method = BoundMethod(program, program.load_method("forward"))
            start = _runtime.compile_stats()["compiled_calls"]
            for i, call in enumerate(calls):
                with torch.no_grad():
                    want = expected(*_fresh(call))
                for _ in range(CALLS_TO_REPLAY if compiled else 1):
                    _check(_execute(method, call), want, rtol, atol, False,
                           f"{'compiled' if compiled else 'node by node'}, input {i}")
            if compiled:
                assert _runtime.compile_stats()["compiled_calls"] > start, "no call was replayed compiled"


def _check(actual: Sequence[Any], expected: Any, rtol: float, atol: float, exact: bool, what: str) -> None:
    try:
        assert_close(actual, expected, rtol, atol, exact)
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}") from None


def amend(configs: Iterable[OpCase], rows: dict[str, str], **changes: Any) -> list[OpCase]:
    """`configs` with `changes` applied to those of the named rows (a config's row is its name
    without the dtype suffix); `rows` maps each row to the reason, and every row must exist."""
    configs = list(configs)
    row = lambda c: c.dtype is None and c.name or c.name.rsplit("-", 1)[0]  # noqa: E731
    missing = set(rows) - {row(c) for c in configs}
    assert not missing, f"no such rows: {sorted(missing)}"
    return [replace(c, **changes) if row(c) in rows else c for c in configs]


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


def eager_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    """`n` greedy tokens from a `models.llama.Model` run eagerly (its cache emptied first), the
    reference for a lowered program's generation."""
    tokens = list(prompt)
    model.reset_cache()
    with torch.no_grad():
        logits = model(torch.tensor([tokens]), torch.tensor([0]))[0, -1]
        for _ in range(n):
            tokens.append(int(logits.argmax()))
            logits = model(torch.tensor([tokens[-1:]]), torch.tensor([len(tokens) - 1]))[0, -1]
    return tokens[len(prompt):]


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
