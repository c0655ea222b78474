"""Per-call overhead: a 2-op graph, `(x + y) * y`, on 4-element fp32 tensors.

The work is negligible, so each figure is what one call through the engine
costs: for the delegate, the stock ExecuTorch runtime, our backend and one MLX
evaluation. Besides the usual engines it times `et_floor`: the same graph
through the stock runtime with ExecuTorch's portable kernels and no delegate,
i.e. what ExecuTorch's Python `execute` (argument conversion, output tensors)
costs before any backend runs. Under the table it splits the delegate's call
into that floor, MLX Python's own evaluation of the graph, and the rest (ours),
and (without --quick) the CPU time each call costs at 100 Hz, delegate beside eager. The
`wait off` row is the delegate with its adaptive wait on MLX's stream thread switched off
(`_runtime.set_stream_linger(0)` around each call; the switch costs well under a microsecond); the
`gate+park off` row the delegate without the gate for small graphs sent to a sleeping stream thread
(`_runtime.set_stream_gate(0)` and the park off: one wake-up per task, the caller sleeping for the result); the
`park off` row the delegate without the stream park (`_runtime.set_stream_park(False)`: at 100 Hz
each call gates a sleeping stream thread instead of releasing a parked one).

    python benchmarks/overhead.py [--quick] [--json out.json] [--engines ...]
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import asdict, replace
from typing import Any, Callable, Iterator, Sequence

import torch

import common
from common import Prepared, Result, Workload

SIZE = 4


class AddMul(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x + y) * y


def _mlx_add_mul() -> Callable[..., Any]:
    return lambda x, y: (x + y) * y


def workloads(quick: bool) -> Iterator[Workload]:
    torch.manual_seed(0)
    inputs = (torch.randn(SIZE), torch.randn(SIZE))
    yield Workload(f"overhead (x+y)*y [{SIZE}]", AddMul(), inputs, _mlx_add_mul)


def _et_floor(w: Workload) -> Prepared:
    """The graph through the stock runtime with portable kernels (no delegate)."""
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    ep = torch.export.export(w.module.eval(), w.inputs, strict=False)
    program = Runtime.get().load_program(to_edge_transform_and_lower(ep).to_executorch().buffer)
    method = program.load_method("forward")
    args = list(w.inputs)
    return Prepared(lambda: method.execute(args), "portable kernels, no delegate", keep=program)


def _no_linger(w: Workload) -> Prepared:
    """The delegate with the adaptive wait off (MLX_DELEGATE_LINGER_US=0) during its calls: every
    call hands its graph to a sleeping MLX stream thread and sleeps until the result, as MLX does."""
    from mlx_delegate import _runtime

    return common.switched(common.ENGINES["delegate"][1], _runtime.stream_linger, _runtime.set_stream_linger, 0,
                           "adaptive wait off")(w)


def _no_gate(w: Workload) -> Prepared:
    """The delegate with the gate and the park off (MLX_DELEGATE_STREAM_GATE=0, MLX_DELEGATE_STREAM_PARK=0)
    during its calls: a small graph sent to a sleeping stream thread wakes it once per task, and the
    caller sleeps for the result."""
    from mlx_delegate import _runtime

    no_park = common.switched(common.ENGINES["delegate"][1], _runtime.stream_park, _runtime.set_stream_park, False)
    return common.switched(no_park, _runtime.stream_gate, _runtime.set_stream_gate, 0, "gate and park off")(w)


def _no_park(w: Workload) -> Prepared:
    """The delegate with the stream park off (MLX_DELEGATE_STREAM_PARK=0) during its calls: a small
    graph called with gaps wakes a sleeping stream thread through the gate, as before the park."""
    from mlx_delegate import _runtime

    return common.switched(common.ENGINES["delegate"][1], _runtime.stream_park, _runtime.set_stream_park, False,
                           "park off")(w)


FLOOR = "et_floor"
NO_LINGER = "no_linger"
NO_GATE = "no_gate"
NO_PARK = "no_park"
common.ENGINES[FLOOR] = ("ExecuTorch floor", _et_floor)
common.ENGINES[NO_LINGER] = ("mlx_delegate, wait off", _no_linger)
common.ENGINES[NO_GATE] = ("mlx_delegate, gate+park off", _no_gate)
common.ENGINES[NO_PARK] = ("mlx_delegate, park off", _no_park)
DEFAULT = ["delegate", NO_PARK, NO_LINGER, NO_GATE, "nodes", FLOOR, "mlx", "eager"]  # also the table order


def breakdown(results: Sequence[Result]) -> list[str]:
    """Per case: ExecuTorch floor, MLX Python, and what remains of each delegate row (ours)."""
    by = {(r.case, r.engine): r.median_s for r in results}
    floor_name, mlx_name = common.ENGINES[FLOOR][0], common.ENGINES["mlx"][0]
    rows = []
    for case in dict.fromkeys(r.case for r in results):
        floor, mlx = by.get((case, floor_name)), by.get((case, mlx_name))
        for key in ("delegate", NO_PARK, NO_LINGER, NO_GATE, "nodes"):
            total = by.get((case, common.ENGINES[key][0]))
            if total is None or floor is None or mlx is None:
                continue
            us = lambda s: f"{s * 1e6:.1f} us"  # noqa: E731
            rows.append([case, common.ENGINES[key][0], us(total), us(floor), us(mlx), us(total - mlx),
                         us(total - floor - mlx)])
    if not rows:
        return []
    headers = ["case", "engine", "call", "ExecuTorch floor", "MLX Python", "above MLX", "ours (rest)"]
    table = common.format_table(headers, rows, [False, False] + [True] * 5)
    return ["", "Breakdown (medians of this run): call = ExecuTorch floor + MLX Python + ours", table]


IDLE_KEYS = ("delegate", NO_PARK, NO_LINGER, NO_GATE, FLOOR, "eager")
IDLE_GAP_S = 0.01  # a call every ~10 ms: an app polling a small model at 100 Hz


def idle_cost(w: Workload, calls: int = 200, rounds: int = 5) -> list[str]:
    """CPU time per call when calls come ~10 ms apart: whatever a runtime burns between calls
    (threads spinning for work) counts. Blocks of calls per engine, alternated, so both see the
    same machine; the process's CPU time over each block is charged to its calls."""
    prepared = {k: common.ENGINES[k][1](w) for k in IDLE_KEYS}
    cpu = {k: [] for k in IDLE_KEYS}
    keys = list(prepared)
    for r in range(rounds):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:  # rotating, so no engine always follows another
            p = prepared[k]
            for _ in range(10):
                p.run()
            start = time.process_time()
            for _ in range(calls):
                p.run()
                time.sleep(IDLE_GAP_S)
            cpu[k].append((time.process_time() - start) / calls)
    best = {k: min(v) for k, v in cpu.items()}
    med = {k: statistics.median(v) for k, v in cpu.items()}
    rows = [[common.ENGINES[k][0], f"{best[k] * 1e3:.3f} ms", f"{best[k] / best['eager']:.2f}x",
             f"{med[k] * 1e3:.3f} ms", f"{med[k] / med['eager']:.2f}x"] for k in IDLE_KEYS]
    table = common.format_table(["engine", "CPU per call (best)", "vs eager", "median", "vs eager"], rows,
                                [False, True, True, True, True])
    return ["", f"Idle cost: CPU time per call at one call every {IDLE_GAP_S * 1e3:.0f} ms "
            f"(best and median of {rounds} blocks of {calls}, engines taking turns in rotating order)", table]


def _with_default_engines(argv: list[str]) -> list[str]:
    """common's default engines lack the floor and node-by-node rows this benchmark is about."""
    return argv if any(a.startswith("--engines") for a in argv) else [*argv, "--engines", ",".join(DEFAULT)]


def main(argv: Sequence[str] | None = None) -> None:
    args = common.parse_args(__doc__.splitlines()[0], _with_default_engines(list(sys.argv[1:] if argv is None
                                                                                  else argv)))
    settings = common.QUICK if args.quick else common.Settings()
    if args.budget is not None:
        settings = replace(settings, budget_s=args.budget)
    chosen = args.engines.split(",")
    engines = [k for k in DEFAULT if k in chosen] + [k for k in common.ENGINES if k in chosen and k not in DEFAULT]
    started = time.perf_counter()
    meta = common.machine_meta(bandwidth=not args.no_bandwidth) | {"quick": args.quick,
                                                                   "settings": asdict(settings)}
    results: list[Result] = []
    for w in workloads(args.quick):
        results += common.run_workload(w, engines, settings)
    meta |= {"loadavg_end": [round(x, 2) for x in os.getloadavg()], "peak_rss_mb": round(common.peak_rss_mb()),
             "wall_s": round(time.perf_counter() - started, 1)}
    print()
    print(common.heading(meta))
    print(common.results_table(results))
    idle = [] if args.quick else [line for w in workloads(args.quick) for line in idle_cost(w)]
    for line in breakdown(results) + idle + common.load_note(meta):
        print(line)
    if args.json:
        common.write_json(args.json, meta, results)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
