"""LLM prefill and decode, side by side: SmolLM2-135M and a 1.2B Llama-3.2-shaped model.

Each engine runs the same `mlx_delegate.models.llama.Model` (weights shared):

- `mlx_delegate`: `mlx_delegate.pipelines.llm.export.to_pte` (one dynamic method, KV cache resident in the
  delegate) through the stock `executorch.runtime`, compiled graphs on (the default). The position
  is a tensor, so every decode step has one signature: the warm-up's second step traces it and every
  timed step replays that `mx::compile`d graph. Prefill runs one length per round, so after one warm
  round it is compiled too (in chat use a new prompt length runs node by node once).
- `mlx_delegate, nodes`: the same program node by node (compiled graphs off, as with
  MLX_DELEGATE_COMPILE=0).
- `eager torch`: the module itself, KV cache written in place (`index_copy_`), 2 threads.
- `ET XNNPACK` (fp32): the same module exported with the cache update as `index_copy`, lowered
  with `XnnpackPartitioner` (what XNNPACK does not take runs on ExecuTorch's portable kernels).
- `MLX Python`: the model written directly in MLX (mlx-lm style: `mx.fast` RMSNorm, RoPE and SDPA,
  preallocated KV cache), weights copied from torch.
- `ET Llama XNNPACK`: ExecuTorch's own Llama export from the executorch wheel (`benchmarks/et_llama.py`:
  `examples/models/llama` with its KV cache and custom SDPA / update-cache ops, XNNPACK), on the same
  weights; fp32, and 8da4w (int8 dynamic activations, int4 weights in groups of 32) in the `gguf` rows.
  Its export takes 10-20 minutes here, so the program is cached (`$MLX_DELEGATE_CACHE`, keyed by the
  weights' bytes and options): its `load` column counts the export only on a first run.
- `gguf` rows (SmolLM2): the file's own quantization (Q4_1 linears, Q8_0 embedding / tied head). The
  delegate runs the GGUF blocks as they are (`mlx_delegate.models.gguf`); `llama.cpp` is
  llama-cpp-python on the same file, same threads (an optional dependency: the row says "not
  installed" without it). Their max|err| is against eager torch on the dequantized weights (fp32 rows
  run those dequantized weights).

Every engine but MLX Python runs the fixed-shape model (RoPE and the cache write at a tensor position,
attention over the whole cache of `--prompt + --decode + 8` positions under a position mask); the MLX
Python mirror slices its cache to the current length (mlx-lm's way).

A round is one prefill of `--prompt` tokens at position 0 followed by `--decode` single-token steps
(fixed token ids, so every engine does the same work); figures are medians over rounds. Engines take
turns within each round for the small model; for the 1.2B model the delegate and eager torch take
turns (they share the machine's load alike), joined by the others while the free memory holds twice the
largest engine loaded so far; the rest run one after another, each freed before the next is built. The memory bandwidth
is probed in the same run, at the start and after each model's rounds; `% bw` is decode tok/s over the
bound, at the mean of the probes before and after that row's rounds (the machine's bandwidth drifts
over minutes), from reading every weight once per token (for the weight-only quantized rows the bytes
read are the program's: its .pte size, packed weights plus their scales and biases).

    python benchmarks/llm.py [--quick] [--json out.json] [--models smollm2,1.2b] [--dtypes fp32,bf16]
"""

from __future__ import annotations

import argparse
import atexit
import copy
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from common import (  # first: mlx_delegate before mlx
    available_mb, format_table, machine_meta, memory_bandwidth_gbs, one_line, peak_rss_mb, rss_mb)
import mlx.core as mx  # noqa: I001
import mlx.nn as mnn
import numpy as np
import torch
from executorch.runtime import Runtime

from mlx_delegate import _runtime
from mlx_delegate.pipelines.llm import export as llm_export
from mlx_delegate.models import llama as llama_module
from mlx_delegate.models import loading
from mlx_delegate.models.llama import Model, ModelArgs

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MX_DTYPES = {torch.float32: mx.float32, torch.bfloat16: mx.bfloat16}
QUANTIZED = ("int8", "int4", "gguf")  # delegate rows, when llm.export.to_pte has quantize=; gguf: see below
ENGINE_KEYS = {"mlx_delegate": "delegate", "mlx_delegate, nodes": "nodes", "MLX Python": "mlx",
               "eager torch": "eager", "ET XNNPACK": "xnnpack", "ET Llama XNNPACK": "et-llama",
               "llama.cpp": "llama.cpp"}
# Opt-in: ExecuTorch's Llama export lowers for 20+ min here; llama-cpp-python is an optional install.
DEFAULT_ENGINES = [k for k in ENGINE_KEYS.values() if k not in ("et-llama", "llama.cpp")]
GGUF = "gguf"  # the dtype label of the rows running a GGUF file's own quantization


# ---------------------------------------------------------------- models

@dataclass(frozen=True)
class ModelSpec:
    key: str
    build: Callable[[int], Model]  # max_seq_len -> fp32 model
    # Engines loaded together and taking turns each round (True: all); the others run one after another.
    interleave: bool | frozenset[str]
    quantized: bool = True  # int8/int4 rows (one more export each)
    gguf: Callable[[], Path] | None = None  # the GGUF file whose own quantization the `gguf` rows run


def smollm2(max_seq_len: int) -> Model:
    """The fp32 rows: the GGUF's weights dequantized (the `gguf` rows keep its quantization)."""
    return loading.load("smollm2", max_seq_len=max_seq_len, dequantize=True).model


def random_llama(max_seq_len: int, **shape: Any) -> Model:
    from transformers import LlamaConfig

    config = LlamaConfig(**shape, max_position_embeddings=max(max_seq_len, 2048),
                         rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    return loading.from_config(config, max_seq_len=max_seq_len, seed=0).model


LLAMA_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True)
TINY = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=256, vocab_size=1024, tie_word_embeddings=True)

MODELS = {
    "smollm2": ModelSpec("SmolLM2-135M", smollm2, interleave=True, gguf=loading.smollm2_path),
    "1.2b": ModelSpec("Llama-1.2B (random)", lambda n: random_llama(n, **LLAMA_1B),
                      interleave=frozenset({"eager torch", "mlx_delegate"})),
    "tiny": ModelSpec("tiny Llama (random)", lambda n: random_llama(n, **TINY), interleave=True),
}


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes one decode step reads: every parameter once (tied weights count once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


# ---------------------------------------------------------------- engines

class Runner:
    """One engine on one model: `step(tokens, pos)` -> last-position logits (materialised)."""

    def step(self, tokens: list[int], pos: int) -> np.ndarray:
        raise NotImplementedError


@contextmanager
def plain_kv_update(in_place: bool) -> Iterator[None]:
    """The model's cache update (at a tensor position) as plain torch `index_copy`: in place for
    eager, functional for export."""

    def update(cache: torch.Tensor, new: torch.Tensor, start_pos: torch.Tensor) -> torch.Tensor:
        index = start_pos.reshape(1) + torch.arange(new.shape[2])
        if in_place:
            return cache.index_copy_(2, index, new)  # the caller's copy_ onto itself is a no-op
        return cache.index_copy(2, index, new)

    saved = llama_module.kv_cache_update_at
    llama_module.kv_cache_update_at = update
    try:
        yield
    finally:
        llama_module.kv_cache_update_at = saved


def _inputs(tokens: list[int], pos: int) -> list[torch.Tensor]:
    return [torch.tensor([tokens], dtype=torch.long), torch.tensor([pos], dtype=torch.long)]


# Programs go through files: `.buffer` bytes are one more copy of the weights, and the
# runtime binding copies bytes it is given once more (a 1.2B model would not fit).
PTE_DIR = Path(tempfile.mkdtemp(prefix="mlx_delegate_bench_"))
atexit.register(shutil.rmtree, PTE_DIR, ignore_errors=True)


def pte_file(program: Any) -> Path:
    """Streams an ExecutorchProgramManager to a new file under PTE_DIR."""
    path = Path(tempfile.mkstemp(suffix=".pte", dir=PTE_DIR)[1])
    with path.open("wb") as f:
        program.write_to_file(f)
    return path


class MethodRunner(Runner):
    def __init__(self, pte: Path, compile_graphs: bool = True) -> None:
        self.program_bytes = pte.stat().st_size
        self.program = Runtime.get().load_program(pte)
        self.method = self.program.load_method("forward")
        self.compile_graphs = compile_graphs

    def step(self, tokens: list[int], pos: int) -> np.ndarray:
        was = _runtime.compile_enabled()
        _runtime.set_compile(self.compile_graphs)
        try:
            return self.method.execute(_inputs(tokens, pos))[0][0, -1].float().numpy()
        finally:
            _runtime.set_compile(was)


class SharedPte:
    """One export for the two delegate rows: built by the first, handed over (and dropped) by the second."""

    def __init__(self, model: Model, quantize: str | None = None) -> None:
        self.model, self.quantize, self.pte = model, quantize, None

    def get(self) -> Path:
        if self.pte is None:
            model = copy.deepcopy(self.model) if self.quantize else self.model  # quantizing works in place
            self.pte = pte_file(llm_export.to_executorch(model, quantize=self.quantize))
            gc.collect()
        return self.pte

    def take(self) -> Path:
        pte, self.pte = self.get(), None
        return pte


class EagerRunner(Runner):
    def __init__(self, model: Model) -> None:
        self.model = model

    def step(self, tokens: list[int], pos: int) -> np.ndarray:
        with torch.no_grad(), plain_kv_update(in_place=True):
            return self.model(*_inputs(tokens, pos), last_only=True)[0, -1].float().numpy()


def xnnpack(model: Model) -> Runner:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    with plain_kv_update(in_place=False):
        ep = llm_export.export_model(model)
    with llm_export.size_oblivious():
        edge = to_edge_transform_and_lower(ep, transform_passes=[llm_export.RestoreExportedRanges(ep)],
                                           partitioner=[XnnpackPartitioner()])
    pte = pte_file(edge.to_executorch())
    del edge, ep
    gc.collect()
    model.reset_cache()
    return MethodRunner(pte)


class LogitsRunner(MethodRunner):
    """A program returning [1, vocab] or [1, L, vocab] logits (ExecuTorch's Llama export)."""

    def step(self, tokens: list[int], pos: int) -> np.ndarray:
        out = self.method.execute(_inputs(tokens, pos))[0]
        return out.reshape(-1, out.shape[-1])[-1].float().numpy()


def et_llama(model: Model, qmode: str | None = None) -> Runner:
    import et_llama as et
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (registers the custom ops)

    pte = et.export(model, Path(tempfile.mkdtemp(dir=PTE_DIR)), qmode=qmode, group_size=32)
    gc.collect()
    return LogitsRunner(pte)


class LlamaCppRunner(Runner):
    """llama.cpp (llama-cpp-python) on a GGUF file; pos 0 starts over with an empty KV cache."""

    def __init__(self, path: Path, n_ctx: int) -> None:
        try:
            import llama_cpp
            from llama_cpp import Llama
        except ImportError as e:
            raise RuntimeError("not installed (benchmarks/README.md: installing the llama.cpp peer)") from e
        self._llama_cpp = llama_cpp
        threads = torch.get_num_threads()
        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads,
                         n_threads_batch=threads, verbose=False)
        self.program_bytes = path.stat().st_size
        self.n_vocab = self.llm.n_vocab()

    def step(self, tokens: list[int], pos: int) -> np.ndarray:
        if pos == 0:
            self.llm.reset()
            ctx = self.llm._ctx  # its KV cache too: llama.cpp refuses positions that go backwards
            if hasattr(ctx, "memory_clear"):
                ctx.memory_clear(True)
            else:
                ctx.kv_cache_clear()
        if self.llm.n_tokens != pos:
            raise RuntimeError(f"llama.cpp is at position {self.llm.n_tokens}, not {pos}")
        self.llm.eval(tokens)
        # The last position's logits from the context: llama-cpp-python >= 0.3.x fills `scores` only with
        # logits_all=True (0.3.36 leaves them stale), and its batch asks for the last position's alone.
        logits = self._llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).copy()


# ---------------------------------------------------------------- MLX Python mirror

class MxAttention(mnn.Module):
    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim, self.base = (a.num_attention_heads, a.num_key_value_heads,
                                                             a.head_dim, a.rope_theta)
        dim, bias = a.hidden_size, a.attention_bias
        self.q_proj = mnn.Linear(dim, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = mnn.Linear(dim, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = mnn.Linear(dim, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = mnn.Linear(self.n_heads * self.head_dim, dim, bias=bias)

    def __call__(self, x: mx.array, cache: list[mx.array], offset: int) -> mx.array:
        b, n, _ = x.shape

        def heads(t: mx.array, h: int) -> mx.array:
            return t.reshape(b, n, h, self.head_dim).transpose(0, 2, 1, 3)

        q, k, v = heads(self.q_proj(x), self.n_heads), heads(self.k_proj(x), self.n_kv), heads(self.v_proj(x), self.n_kv)
        q = mx.fast.rope(q, self.head_dim, traditional=False, base=self.base, scale=1.0, offset=offset)
        k = mx.fast.rope(k, self.head_dim, traditional=False, base=self.base, scale=1.0, offset=offset)
        end = offset + n
        cache[0][..., offset:end, :] = k
        cache[1][..., offset:end, :] = v
        out = mx.fast.scaled_dot_product_attention(q, cache[0][..., :end, :], cache[1][..., :end, :],
                                                   scale=self.head_dim ** -0.5, mask="causal" if n > 1 else None)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))


class MxMLP(mnn.Module):
    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = mnn.Linear(a.hidden_size, a.intermediate_size, bias=a.mlp_bias)
        self.up_proj = mnn.Linear(a.hidden_size, a.intermediate_size, bias=a.mlp_bias)
        self.down_proj = mnn.Linear(a.intermediate_size, a.hidden_size, bias=a.mlp_bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(mnn.silu(self.gate_proj(x)) * self.up_proj(x))


class MxNorm(mnn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = mx.ones((dim,)), eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.weight, self.eps)


class MxBlock(mnn.Module):
    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.self_attn, self.mlp = MxAttention(a), MxMLP(a)
        self.input_layernorm = MxNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = MxNorm(a.hidden_size, a.rms_norm_eps)

    def __call__(self, x: mx.array, cache: list[mx.array], offset: int) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), cache, offset)
        return h + self.mlp(self.post_attention_layernorm(h))


class MxLlamaModel(mnn.Module):
    def __init__(self, a: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = mnn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = [MxBlock(a) for _ in range(a.num_hidden_layers)]
        self.norm = MxNorm(a.hidden_size, a.rms_norm_eps)


class MxLlama(mnn.Module):
    """Parameter names equal the torch model's, so its state dict loads as is."""

    def __init__(self, a: ModelArgs, dtype: mx.Dtype) -> None:
        super().__init__()
        self.args = a
        self.model = MxLlamaModel(a)
        if not a.tie_word_embeddings:
            self.lm_head = mnn.Linear(a.hidden_size, a.vocab_size, bias=False)
        shape = (1, a.num_key_value_heads, a.max_seq_len, a.head_dim)
        self._cache = [[mx.zeros(shape, dtype), mx.zeros(shape, dtype)] for _ in range(a.num_hidden_layers)]

    def __call__(self, tokens: mx.array, offset: int) -> mx.array:
        h = self.model.embed_tokens(tokens)
        for layer, cache in zip(self.model.layers, self._cache):
            h = layer(h, cache, offset)
        h = self.model.norm(h[:, -1:])
        return self.model.embed_tokens.as_linear(h) if self.args.tie_word_embeddings else self.lm_head(h)


class MlxRunner(Runner):
    def __init__(self, model: Model, dtype: torch.dtype) -> None:
        self.mirror = MxLlama(model.args, MX_DTYPES[dtype])
        weights = [(k, mx.array(v.detach().float().numpy()).astype(MX_DTYPES[dtype]))
                   for k, v in model.state_dict().items()]
        self.mirror.load_weights(weights, strict=True)
        mx.eval(self.mirror.parameters(), self.mirror._cache)

    def step(self, tokens: list[int], pos: int) -> np.ndarray:
        logits = self.mirror(mx.array([tokens]), pos)
        mx.eval(logits, self.mirror._cache)
        return np.array(logits[0, -1].astype(mx.float32))


# ---------------------------------------------------------------- rows

@dataclass
class Row:
    model: str
    dtype: str
    engine: str
    prefill_tok_s: float | None = None
    decode_tok_s: float | None = None
    bw_share: float | None = None  # decode tok/s / bandwidth bound
    max_abs_err: float | None = None  # prefill logits vs eager torch in the same dtype
    rounds: int = 0
    load_s: float | None = None
    rss_delta_mb: float | None = None
    program_bytes: int | None = None  # the .pte size, for the delegate rows
    note: str = ""
    error: str | None = None
    prefill_s: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)  # per token


@dataclass
class Job:
    engine: str
    dtype: str
    build: Callable[[], Runner]
    note: str = ""
    warm_rounds: int = 0  # full untimed rounds after the warm-up call (so the prefill length is compiled)

    @property
    def key(self) -> str:
        return f"{self.engine} [{self.dtype}]"


def gguf_jobs(path: Path, fp32: Model, engines: Sequence[str],
              requantized: Sequence[str] = ()) -> tuple[Callable[[], Model], Callable[[Model], list[Job]]]:
    """The `gguf` rows: the delegate on the file's own blocks, llama.cpp on the file, ExecuTorch's
    Llama export in 8da4w from the same (dequantized) weights; and the delegate's `requantized` modes
    (int4, int8) of those weights, taking turns with llama.cpp in the same rounds."""
    def typed() -> Model:
        return loading.load(path, max_seq_len=fp32.args.max_seq_len).model.eval()

    def jobs(m: Model) -> list[Job]:
        out = [Job("mlx_delegate", GGUF, lambda: MethodRunner(SharedPte(m).take()), "GGUF blocks as they are",
                   warm_rounds=1),
               Job("llama.cpp", GGUF, lambda: LlamaCppRunner(path, fp32.args.max_seq_len), "same GGUF file"),
               Job("ET Llama XNNPACK", GGUF, lambda: et_llama(fp32, "8da4w"), "8da4w, group 32")]
        out += [Job("mlx_delegate", q, lambda q=q: MethodRunner(SharedPte(fp32, q).take()),
                    "requantized from the dequantized GGUF", warm_rounds=1) for q in requantized]
        return [j for j in out if ENGINE_KEYS[j.engine] in engines]

    return typed, jobs


def jobs_for(model: Model, dtypes: Sequence[str], quantized: Sequence[str], engines: Sequence[str]) -> Iterator[tuple[str, Callable[[], Model], list[Job]]]:
    """(dtype label, model in that dtype, engine jobs) per dtype, then the quantized rows (pass no
    `quantized` when they run in the `gguf` group instead)."""
    for label in dtypes:
        def typed(label: str = label) -> Model:
            return model if label == "fp32" else copy.deepcopy(model).to_dtype(DTYPES[label])

        def jobs(m: Model, label: str = label) -> list[Job]:
            pte = SharedPte(m)
            out = [Job("mlx_delegate", label, lambda: MethodRunner(pte.get()), "compiled graphs", warm_rounds=1),
                   Job("mlx_delegate, nodes", label, lambda: MethodRunner(pte.take(), compile_graphs=False),
                       "node by node"),
                   Job("MLX Python", label, lambda: MlxRunner(m, DTYPES[label])),
                   Job("eager torch", label, lambda: EagerRunner(m))]
            if label == "fp32":
                out.append(Job("ET XNNPACK", label, lambda: xnnpack(m), "our model, index_copy cache"))
                out.append(Job("ET Llama XNNPACK", label, lambda: et_llama(m), "examples/models/llama, custom SDPA"))
            return [j for j in out if ENGINE_KEYS[j.engine] in engines]

        yield label, typed, jobs
    # Quantized from the fp32 weights, also when no fp32 rows were asked for (`--dtypes ""`).
    for q in (q for q in quantized if q != GGUF):
        def quantized_jobs(m: Model, q: str = q) -> list[Job]:
            return [Job("mlx_delegate", q, lambda: MethodRunner(SharedPte(m, q).take()), "compiled graphs",
                        warm_rounds=1)]

        yield q, lambda: model, quantized_jobs


def workload(m: Model, args: argparse.Namespace) -> tuple[list[int], list[int]]:
    """The fixed prompt and decode token ids every engine runs."""
    rng = np.random.default_rng(0)
    return (rng.integers(0, m.args.vocab_size, args.prompt).tolist(),
            rng.integers(0, m.args.vocab_size, args.decode).tolist())


def run_round(runner: Runner, prompt: list[int], decode: list[int]) -> tuple[float, float, np.ndarray]:
    """(prefill s, decode s per token, prefill logits) for one prefill + len(decode) steps."""
    t0 = time.perf_counter()
    logits = runner.step(prompt, 0)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i, tok in enumerate(decode):
        runner.step([tok], len(prompt) + i)
    return prefill, (time.perf_counter() - t0) / len(decode), logits


def measure(spec: ModelSpec, label: str, m: Model, jobs: list[Job], args: argparse.Namespace,
            reference: dict[str, np.ndarray]) -> list[Row]:
    """Load each job's engine, run `args.rounds` rounds (interleaved when the spec allows), fill rows."""
    prompt, decode = workload(m, args)
    # keyed by engine and dtype: the gguf group also holds requantized delegate rows
    rows = {j.key: Row(spec.key, j.dtype, j.engine, note=j.note) for j in jobs}
    ready: dict[str, Runner] = {}

    def load(job: Job) -> None:
        row = rows[job.key]
        print(f"  {spec.key} {label}: loading {job.key} ...", file=sys.stderr, flush=True)
        rss0, t0 = rss_mb(), time.perf_counter()
        try:
            runner = job.build()
            row.load_s = time.perf_counter() - t0
            _, _, logits = run_round(runner, prompt, decode[:2])  # warm-up
            for _ in range(job.warm_rounds):
                run_round(runner, prompt, decode)
            row.rss_delta_mb = rss_mb() - rss0
            row.program_bytes = getattr(runner, "program_bytes", None)
            if job.engine == "eager torch":
                reference[label] = logits
            ref = reference.get(label)
            row.max_abs_err = float(np.max(np.abs(logits - ref))) if ref is not None else None
            ready[job.key] = runner
        except Exception as e:  # noqa: BLE001  (a failing engine is a table entry)
            row.error = one_line(e)

    def time_rounds(names: Sequence[str]) -> None:
        for r in range(args.rounds):
            order = list(names)[r % max(len(names), 1):] + list(names)[:r % max(len(names), 1)]
            for name in order:
                if name not in ready:
                    continue
                try:
                    p, d, _ = run_round(ready[name], prompt, decode)
                    rows[name].prefill_s.append(p)
                    rows[name].decode_s.append(d)
                except Exception as e:  # noqa: BLE001
                    rows[name].error = one_line(e)
                    del ready[name]

    # eager first: its prefill logits are the reference for the others
    jobs = sorted(jobs, key=lambda j: j.engine != "eager torch")
    together = [j for j in jobs if spec.interleave is True or (spec.interleave and j.engine in spec.interleave)]
    for job in together:
        load(job)
    # The others join the turns while memory allows: each may need twice what the largest loaded one took
    # (an export builds copies before it settles), so a machine with room interleaves every engine.
    need = max((rows[j.key].rss_delta_mb or 0.0 for j in together), default=0.0)
    for job in [j for j in jobs if j not in together]:
        free = available_mb()
        if free is None or free < 2 * need:
            break
        load(job)
        together.append(job)
        need = max(need, rows[job.key].rss_delta_mb or 0.0)
    time_rounds([j.key for j in together])
    ready.clear()
    gc.collect()
    for job in (j for j in jobs if j not in together):
        load(job)
        time_rounds([job.key])
        r = rows[job.key]
        if r.prefill_s:  # progress: the big model's engines take minutes each
            print(f"    {job.key}: prefill {args.prompt / float(np.median(r.prefill_s)):.1f} tok/s, decode "
                  f"{1 / float(np.median(r.decode_s)):.2f} tok/s, err {r.max_abs_err}", file=sys.stderr, flush=True)
        ready.clear()
        gc.collect()
    for row in rows.values():
        if row.prefill_s:
            row.rounds = len(row.prefill_s)
            row.prefill_tok_s = args.prompt / float(np.median(row.prefill_s))
            row.decode_tok_s = 1.0 / float(np.median(row.decode_s))
    return [rows[j.key] for j in sorted(jobs, key=lambda j: list(rows).index(j.key))]


# ---------------------------------------------------------------- output

def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: Sequence[Row]) -> str:
    headers = ["model", "dtype", "engine", "prefill tok/s", "decode tok/s", "% bw", "max|err|", "n", "load",
               "+RSS MB", "note / error"]
    cells, last = [], None
    for r in rows:
        key = (r.model, r.dtype)
        cells.append([r.model if key != last else "", r.dtype if key != last else "", r.engine,
                      fmt(r.prefill_tok_s, ".1f"), fmt(r.decode_tok_s, ".2f"),
                      fmt(r.bw_share * 100 if r.bw_share else None, ".0f"), fmt(r.max_abs_err, ".1e"),
                      str(r.rounds or "-"), fmt(r.load_s, ".1f") + ("s" if r.load_s else ""),
                      fmt(r.rss_delta_mb, ".0f"), f"ERROR {r.error}" if r.error else r.note])
        last = key
    return format_table(headers, cells, [False, False, False] + [True] * 7 + [False])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: a tiny random Llama, 2 rounds, short sequences")
    p.add_argument("--models", help=f"comma-separated subset of {','.join(MODELS)} (default smollm2,1.2b)")
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated subset of fp32,bf16")
    p.add_argument("--engines", default=",".join(DEFAULT_ENGINES),
                   help=f"comma-separated subset of {','.join(ENGINE_KEYS.values())} "
                        f"(default {','.join(DEFAULT_ENGINES)}; the issue-15 peers are opt-in)")
    p.add_argument("--quantize", default=",".join(QUANTIZED),
                   help="delegate rows for these weight-only modes (models that allow it; '' for none)")
    p.add_argument("--prompt", type=int, help="prompt tokens (default 64; quick 16)")
    p.add_argument("--decode", type=int, help="decode steps per round (default 32; quick 8)")
    p.add_argument("--rounds", type=int, help="timed rounds per engine (default 3; quick 2)")
    p.add_argument("--json", metavar="PATH", help="also write meta and rows as JSON")
    p.add_argument("--no-bandwidth", action="store_true", help="skip the memory bandwidth probes (a GEMV over 1 GiB of fp32 weights and a 1 GiB sum)")
    args = p.parse_args(argv)
    args.models = (args.models or ("tiny" if args.quick else "smollm2,1.2b")).split(",")
    args.dtypes = [d for d in args.dtypes.split(",") if d]  # '' for none (e.g. only the gguf rows)
    args.quantize = [q for q in args.quantize.split(",") if q]
    args.engines = args.engines.split(",")
    if set(args.engines) - set(ENGINE_KEYS.values()):
        p.error(f"--engines takes a subset of {','.join(ENGINE_KEYS.values())}")
    if set(args.quantize) - set(QUANTIZED):
        p.error(f"--quantize takes a subset of {','.join(QUANTIZED)}")
    for name, pool in (("model", MODELS), ("dtype", DTYPES)):
        bad = set(getattr(args, name + "s")) - set(pool)
        if bad:
            p.error(f"unknown {name}s {sorted(bad)}; choose from {list(pool)}")
    args.prompt = args.prompt or (16 if args.quick else 64)
    args.decode = args.decode or (8 if args.quick else 32)
    args.rounds = args.rounds or (2 if args.quick else 3)
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    meta = machine_meta(bandwidth=not args.no_bandwidth) | {
        "prompt": args.prompt, "decode": args.decode, "rounds": args.rounds,
        "compile_default": os.environ.get("MLX_DELEGATE_COMPILE", "1"),
        # llama.cpp shares torch's libgomp: its barriers spin unless this says PASSIVE (see README)
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "-")}
    bw = meta.get("bandwidth_gbs")
    probes = [bw] if bw else []  # GEMV probes: the start, then after each group's rounds
    print("  ".join(f"{k}={v}" for k, v in meta.items()), file=sys.stderr, flush=True)
    rows: list[Row] = []
    max_seq_len = args.prompt + args.decode + 8
    for key in args.models:
        spec = MODELS[key]
        print(f"building {spec.key} ...", file=sys.stderr, flush=True)
        base = spec.build(max_seq_len).eval()
        reference: dict[str, np.ndarray] = {}
        quantized = args.quantize if spec.quantized and not args.quick else []
        with_gguf = spec.gguf is not None and GGUF in args.quantize and not args.quick
        # with a gguf group, the requantized rows take turns with llama.cpp there (no fp32 rows needed)
        groups = list(jobs_for(base, args.dtypes, [] if with_gguf else quantized, args.engines))
        if with_gguf:
            requantized = [q for q in quantized if q != GGUF]
            groups.append((GGUF, *gguf_jobs(spec.gguf(), base, args.engines, requantized)))
        for label, typed, jobs in groups:
            m = typed()
            if label == GGUF:  # the dequantized weights' eager logits (one untimed prefill without fp32 rows)
                if "fp32" not in reference:
                    reference["fp32"] = EagerRunner(base).step(workload(base, args)[0], 0)
                    base.reset_cache()
                reference[GGUF] = reference["fp32"]
            got = measure(spec, label, m, jobs(m), args, reference)
            if bw:
                probes.append(round(memory_bandwidth_gbs(), 1))
                print(f"  GEMV bandwidth probe after the rounds: {probes[-1]} GB/s", file=sys.stderr, flush=True)
            for r in got:
                if bw and r.decode_tok_s:
                    read = weight_bytes(m) if r.dtype in DTYPES else r.program_bytes
                    around = (probes[-2] + probes[-1]) / 2
                    r.bw_share = r.decode_tok_s * read / (around * 1e9) if read else None
            rows += got
            print(table(rows), file=sys.stderr, flush=True)  # progress: the table so far
            del m
            gc.collect()
        del base
        gc.collect()
    if probes:
        meta["bandwidth_probes_gbs"] = probes
    meta |= {"loadavg_end": [round(x, 2) for x in os.getloadavg()], "peak_rss_mb": round(peak_rss_mb()),
             "wall_s": round(time.perf_counter() - started, 1)}
    print()
    print("  ".join(f"{k}={v}" for k, v in meta.items()))
    print()
    print(table(rows))
    if bw:
        print(f"% bw: decode tok/s over (the mean of the GEMV probes before and after the row's rounds, of "
              f"{', '.join(map(str, probes))} GB/s) / bytes read per token (every weight once; for the quantized "
              "rows the .pte size)")
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
