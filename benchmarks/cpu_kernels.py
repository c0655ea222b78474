"""Op-level timings of the CPU element-wise / row kernels against MLX's own ops
(MLX_DELEGATE_CPU_KERNELS=0) and eager torch, at the shapes SmolLM2-135M prefill
(32 and 128 tokens) and the Whisper-base encoder (1500 frames) run.

Each op is lowered once on its own and loaded twice: one copy always runs with
the kernels on, the other off (`_runtime.set_cpu_kernels`), and they take turns
with eager torch (2 threads) call by call in one process, so load on the shared
machine hits all three alike. Figures are medians of the call times (through
the delegate: its per-call overhead, ~40 us and an input/output copy, included).
Nothing fails here.

    python benchmarks/cpu_kernels.py [--rounds 5] [--calls 20]

--prefill instead times SmolLM2-135M fp32 prefill (32 and 128 tokens) in one
process: the same program loaded twice, one copy always run with the kernels on
and the other off (`_runtime.set_cpu_kernels`; each compiles its own graph),
and eager torch, taking turns call by call.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from typing import Callable

import torch
import torch.nn.functional as F

import mlx_delegate  # noqa: F401  (before mlx, as in the other benchmarks)
from executorch.runtime import Runtime
from mlx_delegate import _runtime
from mlx_delegate.testing import Lambda, lower

warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)

Op = Callable[[torch.Tensor], torch.Tensor]


def rms(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), torch.ones(x.shape[-1]), 1e-5)


def layer_norm(x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), torch.ones(x.shape[-1]), torch.zeros(x.shape[-1]), 1e-5)


def softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, -1)


# (label, op, shape): SmolLM2-135M (hidden 576, MLP 1536, 9 heads), Whisper base (512, 2048, 8 heads).
CASES: list[tuple[str, Op, tuple[int, ...]]] = [
    ("smollm2 s32 rms_norm", rms, (32, 576)),
    ("smollm2 s32 silu", F.silu, (32, 1536)),
    ("smollm2 s32 softmax", softmax, (9, 32, 32)),
    ("smollm2 s128 rms_norm", rms, (128, 576)),
    ("smollm2 s128 silu", F.silu, (128, 1536)),
    ("smollm2 s128 softmax", softmax, (9, 128, 128)),
    ("whisper layer_norm", layer_norm, (1500, 512)),
    ("whisper gelu", F.gelu, (1500, 2048)),
    ("whisper softmax", softmax, (8, 1500, 1500)),
    ("exp 16M", torch.exp, (1 << 24,)),
]

def ab_runner(buffer: bytes) -> Callable[[str, list[torch.Tensor]], None]:
    """Runs one program with the kernels on or off: two loaded copies, each always run one way, so
    that each compiles (and then replays) its own graph."""
    programs = {k: Runtime.get().load_program(buffer) for k in ("on", "off")}
    methods = {k: p.load_method("forward") for k, p in programs.items()}

    def run(kernels: str, inputs: list[torch.Tensor]) -> None:
        _runtime.set_cpu_kernels(kernels == "on")
        try:
            methods[kernels].execute(inputs)
        finally:
            _runtime.set_cpu_kernels(True)

    run.programs = programs  # keep the programs referenced while their methods run
    return run


def interleaved(engines: dict[str, Callable[[], None]], rounds: int, calls: int) -> dict[str, float]:
    """Median seconds per call of each engine; engines take turns call by call after two warm-up
    calls each (node by node, then traced)."""
    samples: dict[str, list[float]] = {name: [] for name in engines}
    for i in range(2 + rounds * calls):
        for name, run in engines.items():
            t = time.perf_counter()
            run()
            if i >= 2:
                samples[name].append(time.perf_counter() - t)
    return {name: statistics.median(v) for name, v in samples.items()}


def prefill_ab(rounds: int, lengths: tuple[int, ...] = (32, 128)) -> None:
    from mlx_delegate.llm import export as llm_export
    from mlx_delegate.models import loading

    model = loading.load("smollm2", max_seq_len=max(lengths) + 8).model.eval()
    run = ab_runner(llm_export.to_pte(model))
    print(f"{'prompt':>6s} {'kernels on':>12s} {'kernels off':>12s} {'eager torch':>12s}   (prefill tok/s)")
    for length in lengths:
        tokens = torch.randint(0, 49152, (1, length))
        inputs = [tokens, torch.tensor([0])]

        def eager() -> None:
            with torch.no_grad():
                model(*inputs, last_only=True)

        t = interleaved({"on": lambda: run("on", inputs), "off": lambda: run("off", inputs), "eager": eager},
                        rounds, 1)
        print(f"{length:6d} " + " ".join(f"{length / t[k]:12.1f}" for k in ("on", "off", "eager")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--prefill", action="store_true", help="SmolLM2 prefill A/B instead of single ops")
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.prefill:
        return prefill_ab(args.rounds)
    print(f"{'op':24s} {'shape':>16s} {'kernels on':>12s} {'MLX (off)':>12s} {'eager torch':>12s} {'speed-up':>9s}")
    for label, op, shape in CASES:
        x = torch.randn(shape)
        run = ab_runner(lower(Lambda(op), (x,)).buffer)
        heavy = x.numel() > 1 << 22  # fewer calls for the big ones
        t = interleaved({"on": lambda: run("on", [x]), "off": lambda: run("off", [x]), "eager": lambda: op(x)},
                        1 if heavy else args.rounds, 3 if heavy else args.calls)
        on, off, eager = (t[k] * 1e3 for k in ("on", "off", "eager"))
        print(f"{label:24s} {str(shape):>16s} {on:10.3f}ms {off:10.3f}ms {eager:10.3f}ms {off / on:8.1f}x", flush=True)


if __name__ == "__main__":
    main()
