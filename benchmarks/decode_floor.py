"""The fixed per-step cost of an LLM decode step: a program with the default SmolLM2's topology
(its layer count, attention heads, KV heads, cache length, tied head, greedy sampler), so the
same IR nodes per step, but tiny dimensions (hidden 72, MLP 64, vocabulary 128, random weights),
whose products and attention cost next to nothing. Its compiled step is what the ~880 nodes cost
by themselves (graph replay, MLX's per-primitive dispatch to its stream thread, hand-offs); run
next to the real program with `decode_ab.py`, interleaved in one process.

    python benchmarks/decode_floor.py [REAL.pte ...] [--out floor.pte] [--rounds 8] [--off SWITCH,...]

REAL.pte: programs from `mlx_delegate.pipelines.llm.export.save_pte` (e.g. the GGUF default).
`--off`: also a floor program lowered with these `MLXPartitioner(disable=...)` switches (e.g.
`fuse_rope_kv_write`), timed beside the default one: what a lowering change does to the fixed cost.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import common  # noqa: F401  (first: mlx_delegate before mlx)
import decode_ab
from transformers import LlamaConfig

from mlx_delegate import MLXPartitioner
from mlx_delegate.models import loading
from mlx_delegate.pipelines.llm import export


def floor_program(path: Path, max_seq_len: int = 256, disable: frozenset[str] = frozenset()) -> Path:
    """Writes the tiny program with SmolLM2-135M's topology (30 layers, 9 heads, 3 KV heads), lowered
    with the partitioner switches in `disable` off."""
    config = LlamaConfig(hidden_size=72, intermediate_size=64, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=128, max_position_embeddings=max_seq_len,
                         tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    model = loading.from_config(config, max_seq_len=max_seq_len, seed=0).model
    if not disable:
        export.save_pte(model, path, sampler="greedy")
        return path
    edge = export.lower(export.export_model(model, sampler="greedy"), partitioner=MLXPartitioner(disable=disable),
                        constant_methods=export.metadata(model))
    with path.open("wb") as f:
        edge.to_executorch().write_to_file(f)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("programs", nargs="*", type=Path)
    p.add_argument("--out", type=Path, help="where to write the floor program (default: a temporary file)")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--off", default="", help="comma-separated partitioner switches for a second floor program")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        floor = args.out or Path(tmp) / "decode-floor.pte"
        if not floor.exists():
            floor_program(floor)
        floors = [floor]
        if args.off:
            off = floor.with_name(f"{floor.stem}-{args.off.replace(',', '-')}-off.pte")
            floors.insert(0, floor_program(off, disable=frozenset(args.off.split(","))))
        decode_ab.main([*map(str, floors), *map(str, args.programs), "--rounds", str(args.rounds),
                        "--block", str(args.block)])


if __name__ == "__main__":
    main()
