"""The `mlx-delegate demo` block: where each engine's CPU time goes, and the delegate's product
split policies against eager torch in the demo's own alternation.

1. CPU per call by thread (from /proc/self/task/*/schedstat, so every thread's time is counted whole; the
   demo's `time.process_time()` around one call also counts other threads still running then,
   e.g. eager torch's OpenMP workers spinning after its previous call): the delegate alone,
   eager alone, and the two alternating as the demo times them. Threads are grouped by who
   uses them: the calling thread, the delegate's (MLX's stream thread, the kernels' helper pool)
   and eager's (its OpenMP workers).
2. The demo's alternation (delegate, eager / eager, delegate, ...) in blocks of 10 rounds per
   configuration, rotating block by block in one process, medians per configuration:
   - the product split policy (`_blas.set_split_policy`: "measured" chooses per product shape by
     measured time; "always", the default, splits every large product over the pool in even blocks;
     "balanced" splits every one with the calling thread's block sized by the helpers' measured speed);
   - the split shape (`_blas.set_split_shape`: blocks per pool thread, 1 by default, 2 before);
   - the caller's OpenMP team lent to the kernel pool (`_runtime.set_pool_omp_team`: "always" on each
     call, "auto" (the default) where lent calls measure faster, "off"): torch's OpenMP worker, spinning
     after eager's call, takes the pool's parts;
   - the opt-in fp32 linear kernel (bias added per output block in cache; `_runtime.set_linear_kernel`,
     read when a graph is built, so the program is loaded twice: one copy traced with it off, one on).

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

from mlx_delegate import _blas, _runtime
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
    methods = {}
    for on in (False, True):  # each copy traces its compiled graph with the kernel off / on
        previous = _runtime.set_linear_kernel(on)
        program = Runtime.get().load_program(path)
        methods[on] = (program, program.load_method("forward"))  # keep the program referenced
        for _ in range(3):
            methods[on][1].execute([x])
        _runtime.set_linear_kernel(previous)
    method = methods[_runtime.linear_kernel()][1]

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

        # (split policy, blocks per thread, linear kernel, OpenMP team lent to the pool)
        configs = [("always", 2, False, "off"), ("always", 1, False, "off"), ("always", 2, True, "off"),
                   ("always", 1, True, "off"), ("always", 1, True, "always"), ("always", 1, False, "auto"),
                   ("always", 1, False, "always"), ("measured", 1, False, "off"), ("balanced", 1, False, "off")]
        res: dict[tuple, dict[str, list[float]]] = {c: {"delegate": [], "eager": [], "cpu": []} for c in configs}
        for _ in range(args.cycles):
            for config in configs:
                policy, parts, kernel, team = config
                previous, shape = _blas.set_split_policy(policy), _blas.set_split_shape(parts)
                team_before = _runtime.pool_omp_team()
                _runtime.set_pool_omp_team(team)
                run = methods[kernel][1].execute
                for r in range(10):
                    for k in (("delegate", "eager") if r % 2 == 0 else ("eager", "delegate")):
                        t, c = time.perf_counter(), time.process_time()
                        run([x]) if k == "delegate" else eager()
                        res[config][k].append(time.perf_counter() - t)
                        if k == "delegate":
                            res[config]["cpu"].append(time.process_time() - c)
                _blas.set_split_policy(previous)
                _blas.set_split_shape(*shape)
                _runtime.set_pool_omp_team(team_before)
    rows = []
    for (policy, parts, kernel, team), r in res.items():
        d, e = statistics.median(r["delegate"]) * 1e3, statistics.median(r["eager"]) * 1e3
        rows.append([policy, str(parts), "on" if kernel else "off", team, f"{d:.3f} ms",
                     f"{statistics.median(r['cpu']) * 1e3:.3f} ms", f"{e:.3f} ms", f"{e / d:.2f}x"])
    print()
    print(format_table(["split policy", "blocks per thread", "linear kernel", "OpenMP team", "delegate",
                        "delegate CPU (process)", "eager torch", "eager / delegate"], rows,
                       [False, True, False, False, True, True, True, True]))
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}; products run as one call by the measured "
          f"choice: {_blas.serial_choices()}, split: {_blas.split_calls()}")


if __name__ == "__main__":
    main()
