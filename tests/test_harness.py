"""The parity harness itself (mlx_delegate/testing.py): every config runs node by node, compiled
(traced and replayed) and with the CPU kernels off; the checks it adds can fail."""

import pytest
import torch
from torch.export import Dim

from mlx_delegate import _runtime
from mlx_delegate.testing import (
    CALLS_TO_REPLAY,
    CALLS_WITH_KERNELS,
    COMPILE_AFTER,
    TOLERANCE,
    Lambda,
    OpCase,
    amend,
    cases,
    compare_node_and_compiled,
    cpu_kernels_active,
    fp32_tolerance,
    lower,
    lower_and_compare,
    runtime_switches,
)


def stats_since(before):
    return {k: v - before[k] for k, v in _runtime.compile_stats().items()}


def test_every_path_runs_and_is_counted():
    """One input tuple: node by node (1 call), compiled (CALLS_TO_REPLAY calls: node by node,
    trace, replay), kernels off (1 call); the CPU kernels serve exactly the kernels-on calls."""
    (case,) = cases("softmax", lambda x: torch.softmax(x, -1), lambda: (torch.randn(4, 8),))
    before, softmax = _runtime.compile_stats(), _runtime.cpu_kernel_call_counts().get("softmax", 0)
    lower_and_compare(case)
    assert stats_since(before) == {"interpreted_calls": 3, "compiled_calls": CALLS_TO_REPLAY - 1, "traces": 1,
                                   "rejected": 0}
    ran = _runtime.cpu_kernel_call_counts().get("softmax", 0) - softmax
    assert ran == CALLS_WITH_KERNELS * cpu_kernels_active()


def test_switches_are_restored():
    (case,) = cases("add", torch.add, lambda: (torch.randn(3), torch.randn(3)))
    was = _runtime.compile_enabled(), _runtime.cpu_kernels_enabled()
    for switches in ({"compile": False, "cpu_kernels": True}, {"compile": True, "cpu_kernels": False}):
        with runtime_switches(**switches):
            lower_and_compare(case)
            assert _runtime.compile_enabled() == switches["compile"]
            assert not _runtime.cpu_kernels_enabled() or switches["cpu_kernels"]
    assert (_runtime.compile_enabled(), _runtime.cpu_kernels_enabled()) == was


def test_each_dynamic_signature_is_traced_and_replayed():
    (case,) = cases("mul_dynamic", lambda x: x * 2, lambda: (torch.randn(3, 4),),
                    dynamic_shapes=(({0: Dim("n", min=2, max=16)},),),
                    more_inputs=lambda: [(torch.randn(5, 4),), (torch.randn(3, 4),)])
    before = _runtime.compile_stats()
    lower_and_compare(case)
    # Two signatures traced; the third tuple repeats the first's, so all its compiled-path calls replay.
    delta = stats_since(before)
    assert delta["traces"] == 2 and delta["compiled_calls"] == 2 * (CALLS_TO_REPLAY - 1) + CALLS_TO_REPLAY


class Accumulate(torch.nn.Module):
    """A stateful program: the buffer lives in the delegate and changes every call."""

    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x):
        self.total.add_(x)
        return self.total * 2


def test_stateful_program_replays_the_same_call_sequence():
    """Each path starts from the initial buffer and makes the same calls as eager."""
    case = OpCase("accumulate", Accumulate, lambda: (torch.arange(4.0),))
    lowered = lower_and_compare(case)
    assert lowered.stateful


def test_a_stale_compiles_false_fails():
    (case,) = cases("neg", torch.neg, lambda: (torch.randn(3),), compiles=False)
    with pytest.raises(AssertionError, match="cannot trace"):
        lower_and_compare(case)


def test_half_types_are_checked_against_float32():
    """fp16 overflows where float32 does not: the delegate matches eager fp16 (inf) but not the
    true result, and the float32 reference catches it (unless the row opts out)."""
    (case,) = cases("overflow", lambda x: x * 300 * 300, lambda: (torch.rand(5) + 1,), (torch.float16,))
    with pytest.raises(AssertionError, match="against float32"):
        lower_and_compare(case)
    lower_and_compare(amend([case], {"overflow": "fp16 overflows"}, fp32_reference=False)[0])


def test_amend_names_existing_rows():
    configs = cases("neg", torch.neg, lambda: (torch.randn(3),), (torch.float32, torch.float16))
    assert [c.compiled_exact for c in amend(configs, {"neg": "why"}, compiled_exact=False)] == [False, False]
    with pytest.raises(AssertionError, match="no such rows"):
        amend(configs, {"negative": "why"}, compiled_exact=False)


def test_per_dtype_tolerance():
    configs = cases("neg", torch.neg, lambda: (torch.randn(3),), (torch.float32, torch.bfloat16),
                    tolerance={torch.bfloat16: (3e-2, 3e-2)})
    assert [(c.rtol, c.atol) for c in configs] == [(None, None), (3e-2, 3e-2)]
    assert fp32_tolerance(16) == fp32_tolerance(1) and fp32_tolerance(1600)[1] == pytest.approx(10 * 1e-5)


def test_compare_node_and_compiled_runs_both_paths_and_can_fail():
    inputs = [(torch.randn(3, 4),), (torch.randn(3, 4),)]
    buffer = lower(Lambda(lambda x: x.exp() * 2), inputs[0]).buffer
    before = _runtime.compile_stats()["compiled_calls"]
    compare_node_and_compiled(buffer, inputs, lambda x: x.exp() * 2, *TOLERANCE[torch.float32])
    # One signature, called CALLS_TO_REPLAY times per input tuple: from its COMPILE_AFTER-th sighting on
    # (the trace, then replays) every call is compiled.
    assert _runtime.compile_stats()["compiled_calls"] - before == len(inputs) * CALLS_TO_REPLAY - (COMPILE_AFTER - 1)
    with pytest.raises(AssertionError, match="node by node, input 0"):
        compare_node_and_compiled(buffer, inputs, lambda x: x.exp() * 2.001, *TOLERANCE[torch.float32])


def test_compare_node_and_compiled_checks_half_types_against_float32():
    inputs = [(torch.randn(3, 4).half(),)]
    buffer = lower(Lambda(lambda x: x.exp() * 2), inputs[0]).buffer
    compare_node_and_compiled(buffer, inputs, lambda x: x.exp() * 2, *TOLERANCE[torch.float16],
                              fp32_expected=lambda x: x.exp() * 2)
    with pytest.raises(AssertionError, match="against float32, input 0"):
        compare_node_and_compiled(buffer, inputs, lambda x: x.exp() * 2, *TOLERANCE[torch.float16],
                                  fp32_expected=lambda x: x.exp() * 2.2)
