"""transformers' static-cache export, delegate vs ExecuTorch XNNPACK on the same exported program.

A 110M Llama (hidden 768, 12 layers, 12 heads, SwiGLU 2048, vocabulary 32000, tied head; random weights
from a `LlamaConfig`) is exported the way transformers documents it for ExecuTorch:
`TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=N).export(input_ids,
cache_position)`, which wraps the model in `TorchExportableModuleWithStaticCache` (the cache tensors and
their `cumulative_length` counters as module buffers) and exports it with `strict=True`. That export
takes one token per call, so the prompt is fed token by token too (the runner transformers ships,
`TorchExportableModuleWithStaticCache.generate`, does the same).

The one exported program is lowered twice, with `MLXPartitioner` and with `XnnpackPartitioner`; both
`.pte` are loaded from bytes by the stock `executorch.runtime`.

`mlx_delegate, patterns off` (opt-in: `unfused`) is the delegate with the patterns that preprocess
applies switched off (`MLXPartitioner(disable=patterns.IN_PREPROCESS)`: RMSNorm, RoPE and the KV-cache
write stay composed), i.e. this export as the delegate lowered it before they ran there.
`eager torch` (opt-in, `--engines delegate,xnnpack,eager`) runs the same wrapper module (its own static
cache) under `torch.no_grad()`.

A round is `--prompt` single-token calls at positions 0.. (prefill) then `--decode` calls (decode), with
fixed token ids so every engine does the same work; engines take turns within each round (the order
rotates) and figures are medians over rounds. `cpu ms/tok` is the process CPU time (all threads) per
token of the decode phase. `max|err|` compares every call's logits with the model run without a cache
over the whole sequence. The delegate's row says how many delegate segments and leftover ops the
program has, and how many timed delegate calls replayed a compiled graph.

    python benchmarks/hf_static.py [--layers 12] [--prompt 32] [--decode 64] [--rounds 3]
                                   [--engines delegate,xnnpack[,eager]] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import common
import torch
from common import format_table, machine_meta, one_line, print_report
from executorch.exir import to_edge_transform_and_lower
from executorch.runtime import Runtime

import mlx_delegate
from mlx_delegate import _runtime
from mlx_delegate.patterns import IN_PREPROCESS
from mlx_delegate.testing import delegate_summary

ENGINES = {"delegate": "mlx_delegate", "unfused": "mlx_delegate, patterns off", "xnnpack": "ET XNNPACK",
           "eager": "eager torch"}
# eager only when asked: transformers' static-cache forward runs at ~0.5 tok/s here (load ~10), a
# round of it outlasts the others many times over.
DEFAULT_ENGINES = ("delegate", "xnnpack")
STORIES_110M = {"vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
                "num_attention_heads": 12, "num_key_value_heads": 12, "tie_word_embeddings": True}


def build_model(layers: int, max_cache_len: int) -> Any:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**(STORIES_110M | {"num_hidden_layers": layers}),
                         max_position_embeddings=max(max_cache_len, 2048))
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(use_cache=True, cache_implementation="static")
    return model


def export_static(model: Any, max_cache_len: int) -> tuple[torch.export.ExportedProgram, torch.nn.Module]:
    """transformers' documented ExecuTorch export; returns it and the wrapped module it exported."""
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    recipe = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=max_cache_len)
    with torch.no_grad():
        ep = recipe.export(input_ids=torch.tensor([[1]]), cache_position=torch.tensor([0]))  # strict=True
    return ep, recipe.model


def _inputs(token: int, pos: int) -> list[torch.Tensor]:
    return [torch.tensor([[token]], dtype=torch.long), torch.tensor([pos], dtype=torch.long)]


class Engine:
    note = ""

    def step(self, token: int, pos: int) -> torch.Tensor:
        raise NotImplementedError


class ProgramEngine(Engine):
    def __init__(self, ep: torch.export.ExportedProgram, partitioner: Any) -> None:
        edge = to_edge_transform_and_lower(copy.deepcopy(ep), partitioner=[partitioner])
        segments, leftover = delegate_summary(edge)
        self.note = common.graph_note(segments, leftover)
        self.buffer = edge.to_executorch().buffer
        del edge
        self.program = Runtime.get().load_program(self.buffer)  # from bytes
        self.method = self.program.load_method("forward")

    def step(self, token: int, pos: int) -> torch.Tensor:
        return self.method.execute(_inputs(token, pos))[0]


class EagerEngine(Engine):
    def __init__(self, wrapper: torch.nn.Module) -> None:
        self.wrapper = wrapper

    def step(self, token: int, pos: int) -> torch.Tensor:
        ids, position = _inputs(token, pos)
        with torch.no_grad():
            return self.wrapper(input_ids=ids, cache_position=position)


@dataclass
class Row:
    engine: str
    prefill_tok_s: float | None = None
    decode_tok_s: float | None = None
    decode_cpu_ms: float | None = None  # process CPU time per decode token
    max_abs_err: float | None = None
    load_s: float | None = None
    rounds: int = 0
    note: str = ""
    error: str | None = None


def run_phase(engine: Engine, tokens: Sequence[int], start: int, logits: list[torch.Tensor] | None
              ) -> tuple[float, float]:
    """Feeds `tokens` one per call from position `start`; (wall s, CPU s)."""
    w0, c0 = time.perf_counter(), time.process_time()
    for i, t in enumerate(tokens):
        out = engine.step(t, start + i)
        if logits is not None:
            logits.append(out.reshape(-1, out.shape[-1])[-1].clone())
    return time.perf_counter() - w0, time.process_time() - c0


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--max-cache-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--engines", default=",".join(DEFAULT_ENGINES), help=f"subset of {','.join(ENGINES)}")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    keys = [k for k in ENGINES if k in args.engines.split(",")]
    if args.prompt + args.decode > args.max_cache_len:
        p.error("--prompt + --decode must fit in --max-cache-len")

    started = time.perf_counter()
    meta = machine_meta(bandwidth=False) | {"layers": args.layers, "prompt": args.prompt, "decode": args.decode,
                                            "max_cache_len": args.max_cache_len, "rounds": args.rounds}
    model = build_model(args.layers, args.max_cache_len)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (args.prompt + args.decode,), generator=g).tolist()
    with torch.no_grad():  # the reference: no cache, the whole sequence at once
        reference = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()

    t0 = time.perf_counter()
    ep, wrapper = export_static(model, args.max_cache_len)
    print(f"  export (strict): {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)

    builders: dict[str, Callable[[], Engine]] = {
        "delegate": lambda: ProgramEngine(ep, mlx_delegate.MLXPartitioner()),
        "unfused": lambda: ProgramEngine(ep, mlx_delegate.MLXPartitioner(disable={*IN_PREPROCESS, "rope_at"})),
        "xnnpack": lambda: ProgramEngine(ep, common._xnnpack_partitioner()),
        "eager": lambda: EagerEngine(wrapper),
    }
    rows = {k: Row(ENGINES[k]) for k in keys}
    engines: dict[str, Engine] = {}
    for k in keys:
        print(f"  lowering / loading {ENGINES[k]} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            engines[k] = builders[k]()
            rows[k].note = engines[k].note
            rows[k].load_s = time.perf_counter() - t0
            # Untimed first round: the delegate traces its step here, XNNPACK sets up its weights.
            logits: list[torch.Tensor] = []
            run_phase(engines[k], ids, 0, logits)
            rows[k].max_abs_err = max(float((a.float() - b).abs().max()) for a, b in zip(logits, reference))
        except Exception as e:  # noqa: BLE001  (an engine that fails is a table entry)
            rows[k].error = one_line(e)
            engines.pop(k, None)
        gc.collect()

    prefill: dict[str, list[float]] = {k: [] for k in engines}
    decode: dict[str, list[float]] = {k: [] for k in engines}
    cpu: dict[str, list[float]] = {k: [] for k in engines}
    stats0 = _runtime.compile_stats()
    order = list(engines)
    gc.disable()
    try:
        for r in range(args.rounds):
            print(f"  round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
            shift = r % len(order) if order else 0
            for k in order[shift:] + order[:shift]:
                wall, _ = run_phase(engines[k], ids[:args.prompt], 0, None)
                prefill[k].append(wall)
                wall, cpu_s = run_phase(engines[k], ids[args.prompt:], args.prompt, None)
                decode[k].append(wall)
                cpu[k].append(cpu_s)
    finally:
        gc.enable()
    stats = {k: v - stats0.get(k, 0) for k, v in _runtime.compile_stats().items()}
    for k in engines:
        row = rows[k]
        row.rounds = len(decode[k])
        row.prefill_tok_s = args.prompt / statistics.median(prefill[k])
        row.decode_tok_s = args.decode / statistics.median(decode[k])
        row.decode_cpu_ms = 1e3 * statistics.median(cpu[k]) / args.decode
    delegates = [k for k in engines if k in ("delegate", "unfused")]
    if delegates:  # the runtime's counters are process-wide: all delegate rows together
        timed = args.rounds * (args.prompt + args.decode) * len(delegates)
        rows[delegates[0]].note += f"; {stats.get('compiled_calls', 0)}/{timed} timed delegate calls compiled"

    meta |= {"loadavg_end": [round(x, 2) for x in os.getloadavg()], "wall_s": round(time.perf_counter() - started, 1),
             "compile_stats": stats}
    table = format_table(
        ["engine", "prefill tok/s", "decode tok/s", "decode CPU ms/tok", "max|err|", "lower+load", "note"],
        [[r.engine, _f(r.prefill_tok_s, ".1f"), _f(r.decode_tok_s, ".1f"), _f(r.decode_cpu_ms, ".1f"),
          _f(r.max_abs_err, ".1e"), _f(r.load_s, ".1f", " s"), f"ERROR {r.error}" if r.error else r.note]
         for r in rows.values()],
        [False, True, True, True, True, True, False])
    print_report(meta, table, args.json, {"rows": [asdict(r) for r in rows.values()]})


def _f(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else format(x, spec) + suffix


if __name__ == "__main__":
    main()
