"""Op-level timings on the CPU: our CPU kernels against MLX's own ops and eager torch.

Groups (`--ops`, default all):

- `unary`: SiLU at SmolLM2-135M's MLP width (32 and 128 tokens x 1536), GELU at Whisper base's
  (1500 frames x 2048), `exp` over 16M elements.
- `rows`: RMSNorm and softmax at SmolLM2-135M's prefill shapes (32 and 128 tokens: [L, 576],
  9 heads of [L, L]), LayerNorm and softmax at Whisper base's encoder shapes ([1500, 512], 8 heads
  of [1500, 1500]).
- `rope`: one `mlx_delegate::rope_at` node (position as a tensor, the compiled decode graph's form) at
  SmolLM2-135M's decode shapes (q [1, 9, 1, 64] fp32 and bf16, k [1, 3, 1, 64]) and a 64-token
  prefill; eager torch computes the rotate-half form the Llama model writes.
- `qgemv`: one decode-step quantized linear (one row of x) at the GGUF default's shapes (SmolLM2-135M
  Q4_1 gate/up [3072 x 576] and down [576 x 1536], the Q8_0 tied head [49152 x 576]), groups of 32,
  scales / biases stored fp16 (as the GGUF program keeps them) and fp32 (as it stored them before);
  path `eight-groups path off` runs the kernel's general per-group loop instead of its one-row
  eight-groups-at-a-time path (`_runtime.set_qgemv_group32_path`).
- `qgemv1b`: one-row int4 products at the 1.2B Llama-3.2-shaped model's shapes (q / o [2048 x 2048], k / v
  [512 x 2048], gate / up [8192 x 2048], down [2048 x 8192], the tied head [128256 x 2048]) in
  `--quantize int4`'s layout (groups of 64, fp32 scales), then groups of 32 and fp16 / bf16 scales. Each
  case lowers copies of the product with their own weights and inputs, ~384 MB of weights per call in all,
  so a call streams them from memory as a decode step does; `GB/s` is weights + scales + biases over the
  median. Eager torch is not timed (its fp32 weights would be 8x the bytes); `max|err|` is against it.
- `sdpa`: attention at SmolLM2-135M's shape (9 query heads, 3 key heads, head dim 64) over a
  256-slot cache under the position mask the Llama model uses (`arange(S) <= position`), for 1 to 64
  query rows.
- `attn`: encoder-shaped attention (the blocked CPU kernel), q = k = v [1, H, L, 64], L 64 / 128 / 197 /
  512 / 1500 at 4, 8 and 12 heads without a mask, then at 8 heads causal, with an additive float mask
  [1, 1, L, L], and in bfloat16; eager torch's SDPA and eager's bmm + softmax + bmm (`eager bmm`) beside
  it.

Each case is lowered once on its own and its program loaded once per path (each copy compiles its own
graph); the copies and eager torch take turns in rotating order, call by call
(`common.time_interleaved`), in one process, so load on the shared machine hits them alike. Paths
(the `path` column):

- `kernels on`: the delegate as shipped, CPU kernels on (for `sdpa`, the fused decode-attention
  kernel wherever it applies: up to 2 query rows by default).
- `composed` (`sdpa`, `attn`): kernels on, the fused (`sdpa`) / blocked (`attn`) attention kernel off
  (MLX_DELEGATE_SDPA_FUSED_MAX_L=0): scale, BLAS matmuls, the kernels' softmax and the mask ops it
  replaces. Where the fused kernel does not apply (more query rows) this is the same path as
  `kernels on`, a control for the noise.
- `kernels off`: MLX's own ops (`_runtime.set_cpu_kernels(False)`).
- `avx512 off` (`qgemv`, `qgemv1b`): the quantized GEMV's AVX2 kernels where the CPU has AVX-512 VNNI
  (`_runtime.set_qgemv_avx512_path(False)`).
- `guided split on` (`qgemv1b`): the decode GEMV's rows in pieces claimed from one counter that shrink as
  the product ends instead of four equal parts per thread (`_runtime.set_qgemv_guided_split(True)`, opt-in).
- `eager torch`: the torch op (`--threads`, default 2); `attn` adds `eager bmm`.
- with `--nodes`, each delegate path also node by node (`..., nodes`: compiled graphs off).

Figures are per call through the delegate (its per-call overhead, tens of us, and the input/output
copies included). `x on`: median over `kernels on`'s median; `x eager`: over eager torch's; `CPU`:
the process's CPU time per timed call (all threads, mean; on a loaded machine the steadier figure);
`max|err|`: the path's first call against eager torch. Caveat: in-process A/B of the tiny `sdpa`
decode calls has shown a bias against the fused copy (one process per path measured it ahead);
check a surprising `sdpa` row with one process per setting. Nothing fails here.

    python benchmarks/cpu_kernels.py [--ops unary,rows,rope,qgemv,sdpa,attn] [--quick] [--nodes] [--budget S]
                                 [--match TEXT,...]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import common  # first: mlx_delegate before mlx
import numpy as np
import torch
import torch.nn.functional as F
from executorch.runtime import Runtime

from mlx_delegate import _runtime
from mlx_delegate import quantization as Q
from mlx_delegate.custom_ops import rope_at
from mlx_delegate.models.llama import apply_rope
from mlx_delegate.testing import Lambda, lower

GROUPS = ("unary", "rows", "rope", "qgemv", "qgemv1b", "sdpa", "attn")
SDPA_ENV = "MLX_DELEGATE_SDPA_FUSED_MAX_L"
BLOCKED_ENV = "MLX_DELEGATE_SDPA_BLOCKED"


@dataclass
class Case:
    """One op at one shape: the module lowered, its inputs, and eager torch's same computation."""

    group: str
    label: str
    module: torch.nn.Module
    inputs: tuple[torch.Tensor, ...]
    eager: Callable[[], Any]
    paths: tuple[str, ...] = ("kernels on", "kernels off")
    bytes_read: int = 0  # weights + scales + biases one call reads: the table's GB/s column
    eager_timed: bool = True  # False: eager only checks the outputs (its fp32 weights would not fit)
    peers: dict[str, Callable[[], Any]] = field(default_factory=dict)  # more eager forms, timed beside


@dataclass(frozen=True)
class RunAs:
    """How one loaded copy is run: CPU kernels, compiled graphs, environment set around each call."""

    kernels: bool = True
    compiled: bool = True
    env: dict[str, str] = field(default_factory=dict)
    group32: bool = True  # the quantized GEMV's one-row eight-groups path (groups of 32, 64, 128)
    avx512: bool = True  # the quantized GEMV's AVX-512 VNNI kernels (where the CPU has them)
    guided: bool = False  # the quantized GEMV's guided split (shrinking pieces; opt-in) rather than equal parts


PATHS = {"kernels on": RunAs(), "composed": RunAs(env={SDPA_ENV: "0"}), "kernels off": RunAs(kernels=False),
         "blocked off": RunAs(env={BLOCKED_ENV: "0"}),
         "eight-groups path off": RunAs(group32=False), "avx512 off": RunAs(avx512=False),
         "guided split on": RunAs(guided=True)}


def shape_text(x: torch.Tensor) -> str:
    return f"{list(x.shape)} {str(x.dtype).removeprefix('torch.')}"


# ---------------------------------------------------------------- cases

def rms(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), torch.ones(x.shape[-1]), 1e-5)


def layer_norm(x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), torch.ones(x.shape[-1]), torch.zeros(x.shape[-1]), 1e-5)


def softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, -1)


def single_op(group: str, label: str, op: Callable[[torch.Tensor], torch.Tensor],
              shape: tuple[int, ...]) -> Case:
    x = torch.randn(shape)
    return Case(group, f"{label} {shape_text(x)}", Lambda(op), (x,), lambda: op(x))


def unary_cases(quick: bool) -> Iterator[Case]:
    yield single_op("unary", "smollm2 s32 silu", F.silu, (32, 1536))
    if quick:
        return
    yield single_op("unary", "smollm2 s128 silu", F.silu, (128, 1536))
    yield single_op("unary", "whisper gelu", F.gelu, (1500, 2048))
    yield single_op("unary", "exp 16M", torch.exp, (1 << 24,))


def rows_cases(quick: bool) -> Iterator[Case]:
    for tokens in (32,) if quick else (32, 128):
        yield single_op("rows", f"smollm2 s{tokens} rms_norm", rms, (tokens, 576))
        yield single_op("rows", f"smollm2 s{tokens} softmax", softmax, (9, tokens, tokens))
    if not quick:
        yield single_op("rows", "whisper layer_norm", layer_norm, (1500, 512))
        yield single_op("rows", "whisper softmax", softmax, (8, 1500, 1500))


ROPE_D, ROPE_BASE = 64, 100000.0


class RopeAt(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        d = ROPE_D
        self.register_buffer("inv_freq", 1.0 / (ROPE_BASE ** (torch.arange(0, d, 2).float() / d)))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return rope_at(x, self.inv_freq, pos, False, ROPE_BASE)


def rope_eager(module: RopeAt, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The rotate-half form as the Llama model computes it."""
    f = (pos + torch.arange(x.shape[2]))[:, None].float() * module.inv_freq[None, :]
    emb = torch.cat((f, f), -1)
    return apply_rope(x, emb.cos().to(x.dtype), emb.sin().to(x.dtype))


def rope_cases(quick: bool) -> Iterator[Case]:
    shapes = [(9, 1, torch.float32), (3, 1, torch.float32), (9, 1, torch.bfloat16), (9, 64, torch.float32)]
    for heads, length, dtype in shapes[:1] if quick else shapes:
        module = RopeAt().eval()
        x, pos = torch.randn(1, heads, length, ROPE_D, dtype=dtype), torch.tensor([100])
        yield Case("rope", f"rope_at {shape_text(x)}", module, (x, pos),
                   lambda m=module, x=x, pos=pos: rope_eager(m, x, pos))


class PackedLinear(torch.nn.Module):
    """One quantized linear on MLX-affine packed weights (`quantization.QuantizedLinear`)."""

    def __init__(self, n: int, k: int, bits: int, scales_dtype: torch.dtype) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        scales = (torch.rand(n, k // 32, generator=gen) + 0.5) * 0.16 / 2**bits
        biases = -(2 ** (bits - 1) + torch.randn(n, k // 32, generator=gen)) * scales
        packed = Q.MLXQuantized(Q.pack_words(torch.randint(0, 2**bits, (n, k), generator=gen), bits),
                                scales.to(scales_dtype), biases.to(scales_dtype), 32, bits)
        self.linear = Q.QuantizedLinear(packed)
        self.weight = Q.dequantize_mlx(packed.w, packed.scales, packed.biases, 32, bits, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def qgemv_cases(quick: bool) -> Iterator[Case]:
    shapes = [("gate/up Q4_1", 3072, 576, 4), ("down Q4_1", 576, 1536, 4), ("head Q8_0", 49152, 576, 8)]
    for name, n, k, bits in shapes[:1] if quick else shapes:
        for scales_dtype in (torch.float16, torch.float32):
            module = PackedLinear(n, k, bits, scales_dtype).eval()
            x = torch.randn(1, 1, k)
            yield Case("qgemv", f"{name} [{n} x {k}], scales {str(scales_dtype).removeprefix('torch.')}", module,
                       (x,), lambda m=module, x=x: F.linear(x, m.weight),
                       paths=("kernels on", "eight-groups path off", "avx512 off", "kernels off"))


class PackedLinears(torch.nn.Module):
    """`copies` int4 / int8 linears [N, K], each with its own random packed weights and its own input: one
    call streams every copy's weights once, like a decode step, and the per-call overhead is shared."""

    def __init__(self, n: int, k: int, bits: int, group_size: int, scales_dtype: torch.dtype,
                 copies: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.linears = torch.nn.ModuleList()
        for _ in range(copies):
            words = torch.randint(-2**31, 2**31 - 1, (n, k * bits // 32), generator=gen, dtype=torch.int32)
            scales = (torch.rand(n, k // group_size, generator=gen) + 0.5) * 0.16 / 2**bits
            biases = -(2 ** (bits - 1) + torch.randn(n, k // group_size, generator=gen)) * scales
            self.linears.append(Q.QuantizedLinear(Q.MLXQuantized(words, scales.to(scales_dtype),
                                                                 biases.to(scales_dtype), group_size, bits)))

    def forward(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(linear(x) for linear, x in zip(self.linears, xs))


def packed_reference(model: PackedLinears, xs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Eager outputs on weights dequantized 4096 rows at a time (the head's fp32 weight alone is 1 GB)."""
    out = []
    for linear, x in zip(model.linears, xs):
        parts = [F.linear(x, Q.dequantize_mlx(linear.w[r:r + 4096], linear.scales[r:r + 4096],
                                                linear.biases[r:r + 4096], linear.group_size, linear.bits,
                                                dtype=torch.float32).to(x.dtype))
                 for r in range(0, linear.w.shape[0], 4096)]
        out.append(torch.cat(parts, -1))
    return tuple(out)


# The 1.2B Llama-3.2-shaped model's decode products (q / o, k / v, gate / up, down, the tied head);
# copies of each are lowered so one call reads ~QGEMV1B_BYTES, most of it from memory, not cache.
QGEMV1B_SHAPES = [("q/o", 2048, 2048), ("k/v", 512, 2048), ("gate/up", 8192, 2048), ("down", 2048, 8192),
                  ("head", 128256, 2048)]
QGEMV1B_BYTES = 384 << 20


def qgemv1b_cases(quick: bool) -> Iterator[Case]:
    """`--quantize int4`'s layout (groups of 64, fp32 scales) at the 1.2B shapes; then groups of 32 and
    bf16 / fp16 scales at q/o and gate/up (fp32 activations: the table's error column reads fp32 only)."""
    configs = [(name, n, k, 64, torch.float32, torch.float32) for name, n, k in QGEMV1B_SHAPES]
    configs += [(name, n, k, g, sd, xd) for name, n, k in QGEMV1B_SHAPES[0:3:2]
                for g, sd, xd in ((32, torch.float32, torch.float32), (64, torch.bfloat16, torch.float32),
                                  (32, torch.float16, torch.float32))]
    for name, n, k, group_size, scales_dtype, x_dtype in configs[:1] if quick else configs:
        one = n * k // 2 + 2 * n * (k // group_size) * (4 if scales_dtype == torch.float32 else 2)
        copies = max(1, min(96, QGEMV1B_BYTES // one)) if not quick else 2
        module = PackedLinears(n, k, 4, group_size, scales_dtype, copies).eval()
        xs = tuple(torch.randn(1, 1, k).to(x_dtype) for _ in range(copies))
        label = (f"{name} [{n} x {k}] x{copies}, g{group_size}, scales {str(scales_dtype).removeprefix('torch.')}"
                 f", x {str(x_dtype).removeprefix('torch.')}")
        yield Case("qgemv1b", label, module, xs, lambda m=module, xs=xs: packed_reference(m, xs),
                   paths=("kernels on", "eight-groups path off", "avx512 off"), bytes_read=one * copies,
                   eager_timed=False)


SDPA_HQ, SDPA_HK, SDPA_D, SDPA_S = 9, 3, 64, 256


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def sdpa_cases(quick: bool) -> Iterator[Case]:
    """Queries at positions position .. position + L - 1 over the whole cache."""
    shapes = [(1, 255, torch.float32), (1, 128, torch.float32), (1, 128, torch.bfloat16),
              (2, 128, torch.float32), (4, 128, torch.float32), (8, 128, torch.float32),
              (16, 128, torch.float32), (32, 128, torch.float32), (64, 128, torch.float32)]
    for length, position, dtype in [shapes[1], shapes[-2]] if quick else shapes:
        q, k, v = (torch.randn(1, h, n, SDPA_D, dtype=dtype)
                   for h, n in ((SDPA_HQ, length), (SDPA_HK, SDPA_S), (SDPA_HK, SDPA_S)))
        mask = torch.arange(SDPA_S)[None, :] <= (position + torch.arange(length))[:, None]
        inputs = (q, k, v, mask)
        yield Case("sdpa", f"sdpa q {shape_text(q)}, kv {SDPA_S}, pos {position}", Lambda(attention), inputs,
                   lambda inputs=inputs: attention(*inputs), paths=("kernels on", "composed", "kernels off"))


def attention_bmm(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                  causal: bool = False) -> torch.Tensor:
    """Eager's composed attention: bmm, softmax, bmm."""
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores + mask
    if causal:
        scores = scores.masked_fill(torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, -1) @ v


ATTN_LENGTHS = (64, 128, 197, 512, 1500)


def attn_cases(quick: bool) -> Iterator[Case]:
    """Each configuration lowered once; `kernels on` against the blocked kernel switched off and eager."""
    configs = [(length, heads, "none", torch.float32) for length in ATTN_LENGTHS for heads in (4, 8, 12)]
    configs += [(length, 8, kind, dtype) for kind, dtype in (("causal", torch.float32), ("mask", torch.float32),
                                                             ("none", torch.bfloat16)) for length in ATTN_LENGTHS]
    if quick:
        configs = [(128, 4, "none", torch.float32), (197, 8, "causal", torch.float32)]
    for length, heads, kind, dtype in configs:
        q, k, v = (torch.randn(1, heads, length, 64).to(dtype) for _ in range(3))
        label = f"attn L {length} H {heads} {kind} {str(dtype).removeprefix('torch.')}"
        paths = ("kernels on", "blocked off")
        if kind == "mask":
            mask = torch.randn(1, 1, length, length).to(dtype)
            inputs: tuple[torch.Tensor, ...] = (q, k, v, mask)
            yield Case("attn", label, Lambda(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)),
                       inputs, lambda i=inputs: F.scaled_dot_product_attention(*i[:3], attn_mask=i[3]), paths,
                       peers={"eager bmm": lambda i=inputs: attention_bmm(*i)})
        else:
            causal = kind == "causal"
            inputs = (q, k, v)
            yield Case("attn", label,
                       Lambda(lambda q, k, v, c=causal: F.scaled_dot_product_attention(q, k, v, is_causal=c)),
                       inputs, lambda i=inputs, c=causal: F.scaled_dot_product_attention(*i, is_causal=c), paths,
                       peers={"eager bmm": lambda i=inputs, c=causal: attention_bmm(*i, causal=c)})


SOURCES: dict[str, Callable[[bool], Iterator[Case]]] = {
    "unary": unary_cases, "rows": rows_cases, "rope": rope_cases, "qgemv": qgemv_cases, "qgemv1b": qgemv1b_cases,
    "sdpa": sdpa_cases, "attn": attn_cases}


# ---------------------------------------------------------------- running

def delegate_run(buffer: bytes, inputs: tuple[torch.Tensor, ...],
                 path: RunAs) -> tuple[Callable[[], Any], Any]:
    """(one call, the Program to keep alive) for a new loaded copy of `buffer`, always run as `path` says."""
    program = Runtime.get().load_program(buffer)
    method = program.load_method("forward")
    args = list(inputs)

    def run() -> Any:
        was = _runtime.cpu_kernels_enabled(), _runtime.compile_enabled(), _runtime.qgemv_guided_split()
        _runtime.set_cpu_kernels(path.kernels)
        _runtime.set_compile(path.compiled)
        _runtime.set_qgemv_group32_path(path.group32)
        _runtime.set_qgemv_avx512_path(path.avx512)
        _runtime.set_qgemv_guided_split(path.guided)
        os.environ.update(path.env)  # read when the graph is built: the first and the tracing call
        try:
            return method.execute(args)
        finally:
            for key in path.env:
                os.environ.pop(key, None)
            _runtime.set_cpu_kernels(was[0])
            _runtime.set_compile(was[1])
            _runtime.set_qgemv_group32_path(True)
            _runtime.set_qgemv_avx512_path(True)
            _runtime.set_qgemv_guided_split(was[2])

    return run, program


@dataclass
class Row:
    case: str
    path: str
    median_s: float | None = None
    p90_s: float | None = None
    rounds: int = 0
    max_abs_err: float | None = None
    error: str | None = None
    bytes_read: int = 0
    cpu_s: float | None = None  # process CPU time per timed call (all threads), mean


def run_case(case: Case, settings: common.Settings, nodes: bool) -> list[Row]:
    """Lower `case` once, load it once per path, check each path against eager and time them all."""
    with torch.no_grad():
        reference = common.to_numpy(case.eager())
    paths = {name: PATHS[name] for name in case.paths}
    if nodes:
        paths |= {f"{name}, nodes": replace(PATHS[name], compiled=False) for name in case.paths}
    rows = {name: Row(case.label, name) for name in [*paths, "eager torch", *case.peers]}
    print(f"  {case.label}: lowering ...", file=sys.stderr, flush=True)
    try:
        buffer = lower(case.module, case.inputs).buffer
    except Exception as e:  # noqa: BLE001  (a case that cannot lower is a table entry)
        for name in paths:
            rows[name].error = common.one_line(e)
        buffer = None

    def eager() -> Any:
        with torch.no_grad():
            return case.eager()

    runs: dict[str, Callable[[], Any]] = {}
    keep = []
    for name, path in paths.items() if buffer is not None else ():
        try:
            run, program = delegate_run(buffer, case.inputs, path)
            keep.append(program)
            rows[name].max_abs_err = common.max_abs_err(run(), reference)  # the cold, node-by-node call
            run()  # the second call traces the compiled graph: not a fair estimate of a call
            runs[name] = run
        except Exception as e:  # noqa: BLE001
            rows[name].error = common.one_line(e)
    if case.eager_timed:
        runs["eager torch"] = eager
        rows["eager torch"].max_abs_err = 0.0
    else:
        del rows["eager torch"]
    for name, peer in case.peers.items():
        with torch.no_grad():
            rows[name].max_abs_err = common.max_abs_err(peer(), reference)
        runs[name] = peer
    estimates = {}
    for name, run in list(runs.items()):
        try:
            estimates[name] = common.warm_up(run, settings)
        except Exception as e:  # noqa: BLE001
            rows[name].error = common.one_line(e)
            del runs[name]
    cpu = {name: [0.0, 0] for name in runs}

    def with_cpu(name: str, fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            c0 = time.process_time()
            try:
                return fn()
            finally:
                cpu[name][0] += time.process_time() - c0
                cpu[name][1] += 1
        return run

    samples, errors = common.time_interleaved({k: with_cpu(k, f) for k, f in runs.items()}, estimates, settings)
    for name, (total, calls) in cpu.items():
        rows[name].cpu_s = total / calls if calls else None
    for name, xs in samples.items():
        row = rows[name]
        row.bytes_read = case.bytes_read
        row.error = errors.get(name, row.error)
        if xs:
            row.median_s, row.p90_s, row.rounds = float(np.median(xs)), float(np.percentile(xs, 90)), len(xs)
    return list(rows.values())


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def table(rows: list[Row]) -> str:
    headers = ["case", "path", "median", "p90", "n", "x on", "x eager", "CPU", "CPU x eager", "GB/s", "max|err|",
               "error"]
    right = [False, False, True, True, True, True, True, True, True, True, True, False]
    by_case: dict[str, dict[str, Row]] = {}
    for r in rows:
        by_case.setdefault(r.case, {})[r.path] = r
    lines = []
    for case, paths in by_case.items():
        on = paths["kernels on"].median_s
        eager = paths["eager torch"].median_s if "eager torch" in paths else None
        eager_cpu = paths["eager torch"].cpu_s if "eager torch" in paths else None
        for i, r in enumerate(paths.values()):
            lines.append([case if i == 0 else "", r.path, common.fmt_time(r.median_s),
                          common.fmt_time(r.p90_s),
                          str(r.rounds) if r.rounds else "-", ratio(r.median_s, on), ratio(r.median_s, eager),
                          common.fmt_time(r.cpu_s), ratio(r.cpu_s, eager_cpu),
                          f"{r.bytes_read / r.median_s / 1e9:.1f}" if r.bytes_read and r.median_s else "-",
                          "-" if r.max_abs_err is None else f"{r.max_abs_err:.1e}", r.error or ""])
    return common.format_table(headers, lines, right)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default=",".join(GROUPS), help=f"comma-separated groups of {','.join(GROUPS)}")
    p.add_argument("--quick", action="store_true", help="smoke run: 1-2 small cases a group")
    p.add_argument("--nodes", action="store_true", help="also time each delegate path node by node")
    p.add_argument("--budget", type=float, help="timed seconds per path and case (overrides the default)")
    p.add_argument("--threads", type=int, default=common.THREADS, help="eager torch's threads")
    p.add_argument("--match", default="", help="comma-separated label substrings: only cases whose label has one")
    args = p.parse_args(argv)
    groups = args.ops.split(",")
    unknown = set(groups) - set(GROUPS)
    if unknown:
        p.error(f"unknown op groups {sorted(unknown)}; choose from {list(GROUPS)}")
    torch.set_num_threads(args.threads)
    settings = common.QUICK if args.quick else common.Settings()
    if args.budget is not None:
        settings = replace(settings, budget_s=args.budget)
    started = time.perf_counter()
    meta = common.machine_meta(bandwidth=False) | {"quick": args.quick}
    rows: list[Row] = []
    for group in GROUPS:
        if group in groups:
            for case in SOURCES[group](args.quick):
                if not args.match or any(m in case.label for m in args.match.split(",")):
                    rows += run_case(case, settings, args.nodes)
    meta |= {"loadavg_end": [round(x, 2) for x in os.getloadavg()],
             "wall_s": round(time.perf_counter() - started, 1)}
    print()
    print(common.heading(meta))
    print(table(rows))
    for line in common.load_note(meta):
        print(line)


if __name__ == "__main__":
    main()
