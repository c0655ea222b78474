"""A/B of one optimisation switch on SmolLM2-135M decode, interleaved in one process.

    python benchmarks/fusion_ab.py [fp32|bf16] [rounds] [steps] [switch]

Lowers the model twice (default, and with `MLXPartitioner(disable={switch})`, switch
`fuse_linears` unless given), then alternates `steps` decode steps on each for `rounds`
rounds, so both see the same machine load. Prints tok/s (median, best, the paired
per-round ratio) and the process CPU time per token, which load perturbs less than wall time.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import llm
from mlx_delegate import MLXPartitioner
from mlx_delegate.llm import export as llm_export


def runner(model: torch.nn.Module, disable: tuple[str, ...]) -> llm.MethodRunner:
    edge = llm_export.lower(llm_export.export_model(model, full_logits=False),
                            partitioner=MLXPartitioner(disable=disable),
                            constant_methods=llm_export.metadata(model))
    return llm.MethodRunner(llm.pte_file(edge.to_executorch()))


def decode(r: llm.MethodRunner, steps: int, pos0: int) -> tuple[float, float]:
    """(tok/s, CPU seconds per token) over `steps` decode steps from position pos0."""
    t, c = time.perf_counter(), time.process_time()
    for i in range(steps):
        r.step([5], pos0 + i)
    return steps / (time.perf_counter() - t), (time.process_time() - c) / steps


def main() -> None:
    dtype = sys.argv[1] if len(sys.argv) > 1 else "fp32"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    switch = sys.argv[4] if len(sys.argv) > 4 else "fuse_linears"
    prompt_len, max_seq_len = 64, 256
    if prompt_len + 4 + rounds * steps > max_seq_len:
        sys.exit(f"rounds * steps must stay under {max_seq_len - prompt_len - 4}")
    model = llm.smollm2(max_seq_len)
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    runners = {"on": runner(model, ()), "off": runner(model, (switch,))}
    for r in runners.values():  # prefill and warm up
        r.step(list(range(10, 10 + prompt_len)), 0)
        for i in range(4):
            r.step([5], prompt_len + i)
    rates: dict[str, list[float]] = {k: [] for k in runners}
    cpu: dict[str, list[float]] = {k: [] for k in runners}
    for i in range(rounds):
        for k, r in runners.items():
            rate, seconds = decode(r, steps, prompt_len + 4 + i * steps)
            rates[k].append(rate)
            cpu[k].append(seconds)
    for k in runners:
        print(f"{dtype} {switch} {k:3s}: median {statistics.median(rates[k]):6.2f} tok/s, best {max(rates[k]):6.2f}, "
              f"CPU {statistics.median(cpu[k]) * 1e3:6.1f} ms/token")
    ratios = [a / b for a, b in zip(rates["on"], rates["off"])]
    print(f"paired on/off: median {statistics.median(ratios):.3f}, on faster in {sum(x > 1 for x in ratios)} "
          f"of {rounds} rounds")


if __name__ == "__main__":
    main()
