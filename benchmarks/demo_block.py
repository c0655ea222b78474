"""The `mlx-delegate demo` block: where each engine's CPU time goes, and the delegate's product
split policies against eager torch in the demo's own alternation.

1. CPU per call by thread (from /proc/self/task/*/schedstat, so every thread's time is counted whole; the
   demo's `time.process_time()` around one call also counts other threads still running then,
   e.g. eager torch's OpenMP workers spinning after its previous call): the delegate alone,
   eager alone, and the two alternating as the demo times them. Threads are grouped by who
   uses them: the calling thread, the delegate's (MLX's stream thread, the kernels' helper pool)
   and eager's (its OpenMP workers).
2. The demo's alternation (delegate, eager / eager, delegate, ...) in blocks of 10 rounds per
   product split policy (`_blas.set_split_policy`: "measured" chooses per product
   shape by measured time; "always", the default, splits every large product over the pool), the policies
   rotating block by block in one process. Medians per policy.

    python benchmarks/demo_block.py [--rounds 200] [--cycles 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import common  # noqa: F401  (imports mlx_delegate first: the BLAS route)
import torch
from common import format_table, heading, machine_meta
from executorch.runtime import Runtime

from mlx_delegate import _blas
from mlx_delegate.cli.demo import DemoBlock, DemoConfig, lower_to_file
from mlx_delegate.pipelines.cache import cache_dir


def thread_cpu() -> dict[int, float]:
    """CPU seconds so far of each thread of this process (schedstat: nanoseconds on a CPU)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0]) / 1e9
        except OSError:  # the thread ended
            continue
    return out


def by_thread(fns: dict[str, Callable[[], object]],
              rounds: int) -> tuple[dict[str, float], dict[int, float], float]:
    """Median wall ms per engine, CPU ms per round by thread and mean wall ms per round, the
    engines alternating (the mean counts the slow calls that a median leaves out)."""
    for fn in fns.values():
        for _ in range(5):
            fn()
    walls: dict[str, list[float]] = {k: [] for k in fns}
    start, before = time.perf_counter(), thread_cpu()
    for r in range(rounds):
        for k in (list(fns) if r % 2 == 0 else list(reversed(fns))):
            t = time.perf_counter()
            fns[k]()
            walls[k].append(time.perf_counter() - t)
    after, elapsed = thread_cpu(), time.perf_counter() - start
    per = {tid: (v - before.get(tid, 0.0)) / rounds * 1e3 for tid, v in after.items()}
    return {k: statistics.median(w) * 1e3 for k, w in walls.items()}, per, elapsed / rounds * 1e3


def group(per: dict[int, float], ids: set[int]) -> float:
    """CPU ms per round of the threads `ids`."""
    return sum(ms for t, ms in per.items() if t in ids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=200, help="rounds per mode in part 1")
    p.add_argument("--cycles", type=int, default=20, help="blocks of 10 rounds per policy in part 2")
    args = p.parse_args()
    meta = machine_meta(bandwidth=False)

    cfg = DemoConfig()
    torch.manual_seed(0)
    model = DemoBlock(cfg).eval()
    x = torch.randn(1, cfg.seq, cfg.dim)
    path = lower_to_file(model, (x,), cache_dir() / f"demo-{cfg.tag}.pte")
    method = Runtime.get().load_program(path).load_method("forward")

    def delegate() -> object:
        return method.execute([x])

    def eager() -> object:
        return model(x)

    with torch.no_grad():
        caller = os.getpid()  # the main thread's id
        modes = {"delegate alone": {"delegate": delegate}, "eager alone": {"eager": eager},
                 "alternating (the demo)": {"delegate": delegate, "eager": eager}}
        measured = {name: by_thread(fns, args.rounds) for name, fns in modes.items()}
        # Threads that worked in the delegate-alone mode are the delegate's, in the eager-alone mode eager's.
        ours = {t for t, ms in measured["delegate alone"][1].items() if ms > 0.01 and t != caller}
        theirs = {t for t, ms in measured["eager alone"][1].items() if ms > 0.01 and t != caller} - ours
        rows = []
        for name, (walls, per, round_ms) in measured.items():
            rows.append([name, ", ".join(f"{k} {v:.3f} ms" for k, v in walls.items()),
                         f"{round_ms:.3f}", f"{sum(per.values()):.3f}", f"{per.get(caller, 0.0):.3f}", f"{group(per, ours):.3f}",
                         f"{group(per, theirs):.3f}"])
        print(heading(meta))
        print(format_table(["mode", "wall per call (median)", "wall per round (mean)", "CPU per round",
                            "caller thread", "delegate's threads", "eager's OpenMP workers"], rows,
                           [False, False, True, True, True, True, True]))

        policies = ("measured", "always")
        res: dict[str, dict[str, list[float]]] = {v: {"delegate": [], "eager": []} for v in policies}
        for _ in range(args.cycles):
            for policy in policies:
                previous = _blas.set_split_policy(policy)
                for r in range(10):
                    for k in (("delegate", "eager") if r % 2 == 0 else ("eager", "delegate")):
                        t = time.perf_counter()
                        delegate() if k == "delegate" else eager()
                        res[policy][k].append(time.perf_counter() - t)
                _blas.set_split_policy(previous)
    rows = []
    for policy, r in res.items():
        d, e = statistics.median(r["delegate"]) * 1e3, statistics.median(r["eager"]) * 1e3
        rows.append([policy, f"{d:.3f} ms", f"{e:.3f} ms", f"{e / d:.2f}x"])
    print()
    print(format_table(["split policy", "delegate", "eager torch", "eager / delegate"], rows,
                       [False, True, True, True]))
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}; products run as one call by the measured "
          f"choice: {_blas.serial_choices()}, split: {_blas.split_calls()}")


if __name__ == "__main__":
    main()
