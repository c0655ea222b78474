import os

import pytest
import torch
import torch.nn.functional as F
from executorch.runtime import Runtime
from torch.export import Dim

import mlx_delegate
from mlx_delegate.testing import (CALLS_WITH_KERNELS, FLOATS, TOLERANCE, assert_close, cases, cpu_kernels_active,
                                  lower_and_compare)

F32 = (torch.float32,)


def qkv(b=1, hq=4, hk=4, lq=5, lk=5, e=8, ev=None):
    return lambda: (torch.randn(b, hq, lq, e), torch.randn(b, hk, lk, e), torch.randn(b, hk, lk, ev or e))


def with_mask(make, mask):
    return lambda: (*make(), mask())


def bool_mask(lq, lk, empty_row=None):
    def make():
        m = torch.rand(lq, lk) > 0.3
        m[:, 0] = True
        if empty_row is not None:
            m[empty_row] = False
        return m
    return make


def float_mask(shape, empty_row=None):
    def make():
        m = torch.randn(*shape)
        if empty_row is not None:
            m[..., empty_row, :] = float("-inf")
        return m
    return make


def sdpa(**kw):
    return lambda q, k, v, *mask: F.scaled_dot_product_attention(q, k, v, *mask, **kw)


def dynamic_q(dtype):
    """Same program run with several query lengths (to_edge narrows the range to >= 2)."""
    def more():
        torch.manual_seed(1)
        return [tuple(x.to(dtype) for x in qkv(hq=4, hk=2, lq=lq, lk=9)()) for lq in (3, 9, 2)]
    return more


CASES = [
    *cases("sdpa", sdpa(), qkv(b=2), FLOATS),
    *cases("sdpa_scale", sdpa(scale=0.5), qkv(), F32),
    *cases("sdpa_gqa", sdpa(enable_gqa=True), qkv(hq=8, hk=2, lq=3, lk=7), FLOATS),
    *cases("sdpa_causal", sdpa(is_causal=True), qkv(lq=6, lk=6), F32),
    # torch aligns is_causal top-left when the lengths differ, MLX's "causal" bottom-right.
    *cases("sdpa_causal_short_q", sdpa(is_causal=True), qkv(lq=3, lk=7), FLOATS),
    *cases("sdpa_causal_long_q", sdpa(is_causal=True), qkv(lq=7, lk=3), F32),
    *cases("sdpa_causal_gqa", sdpa(is_causal=True, enable_gqa=True), qkv(hq=6, hk=2, lq=4, lk=4), F32),
    *cases("sdpa_bool_mask", sdpa(), with_mask(qkv(lq=4, lk=6), bool_mask(4, 6)), FLOATS),
    *cases("sdpa_float_mask", sdpa(), with_mask(qkv(b=2, lq=4, lk=6), float_mask((2, 1, 4, 6))), F32),
    *cases("sdpa_gqa_mask_per_head", sdpa(enable_gqa=True),
           with_mask(qkv(hq=4, hk=2, lq=3, lk=5), float_mask((1, 4, 3, 5))), F32),
    *cases("sdpa_bool_mask_empty_row", sdpa(), with_mask(qkv(lq=4, lk=6), bool_mask(4, 6, empty_row=2)),
           F32),
    *cases("sdpa_float_mask_empty_row", sdpa(), with_mask(qkv(lq=4, lk=6), float_mask((4, 6), empty_row=1)),
           FLOATS),
    *cases("sdpa_value_dim", sdpa(), qkv(e=8, ev=12), F32),
]

DYNAMIC = [
    case
    for dtype in FLOATS
    for case in cases(
        "sdpa_dynamic_q", sdpa(enable_gqa=True), qkv(hq=4, hk=2, lq=2, lk=9), (dtype,),
        dynamic_shapes=(({2: Dim("q_len", min=1, max=64)}, None, None),), more_inputs=dynamic_q(dtype))
]


@pytest.mark.parametrize("case", CASES + DYNAMIC, ids=str)
def test_sdpa(case):
    lower_and_compare(case)


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu_kernels", "mlx"])
def test_sdpa_cpu_path(kernels, monkeypatch):
    """float32 attention with many query rows on the CPU is composed around the two-core softmax
    kernel when the blocked kernel is off (with the kernels on; the fused decode kernel is switched
    off here so these small cases take that path); both paths match eager torch (GQA, causal with L < S, a fully masked row)."""
    monkeypatch.setenv("MLX_DELEGATE_SDPA_FUSED_MAX_L", "0")
    monkeypatch.setenv("MLX_DELEGATE_SDPA_BLOCKED", "0")  # the composed path, not the blocked kernel
    runtime = mlx_delegate._runtime
    was = runtime.cpu_kernels_enabled()
    runtime.set_cpu_kernels(kernels)
    try:
        active = cpu_kernels_active()  # on a GPU default device MLX's softmax runs either way
        before = runtime.cpu_kernel_call_counts().get("softmax", 0)
        for case in cases("sdpa_gqa", sdpa(enable_gqa=True), qkv(hq=8, hk=2, lq=3, lk=7), F32) + \
                cases("sdpa_causal_short_q", sdpa(is_causal=True), qkv(lq=3, lk=7), F32) + \
                cases("sdpa_bool_mask_empty_row", sdpa(), with_mask(qkv(lq=4, lk=6), bool_mask(4, 6, empty_row=2)),
                      F32):
            lower_and_compare(case)
        ran = runtime.cpu_kernel_call_counts().get("softmax", 0) - before
    finally:
        runtime.set_cpu_kernels(was)
    assert (ran >= 3) if active else (ran == 0)


# The fused decode kernel (cpp/kernels/attention_cpu): few query rows (L <= 2 by default).
def position_mask(lq, lk, position):
    """The Llama model's mask over a fixed-size cache: query i sees keys 0 .. position + i."""
    return lambda: torch.arange(lk)[None, :] <= (position + torch.arange(lq))[:, None]


def ragged_mask(lk, ends, as_float=False):
    """Row i sees keys 0 .. ends[i] (-1: none) but key 3: the last visible key at every offset
    within and across 8-key words, which the kernel's search for a row's visible end skips by."""
    def make():
        m = torch.arange(lk)[None, :] <= torch.tensor(ends)[:, None]
        m[:, 3] = False
        if not as_float:
            return m
        return torch.where(m, torch.randn(m.shape), torch.tensor(float("-inf")))
    return make


def cache_slice(lq, lk, size, e=64):
    """k and v as slices of bigger caches (strided views inside the graph)."""
    def fn(q, k_cache, v_cache, mask):
        return F.scaled_dot_product_attention(q, k_cache[:, :, :lk], v_cache[:, :, 1:lk + 1], attn_mask=mask,
                                              enable_gqa=True)
    make = lambda: (torch.randn(1, 9, lq, e), torch.randn(1, 3, size, e), torch.randn(1, 3, size, e),
                    position_mask(lq, lk, lk // 2)())
    return fn, make


def transposed_kv(q, k_t, v):
    """k arrives as [B, H, D, S]: its last axis is strided."""
    return F.scaled_dot_product_attention(q, k_t.transpose(-1, -2), v)


def heads_last(q, k, v, mask):
    """q, k and v as [B, L, H, D] (a projection's layout), attended as [B, H, L, D] views."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          attn_mask=mask, enable_gqa=True).transpose(1, 2)


def heads_last_inputs(n, seed):
    """heads_last's q [1, n, 4, 64], k / v [1, n, 2, 64] and a position mask, from `seed`."""
    def make():
        g = torch.Generator().manual_seed(seed)
        return (*(torch.randn(1, n, h, 64, generator=g) for h in (4, 2, 2)), position_mask(n, n, 0)())
    return make


SLICED, SLICED_INPUTS = cache_slice(lq=1, lk=200, size=256)
FUSED = [
    *cases("fused_l1_s1", sdpa(), qkv(hq=4, hk=4, lq=1, lk=1, e=64), FLOATS),
    *cases("fused_l1_s7_gqa_d40_bool", sdpa(enable_gqa=True),
           with_mask(qkv(hq=6, hk=2, lq=1, lk=7, e=40), bool_mask(1, 7)), FLOATS),
    *cases("fused_l1_s256_smollm2", sdpa(enable_gqa=True),
           with_mask(qkv(hq=9, hk=3, lq=1, lk=256, e=64), position_mask(1, 256, 100)), FLOATS),
    *cases("fused_l2_s256_gqa", sdpa(enable_gqa=True),
           with_mask(qkv(hq=9, hk=3, lq=2, lk=256, e=64), position_mask(2, 256, 37)), FLOATS),
    *cases("fused_l5_s7_float_mask", sdpa(), with_mask(qkv(b=2, hq=3, hk=3, lq=5, lk=7, e=40),
                                                       float_mask((2, 1, 5, 7))), FLOATS),
    *cases("fused_float_mask_per_head", sdpa(enable_gqa=True),
           with_mask(qkv(hq=4, hk=2, lq=3, lk=5), float_mask((1, 4, 3, 5))), (torch.float32,)),
    *cases("fused_float_mask_empty_row", sdpa(), with_mask(qkv(lq=4, lk=6, e=40), float_mask((4, 6), empty_row=1)),
           FLOATS),
    *cases("fused_bool_mask_empty_row", sdpa(enable_gqa=True),
           with_mask(qkv(hq=6, hk=3, lq=4, lk=7), bool_mask(4, 7, empty_row=2)), FLOATS),
    *cases("fused_bool_mask_per_column", sdpa(), with_mask(qkv(lq=3, lk=6), lambda: torch.rand(1, 6) > 0.4),
           (torch.float32,)),
    *cases("fused_causal_short_q", sdpa(is_causal=True), qkv(hq=4, hk=4, lq=3, lk=7), FLOATS),
    *cases("fused_causal_square_gqa", sdpa(is_causal=True, enable_gqa=True), qkv(hq=6, hk=2, lq=4, lk=4),
           (torch.float32,)),
    *cases("fused_value_dim", sdpa(scale=0.3), qkv(lq=2, lk=7, e=40, ev=24), (torch.float32,)),
    *cases("fused_cache_slices", SLICED, SLICED_INPUTS, FLOATS),
    *cases("fused_transposed_k", transposed_kv,
           lambda: (torch.randn(1, 4, 2, 40), torch.randn(1, 4, 40, 9), torch.randn(1, 4, 9, 40)), FLOATS),
    *cases("fused_heads_last", heads_last,
           lambda: (torch.randn(1, 3, 6, 64), torch.randn(1, 9, 2, 64), torch.randn(1, 9, 2, 64),
                    position_mask(3, 9, 4)()), (torch.float32,)),
    # D 128 and 16: the AVX-512 row loops' largest and smallest register tiles (fp32 k / v only).
    *cases("fused_l1_s33_gqa_d128", sdpa(enable_gqa=True),
           with_mask(qkv(hq=4, hk=2, lq=1, lk=33, e=128), position_mask(1, 33, 20)), (torch.float32,)),
    *cases("fused_l2_s9_d16", sdpa(), qkv(hq=2, hk=2, lq=2, lk=9, e=16), (torch.float32,)),
    # Keys 5 and 37 of 50 hidden: sixteen-key steps beside one-key ones; a float mask per head.
    *cases("fused_l1_s50_d32_holes", sdpa(enable_gqa=True),
           with_mask(qkv(hq=4, hk=2, lq=1, lk=50, e=32),
                     lambda: ((torch.arange(50) != 5) & (torch.arange(50) != 37))[None, :]), (torch.float32,)),
    *cases("fused_l2_s40_d32_float_mask_per_head", sdpa(enable_gqa=True),
           with_mask(qkv(hq=4, hk=2, lq=2, lk=40, e=32), float_mask((1, 4, 2, 40))), (torch.float32,)),
    # Rows ending at keys 0 .. 70 of 71 (one row sees nothing): the kernel cuts each row at its last
    # visible key.
    *cases("fused_bool_mask_ragged_ends", sdpa(enable_gqa=True),
           with_mask(qkv(hq=8, hk=2, lq=8, lk=71, e=32), ragged_mask(71, [0, 6, 7, 8, 15, -1, 64, 70])), FLOATS),
    *cases("fused_float_mask_ragged_ends", sdpa(),
           with_mask(qkv(hq=2, hk=2, lq=8, lk=71, e=32), ragged_mask(71, [70, 9, 16, 0, 23, 31, 32, -1], True)),
           FLOATS),
    *cases("fused_l16", sdpa(enable_gqa=True),
           with_mask(qkv(hq=9, hk=3, lq=16, lk=64, e=64), position_mask(16, 64, 20)), (torch.float32,)),
]


def run_fresh(buffer: bytes, inputs: tuple, kernels: bool, calls: int = 1) -> list:
    """The program loaded anew (its own compiled graphs) and run `calls` times with the CPU
    kernels on or off; the last call's outputs."""
    runtime = mlx_delegate._runtime
    was = runtime.cpu_kernels_enabled()
    runtime.set_cpu_kernels(kernels)
    try:
        program = Runtime.get().load_program(buffer)
        method = program.load_method("forward")
        for _ in range(calls):
            out = method.execute(list(inputs))
        return out
    finally:
        runtime.set_cpu_kernels(was)


def fused_calls() -> int:
    return mlx_delegate._runtime.cpu_kernel_call_counts().get("sdpa", 0)


@pytest.mark.parametrize("case", FUSED, ids=str)
def test_sdpa_fused_cpu(case, monkeypatch):
    """Few query rows: the fused kernel serves the op, matching eager torch and the kernels-off
    (MLX) path. Its row limit is raised to 16 here so that L 3 .. 16 exercise it too."""
    monkeypatch.setenv("MLX_DELEGATE_SDPA_FUSED_MAX_L", "16")
    before = fused_calls()
    lowered = lower_and_compare(case)
    assert (fused_calls() > before) == cpu_kernels_active()
    inputs = case.inputs()
    rtol, atol = TOLERANCE[case.dtype]
    assert_close(run_fresh(lowered.buffer, inputs, kernels=False),
                 run_fresh(lowered.buffer, inputs, kernels=True), rtol, atol)


@pytest.mark.parametrize("case", [c for c in FUSED if c.name in (
    "fused_l2_s256_gqa-float32", "fused_l2_s256_gqa-bfloat16", "fused_cache_slices-float32",
    "fused_bool_mask_empty_row-float16", "fused_causal_short_q-float32")], ids=str)
def test_sdpa_fused_cpu_compiled(case, compile_on, monkeypatch):
    """Inside a compiled graph (traced on the second call, replayed after): same results."""
    monkeypatch.setenv("MLX_DELEGATE_SDPA_FUSED_MAX_L", "16")
    inputs = case.inputs()
    with torch.no_grad():
        expected = case.module().eval()(*inputs)
    lowered = lower_and_compare(case)
    before, compiled_before = fused_calls(), mlx_delegate._runtime.compile_stats()["compiled_calls"]
    actual = run_fresh(lowered.buffer, inputs, kernels=True, calls=4)
    assert fused_calls() - before == (4 if cpu_kernels_active() else 0)
    assert mlx_delegate._runtime.compile_stats()["compiled_calls"] - compiled_before == 3
    assert_close(actual, expected, *TOLERANCE[case.dtype])


@pytest.mark.parametrize("case", [c for c in FUSED if c.name in (
    "fused_l1_s256_smollm2-float32", "fused_l1_s33_gqa_d128-float32", "fused_l2_s9_d16-float32",
    "fused_cache_slices-float32", "fused_l1_s50_d32_holes-float32", "fused_l2_s40_d32_float_mask_per_head-float32")],
    ids=str)
def test_sdpa_fused_row_loops_match_per_key_loops(case, monkeypatch):
    """The AVX-512 row loops (fp32 k / v, D a multiple of 16: sixteen keys per step where none is
    hidden, a bool mask row widened in vectors) against the per-key loops they replace
    (`set_sdpa_row_loops(False)`) and eager torch; hidden keys inside a step of sixteen take the
    one-key step there."""
    monkeypatch.setenv("MLX_DELEGATE_SDPA_FUSED_MAX_L", "16")
    inputs = case.inputs()
    with torch.no_grad():
        expected = case.module().eval()(*inputs)
    lowered = lower_and_compare(case)
    runtime = mlx_delegate._runtime
    try:
        runtime.set_sdpa_row_loops(False)
        per_key = run_fresh(lowered.buffer, inputs, kernels=True)
    finally:
        runtime.set_sdpa_row_loops(True)
    before = runtime.cpu_kernel_call_counts().get("sdpa_row_loops", 0)
    rows = run_fresh(lowered.buffer, inputs, kernels=True)
    ran = runtime.cpu_kernel_call_counts().get("sdpa_row_loops", 0) - before
    avx512 = (runtime.cpu_vector_kernels() and os.environ.get("MLX_DELEGATE_CPU_KERNELS") != "avx2"
              and "avx512f" in open("/proc/cpuinfo").read())
    assert (ran > 0) == (avx512 and cpu_kernels_active())
    assert_close(rows, per_key, 1e-5, 1e-6)  # only the order of the float sums differs
    assert_close(rows, expected, *TOLERANCE[case.dtype])


@pytest.mark.parametrize("max_l", ["0", "4", None])
def test_sdpa_fused_cpu_switch(max_l, monkeypatch):
    """MLX_DELEGATE_SDPA_FUSED_MAX_L bounds the query rows the fused kernel takes (0: never);
    longer queries keep the composed path, and both give torch's result."""
    if max_l is None:
        monkeypatch.delenv("MLX_DELEGATE_SDPA_FUSED_MAX_L", raising=False)  # the default: L <= 2
    else:
        monkeypatch.setenv("MLX_DELEGATE_SDPA_FUSED_MAX_L", max_l)
    before = fused_calls()
    for lq in (5, 4, 2):
        lower_and_compare(cases(f"sdpa_l{lq}", sdpa(enable_gqa=True), qkv(hq=4, hk=2, lq=lq, lk=9), F32)[0])
    configs = {"0": 0, "4": 2, None: 1}[max_l]  # configs the fused kernel serves
    assert fused_calls() - before == configs * CALLS_WITH_KERNELS * cpu_kernels_active()


def trailing_inf_mask(lq, lk, visible):
    """A float mask whose keys from `visible` on are -inf for every query."""
    def make():
        m = torch.randn(lq, lk)
        m[:, visible:] = float("-inf")
        return m
    return make


def hidden_rows_mask(lq, lk, first_hidden):
    """A bool mask that hides every key from query `first_hidden` on (a whole block of rows)."""
    def make():
        m = bool_mask(lq, lk)()
        m[first_hidden:] = False
        return m
    return make


# The blocked kernel (cpp/kernels/attention_cpu, long queries: blocks of 128 query rows on the BLAS, 64
# past 2048 keys). L and S are not multiples of the block; head dims 64 and 80; masks, causal alignments,
# strided views (packed per head).
BLOCKED = [
    *cases("blocked_l70_d64", sdpa(), qkv(b=2, hq=2, hk=2, lq=70, lk=70, e=64), FLOATS),
    *cases("blocked_l130_s70_d80_gqa", sdpa(enable_gqa=True), qkv(hq=4, hk=2, lq=130, lk=70, e=80), FLOATS),
    *cases("blocked_causal_l133", sdpa(is_causal=True), qkv(hq=2, hk=2, lq=133, lk=133, e=64), FLOATS),
    *cases("blocked_causal_short_q", sdpa(is_causal=True), qkv(hq=2, hk=2, lq=67, lk=131, e=80), FLOATS),
    *cases("blocked_causal_long_q_gqa", sdpa(is_causal=True, enable_gqa=True),
           qkv(hq=4, hk=2, lq=131, lk=67, e=64), (torch.float32,)),
    *cases("blocked_bool_mask_empty_row", sdpa(),
           with_mask(qkv(hq=2, hk=2, lq=70, lk=37, e=64), bool_mask(70, 37, empty_row=65)), FLOATS),
    *cases("blocked_float_mask_per_head", sdpa(enable_gqa=True),
           with_mask(qkv(b=2, hq=4, hk=2, lq=66, lk=45, e=80), float_mask((2, 4, 66, 45), empty_row=3)), FLOATS),
    # Trailing hidden keys (a prefill over a fixed-size cache) are skipped: same result.
    *cases("blocked_prefill_cache", sdpa(enable_gqa=True),
           with_mask(qkv(hq=6, hk=2, lq=40, lk=200, e=64), position_mask(40, 200, 10)), FLOATS),
    *cases("blocked_float_mask_trailing_inf", sdpa(),
           with_mask(qkv(hq=2, hk=2, lq=33, lk=90, e=80), trailing_inf_mask(33, 90, 50)), FLOATS),
    *cases("blocked_hidden_block", sdpa(),
           with_mask(qkv(hq=2, hk=2, lq=140, lk=37, e=64), hidden_rows_mask(140, 37, 128)), FLOATS),
    *cases("blocked_value_dim", sdpa(scale=0.3), qkv(hq=2, hk=2, lq=9, lk=20, e=40, ev=24), (torch.float32,)),
    *cases("blocked_transposed_k", transposed_kv,
           lambda: (torch.randn(1, 2, 70, 64), torch.randn(1, 2, 64, 90), torch.randn(1, 2, 90, 64)), FLOATS),
    *cases("blocked_heads_last", heads_last,
           lambda: (torch.randn(1, 131, 4, 64), torch.randn(1, 131, 2, 64), torch.randn(1, 131, 2, 64),
                    position_mask(131, 131, 0)()), FLOATS),
    # Three blocks per head, every block a part of its own, each thread keeping a head's packed keys and
    # values for its next block of the same call; the later runs (new data, same shapes) must not see them.
    *cases("blocked_heads_last_calls", heads_last, heads_last_inputs(300, seed=0), F32,
           more_inputs=lambda: [heads_last_inputs(300, seed=s)() for s in (1, 2)]),
    # Past 2048 keys the blocks are 64 rows again.
    *cases("blocked_long_s", sdpa(), qkv(hq=1, hk=1, lq=70, lk=2100, e=64), (torch.float32,)),
    # ViT's L 197 (a full and a partial block), an odd head dim, rows of 197 keys (vector tails).
    *cases("blocked_l197_d40_gqa", sdpa(enable_gqa=True), qkv(hq=6, hk=2, lq=197, lk=197, e=40), FLOATS),
    *cases("blocked_l197_float_mask_empty_row", sdpa(),
           with_mask(qkv(hq=3, hk=3, lq=197, lk=51, e=24), float_mask((1, 1, 197, 51), empty_row=150)), FLOATS),
]


def blocked_calls() -> int:
    return mlx_delegate._runtime.cpu_kernel_call_counts().get("sdpa_blocked", 0)


@pytest.mark.parametrize("case", BLOCKED, ids=str)
def test_sdpa_blocked_cpu(case):
    """More than two query rows: the blocked kernel serves the op, matching eager torch and the
    kernels-off (MLX) path."""
    before = blocked_calls()
    lowered = lower_and_compare(case)
    assert (blocked_calls() > before) == (cpu_kernels_active() and mlx_delegate._blas.mode() == "torch")
    inputs = case.inputs()
    rtol, atol = TOLERANCE[case.dtype]
    assert_close(run_fresh(lowered.buffer, inputs, kernels=False),
                 run_fresh(lowered.buffer, inputs, kernels=True), rtol, atol)


@pytest.mark.parametrize("case", [c for c in BLOCKED if c.name in (
    "blocked_causal_short_q-bfloat16", "blocked_float_mask_per_head-float32")], ids=str)
def test_sdpa_blocked_cpu_compiled(case, compile_on):
    """Inside a compiled graph (traced on the second call, replayed after): same results."""
    inputs = case.inputs()
    with torch.no_grad():
        expected = case.module().eval()(*inputs)
    lowered = lower_and_compare(case)
    before, compiled_before = blocked_calls(), mlx_delegate._runtime.compile_stats()["compiled_calls"]
    actual = run_fresh(lowered.buffer, inputs, kernels=True, calls=4)
    served = cpu_kernels_active() and mlx_delegate._blas.mode() == "torch"
    assert blocked_calls() - before == (4 if served else 0)
    assert mlx_delegate._runtime.compile_stats()["compiled_calls"] - compiled_before == 3
    assert_close(actual, expected, *TOLERANCE[case.dtype])


def bf16_products_expected() -> bool:
    """Whether bfloat16 attention takes the 16-bit products here: kernels served, AVX-512 not capped, and the
    CPU's bf16 dot products (MKL emulates them elsewhere; the kernel keeps the fp32 path there)."""
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    return (cpu_kernels_active() and mlx_delegate._blas.mode() == "torch"
            and os.environ.get("MLX_DELEGATE_CPU_KERNELS", "") not in ("avx2", "portable")
            and {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= flags)


def bf16_calls() -> int:
    return mlx_delegate._runtime.cpu_kernel_call_counts().get("sdpa_blocked_bf16", 0)


@pytest.mark.parametrize("case", [c for c in BLOCKED if c.dtype == torch.bfloat16 and c.name.split("-")[0] in (
    "blocked_causal_l133", "blocked_float_mask_per_head", "blocked_heads_last", "blocked_transposed_k",
    "blocked_l197_d40_gqa", "blocked_hidden_block")], ids=str)
def test_sdpa_blocked_bf16_products(case, monkeypatch):
    """bfloat16 q / k / v: the 16-bit products (MKL's bf16 gemm, weights rounded to bf16 for P V) where the
    CPU has them, matching eager torch and the fp32 path (MLX_DELEGATE_SDPA_BF16=0: widened for sgemm)."""
    before = bf16_calls()
    lowered = lower_and_compare(case)
    assert (bf16_calls() > before) == bf16_products_expected()
    inputs = case.inputs()
    products = run_fresh(lowered.buffer, inputs, kernels=True)
    monkeypatch.setenv("MLX_DELEGATE_SDPA_BF16", "0")
    before = bf16_calls()
    widened = run_fresh(lowered.buffer, inputs, kernels=True)
    assert bf16_calls() == before
    assert_close(products, widened, *TOLERANCE[case.dtype])


def test_sdpa_blocked_switch(monkeypatch):
    """MLX_DELEGATE_SDPA_BLOCKED=0 turns the blocked kernel off (the composed path runs, same result)."""
    monkeypatch.setenv("MLX_DELEGATE_SDPA_BLOCKED", "0")
    before = blocked_calls()
    lower_and_compare(cases("blocked_off", sdpa(is_causal=True), qkv(hq=2, hk=2, lq=70, lk=70, e=64), F32)[0])
    assert blocked_calls() == before
