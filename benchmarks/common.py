"""Shared pieces of the benchmarks: engine adapters, interleaved timing, machine
probes, the table printer and the JSON writer.

A benchmark describes each measured case as a `Workload` (a torch module, its
inputs and a factory for the same computation written in MLX Python).
`run_workload` prepares every engine on it, checks each against eager torch,
then times them in interleaved rounds so that load on the shared machine hits
all engines alike.
Figures are printed side by side; nothing here passes or fails.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import subprocess
import sys
import time
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

import mlx_delegate  # before mlx: it routes MLX's sgemm to torch's BLAS only if libmlx is not loaded yet
import mlx.core as mx  # noqa: I001
import numpy as np
from mlx_delegate import _blas
from mlx_delegate.memory import available_mb, peak_rss_mb, rss_mb  # noqa: F401  (re-exported to the scripts)
from mlx_delegate.testing import lower

# Deprecation chatter from torch/executorch internals, once per export: not ours to fix.
warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)

THREADS = 2  # the cores of the reference machine; eager torch and the bandwidth probe use them all
torch.set_num_threads(THREADS)


# ---------------------------------------------------------------- workloads and engines

@dataclass
class Workload:
    """One measured case: the same computation for every engine."""

    case: str
    module: torch.nn.Module
    inputs: tuple[torch.Tensor, ...]
    # Builds the MLX Python mirror (weights copied from `module`); called only if that engine runs.
    mlx_factory: Callable[[], Callable[..., Any]]
    tokens: int = 0  # tokens per call, for tok/s (0: not a token workload)
    weight_bytes: int = 0  # bytes of weights one call reads, for the bandwidth bound


@dataclass
class Prepared:
    """An engine made ready for one workload."""

    run: Callable[[], Any]  # one call; the result is materialised when it returns
    note: str = ""
    keep: Any = None  # must outlive `run` (the ExecuTorch Program owns the loaded method)


Engine = Callable[[Workload], Prepared]


def _eager(w: Workload) -> Prepared:
    module = w.module.eval()

    def run() -> Any:
        with torch.no_grad():
            return module(*w.inputs)

    return Prepared(run)


def _mlx_python(w: Workload) -> Prepared:
    forward = w.mlx_factory()
    args = [mx.array(t.numpy()) for t in w.inputs]

    def run() -> Any:
        out = forward(*args)
        mx.eval(out)  # MLX is lazy: the call is only done once the graph is evaluated
        return out

    return Prepared(run)


def graph_note(segments: int, leftover: Sequence[str], shown: int = 4) -> str:
    """`3 seg; 85 ops outside: mm x84, embedding`: how much of the graph the delegate took."""
    if not leftover:
        return f"{segments} seg, all ops inside"
    counts = Counter(leftover).most_common()
    names = ", ".join(f"{op} x{k}" if k > 1 else op for op, k in counts[:shown])
    more = f", +{len(counts) - shown} kinds" if len(counts) > shown else ""
    return f"{segments} seg; {len(leftover)} ops outside: {names}{more}"


def _executorch(make_partitioner: Callable[[], Any]) -> Engine:
    """Export, lower with the partitioner, load with the stock `executorch.runtime`."""

    def prepare(w: Workload) -> Prepared:
        lowered = lower(w.module.eval(), w.inputs, partitioner=make_partitioner())
        segments, leftover = lowered.summary
        method = lowered.method()
        args = list(w.inputs)
        # Keep only the Program: the Lowered also holds the edge program, a second copy of the weights.
        return Prepared(lambda: method.execute(args), graph_note(segments, leftover), keep=lowered.program)

    return prepare


def switched(engine: Engine, get: Callable[[], Any], set_: Callable[[Any], Any], value: Any,
             note: str | None = None) -> Engine:
    """`engine` (the same program) with a process-wide switch at `value` during its calls only:
    `get()` reads the switch, `set_(v)` sets it; it is restored after each call. `note` replaces the
    row's note."""

    def prepare(w: Workload) -> Prepared:
        p = engine(w)

        def run() -> Any:
            was = get()
            set_(value)
            try:
                return p.run()
            finally:
                set_(was)

        return replace(p, run=run) if note is None else replace(p, run=run, note=note)

    return prepare


def _node_by_node(engine: Engine) -> Engine:
    """`engine` with the delegate's compiled graphs off during its calls (MLX_DELEGATE_COMPILE=0)."""
    from mlx_delegate import _runtime

    return switched(engine, _runtime.compile_enabled, _runtime.set_compile, False)


def _mkl_blocks(engine: Engine) -> Engine:
    """`engine` with the blocks of its large fp32 products on MKL's single-threaded sgemm during its
    calls (`_blas.set_sgemm_kind("mkl")`), where the default (except on Intel processors with AVX-512)
    is the runtime's own gemm."""
    from mlx_delegate import _blas

    return switched(engine, _blas.sgemm_kind, _blas.set_sgemm_kind, "mkl")


def _xnnpack_partitioner() -> Any:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    return XnnpackPartitioner()


# Display name and adapter per engine, in table order.
ENGINES: dict[str, tuple[str, Engine]] = {
    "delegate": ("mlx_delegate", _executorch(mlx_delegate.MLXPartitioner)),
    "nodes": ("mlx_delegate, node by node", _node_by_node(_executorch(mlx_delegate.MLXPartitioner))),
    "mkl-blocks": ("mlx_delegate, MKL blocks", _mkl_blocks(_executorch(mlx_delegate.MLXPartitioner))),
    "mlx": ("MLX Python", _mlx_python),
    "eager": ("eager torch", _eager),
    "xnnpack": ("ET XNNPACK", _executorch(_xnnpack_partitioner)),
}

# `nodes` (compiled graphs off) and `mkl-blocks` only when asked for: A/B engines.
DEFAULT_ENGINES = [k for k in ENGINES if k not in ("nodes", "mkl-blocks")]


# ---------------------------------------------------------------- timing

@dataclass(frozen=True)
class Settings:
    warmup: int = 3  # calls after the checked first call, fewer once they take `warmup_s`
    warmup_s: float = 2.0
    min_rounds: int = 3
    max_rounds: int = 60
    budget_s: float = 8.0  # timed seconds per engine and case; slow engines get min_rounds regardless
    batch_s: float = 0.005  # calls faster than this are timed in batches, so the clock's cost vanishes


QUICK = Settings(warmup=1, warmup_s=0.5, min_rounds=3, max_rounds=10, budget_s=1.5)


def _call_s(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def warm_up(fn: Callable[[], Any], s: Settings) -> float:
    """Call `fn` up to `s.warmup` times (at least once, fewer when slow); the fastest call's seconds."""
    times = [_call_s(fn)]
    while len(times) < s.warmup and sum(times) < s.warmup_s:
        times.append(_call_s(fn))
    return min(times)


def time_interleaved(runs: dict[str, Callable[[], Any]], estimate_s: dict[str, float],
                     s: Settings) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Seconds per call, one sample per round, with engines taking turns within each round.

    Each engine gets as many rounds as its budget allows (from `estimate_s`), at
    least `min_rounds`; the order rotates every round. Returns (samples, errors).
    """
    inner = {k: max(1, min(10_000, math.ceil(s.batch_s / max(estimate_s[k], 1e-9)))) for k in runs}
    rounds = {k: max(s.min_rounds, min(s.max_rounds, int(s.budget_s / (estimate_s[k] * inner[k] + 1e-9))))
              for k in runs}
    samples: dict[str, list[float]] = {k: [] for k in runs}
    errors: dict[str, str] = {}
    order = list(runs)
    gc.disable()  # a collection inside one engine's turn would be charged to it
    try:
        for r in range(max(rounds.values(), default=0)):
            active = [k for k in order if r < rounds[k] and k not in errors]
            shift = r % len(active) if active else 0
            for k in active[shift:] + active[:shift]:
                fn, n = runs[k], inner[k]
                try:
                    t0 = time.perf_counter()
                    for _ in range(n):
                        fn()
                    samples[k].append((time.perf_counter() - t0) / n)
                except Exception as e:  # noqa: BLE001  (an engine failing mid-run is a table entry)
                    errors[k] = one_line(e)
    finally:
        gc.enable()
    return samples, errors


# ---------------------------------------------------------------- results

@dataclass
class Result:
    case: str
    engine: str
    median_s: float | None = None
    p90_s: float | None = None
    rounds: int = 0
    tokens: int = 0
    max_abs_err: float | None = None  # against eager torch
    load_s: float | None = None  # export + lower + load (or the weight copy)
    first_s: float | None = None  # the first, cold call
    rss_delta_mb: float | None = None  # resident memory the engine added while loading
    note: str = ""
    error: str | None = None

    @property
    def tok_s(self) -> float | None:
        return self.tokens / self.median_s if self.tokens and self.median_s else None


def one_line(e: BaseException, limit: int = 160) -> str:
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def to_numpy(x: Any) -> list[np.ndarray]:
    """Flatten an engine's result (torch tensors, mx arrays, nested sequences) to numpy arrays."""
    if isinstance(x, (list, tuple)):
        return [a for e in x for a in to_numpy(e)]
    if isinstance(x, torch.Tensor):
        return [x.detach().numpy()]
    return [np.array(x)]


def max_abs_err(actual: Any, expected: list[np.ndarray]) -> float:
    got = to_numpy(actual)
    if len(got) != len(expected):
        raise ValueError(f"{len(got)} outputs, eager gives {len(expected)}")
    err = 0.0
    for a, e in zip(got, expected):
        if a.shape != e.shape:
            raise ValueError(f"output shape {a.shape}, eager gives {e.shape}")
        err = max(err, float(np.max(np.abs(a.astype(np.float64) - e.astype(np.float64)), initial=0.0)))
    return err


def _prepare(name: str, w: Workload, reference: list[np.ndarray], s: Settings,
             results: dict[str, Result]) -> tuple[Prepared, float] | None:
    """Load and warm one engine; returns it with a per-call estimate, or None (error recorded)."""
    res = results[name]
    rss0, t0 = rss_mb(), time.perf_counter()
    try:
        prepared = ENGINES[name][1](w)
        res.note = prepared.note
        res.load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        first = prepared.run()
        res.first_s = time.perf_counter() - t0
        res.max_abs_err = max_abs_err(first, reference)
        estimate = warm_up(prepared.run, s)
    except Exception as e:  # noqa: BLE001  (an engine that fails is reported, not fatal)
        res.error = one_line(e)
        return None
    res.rss_delta_mb = rss_mb() - rss0
    return prepared, estimate


def run_workload(w: Workload, engines: Sequence[str], s: Settings) -> list[Result]:
    """Prepare, check and time every engine on one workload."""
    with torch.no_grad():
        reference = to_numpy(w.module.eval()(*w.inputs))
    results = {k: Result(w.case, ENGINES[k][0], tokens=w.tokens) for k in engines}
    ready: dict[str, tuple[Prepared, float]] = {}
    for name in engines:
        print(f"  {w.case}: preparing {ENGINES[name][0]} ...", file=sys.stderr, flush=True)
        got = _prepare(name, w, reference, s, results)
        if got is not None:
            ready[name] = got
    print(f"  {w.case}: timing {len(ready)} engines ...", file=sys.stderr, flush=True)
    samples, errors = time_interleaved({k: p.run for k, (p, _) in ready.items()},
                                       {k: est for k, (_, est) in ready.items()}, s)
    for name, xs in samples.items():
        res = results[name]
        res.error = errors.get(name)
        if xs:
            res.median_s, res.p90_s, res.rounds = float(np.median(xs)), float(np.percentile(xs, 90)), len(xs)
    del ready
    gc.collect()
    return list(results.values())


# ---------------------------------------------------------------- machine probes

def memory_bandwidth_gbs(gib: float = 1.0, reps: int = 5, kind: str = "gemv") -> float:
    """Read bandwidth with THREADS threads over `gib` GiB of fp32 (best of `reps`). `gemv` (the default)
    streams it as a decode step's products do: torch's matrix-vector product over a weight-shaped
    [rows, 4096] matrix. `sum` is the `x.sum()` probe it replaced, which read below what the fp32
    decode of the 1.2B model streamed in the same run (24.7 against 29.2 GB/s, 2026-11-26 05:57)."""
    if kind not in ("gemv", "sum"):
        raise ValueError(f"bandwidth probe {kind!r}: expected 'gemv' or 'sum'")
    x = torch.ones(int(gib * 2**30) // 4)
    if kind == "sum":
        run = x.sum
    else:
        w, v = x.view(-1, 4096), torch.ones(4096)
        run = lambda: torch.mv(w, v)  # noqa: E731
    run()
    best = min(_call_s(run) for _ in range(reps))
    return x.numel() * 4 / best / 1e9


def _git_revision() -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + ("+dirty" if dirty else "")


def cpu_model() -> str:
    """The processor's name and widest vector set: the CPU kernels take AVX-512 or AVX2 paths, so
    figures compare only between runs on the same kind of processor."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return platform.processor() or "unknown"
    def field(key: str, default: str = "?") -> str:
        return next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.split(":")[0].strip() == key),
                    default)

    name = f"{field('model name', 'unknown')} (family {field('cpu family')} model {field('model')})"
    flags = set(field("flags", "").split())
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{name}, {vector}{', AMX' if 'amx_tile' in flags else ''}"


def machine_meta(bandwidth: bool = True) -> dict[str, Any]:
    import executorch  # noqa: F401  (namespace package: version from metadata)
    from importlib.metadata import version

    meta: dict[str, Any] = {
        "time": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores",
        "cpu": cpu_model(),
        "python": platform.python_version(),
        "torch": torch.__version__, "executorch": version("executorch"), "mlx": mx.__version__,
        "mlx_delegate": f"{mlx_delegate.__version__} ({_git_revision()})",
        "torch_threads": torch.get_num_threads(),
        "mlx_blas": _blas.mode(),  # shared by the delegate and MLX Python: one libmlx per process
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }
    if bandwidth:
        meta["bandwidth_gbs"] = round(memory_bandwidth_gbs(), 1)
        meta["bandwidth_sum_gbs"] = round(memory_bandwidth_gbs(kind="sum"), 1)
    return meta


# ---------------------------------------------------------------- output

def format_table(headers: Sequence[str], rows: Iterable[Sequence[str]], right: Sequence[bool]) -> str:
    """A Markdown table in docs/performance.md's format, padded so it reads as plain text too."""
    headers = [h.replace("|", "\\|") for h in headers]
    rows = [[c.replace("|", "\\|") for c in r] for r in rows]
    widths = [max(len(h), 3, *(len(r[i]) for r in rows)) if rows else max(len(h), 3) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)) + " |"

    rule = "|" + "|".join("-" * (w + 1) + ":" if r else "-" * (w + 2) for w, r in zip(widths, right)) + "|"
    return "\n".join([line(headers), rule] + [line(r) for r in rows])


def heading(meta: dict[str, Any]) -> str:
    """The lines above a table in docs/performance.md: the date and the command that produced it,
    then the run's metadata."""
    script = Path(sys.argv[0])
    try:
        script = script.resolve().relative_to(Path(__file__).resolve().parent.parent)
    except ValueError:
        pass
    command = " ".join(["python", str(script), *sys.argv[1:]])
    date = str(meta.get("time", datetime.datetime.now().isoformat()))[:10]
    info = ", ".join(f"{k}={v}" for k, v in meta.items() if k not in ("time", "settings"))
    return f"### {date}: `{command}`\n\n{info}\n"


def fmt_time(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else format(x, spec) + suffix


def results_table(results: Sequence[Result]) -> str:
    """One row per (case, engine), the case named once, with the time relative to eager torch."""
    eager = {r.case: r.median_s for r in results if r.engine == ENGINES["eager"][0]}
    headers = ["case", "engine", "median", "p90", "n", "tok/s", "x eager", "max|err|", "load", "1st call",
               "+RSS MB", "delegation / error"]
    right = [False, False] + [True] * 9 + [False]
    rows, last = [], None
    for r in results:
        base = eager.get(r.case)
        ratio = r.median_s / base if r.median_s and base else None
        rows.append([
            r.case if r.case != last else "", r.engine, fmt_time(r.median_s), fmt_time(r.p90_s),
            str(r.rounds) if r.rounds else "-", _fmt(r.tok_s, ".1f"), _fmt(ratio, ".2f", "x"),
            _fmt(r.max_abs_err, ".1e"), fmt_time(r.load_s), fmt_time(r.first_s), _fmt(r.rss_delta_mb, ".0f"),
            f"ERROR {r.error}" if r.error else r.note,
        ])
        last = r.case
    return format_table(headers, rows, right)


def bandwidth_note(w: Workload, meta: dict[str, Any]) -> list[str]:
    """The bound on a single-token workload when every call streams all weights once."""
    bw = meta.get("bandwidth_gbs")
    if not (bw and w.weight_bytes and w.tokens == 1):
        return []
    return [f"{w.case}: {w.weight_bytes / 1e9:.2f} GB of weights at {bw} GB/s bounds one call at "
            f"{bw * 1e9 / w.weight_bytes:.0f} tok/s"]


def load_note(meta: dict[str, Any]) -> list[str]:
    """A warning when other processes competed for the cores during the run."""
    cores = os.cpu_count() or 1
    worst = max(meta["loadavg_start"][0], meta["loadavg_end"][0])
    if worst <= cores:
        return []
    return [f"machine loaded: 1-min load average up to {worst} on {cores} cores; multi-threaded engines "
            f"(eager torch, XNNPACK) suffer most; compare figures only within this run"]


def print_report(meta: dict[str, Any], table: str, json_path: str | None, payload: dict[str, Any]) -> None:
    """A script's output: the dated heading, its table, the load warning; `payload` (with the
    metadata) as JSON at `json_path` when given."""
    print()
    print(heading(meta))
    print(table)
    for line in load_note(meta):
        print(line)
    if json_path:
        Path(json_path).write_text(json.dumps({"meta": meta} | payload, indent=2, default=str) + "\n")
        print(f"wrote {json_path}")


def write_json(path: str, meta: dict[str, Any], results: Sequence[Result]) -> None:
    rows = [asdict(r) | {"tok_s": r.tok_s} for r in results]
    Path(path).write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")


# ---------------------------------------------------------------- command line

WorkloadSource = Callable[[bool], Iterator[Workload]]  # quick -> workloads, built one at a time


def parse_args(description: str, argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="smaller smoke run (fewer rounds, smaller shapes)")
    p.add_argument("--json", metavar="PATH", help="also write meta and results as JSON")
    p.add_argument("--engines", default=",".join(DEFAULT_ENGINES),
                   help=f"comma-separated subset of {','.join(ENGINES)} (default: {','.join(DEFAULT_ENGINES)})")
    p.add_argument("--budget", type=float, help="timed seconds per engine and case (overrides the default)")
    p.add_argument("--no-bandwidth", action="store_true", help="skip the memory bandwidth probes (a GEMV over 1 GiB of fp32 weights and a 1 GiB sum)")
    args = p.parse_args(argv)
    unknown = set(args.engines.split(",")) - set(ENGINES)
    if unknown:
        p.error(f"unknown engines {sorted(unknown)}; choose from {list(ENGINES)}")
    return args


def main(description: str, sources: Sequence[WorkloadSource], argv: Sequence[str] | None = None) -> None:
    """Run every workload of `sources` on the chosen engines and print one table."""
    args = parse_args(description, argv)
    settings = QUICK if args.quick else Settings()
    if args.budget is not None:
        settings = replace(settings, budget_s=args.budget)
    engines = [k for k in ENGINES if k in args.engines.split(",")]
    started = time.perf_counter()
    meta = machine_meta(bandwidth=not args.no_bandwidth) | {"quick": args.quick, "settings": asdict(settings)}
    results: list[Result] = []
    notes: list[str] = []
    for source in sources:
        for w in source(args.quick):  # built lazily, so one model is freed before the next is built
            results += run_workload(w, engines, settings)
            notes += bandwidth_note(w, meta)
    meta |= {"loadavg_end": [round(x, 2) for x in os.getloadavg()], "peak_rss_mb": round(peak_rss_mb()),
             "wall_s": round(time.perf_counter() - started, 1)}
    print()
    print(heading(meta))
    print(results_table(results))
    for line in notes + load_note(meta):
        print(line)
    if args.json:
        write_json(args.json, meta, results)
        print(f"wrote {args.json}")
