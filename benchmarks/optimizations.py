"""Each graph/memory optimisation off and on, side by side.

For a Llama-shaped decoder step (KV caches as buffers, per-layer mask
construction, attention written out) and a Whisper-shaped encoder (LayerNorm,
attention and GELU written out, as hand-written modules export them), prints
IR node count, delegate call inputs/outputs, MLX peak memory one call adds
(above weights and buffers already resident),
the largest difference from eager torch and median latency (timed in
interleaved rounds) with every optimisation on, then with each one switched off.

    python benchmarks/optimizations.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch

import mlx_delegate  # noqa: F401  (first: installs the BLAS route before mlx loads)
from common import fmt_time, format_table
from mlx_delegate import MLXPartitioner, _runtime
from mlx_delegate.ir import nodes as N
from mlx_delegate.testing import lower

CONFIGS = {"all on": set(), "cse off": {"cse"}, "early_release off": {"early_release"},
           "fuse_layer_norm off": {"fuse_layer_norm"}, "fuse_activations off": {"fuse_activations"},
           "fuse_attention off": {"fuse_attention"}, "all fusions off": {"fusions"}}


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


def ir_node_count(lowered: Any) -> int:
    ep = lowered.edge.exported_program()
    return sum(len(N.deserialize(m.processed_bytes).instructions)
               for _, m in ep.graph_module.named_children() if hasattr(m, "processed_bytes"))


def delegate_io(lowered: Any) -> str:
    ep = lowered.edge.exported_program()
    calls = [n for n in ep.graph.nodes if n.target is torch.ops.higher_order.executorch_call_delegate]
    return "+".join(f"{len(c.args) - 1}/{len(c.users)}" for c in calls)


def prepare(module: torch.nn.Module, inputs: tuple,
            disabled: set[str]) -> tuple[list[str], Callable[[], Any]]:
    """Lower with `disabled` switched off; (IR nodes, segments, delegate in/out, MLX peak above what is
    resident before the call, max |diff| vs eager) and one call."""
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
    columns = [str(ir_node_count(lowered)), f"{segments} ({len(leftover)} fallback)", delegate_io(lowered),
               f"{peak / 2**20:.1f} MiB", f"{diff:.1e}"]
    return columns, lambda: method.execute(list(inputs))


def interleaved_medians(calls: dict[str, Callable[[], Any]], runs: int) -> dict[str, float]:
    """Median seconds per call, timed in rounds that call each config once, so machine load hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(runs):
        for name, call in calls.items():
            t = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small models, few runs")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    dim, layers, runs = (128, 2, 5) if args.quick else (512, 8, 20)
    models: dict[str, Callable[[], tuple[torch.nn.Module, tuple]]] = {
        "llama-shaped decode step": lambda: (DecoderStep(dim, layers, 256).eval(),
                                             (torch.randn(1, dim), torch.tensor(3))),
        "whisper-shaped encoder": lambda: (EncoderBlock(dim // 2, max(layers // 2, 1)).eval(),
                                           (torch.randn(1, 80, 200 if args.quick else 1000),)),
    }
    rows = []
    for name, make in models.items():
        module, inputs = make()
        columns, calls = {}, {}
        for config, disabled in CONFIGS.items():
            try:
                columns[config], calls[config] = prepare(module, inputs, disabled)
            except Exception as e:  # report, keep going: a table, never a crash
                columns[config] = [f"error: {type(e).__name__}: {str(e)[:80]}", "", "", "", ""]
        medians = interleaved_medians(calls, runs)
        rows += [[name, config, *cols, fmt_time(medians[config]) if config in medians else ""]
                 for config, cols in columns.items()]
    headers = ["model", "optimisations", "IR nodes", "segments", "delegate in/out", "MLX peak (call)",
               "max |diff|", "median"]
    print(format_table(headers, rows, right=[False, False, True, False, True, True, True, True]))


if __name__ == "__main__":
    main()
