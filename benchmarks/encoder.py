"""Transformer encoders on the CPU: the delegate, eager torch and ExecuTorch XNNPACK side by side.

Cases (batch 1, float32, random weights):
- `torch-layer`: `nn.TransformerEncoder` of 2 `nn.TransformerEncoderLayer`s (d 512, 8 heads, FFN 2048,
  GELU, post-norm) at T = 128, 512, 1500; eager torch takes its fused fast path (`_transformer_encoder_layer_fwd`)
- `bert`: transformers `BertModel` (BERT-base layer shapes: d 768, 12 heads, FFN 3072; 2 layers) at T = 128,
  512, 1500, SDPA attention
- `vit`: transformers `ViTModel` (ViT-B/16 layer shapes at 224 x 224: 197 tokens; 2 layers)
- `whisper-encoder`: the Whisper base encoder (6 layers, d 512, 8 heads; 80 x 3000 log-mel frames in,
  1500 positions out), from `WhisperConfig` with random weights (`benchmarks/speech.py` times whole
  transcriptions with the real weights)
- `demo-block`: the `mlx-delegate demo` transformer block (d 256, 4 heads, T 128)
- `attention`: `F.scaled_dot_product_attention` alone: 8 heads of 64 at L = S = 512 and 1500 (no mask),
  causal with heads of 80 at 512, and a prefill over a KV cache (9 query / 3 key heads of 64, 34 queries over
  a 2048-entry cache under a position mask, the layout `mlx_delegate.models.llama` exports)
- `llama-prefill`: a SmolLM2-135M-shaped `LlamaModel` (4 of its 30 layers) over a 64-token prompt, causal,
  no cache: the compute of a prefill (the LLM export adds the KV-cache writes; `benchmarks/llm.py`
  measures those through `generate`)

Engines: `mlx_delegate` (stock `executorch.runtime`, compiled graphs as by default), `eager torch`
(2 threads, `torch.no_grad()`), `ET XNNPACK` (its own export and lowering), and, when asked for,
`composed` (the delegate with its blocked attention kernel off, `MLX_DELEGATE_SDPA_BLOCKED=0` while its
graphs are built: the composed matmul + softmax path it replaced) and `omp` (the delegate with its large
fp32 products as one MKL call on MKL's OpenMP team, `_runtime.set_blas_split(False)` around each call:
what it did before it cut them into blocks on its own helper pool), `lent-team` (the caller's OpenMP
team lent to that pool on every call, its worker taking the pool's parts: `_runtime.set_pool_omp_team("always")`;
`own-pool`: never lent, "off"; the default, "auto", lends it where lent calls measure faster),
`measured` (each large fp32 product
shape split over that pool or run as one single-threaded call, whichever its recent calls timed faster:
`_blas.set_split_policy("measured")`; the default splits every one), `balanced` (every large product
split, the calling thread's block sized by the helpers' measured speed: `_blas.set_split_policy("balanced")`)
and `unfused-act` (the delegate
lowered with `disable={"fuse_linear_activation"}`: a linear's bias add and GELU as separate passes),
`mlx-linears` (fp32 linears as MLX's matmul plus broadcast adds for the bias and the residual, as before
2026-11-26 17:40: the delegate lowered with `disable={"fuse_linear_residual"}` and
`_runtime.set_linear_kernel(False)` while its graphs are built; by default the CPU linear kernel adds
each output block's bias and residual in cache) and `two-blocks` (split products cut into two blocks per pool thread instead of one:
`_blas.set_split_shape(2)`) and `mkl-blocks` (the blocks of split products on MKL's single-threaded
sgemm, `_blas.set_sgemm_kind("mkl")`, where processors other than Intel's with AVX-512 default to the runtime's own gemm).
Each is checked against
eager torch, then the engines take turns call by call (interleaved rounds, the order rotating). Every
row shows wall time and process CPU time per call (all threads, so 2 busy cores give CPU = 2 x wall).

    python benchmarks/encoder.py [--quick] [--cases torch-layer,whisper-encoder] [--engines delegate,eager]
                                 [--lengths 128,512] [--budget S] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Sequence

import common
import mlx_delegate
from common import ENGINES, Workload, fmt_time, format_table, machine_meta, max_abs_err, one_line, to_numpy
import torch
import torch.nn.functional as F
from torch import nn

ENGINE_KEYS = ("delegate", "mkl-blocks", "composed", "omp", "lent-team", "own-pool", "measured", "balanced", "unfused-act", "mlx-linears",
               "two-blocks", "eager", "xnnpack")
DEFAULT_ENGINES = ("delegate", "eager", "xnnpack")
CASES = ("torch-layer", "bert", "vit", "whisper-encoder", "demo-block", "attention", "llama-prefill")
LENGTHS = (128, 512, 1500)
QUICK_LENGTHS = (128,)


def _env(name: str) -> Callable[[], str | None]:
    return lambda: os.environ.get(name)


def _set_env(name: str) -> Callable[[str | None], None]:
    def set_(value: str | None) -> None:
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    return set_


def _delegate_with(get: Callable[[], Any], set_: Callable[[Any], Any], value: Any) -> common.Engine:
    return lambda w: common.switched(ENGINES["delegate"][1], get, set_, value)(w)


def _composed(w: Workload) -> common.Prepared:
    """The delegate with the blocked attention kernel off while its graphs are built and run."""
    return _delegate_with(_env("MLX_DELEGATE_SDPA_BLOCKED"), _set_env("MLX_DELEGATE_SDPA_BLOCKED"), "0")(w)


def _omp_team(w: Workload) -> common.Prepared:
    """The delegate with large fp32 products as one MKL call on MKL's OpenMP team (as before the
    runtime cut them into blocks on its own helper pool: `_runtime.set_blas_split(False)`)."""
    from mlx_delegate import _runtime

    return _delegate_with(lambda: True, _runtime.set_blas_split, False)(w)


def _lent_team(w: Workload) -> common.Prepared:
    """The delegate with the caller's OpenMP team lent to its kernel pool for each call
    (`_runtime.set_pool_omp_team("always")`): torch's OpenMP worker takes the pool's parts."""
    from mlx_delegate import _runtime

    return _delegate_with(_runtime.pool_omp_team, _runtime.set_pool_omp_team, "always")(w)


def _own_pool(w: Workload) -> common.Prepared:
    """The delegate with its kernel pool's own helpers only (`_runtime.set_pool_omp_team("off")`)."""
    from mlx_delegate import _runtime

    return _delegate_with(_runtime.pool_omp_team, _runtime.set_pool_omp_team, "off")(w)


def _measured_split(w: Workload) -> common.Prepared:
    """The delegate with each large fp32 product shape split over its helper pool or run as one
    call, by measured time (`_blas.set_split_policy("measured")`)."""
    from mlx_delegate import _blas

    return _delegate_with(_blas.split_policy, _blas.set_split_policy, "measured")(w)


def _balanced_split(w: Workload) -> common.Prepared:
    """The delegate with each split product's calling-thread block sized by the helpers' measured
    speed (`_blas.set_split_policy("balanced")`)."""
    from mlx_delegate import _blas

    return _delegate_with(_blas.split_policy, _blas.set_split_policy, "balanced")(w)


def _mlx_linears(w: Workload) -> common.Prepared:
    """The delegate with fp32 linears as MLX's matmul plus broadcast adds (bias, residual): lowered
    without `fuse_linear_residual`, graphs built with `_runtime.set_linear_kernel(False)`."""
    from mlx_delegate import _runtime

    lowering = common._executorch(lambda: mlx_delegate.MLXPartitioner(disable={"fuse_linear_residual"}))
    return common.switched(lowering, _runtime.linear_kernel, _runtime.set_linear_kernel, False)(w)


def _two_blocks(w: Workload) -> common.Prepared:
    """The delegate with split products cut into two blocks per pool thread (the default before
    2026-11-26 07:50: `_blas.set_split_shape(2)`)."""
    from mlx_delegate import _blas

    return _delegate_with(_blas.split_shape, lambda s: _blas.set_split_shape(*s), (2, "longer"))(w)


LOCAL_ENGINES = {
    "mlx-linears": ("mlx_delegate, MLX matmul + adds", _mlx_linears),
    "two-blocks": ("mlx_delegate, 2 blocks per thread", _two_blocks),
    "composed": ("mlx_delegate, attention composed", _composed),
    "omp": ("mlx_delegate, products on MKL's OpenMP team", _omp_team),
    "lent-team": ("mlx_delegate, OpenMP team lent on every call", _lent_team),
    "own-pool": ("mlx_delegate, OpenMP team never lent", _own_pool),
    "measured": ("mlx_delegate, split by measured time", _measured_split),
    "balanced": ("mlx_delegate, balanced split", _balanced_split),
    # the linear + GELU / SiLU fusion off: bias add and activation as their own passes
    "unfused-act": ("mlx_delegate, linear act unfused",
                    common._executorch(lambda: mlx_delegate.MLXPartitioner(disable={"fuse_linear_activation"}))),
}


def engine(key: str) -> tuple[str, Any]:
    return LOCAL_ENGINES[key] if key in LOCAL_ENGINES else ENGINES[key]


def _no_mlx() -> Any:
    raise NotImplementedError("no MLX Python mirror for this case")


class HiddenStates(nn.Module):
    """A transformers model's last hidden state (one tensor out, for every engine alike)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.model(*args).last_hidden_state


def torch_layer(lengths: Sequence[int]) -> Iterator[Workload]:
    layer = nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.0, activation="gelu", batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    for t in lengths:
        yield Workload(f"torch-layer T={t}", model, (torch.randn(1, t, 512),), _no_mlx)


def bert(lengths: Sequence[int]) -> Iterator[Workload]:
    from transformers import BertConfig, BertModel

    config = BertConfig(num_hidden_layers=2, max_position_embeddings=max(lengths), attn_implementation="sdpa")
    model = HiddenStates(BertModel(config, add_pooling_layer=False)).eval()
    for t in lengths:
        ids = torch.randint(0, config.vocab_size, (1, t))
        yield Workload(f"bert T={t}", model, (ids,), _no_mlx)


def vit() -> Iterator[Workload]:
    from transformers import ViTConfig, ViTModel

    config = ViTConfig(num_hidden_layers=2, attn_implementation="sdpa")
    model = HiddenStates(ViTModel(config, add_pooling_layer=False)).eval()
    yield Workload("vit T=197", model, (torch.randn(1, 3, 224, 224),), _no_mlx)


def whisper_encoder() -> Iterator[Workload]:
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    config = WhisperConfig(d_model=512, encoder_layers=6, encoder_attention_heads=8, encoder_ffn_dim=2048,
                           num_mel_bins=80, attn_implementation="sdpa")
    encoder = WhisperEncoder(config).eval()
    yield Workload("whisper-encoder T=1500", HiddenStates(encoder), (torch.randn(1, 80, 3000),), _no_mlx)


def demo_block() -> Iterator[Workload]:
    from mlx_delegate.cli.demo import DemoBlock, DemoConfig

    cfg = DemoConfig()
    yield Workload(f"demo-block T={cfg.seq}", DemoBlock(cfg).eval(), (torch.randn(1, cfg.seq, cfg.dim),), _no_mlx)


class Attention(nn.Module):
    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *mask: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, *mask, is_causal=self.causal, enable_gqa=True)


def attention(quick: bool) -> Iterator[Workload]:
    def qkv(hq: int, hk: int, lq: int, s: int, d: int) -> tuple[torch.Tensor, ...]:
        return torch.randn(1, hq, lq, d), torch.randn(1, hk, s, d), torch.randn(1, hk, s, d)

    rows = [("L=512 D=64", False, qkv(8, 8, 512, 512, 64)), ("L=512 D=80 causal", True, qkv(8, 8, 512, 512, 80))]
    if not quick:
        rows.append(("L=1500 D=64", False, qkv(8, 8, 1500, 1500, 64)))
    cache = 2048
    position_mask = torch.arange(cache)[None, :] <= torch.arange(34)[:, None]
    rows.append(("prefill 34 of 2048 GQA", False, (*qkv(9, 3, 34, cache, 64), position_mask)))
    for name, causal, inputs in rows:
        yield Workload(f"sdpa {name}", Attention(causal), inputs, _no_mlx)


def llama_prefill(tokens: int) -> Iterator[Workload]:
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=4,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                         rope_theta=100000.0, tie_word_embeddings=True, use_cache=False,
                         attn_implementation="sdpa")

    class Prefill(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = LlamaModel(config)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=ids, use_cache=False).last_hidden_state

    ids = torch.randint(0, config.vocab_size, (1, tokens))
    yield Workload(f"llama-prefill T={tokens}", Prefill().eval(), (ids,), _no_mlx, tokens=tokens)


def workloads(cases: Sequence[str], quick: bool, lengths: Sequence[int] | None = None) -> Iterator[Workload]:
    lengths = lengths or (QUICK_LENGTHS if quick else LENGTHS)
    sources: dict[str, Callable[[], Iterator[Workload]]] = {
        "torch-layer": lambda: torch_layer(lengths),
        "bert": lambda: bert(lengths),
        "vit": vit,
        "whisper-encoder": whisper_encoder,
        "demo-block": demo_block,
        "attention": lambda: attention(quick),
        "llama-prefill": lambda: llama_prefill(16 if quick else 64),
    }
    for case in cases:
        torch.manual_seed(0)
        yield from sources[case]()


@dataclass
class Row:
    case: str
    engine: str
    wall_s: float | None = None  # median per call
    cpu_s: float | None = None  # median process CPU time per call (all threads)
    rounds: int = 0
    tokens: int = 0
    max_abs_err: float | None = None
    load_s: float | None = None  # export + lower + load
    note: str = ""
    error: str | None = None


def time_rounds(runs: dict[str, Callable[[], Any]], budget_s: float, min_rounds: int,
                estimate: dict[str, float]) -> tuple[dict[str, list[tuple[float, float]]], dict[str, str]]:
    """(wall, CPU) seconds per call, one call per engine per round, the order rotating each round."""
    rounds = max(min_rounds, min(60, int(budget_s / max(max(estimate.values(), default=1.0), 1e-4))))
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
    errors: dict[str, str] = {}
    order = list(runs)
    gc.disable()
    try:
        for r in range(rounds):
            active = [k for k in order if k not in errors]
            shift = r % len(active) if active else 0
            for k in active[shift:] + active[:shift]:
                try:
                    w0, c0 = time.perf_counter(), time.process_time()
                    runs[k]()
                    samples[k].append((time.perf_counter() - w0, time.process_time() - c0))
                except Exception as e:  # noqa: BLE001  (an engine failing mid-run is a table entry)
                    errors[k] = one_line(e)
    finally:
        gc.enable()
    return samples, errors


def counting_lent(run: Callable[[], Any], lent: dict[str, int], key: str) -> Callable[[], Any]:
    """`run`, adding to lent[key] each call that lent the caller's OpenMP team to the kernel pool."""
    from mlx_delegate import _runtime

    def counted() -> Any:
        before = _runtime.omp_team_stats()["calls"]
        out = run()
        lent[key] += _runtime.omp_team_stats()["calls"] - before
        return out

    return counted


def run_case(w: Workload, engines: Sequence[str], budget_s: float, min_rounds: int) -> list[Row]:
    with torch.no_grad():
        reference = to_numpy(w.module.eval()(*w.inputs))
    rows = {k: Row(w.case, engine(k)[0], tokens=w.tokens) for k in engines}
    ready: dict[str, Any] = {}
    estimate: dict[str, float] = {}
    for k in engines:
        print(f"  {w.case}: preparing {engine(k)[0]} ...", file=sys.stderr, flush=True)
        row = rows[k]
        try:
            t0 = time.perf_counter()
            prepared = engine(k)[1](w)
            row.load_s, row.note = time.perf_counter() - t0, prepared.note
            row.max_abs_err = max_abs_err(prepared.run(), reference)
            t0 = time.perf_counter()
            prepared.run()
            estimate[k] = time.perf_counter() - t0
            ready[k] = prepared
        except Exception as e:  # noqa: BLE001  (an engine that fails is reported, not fatal)
            row.error = one_line(e)
    print(f"  {w.case}: timing {len(ready)} engines ...", file=sys.stderr, flush=True)
    lent = {k: 0 for k in ready if k not in ("eager", "xnnpack")}
    samples, errors = time_rounds({k: counting_lent(p.run, lent, k) if k in lent else p.run
                                   for k, p in ready.items()}, budget_s, min_rounds, estimate)
    for k, xs in samples.items():
        row = rows[k]
        row.error = errors.get(k, row.error)
        if xs:
            row.wall_s = statistics.median(x[0] for x in xs)
            row.cpu_s = statistics.median(x[1] for x in xs)
            row.rounds = len(xs)
            if k in lent:  # how many timed calls lent the OpenMP team (the default chooses by measurement)
                row.note += f"; team lent {lent[k]}/{len(xs)}"
    del ready
    gc.collect()
    return list(rows.values())


def _f(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else format(x, spec) + suffix


def table(rows: Sequence[Row]) -> str:
    base = {r.case: r for r in rows if r.engine == ENGINES["eager"][0]}
    xnn = {r.case: r for r in rows if r.engine == ENGINES["xnnpack"][0]}
    headers = ["case", "engine", "wall", "CPU", "n", "tok/s", "x eager", "x XNNPACK", "max|err|", "load",
               "delegation / error"]
    right = [False, False] + [True] * 8 + [False]
    out, last = [], None
    for r in rows:
        e, x = base.get(r.case), xnn.get(r.case)
        vs_eager = r.wall_s / e.wall_s if r.wall_s and e and e.wall_s else None
        vs_xnn = r.wall_s / x.wall_s if r.wall_s and x and x.wall_s else None
        tok_s = r.tokens / r.wall_s if r.tokens and r.wall_s else None
        out.append([r.case if r.case != last else "", r.engine, fmt_time(r.wall_s), fmt_time(r.cpu_s),
                    str(r.rounds or "-"), _f(tok_s, ".0f"), _f(vs_eager, ".2f", "x"), _f(vs_xnn, ".2f", "x"),
                    _f(r.max_abs_err, ".1e"), fmt_time(r.load_s), f"ERROR {r.error}" if r.error else r.note])
        last = r.case
    return format_table(headers, out, right)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="T = 128 only, a 16-token prefill, fewer rounds")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    p.add_argument("--engines", default=",".join(DEFAULT_ENGINES),
                   help=f"comma-separated subset of {','.join(ENGINE_KEYS)} (default: {','.join(DEFAULT_ENGINES)})")
    p.add_argument("--budget", type=float, help="timed seconds per case (default 10, quick 2)")
    p.add_argument("--lengths", type=lambda v: [int(t) for t in v.split(",")],
                   help=f"sequence lengths of torch-layer and bert (default {','.join(map(str, LENGTHS))}, quick 128)")
    p.add_argument("--json", metavar="PATH", help="also write meta and rows as JSON")
    args = p.parse_args(argv)
    for name, given, known in (("cases", args.cases, CASES), ("engines", args.engines, ENGINE_KEYS)):
        unknown = set(given.split(",")) - set(known)
        if unknown:
            p.error(f"unknown {name} {sorted(unknown)}; choose from {list(known)}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    engines = [k for k in ENGINE_KEYS if k in args.engines.split(",")]
    cases = [c for c in CASES if c in args.cases.split(",")]
    budget = args.budget if args.budget is not None else (2.0 if args.quick else 10.0)
    started = time.perf_counter()
    meta = machine_meta(bandwidth=False) | {"quick": args.quick, "budget_s": budget}
    rows: list[Row] = []
    for w in workloads(cases, args.quick, args.lengths):
        rows += run_case(w, engines, budget, min_rounds=3)
    meta |= {"loadavg_end": [round(x, 2) for x in os.getloadavg()], "wall_s": round(time.perf_counter() - started, 1)}
    common.print_report(meta, table(rows), args.json, {"rows": [asdict(r) for r in rows]})


if __name__ == "__main__":
    main()
