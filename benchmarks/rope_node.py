"""One RoPE node on the CPU: the kernel (kernels/rope_cpu) against MLX's composed mx::fast::rope
(kernels off) and eager torch, at SmolLM2-135M's decode shapes (q [1, 9, 1, 64], k [1, 3, 1, 64])
and a prefill shape, position as a tensor (the compiled decode graph's form).

One `rope_at` op is lowered once and loaded twice, one copy per path (each compiles its own graph);
the copies and eager torch take turns call by call in one process. Medians of the call times
through the delegate (its per-call overhead, ~40 us, included), compiled graphs and node by node.
Nothing fails here.

    python benchmarks/rope_node.py [--rounds 5] [--calls 40]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import common  # noqa: F401  (mlx_delegate before mlx)
import torch
from executorch.runtime import Runtime

from mlx_delegate import _runtime
from mlx_delegate.custom_ops import rope_at
from mlx_delegate.llm.export import lower
from mlx_delegate.models.llama import apply_rope

D, BASE = 64, 100000.0


class RopeAt(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (BASE ** (torch.arange(0, D, 2, dtype=torch.float32) / D)))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return rope_at(x, self.inv_freq, pos, False, BASE)


def eager(module: RopeAt, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The rotate-half form as the Llama model computes it."""
    f = (pos + torch.arange(x.shape[2]))[:, None].float() * module.inv_freq[None, :]
    emb = torch.cat((f, f), -1)
    return apply_rope(x, emb.cos().to(x.dtype), emb.sin().to(x.dtype))


def runners(buffer: bytes) -> dict[str, Callable[[list[torch.Tensor]], None]]:
    """One loaded copy per path, each always run the same way."""
    kernels = {"kernel": True, "mlx": False}
    programs = {name: Runtime.get().load_program(buffer) for name in kernels}
    methods = {name: p.load_method("forward") for name, p in programs.items()}

    def make(name: str) -> Callable[[list[torch.Tensor]], None]:
        def run(x: list[torch.Tensor]) -> None:
            _runtime.set_cpu_kernels(kernels[name])
            try:
                methods[name].execute(x)
            finally:
                _runtime.set_cpu_kernels(True)

        run.program = programs[name]  # keep it referenced while its method runs
        return run

    return {name: make(name) for name in kernels}


def interleaved(engines: dict[str, Callable[[], None]], rounds: int, calls: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in engines}
    for i in range(2 + rounds * calls):
        for name, run in engines.items():
            t = time.perf_counter()
            run()
            if i >= 2:
                samples[name].append(time.perf_counter() - t)
    return {name: statistics.median(v) for name, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny ops: torch's worker threads would only contend with the kernel pool
    module = RopeAt().eval()
    cases = [(9, 1, torch.float32), (3, 1, torch.float32), (9, 1, torch.bfloat16), (9, 64, torch.float32)]
    names = ("kernel", "mlx", "eager")
    print(f"{'compiled':>8s} {'H':>2s} {'L':>3s} {'dtype':>8s} " + " ".join(f"{n:>8s}" for n in names)
          + "   (us per call)")
    for compiled in (True, False):
        _runtime.set_compile(compiled)
        for heads, length, dtype in cases:
            x, pos = torch.randn(1, heads, length, D, dtype=dtype), torch.tensor([100])
            ep = torch.export.export(module, (x, pos), strict=True)
            run = runners(lower(ep).to_executorch().buffer)
            engines = {name: (lambda r=r: r([x, pos])) for name, r in run.items()}
            engines["eager"] = lambda: eager(module, x, pos)
            t = interleaved(engines, args.rounds, args.calls)
            print(f"{str(compiled):>8s} {heads:2d} {length:3d} {str(dtype).removeprefix('torch.'):>8s} "
                  + " ".join(f"{t[n] * 1e6:8.1f}" for n in names), flush=True)


if __name__ == "__main__":
    main()
