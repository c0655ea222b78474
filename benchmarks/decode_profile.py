"""Where an LLM decode step goes, by node kind (`MLX_DELEGATE_PROFILE`'s per-node timer), and the
memory a step needs above the resident state (weights and KV caches), compiled and profiled: a
cache write that copies its cache instead of updating it in place shows up there as a whole cache.

Programs are .pte files from `mlx_delegate.pipelines.llm.export.save_pte`. Profiled steps run node by
node and evaluate each node on its own, so their sum is above a compiled step's time.

    python benchmarks/decode_profile.py A.pte [B.pte ...] [--steps 20]
"""

from __future__ import annotations

import argparse
import os
from collections import defaultdict
from pathlib import Path

import common  # first: mlx_delegate before mlx

from mlx_delegate import _runtime
from mlx_delegate.pipelines.llm.generate import Generator


def step_memory(g: Generator, steps: int = 4) -> int:
    """Most bytes above the live ones during one single-token step."""
    most = 0
    for _ in range(steps):
        _runtime.reset_peak_memory()
        live = _runtime.active_memory()
        g._run([5], [])
        most = max(most, _runtime.peak_memory() - live)
    return most


def profile(path: Path, steps: int) -> None:
    g = Generator(str(path))
    g.warm_up(8, 3)
    g._run(list(range(1, 9)), [])
    compiled_kb = step_memory(g) / 1024
    was = _runtime.profile_enabled()
    _runtime.set_profile(True)
    _runtime.reset_profile()
    try:
        profiled_kb = step_memory(g) / 1024
        _runtime.reset_profile()
        for _ in range(steps):
            if g.pos + 1 >= g.max_seq_len:
                g.pos = 9
            g._run([5], [])
        report = _runtime.profile_report()
    finally:
        _runtime.set_profile(was)
        _runtime.reset_profile()
    kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for key, calls, seconds in report:
        kinds[key.split()[0]][0] += calls / steps
        kinds[key.split()[0]][1] += seconds / steps * 1e3
    total = sum(ms for _, ms in kinds.values())
    rows = [[kind, f"{n:.0f}", f"{ms:.2f}", f"{100 * ms / total:.1f} %"]
            for kind, (n, ms) in sorted(kinds.items(), key=lambda kv: -kv[1][1])]
    rows.append(["total", f"{sum(n for n, _ in kinds.values()):.0f}", f"{total:.2f}", "100 %"])
    print(f"\n{path.name}: memory above the resident state per step: compiled {compiled_kb:.0f} KB, "
          f"profiled {profiled_kb:.0f} KB; profile over {steps} steps (load average "
          f"{os.getloadavg()[0]:.2f}):")
    print(common.format_table(["node kind", "nodes", "ms / step", "share"], rows, [False, True, True, True]))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("programs", nargs="+", type=Path)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    print(common.heading(common.machine_meta(bandwidth=False)))
    for path in args.programs:
        profile(path, args.steps)


if __name__ == "__main__":
    main()
