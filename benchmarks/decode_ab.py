"""Decode tok/s of LLM programs (.pte files from `mlx_delegate.pipelines.llm.export.save_pte`), A/B in one
process: each program, with one of the quantized GEMV's switches off and on (`--switch group32`: its one-row
eight-groups path (groups of 32, 64 and 128), `_runtime.set_qgemv_group32_path`; `--switch avx512`: its AVX-512 VNNI kernels,
`_runtime.set_qgemv_avx512_path`), runs a block of single-token steps in turn, the order reversed every
round, so load on the shared machine hits every variant alike. Use it to compare programs of one model
lowered differently (e.g. before / after a lowering change, GGUF blocks against `--quantize int4`).

A step is the compiled decode graph (warmed up: prefill of 8 tokens, then steps from position 9 on, the
position rewound before the cache fills). `cpu ms/token` is the process's CPU time per step (all threads),
less sensitive to the machine's load than the wall time. Medians over rounds; `best` is the fastest block.

    python benchmarks/decode_ab.py A.pte B.pte ... [--rounds 12] [--block 16] [--switch group32|avx512|spin_yield|sdpa_rows]

`--switch avx512` toggles the quantized GEMV's AVX-512 kernels; `--switch spin_yield` how the kernel
pool's helpers wait between jobs (`_runtime.set_pool_spin_yield`: yield the core, or pause on it);
`--switch sdpa_rows` the decode attention's AVX-512 row loops (`_runtime.set_sdpa_row_loops`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import common  # first: mlx_delegate before mlx

from mlx_delegate import _runtime
from mlx_delegate.pipelines.llm.generate import Generator

# name: (the table's column, the runtime switch; each on by default)
SWITCHES = {"group32": ("eight-groups path", _runtime.set_qgemv_group32_path),
            "avx512": ("AVX-512 kernels", _runtime.set_qgemv_avx512_path),
            "spin_yield": ("helper yields", _runtime.set_pool_spin_yield),
            "sdpa_rows": ("attention row loops", _runtime.set_sdpa_row_loops)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("programs", nargs="+", type=Path)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--block", type=int, default=16, help="decode steps per variant per round")
    p.add_argument("--switch", choices=sorted(SWITCHES), default="group32", help="the kernel switch A/B'd")
    args = p.parse_args(argv)
    label, switch = SWITCHES[args.switch]
    gens = {path: Generator(str(path)) for path in args.programs}
    for g in gens.values():
        g.warm_up(8, 3)
        g._run(list(range(1, 9)), [])
    variants = [(path, on) for path in args.programs for on in (False, True)]
    wall: dict[tuple[Path, bool], list[float]] = {v: [] for v in variants}
    cpu: dict[tuple[Path, bool], list[float]] = {v: [] for v in variants}
    meta = common.machine_meta(bandwidth=False)
    try:
        for r in range(args.rounds):
            for v in variants if r % 2 == 0 else variants[::-1]:
                path, on = v
                switch(on)
                g = gens[path]
                if g.pos + args.block >= g.max_seq_len:
                    g.pos = 9
                t, c = time.perf_counter(), time.process_time()
                for _ in range(args.block):
                    g._run([5], [])
                wall[v].append(args.block / (time.perf_counter() - t))
                cpu[v].append((time.process_time() - c) / args.block * 1e3)
    finally:
        switch(True)
    meta |= {"loadavg_end": [round(x, 2) for x in os.getloadavg()], "rounds": args.rounds, "block": args.block}
    rows = [[path.name, "on" if on else "off", f"{statistics.median(wall[v]):.1f}", f"{max(wall[v]):.1f}",
             f"{statistics.median(cpu[v]):.2f}", f"{path.stat().st_size / 1e6:.1f} MB"]
            for v in variants for path, on in [v]]
    print(common.heading(meta))
    print(common.format_table(["program", label, "decode tok/s", "best", "cpu ms/token", ".pte"], rows,
                              [False, False, True, True, True, True]))
    for line in common.load_note(meta):
        print(line)


if __name__ == "__main__":
    main()
