"""Where a quantized decode step's wall time goes, from the runtime's own per-step counters
(`_runtime.set_step_counters`), not the per-node profiler (which evaluates each node on its own):

- `products`: the quantized GEMV's tasks on MLX's stream thread, of which `streaming` is the rows on
  the kernel pool (`GB/s` = weights + scales + biases over that time) and `prep + epilogue` the rest
  (RMSNorm, x to int16, group sums; GLU, residual);
- `helper wait`: inside `streaming`, the stream thread's time from its own last part to the product's
  end, waiting for the helper's parts; `helper late`: from a product's publication to the helper's
  first part, per product; `slept`: products the helper reached from sleep (a futex wake-up) rather
  than its spin; `missed`: products it took no part of; `helper share`: its parts over all parts;
- `gaps`: the stream thread's time between one product's end and the next one's start within a step
  (the other nodes and MLX's scheduling), split into that thread's CPU time there (`gap cpu`: the other
  nodes' work and MLX's per-task cost) and the rest (`gap idle`: waiting for the caller to enqueue, or
  for a core);
- `lead-in`: from the step's start (the Python call) to its first product (the call's set-up, the
  graph built and enqueued, the embedding); `tail`: from its last product to the call's return (the
  output copied out). step = lead-in + products + gaps + tail.

Programs are .pte files from `mlx_delegate.pipelines.llm.export.save_pte` (`--export` writes the 1.2B
Llama-3.2-shaped model's `--quantize int4` program, random weights, as `benchmarks/llm.py` builds it).
With `--switch`, each program runs with the runtime switch off and on in turn (ABBA rounds), as in
`decode_ab.py`. `cpu ms/token` is the process's CPU time per step (all threads).

    python benchmarks/decode_split.py PROGRAM.pte ... [--rounds 6] [--block 16] [--switch pool_hold|huge_pages|arena|guided|omp_team|omp_team_always|spin_yield|torch_threads|rope_kv_packed|kernel_chains|chain_writes|omp_pause] [--probe]
    python benchmarks/decode_split.py --export 1b-int4.pte [--layers 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import common  # first: mlx_delegate before mlx
import torch

from mlx_delegate import _runtime
from mlx_delegate.pipelines.llm.generate import Generator

# name: (the table's column, the runtime switch, its default); switches read at load (LOAD_SWITCHES)
# load the program once per setting.
SWITCHES = {"none": ("-", lambda on: None, None),
            "pool_hold": ("helpers held in a call", _runtime.set_pool_hold_in_call, False),
            "huge_pages": ("huge-page constants", _runtime.set_huge_page_constants, True),
            "arena": ("constant arena (off: 4 MiB+ only)", _runtime.set_constant_arena, True),
            "spin_yield": ("helper yields", _runtime.set_pool_spin_yield, False),
            "guided": ("guided split", _runtime.set_qgemv_guided_split, False),
            "omp_team": ("OpenMP team lent when faster (off: never)",
                         lambda on: _runtime.set_pool_omp_team("auto" if on else "off"), True),
            "omp_team_always": ("OpenMP team lent on every call (off: never)",
                                lambda on: _runtime.set_pool_omp_team("always" if on else "off"), False),
            # eager torch's own threads (common.THREADS) against one: the Python binding's output tensors are
            # torch ops, whose OpenMP workers keep spinning for a while after each
            "torch_threads": (f"torch threads {common.THREADS} (off: 1)",
                              lambda on: torch.set_num_threads(common.THREADS if on else 1), True),
            "rope_kv_packed": ("q / k / v read from their projection", _runtime.set_rope_kv_packed, True),
            "kernel_chains": ("kernel runs folded into chains", _runtime.set_kernel_chains, True),
            "chain_writes": ("cache writes in chains, weights held by them", _runtime.set_kernel_chain_writes, True),
            # the stock runtime's clone of returned logits wakes torch's OpenMP team, whose worker then spins
            "omp_pause": ("OpenMP team paused before a long call", _runtime.set_pool_omp_pause, True)}
# Read at load or when a graph is traced: each setting loads (and warms up) the program once.
LOAD_SWITCHES = {"huge_pages", "arena", "rope_kv_packed", "kernel_chains", "chain_writes"}


def export_1b(path: Path, layers: int) -> None:
    """The 1.2B Llama-3.2-shaped model of `benchmarks/llm.py` (random weights), `--quantize int4`."""
    from llm import LLAMA_1B, random_llama

    from mlx_delegate.pipelines.llm import export

    shape = dict(LLAMA_1B, num_hidden_layers=layers)
    export.save_pte(random_llama(104, **shape), path, quantize="int4")


def anon_huge_mb() -> float:
    """The process's memory in transparent huge pages (AnonHugePages), in MB; 0 where Linux does not say."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024 / 1e6
    except OSError:
        pass
    return 0.0


def run_block(g: Generator, steps: int) -> dict[str, float]:
    """`steps` single-token steps with the counters reset first; the sums and the wall / CPU times."""
    if g.pos + steps >= g.max_seq_len:
        g.pos = 9
    _runtime.reset_step_counters()
    wall = cpu = 0.0
    for _ in range(steps):
        _runtime.step_counters_begin()
        t, c = time.perf_counter(), time.process_time()
        g._run([5], [])
        wall += time.perf_counter() - t
        cpu += time.process_time() - c
        _runtime.step_counters_end()
    out = {k: float(v) for k, v in _runtime.step_counters().items()}
    return out | {"wall_s": wall, "cpu_s": cpu, "steps": float(steps)}


def summarise(blocks: list[dict[str, float]]) -> list[str]:
    """One table row: medians over blocks of each per-step figure."""
    def med(f) -> float:  # noqa: ANN001
        return statistics.median(f(b) for b in blocks)

    ms = lambda key: lambda b: b[key] / b["steps"] / 1e6  # noqa: E731
    step = med(lambda b: b["wall_s"] / b["steps"] * 1e3)
    products = med(ms("qgemv_wall_ns"))
    streaming = med(ms("qgemv_parallel_ns"))
    gaps = med(ms("qgemv_gap_wall_ns"))
    gap_cpu = med(ms("qgemv_gap_cpu_ns"))
    lead, tail = med(ms("qgemv_lead_ns")), med(ms("qgemv_tail_ns"))
    gbs = med(lambda b: b["qgemv_bytes"] / max(b["qgemv_parallel_ns"], 1.0))
    step_gbs = med(lambda b: b["qgemv_bytes"] / (b["wall_s"] * 1e9))
    per_job = lambda key: lambda b: b[key] / max(b["pool_jobs"], 1.0)  # noqa: E731
    share = med(lambda b: b["pool_helper_parts"] / max(b["pool_helper_parts"] + b["pool_caller_parts"], 1.0))
    return [f"{1e3 / step:.2f}", f"{step:.2f}", f"{med(lambda b: b['cpu_s'] / b['steps'] * 1e3):.2f}",
            f"{products:.2f}", f"{streaming:.2f}", f"{gbs:.1f}", f"{step_gbs:.1f}", f"{products - streaming:.2f}",
            f"{med(ms('pool_caller_wait_ns')):.2f}", f"{med(per_job('pool_helper_late_ns')) / 1e3:.1f}",
            f"{med(lambda b: b['pool_helper_sleeps'] / b['steps']):.1f}",
            f"{med(lambda b: b['pool_helper_missed'] / b['steps']):.1f}", f"{100 * share:.0f} %",
            f"{gaps:.2f}", f"{gap_cpu:.2f}", f"{gaps - gap_cpu:.2f}", f"{lead:.2f}", f"{tail:.2f}",
            f"{med(lambda b: b['qgemv_calls'] / b['steps']):.0f}"]


HEADERS = ["tok/s", "step ms", "cpu ms/token", "products ms", "streaming ms", "GB/s streaming", "GB/s step",
           "prep + epilogue ms", "helper wait ms", "helper late us", "slept / step", "missed / step",
           "helper share", "gaps ms", "gap cpu ms", "gap idle ms", "lead-in ms", "tail ms", "products / step"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("programs", nargs="*", type=Path)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--block", type=int, default=16, help="decode steps per variant per round")
    p.add_argument("--switch", choices=sorted(SWITCHES), default="none", help="a runtime switch A/B'd off / on")
    p.add_argument("--probe", action="store_true", help="the GEMV bandwidth probe before and after (common.py)")
    p.add_argument("--export", type=Path, help="write the 1.2B int4 program here and exit")
    p.add_argument("--layers", type=int, default=16, help="layers of the exported model")
    args = p.parse_args(argv)
    if args.export:
        export_1b(args.export, args.layers)
        return
    if not args.programs:
        p.error("no programs")
    label, switch, default = SWITCHES[args.switch]
    states = (None,) if args.switch == "none" else (False, True)
    variants = [(path, on) for path in args.programs for on in states]
    gens: dict[tuple[Path, bool | None], Generator] = {}
    warmed: set[Generator] = set()

    def warm_up(g: Generator) -> None:  # traces the decode graph (under the switch's setting, if a load switch)
        g.warm_up(8, 3)
        g._run(list(range(1, 9)), [])
        warmed.add(g)

    huge_mb: dict[tuple[Path, bool | None], float] = {}  # what each load added in huge pages
    for path, on in variants:
        if args.switch in LOAD_SWITCHES:
            switch(on)
            before = anon_huge_mb()
            gens[(path, on)] = g = Generator(str(path))
            huge_mb[(path, on)] = anon_huge_mb() - before
            warm_up(g)
        else:
            gens[(path, on)] = gens.get((path, None)) or Generator(str(path))
            gens[(path, None)] = gens[(path, on)]
    if args.switch in LOAD_SWITCHES:
        switch(default)
    for g in set(gens.values()) - warmed:
        warm_up(g)
    blocks: dict[tuple[Path, bool | None], list[dict[str, float]]] = {v: [] for v in variants}
    meta = common.machine_meta(bandwidth=False)
    probes = [common.memory_bandwidth_gbs()] if args.probe else []
    _runtime.set_step_counters(True)
    try:
        for r in range(args.rounds):
            for v in variants if r % 2 == 0 else variants[::-1]:
                path, on = v
                if on is not None and args.switch not in LOAD_SWITCHES:
                    switch(on)
                blocks[v].append(run_block(gens[v], args.block))
    finally:
        _runtime.set_step_counters(False)
        if default is not None:
            switch(default)
    if args.probe:
        probes.append(common.memory_bandwidth_gbs())
    meta |= {"loadavg_end": [round(x, 2) for x in os.getloadavg()], "rounds": args.rounds, "block": args.block}
    rows = [[path.name, "-" if on is None else "on" if on else "off", *summarise(blocks[(path, on)])]
            for path, on in variants]
    print(common.heading(meta))
    print(common.format_table(["program", label, *HEADERS], rows, [False, False] + [True] * len(HEADERS)))
    for (path, on), mb in huge_mb.items():
        print(f"{path.name} {label} {'on' if on else 'off'}: its load added {mb:.0f} MB in huge pages (AnonHugePages)")
    if probes:
        print(f"GEMV bandwidth probe (torch mv over 1 GiB): {', '.join(f'{x:.1f}' for x in probes)} GB/s "
              f"(before, after)")
    for line in common.load_note(meta):
        print(line)


if __name__ == "__main__":
    main()
