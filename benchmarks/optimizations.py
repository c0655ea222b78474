"""Each optimisation off and on, side by side; two modes.

Synthetic (the default): for a Llama-shaped decoder step (KV caches as buffers, per-layer mask
construction, attention written out) and a Whisper-shaped encoder (LayerNorm, attention and GELU
written out, as hand-written modules export them), prints IR node count, delegate segments, delegate
call inputs/outputs, MLX peak memory one call adds (above weights and buffers already resident), the
largest difference from eager torch and median latency with every optimisation on, then with each
`MLXPartitioner(disable=...)` switch off in turn (no pattern pass here, as `testing.lower` lowers).

    python benchmarks/optimizations.py [--quick]

Model A/B (`--model`): a real LLM (`mlx_delegate.pipelines.llm.export`: one dynamic method, KV cache resident in
the delegate) lowered as shipped (`default`) and with each `--switch` off on its own (`<switch> off`),
all loaded together. Rows time a prefill of each `--prompt` length at position 0 and a decode turn of
`--steps` single-token steps (the same positions every turn: the fixed-shape model attends over the
whole cache under a position mask, so the work does not depend on the position), with compiled graphs
(and node by node with `--nodes`). Switches:

- partitioner switches, `MLXPartitioner(disable={switch})`: cse, early_release, the fuse_* fusions,
  fusions (all of them); the program is lowered again;
- pattern switches, `MLXPatternPass(disable={switch})`: rms_norm, rope, quantized, and rope_at (the
  tensor-position RoPE fusion alone: positions `pos + arange(L)` stay composed, cos/sin tables node by
  node); lowered again;
- runtime switches, the default program loaded once more and run with: cpu_kernels (the CPU kernels off,
  MLX's own ops), fused_sdpa (the fused decode-attention kernel off, MLX_DELEGATE_SDPA_FUSED_MAX_L=0).

Columns: tok/s are tokens / median seconds of the turn; `CPU ms/tok` is the process's CPU time per
decode token (all threads; load perturbs it less than wall time); `x default`: decode tok/s over the
default's with the same graphs; `max|err|`: the largest logit difference from eager torch after the
longest prompt; `IR nodes`: instructions in the delegate payloads.

    python benchmarks/optimizations.py --model smollm2 --switch fuse_linears,rope_at [--dtype bf16]
        [--prompt 32,128] [--steps 8] [--nodes] [--quick]

Every timing interleaves the configurations (`common.time_interleaved`). Nothing fails here.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import common  # first: mlx_delegate before mlx
import numpy as np
import torch
from executorch.runtime import Runtime

from mlx_delegate import MLXPartitioner, _runtime
from mlx_delegate.ir import nodes as N
from mlx_delegate.pipelines.llm import export as llm_export
from mlx_delegate.partitioner import SWITCHES
from mlx_delegate.patterns import PATTERN_SWITCHES, MLXPatternPass, preprocess_switches
from mlx_delegate.testing import lower

# Synthetic mode: every partitioner switch off in turn ("fusions": all the fuse_* at once).
CONFIGS = {"all on": set()} | {("all fusions" if s == "fusions" else s) + " off": {s} for s in SWITCHES}

class DecoderStep(torch.nn.Module):
    """Llama-shaped: RMSNorm, attention over a resident KV cache, SwiGLU MLP."""

    def __init__(self, dim: int, layers: int, ctx: int, heads: int = 8):
        super().__init__()
        self.heads, self.ctx = heads, ctx
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(dim, 3 * dim, bias=False) for _ in range(layers))
        self.o = torch.nn.ModuleList(torch.nn.Linear(dim, dim, bias=False) for _ in range(layers))
        self.up = torch.nn.ModuleList(torch.nn.Linear(dim, 6 * dim, bias=False) for _ in range(layers))
        self.down = torch.nn.ModuleList(torch.nn.Linear(3 * dim, dim, bias=False) for _ in range(layers))
        for i in range(layers):
            self.register_buffer(f"k{i}", torch.zeros(1, heads, ctx, dim // heads))
            self.register_buffer(f"v{i}", torch.zeros(1, heads, ctx, dim // heads))

    @staticmethod
    def norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        h, d = self.heads, x.shape[-1] // self.heads
        for i, (qkv, o, up, down) in enumerate(zip(self.qkv, self.o, self.up, self.down)):
            # The same mask is rebuilt per layer, as exported HF models do (CSE merges it).
            mask = torch.arange(self.ctx) <= pos
            q, k, v = qkv(self.norm(x)).view(1, 3, h, 1, d).unbind(1)  # [B, H, L, D]
            kc, vc = getattr(self, f"k{i}"), getattr(self, f"v{i}")
            kc.index_copy_(2, pos.view(1), k)
            vc.index_copy_(2, pos.view(1), v)
            att = (q @ kc.transpose(-1, -2)) / d**0.5
            att = torch.where(mask, att, torch.full_like(att, -1e9)).softmax(-1)
            x = x + o((att @ vc).transpose(1, 2).reshape(1, -1))
            g, u = up(self.norm(x)).chunk(2, -1)
            x = x + down(torch.nn.functional.silu(g) * u)
        return x


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    c = x - x.mean(-1, keepdim=True)
    return c / torch.sqrt((c * c).mean(-1, keepdim=True) + 1e-5) * weight + bias


def gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.erf(x / 2**0.5))


class EncoderLayer(torch.nn.Module):
    def __init__(self, dim: int, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)  # parameters only
        self.qkv, self.out = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.fc1, self.fc2 = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        h = layer_norm(x, self.ln1.weight, self.ln1.bias)
        q, k, v = self.qkv(h).reshape(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.softmax(q @ k.transpose(-1, -2) / (c // self.heads) ** 0.5, dim=-1) @ v
        x = x + self.out(a.transpose(1, 2).reshape(b, t, c))
        return x + self.fc2(gelu(self.fc1(layer_norm(x, self.ln2.weight, self.ln2.bias))))


class EncoderBlock(torch.nn.Module):
    """Whisper-shaped: conv front end, then pre-norm attention + GELU MLP layers."""

    def __init__(self, dim: int, layers: int, mels: int = 80):
        super().__init__()
        self.conv1 = torch.nn.Conv1d(mels, dim, 3, padding=1)
        self.conv2 = torch.nn.Conv1d(dim, dim, 3, stride=2, padding=1)
        self.layers = torch.nn.ModuleList(EncoderLayer(dim) for _ in range(layers))

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        x = gelu(self.conv2(gelu(self.conv1(mel)))).transpose(1, 2)
        for layer in self.layers:
            x = layer(x)
        return x


def ir_node_count(edge: Any) -> int:
    ep = edge.exported_program()
    return sum(len(N.deserialize(m.processed_bytes).instructions)
               for _, m in ep.graph_module.named_children() if hasattr(m, "processed_bytes"))


def delegate_io(edge: Any) -> str:
    ep = edge.exported_program()
    calls = [n for n in ep.graph.nodes if n.target is torch.ops.higher_order.executorch_call_delegate]
    return "+".join(f"{len(c.args) - 1}/{len(c.users)}" for c in calls)


# ---------------------------------------------------------------- synthetic mode

def prepare(module: torch.nn.Module, inputs: tuple,
            disabled: set[str]) -> tuple[list[str], Callable[[], Any], Any]:
    """Lower with `disabled` switched off; (IR nodes, segments, delegate in/out, MLX peak above what is
    resident before the call, max |diff| vs eager), one call, and the Program to keep alive."""
    lowered = lower(module, inputs, partitioner=MLXPartitioner(disable=disabled))
    method = lowered.method()
    method.execute(list(inputs))
    # Other configs' programs stay loaded (for interleaved timing): count only what the call adds.
    resident = _runtime.active_memory()
    _runtime.reset_peak_memory()
    out = method.execute(list(inputs))[0]
    peak = _runtime.peak_memory() - resident
    with torch.no_grad():
        diff = (out - module(*inputs)).abs().max().item()
    segments, leftover = lowered.summary
    columns = [str(ir_node_count(lowered.edge)), f"{segments} ({len(leftover)} fallback)",
               delegate_io(lowered.edge), f"{peak / 2**20:.1f} MiB", f"{diff:.1e}"]
    return columns, lambda: method.execute(list(inputs)), lowered.program


def medians(runs: dict[Any, Callable[[], Any]], settings: common.Settings,
            warmed: Callable[[], None] | None = None) -> dict[Any, float]:
    """Median seconds per call, the runs interleaved (`common.time_interleaved`) after warming each up
    (then `warmed` is called); a run that fails has no entry."""
    estimates = {name: common.warm_up(run, settings) for name, run in runs.items()}
    if warmed:
        warmed()
    samples, _ = common.time_interleaved(runs, estimates, settings)
    return {name: float(np.median(xs)) for name, xs in samples.items() if xs}


def synthetic(quick: bool, settings: common.Settings) -> str:
    torch.manual_seed(0)
    dim, layers = (128, 2) if quick else (512, 8)
    models: dict[str, Callable[[], tuple[torch.nn.Module, tuple]]] = {
        "llama-shaped decode step": lambda: (DecoderStep(dim, layers, 256).eval(),
                                             (torch.randn(1, dim), torch.tensor(3))),
        "whisper-shaped encoder": lambda: (EncoderBlock(dim // 2, max(layers // 2, 1)).eval(),
                                           (torch.randn(1, 80, 200 if quick else 1000),)),
    }
    rows = []
    for name, make in models.items():
        module, inputs = make()
        columns, calls, keep = {}, {}, []
        for config, disabled in CONFIGS.items():
            print(f"  {name}: {config} ...", file=sys.stderr, flush=True)
            try:
                columns[config], calls[config], program = prepare(module, inputs, disabled)
                keep.append(program)
            except Exception as e:  # noqa: BLE001  (report, keep going: a table, never a crash)
                columns[config] = [f"error: {common.one_line(e, 90)}", "", "", "", ""]
        times = medians(calls, settings)
        rows += [[name if i == 0 else "", config, *cols, common.fmt_time(times.get(config))]
                 for i, (config, cols) in enumerate(columns.items())]
    headers = ["model", "optimisations", "IR nodes", "segments", "delegate in/out", "MLX peak (call)",
               "max |diff|", "median"]
    return common.format_table(headers, rows, right=[False, False, True, False, True, True, True, True])


# ---------------------------------------------------------------- model A/B mode

# Switches of the runtime rather than the lowering: (CPU kernels on, environment around each call).
RUNTIME_SWITCHES = {"cpu_kernels": (False, {}), "fused_sdpa": (True, {"MLX_DELEGATE_SDPA_FUSED_MAX_L": "0"})}
AB_SWITCHES = sorted({*SWITCHES, *PATTERN_SWITCHES, *RUNTIME_SWITCHES})

TINY = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 256, "vocab_size": 1024, "tie_word_embeddings": True}


def build_model(name: str, max_seq_len: int, dtype: torch.dtype) -> Any:
    from mlx_delegate.models import loading

    if name == "smollm2":
        # The float model (--dtype), not the file's Q4_1 blocks that `generate` runs by default.
        return loading.load("smollm2", dtype=dtype, max_seq_len=max_seq_len, dequantize=True).model.eval()
    from transformers import LlamaConfig

    config = LlamaConfig(**TINY, max_position_embeddings=2048,
                         rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    return loading.from_config(config, dtype=dtype, max_seq_len=max_seq_len, seed=0).model.eval()


@dataclass
class Variant:
    """One configuration of the model A/B: how it is lowered and how its calls run."""

    name: str
    disable: frozenset[str] = frozenset()  # MLXPartitioner(disable=...)
    patterns: frozenset[str] = frozenset()  # MLXPatternPass(disable=...)
    kernels: bool = True
    env: dict[str, str] = field(default_factory=dict)

    @property
    def lowered_as_default(self) -> bool:
        return not self.disable and not self.patterns


def variant(switch: str) -> Variant:
    v = Variant(f"{switch} off")
    if switch in RUNTIME_SWITCHES:
        v.kernels, v.env = RUNTIME_SWITCHES[switch]
    elif switch in PATTERN_SWITCHES:
        v.patterns = frozenset({switch})
    else:
        v.disable = frozenset({switch})
    return v


class LLMRunner:
    """One loaded copy of a program, always run with the same settings."""

    def __init__(self, pte: Path, v: Variant, compiled: bool) -> None:
        self.program = Runtime.get().load_program(str(pte))
        self.method = self.program.load_method("forward")
        self.v, self.compiled = v, compiled
        self.cpu_s: list[float] = []  # process CPU seconds per decode turn

    def step(self, tokens: torch.Tensor, pos: int) -> torch.Tensor:
        was = _runtime.cpu_kernels_enabled(), _runtime.compile_enabled()
        _runtime.set_cpu_kernels(self.v.kernels)
        _runtime.set_compile(self.compiled)
        os.environ.update(self.v.env)  # read when a graph is built
        try:
            return self.method.execute([tokens, torch.tensor([pos])])[0]
        finally:
            for key in self.v.env:
                os.environ.pop(key, None)
            _runtime.set_cpu_kernels(was[0])
            _runtime.set_compile(was[1])

    def decode(self, start: int, steps: int) -> None:
        c = time.process_time()
        for i in range(steps):
            self.step(torch.tensor([[5]]), start + i)
        self.cpu_s.append(time.process_time() - c)


def lower_llm(model: Any, v: Variant, directory: Path) -> tuple[Path, int]:
    """The .pte file of `model` lowered as `v` says, and its IR node count."""
    ep = llm_export.export_model(model)
    edge = llm_export.lower(ep, partitioner=MLXPartitioner(disable=v.disable | preprocess_switches(v.patterns)),
                            constant_methods=llm_export.metadata(model),
                            pattern_pass=MLXPatternPass(disable=v.patterns))
    nodes = ir_node_count(edge)
    path = directory / f"{v.name.replace(' ', '_')}.pte"
    with path.open("wb") as f:
        edge.to_executorch().write_to_file(f)
    return path, nodes


def model_ab(args: argparse.Namespace, settings: common.Settings) -> str:
    prompts = sorted({int(x) for x in args.prompt.split(",")})
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    max_seq_len = args.max_seq_len or max(256, prompts[-1] + args.steps + 8)
    if prompts[-1] + args.steps > max_seq_len:
        raise SystemExit(f"--prompt {prompts[-1]} + --steps {args.steps} exceed --max-seq-len {max_seq_len}")
    model = build_model(args.model, max_seq_len, dtype)
    variants = [Variant("default")] + [variant(s) for s in args.switch.split(",")]
    directory = Path(tempfile.mkdtemp(prefix="mlx_delegate_ab_"))
    try:
        files: dict[str, tuple[Path, int]] = {}
        for v in variants:
            reuse = v.lowered_as_default and "default" in files  # a runtime switch: the same program
            if not reuse:
                print(f"  {args.model}: lowering {v.name} ...", file=sys.stderr, flush=True)
            files[v.name] = files["default"] if reuse else lower_llm(model, v, directory)
        tokens = torch.randint(0, model.args.vocab_size, (1, prompts[-1]),
                               generator=torch.Generator().manual_seed(0))
        with torch.no_grad():  # after lowering: the eager call writes the module's KV cache
            reference = model(tokens, torch.tensor([0]), last_only=True).float()
        graphs = [True, False] if args.nodes else [True]
        runners = {(v.name, c): LLMRunner(files[v.name][0], v, c) for c in graphs for v in variants}
        err = {k: float((r.step(tokens, 0).float() - reference).abs().max()) for k, r in runners.items()}
        for r in runners.values():  # a second call of each shape traces its compiled graph
            r.step(tokens, 0)
            r.decode(prompts[-1], 2)
        prefill = {n: medians({k: (lambda r=r, n=n: r.step(tokens[:, :n], 0)) for k, r in runners.items()},
                              settings) for n in prompts}

        def clear_cpu() -> None:
            for r in runners.values():
                r.cpu_s.clear()

        decode = medians({k: (lambda r=r: r.decode(prompts[-1], args.steps)) for k, r in runners.items()},
                         settings, warmed=clear_cpu)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    headers = ["model", "config", "graphs", *[f"prefill {n} tok/s" for n in prompts], "decode tok/s",
               "CPU ms/tok", "x default", "max|err|", "IR nodes"]
    right = [False, False, False] + [True] * (len(prompts) + 5)
    rows = []
    label = f"{args.model} {args.dtype}"
    for i, (name, compiled) in enumerate(runners):
        key, base = (name, compiled), decode.get(("default", compiled))
        rate = args.steps / decode[key] if key in decode else None
        cpu = runners[key].cpu_s  # the timed turns only
        rows.append([label if i == 0 else "", name, "compiled" if compiled else "nodes",
                     *[f"{n / prefill[n][key]:.1f}" if key in prefill[n] else "-" for n in prompts],
                     f"{rate:.2f}" if rate else "-",
                     f"{np.median(cpu) / args.steps * 1e3:.1f}" if cpu else "-",
                     f"{base / decode[key]:.3f}x" if key in decode and base else "-", f"{err[key]:.1e}",
                     str(files[name][1])])
    return common.format_table(headers, rows, right)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: small models, short prompts, few rounds")
    p.add_argument("--budget", type=float, help="timed seconds per configuration and row (default: common's)")
    p.add_argument("--model", choices=("smollm2", "tiny"),
                   help="model A/B on this LLM (tiny: a random 2-layer Llama) instead of the synthetic table")
    p.add_argument("--switch", default="fuse_linears",
                   help=f"model A/B: comma-separated switches, each off against the default: {AB_SWITCHES}")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="model A/B: weights' dtype")
    p.add_argument("--prompt", help="model A/B: comma-separated prefill lengths (64; 16 with --quick)")
    p.add_argument("--steps", type=int, help="model A/B: decode steps per turn (default 8; 2 with --quick)")
    p.add_argument("--max-seq-len", type=int, help="model A/B: KV cache length (default 256, or what fits)")
    p.add_argument("--nodes", action="store_true", help="model A/B: also node by node (compiled graphs off)")
    args = p.parse_args(argv)
    unknown = set(args.switch.split(",")) - set(AB_SWITCHES)
    if unknown:
        p.error(f"unknown switches {sorted(unknown)}; choose from {AB_SWITCHES}")
    args.prompt = args.prompt or ("16" if args.quick else "64")
    args.steps = args.steps or (2 if args.quick else 8)
    settings = common.QUICK if args.quick else common.Settings()
    if args.budget is not None:
        settings = replace(settings, budget_s=args.budget)
    started = time.perf_counter()
    meta = common.machine_meta(bandwidth=False) | {"quick": args.quick}
    text = model_ab(args, settings) if args.model else synthetic(args.quick, settings)
    meta |= {"loadavg_end": [round(x, 2) for x in os.getloadavg()],
             "wall_s": round(time.perf_counter() - started, 1)}
    print()
    print(common.heading(meta))
    print(text)
    for line in common.load_note(meta):
        print(line)


if __name__ == "__main__":
    main()
