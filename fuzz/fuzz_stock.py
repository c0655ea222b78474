"""Fuzzing of whole .pte files through the stock ExecuTorch Python runtime.

Each case mutates one seed program (fuzz/seeds.py, lowered at start-up) and runs it as a user
would: `Runtime.get().load_program` (from bytes, or from a file for about a quarter of the cases),
`load_method("forward")`, `execute`, with the Python binding's log redirection active (the
binding sends ExecuTorch's log lines to `sys.stderr`, decoding them as UTF-8). Mutations target
the delegate blob, the named-data (constants) segments and their table entries, the segment
table's offsets and sizes, the program's delegate entry (backend id, data reference, the
DelegateCall's index and arguments), the extended header, and truncate files (`mutate.py`;
`--kinds` picks, and adds "flatbuffer": any word of ExecuTorch's own program table).

Cases run in a child process, one after the other; the parent watches it through a small shared
status file (the case it is on, counters), so a case that aborts, segfaults or hangs is counted,
saved to the artifact directory and skipped, and a fresh child carries on with the next case.
Every rejection must be a Python exception with a message, and every log line printable ASCII.
A mutant that runs is checked against the unmutated program's outputs for the same (valid) inputs
and call number (`check_result`): the same number of outputs and dtypes, and the same shapes where
the seed's outputs are static; and, where the bytes the program hands to the delegate (delegate blob,
named data, delegate entry: `reads`) are those of the seed, the same values bit for bit. A mutant
that changed what the delegate reads may compute anything of the right form (a mutated constant is
a different program), so its values are only counted as changed or unchanged.
Case `i` of a run is a pure function of (--seed, i): any finding can be rebuilt.

    python fuzz/fuzz_stock.py --runs 10000 --seed 1                  # exits 1 on any finding
    python fuzz/fuzz_stock.py --runs 1000000 --max-seconds 3600      # long run, stops at the time limit
    python fuzz/fuzz_stock.py --replay crash-*.bin                   # rerun files (name starts with the seed)
"""

from __future__ import annotations

import argparse
import collections
import datetime
import io
import json
import mmap
import pickle
import random
import signal
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from mutate import DEFAULT_KINDS, PTE_KINDS, mutate_pte  # noqa: E402
from pte import Layout, layout  # noqa: E402

OUTCOMES = ("rejected at load_program", "rejected at load_method", "failed at execute", "ran")
# Findings a worker reports without dying; aborts, signals and hangs are seen by the parent.
SILENT_ERROR, UNPRINTABLE_LOG = "error without a message", "log line not printable ASCII"
WRONG_RESULT = "ran with the seed's delegate bytes but gave a different result"
MALFORMED = "ran but returned outputs of the wrong number, dtype or shape"
# How the mutants that ran compare with the seed (see check_result).
RESULTS = ("result unchanged", "result changed", "reads the seed's bytes", "file unchanged")
COUNTERS = OUTCOMES + ("executions", "log lines", SILENT_ERROR, UNPRINTABLE_LOG, WRONG_RESULT, MALFORMED) + RESULTS
STATIC_SEEDS = ("elementwise", "matmul", "conv", "buffer", "attention")  # no dynamic output dim
SLOT_CASE, SLOT_DONE = 0, 1  # status file: int64 slots, then one per COUNTERS entry
N_SLOTS = 2 + len(COUNTERS)
MAX_TENSOR_BYTES = 16 << 20  # an absurd shape is a clean error, not an out-of-memory kill
MEMORY_LIMIT = 8 << 30  # worker address space: a runaway allocation fails instead of swamping the machine


@dataclass
class StockSeed:
    name: str
    pte: bytes
    inputs: list  # fuzz/seeds.py TensorArgs


@dataclass
class Case:
    index: int
    seed: int
    data: bytes
    kind: str
    from_file: bool
    runs: int  # execute() calls (a second one exercises the compiled-graph path)


def make_case(seeds: list[StockSeed], layouts: list[Layout], base_seed: int, index: int,
              kinds: tuple[str, ...] = DEFAULT_KINDS) -> Case:
    rng = random.Random(f"{base_seed}:{index}")
    s = rng.randrange(len(seeds))
    data, kind = mutate_pte(seeds[s].pte, layouts[s], rng, kinds)
    return Case(index, s, data, kind, rng.random() < 0.25, 2 if rng.random() < 0.25 else 1)


def reads(pte: bytes) -> tuple | None:
    """What a program hands to the delegate: the delegate blob's and named data's bytes (as the
    segment table and header resolve them), the delegate entry and named-data table fields. None
    where the file cannot be walked."""
    try:
        lay = layout(pte)
        regions = tuple(bytes(pte[a:b]) for g in ("blob", "named_data", "delegate") for a, b in lay.regions.get(g, []))
        fields = tuple(bytes(pte[f.offset:f.offset + f.width]) for g in ("delegate", "named_data")
                       for f in lay.fields.get(g, []))
        return regions, fields
    except Exception:  # a mutant the walker cannot follow: treated as changed
        return None


def check_result(outputs: list, reference: list, same_reads: bool, static: bool) -> tuple[str | None, bool]:
    """(finding or None, whether the values equal the reference bit for bit) for the outputs of a
    mutant that ran, against the unmutated program's outputs for the same inputs and call number."""
    import torch

    if len(outputs) != len(reference) or any(
            not isinstance(o, torch.Tensor) or o.dtype != r.dtype or (static and o.shape != r.shape)
            for o, r in zip(outputs, reference)):
        return MALFORMED, False
    bits = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731  (NaNs and -0.0 compare by bits)
    same = all(o.shape == r.shape and torch.equal(bits(o), bits(r)) for o, r in zip(outputs, reference))
    return (WRONG_RESULT if same_reads and not same else None), same


def run_case(runtime: Any, source: bytes | str, inputs: list, runs: int = 1,
             outputs: list | None = None) -> tuple[str, int, str]:
    """(outcome, execute() calls made, error message) of loading and running one program; the last
    call's outputs (copied) go into `outputs` when given."""
    stage, executions = OUTCOMES[0], 0
    try:
        program = runtime.load_program(source)
        stage = OUTCOMES[1]
        method = program.load_method("forward")
        if method is None:
            return stage, 0, "load_method returned None"
        stage = OUTCOMES[2]
        for _ in range(runs):
            executions += 1
            result = method.execute(inputs)
        if outputs is not None:
            outputs[:] = [o.clone() if hasattr(o, "clone") else o for o in result]
        return OUTCOMES[3], executions, ""
    except Exception as e:  # every rejection must be an exception that says what is wrong
        message = f"{type(e).__name__}: {e}"
        return (stage if str(e).strip() else SILENT_ERROR), executions, message


class LogSink(io.TextIOBase):
    """Stands in for sys.stderr: the binding writes ExecuTorch's log lines here (already decoded,
    so a bad byte would have aborted before this); counts them and flags any non-ASCII one."""

    def __init__(self, on_line: Any, on_unprintable: Any) -> None:
        self.on_line, self.on_unprintable, self.last = on_line, on_unprintable, ""

    def write(self, text: str) -> int:
        if text.strip():
            self.on_line()
            self.last = text[-300:]
            if not text.isascii() or not all(c.isprintable() or c in "\n\t" for c in text):
                self.on_unprintable(text)
        return len(text)

    def flush(self) -> None:
        pass


# --------------------------------------------------------------------------- worker (child process)


def _tensors(args: list) -> list:
    from seeds import from_arg

    return [from_arg(a) for a in args]


def worker(ns: argparse.Namespace) -> None:
    import faulthandler
    import resource

    faulthandler.enable()  # a crash leaves its Python stack in this worker's stderr file
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    from mlx_delegate import _runtime  # before mlx: installs the fast BLAS route

    import mlx.core as mx
    import torch
    from executorch.runtime import Runtime

    torch.set_num_threads(1)
    _runtime.set_max_tensor_bytes(MAX_TENSOR_BYTES)
    mx.set_cache_limit(0)
    seeds: list[StockSeed] = pickle.loads(Path(ns.seeds_file).read_bytes())
    layouts = [layout(s.pte) for s in seeds]
    inputs = [_tensors(s.inputs) for s in seeds]
    with open(ns.status, "r+b") as f:
        status = mmap.mmap(f.fileno(), 8 * N_SLOTS)

    def bump(name: str, by: int = 1) -> None:
        at = 8 * (2 + COUNTERS.index(name))
        struct.pack_into("<q", status, at, struct.unpack_from("<q", status, at)[0] + by)

    findings = open(ns.findings, "a")
    case_box: list[Case] = []

    def unprintable(text: str) -> None:
        bump(UNPRINTABLE_LOG)
        c = case_box[0]
        findings.write(json.dumps({"case": c.index, "finding": UNPRINTABLE_LOG, "seed": seeds[c.seed].name,
                                   "kind": c.kind, "detail": ascii(text[:300])}) + "\n")
        findings.flush()

    sys.stderr = LogSink(lambda: bump("log lines"), unprintable)
    runtime = Runtime.get()
    # The unmutated programs' outputs per call number (a stateful seed changes with each call).
    references = []
    for seed, args in zip(seeds, inputs):
        method = runtime.load_program(seed.pte).load_method("forward")
        references.append([[o.clone() for o in method.execute(args)] for _ in range(2)])
    seed_reads = [reads(seed.pte) for seed in seeds]

    def report(finding: str, case: Case, detail: str) -> None:
        findings.write(json.dumps({"case": case.index, "finding": finding, "seed": seeds[case.seed].name,
                                   "kind": case.kind, "detail": detail}) + "\n")
        findings.flush()

    path = Path(ns.workdir) / "case.pte"
    for i in range(ns.start, ns.stop):
        if time.time() > ns.deadline:
            break
        struct.pack_into("<q", status, 8 * SLOT_CASE, i)
        case = make_case(seeds, layouts, ns.seed, i, ns.kinds)
        case_box[:] = [case]
        source: bytes | str = case.data
        if case.from_file:
            path.write_bytes(case.data)
            source = str(path)
        outputs: list = []
        outcome, executions, message = run_case(runtime, source, inputs[case.seed], case.runs, outputs)
        bump(outcome)
        bump("executions", executions)
        if outcome == SILENT_ERROR:
            report(SILENT_ERROR, case, message)
        elif outcome == OUTCOMES[3]:
            # The ExecuTorch program table is mutated only by the opt-in "flatbuffer" kind, which
            # `reads` does not cover.
            same_reads = "flatbuffer" not in case.kind and reads(case.data) == seed_reads[case.seed]
            finding, same = check_result(outputs, references[case.seed][case.runs - 1], same_reads,
                                         seeds[case.seed].name in STATIC_SEEDS)
            bump(RESULTS[0] if same else RESULTS[1])
            bump(RESULTS[2], same_reads)
            bump(RESULTS[3], case.data == seeds[case.seed].pte)
            if finding:
                bump(finding)
                report(finding, case, repr([(tuple(o.shape), str(o.dtype)) if hasattr(o, "shape") else o
                                            for o in outputs])[:300])
        struct.pack_into("<q", status, 8 * SLOT_DONE, i + 1 - ns.start)
    status.flush()


# --------------------------------------------------------------------------- parent


def build_stock_seeds() -> list[StockSeed]:
    from seeds import build_seeds

    return [StockSeed(s.name, s.pte, s.inputs) for s in build_seeds()]


def _read_status(path: Path) -> list[int]:
    data = path.read_bytes()
    return list(struct.unpack_from(f"<{N_SLOTS}q", data))


def fuzz(ns: argparse.Namespace) -> int:
    started = time.time()
    deadline = started + ns.max_seconds if ns.max_seconds else float("inf")
    work = Path(tempfile.mkdtemp(prefix="mlxd-fuzz-stock-"))
    artifacts = Path(ns.artifacts or work / "artifacts")
    artifacts.mkdir(parents=True, exist_ok=True)
    if ns.seeds_cache and Path(ns.seeds_cache).exists():
        seeds = pickle.loads(Path(ns.seeds_cache).read_bytes())
    else:
        seeds = build_stock_seeds()
        if ns.seeds_cache:
            Path(ns.seeds_cache).write_bytes(pickle.dumps(seeds))
    seeds_file, status_file, findings_file = work / "seeds.pkl", work / "status", work / "findings.jsonl"
    seeds_file.write_bytes(pickle.dumps(seeds))
    layouts = [layout(s.pte) for s in seeds]
    print(f"fuzz_stock: {len(seeds)} seeds: {', '.join(s.name for s in seeds)}; seed {ns.seed}; "
          f"up to {ns.runs} cases", flush=True)

    totals: collections.Counter[str] = collections.Counter()
    findings: list[dict] = []
    cases, next_case, workers, reported = 0, 0, 0, time.time()
    while next_case < ns.runs and time.time() < deadline:
        status_file.write_bytes(struct.pack("<q", -1) + bytes(8 * (N_SLOTS - 1)))  # -1: no case started yet
        stderr_path = work / "worker.stderr"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--seeds-file", str(seeds_file),
               "--status", str(status_file), "--findings", str(findings_file), "--workdir", str(work),
               "--seed", str(ns.seed), "--start", str(next_case), "--stop", str(ns.runs),
               "--deadline", str(deadline), "--kinds", ",".join(ns.kinds)]
        workers += 1
        with open(stderr_path, "wb") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
            last, last_change, hung = None, time.time(), False
            while proc.poll() is None:
                time.sleep(0.2)
                now = _read_status(status_file)[:2]
                if ns.progress_seconds and time.time() - reported > ns.progress_seconds:
                    reported = time.time()
                    print(f"fuzz_stock progress: {cases + now[SLOT_DONE]} cases, {len(findings)} crashes/hangs, "
                          f"{reported - started:.0f} s", flush=True)
                if now != last:
                    last, last_change = now, time.time()
                elif time.time() - last_change > ns.hang_seconds:
                    proc.kill()  # our own child: no progress for too long
                    proc.wait()
                    hung = True
        st = _read_status(status_file)
        done = st[SLOT_DONE]
        for name, value in zip(COUNTERS, st[2:]):
            totals[name] += value
        cases += done
        if proc.returncode == 0 and not hung:
            next_case += done
            if done == 0:
                break  # deadline reached before the first case
            continue
        # The worker died (signal, abort, uncaught error) or hung on the case it was on.
        index = st[SLOT_CASE]
        tail = stderr_path.read_bytes()[-3000:].decode("utf-8", "replace")
        if index < 0:  # the harness itself is broken: no case to blame
            print(f"fuzz_stock: worker failed before its first case (exit {proc.returncode}):\n{tail}", flush=True)
            return 2
        case = make_case(seeds, layouts, ns.seed, index, ns.kinds)
        what = "hang" if hung else f"exit {proc.returncode}" + (
            f" ({signal.Signals(-proc.returncode).name})" if proc.returncode < 0 else "")
        name = f"{seeds[case.seed].name}-{case.kind}-{ns.seed}-{index}.bin"
        (artifacts / name).write_bytes(case.data)
        findings.append({"case": index, "finding": what, "seed": seeds[case.seed].name, "kind": case.kind,
                         "from_file": case.from_file, "artifact": str(artifacts / name), "stderr": tail})
        print(f"fuzz_stock: case {index} ({name}): {what}\n{tail[-1200:]}", flush=True)
        cases += 1
        next_case = index + 1
    if findings_file.exists():
        for line in findings_file.read_text().splitlines():
            findings.append(json.loads(line))
    elapsed = time.time() - started
    crashes = sum(1 for f in findings if f["finding"].startswith(("exit", "hang")))
    summary = {
        "date": datetime.date.today().isoformat(), "command": " ".join([Path(sys.executable).name] + sys.argv),
        "seed": ns.seed, "kinds": list(ns.kinds), "mutations": cases, "executions": totals["executions"], "crashes": crashes,
        "findings": len(findings), "seconds": round(elapsed, 1), "workers": workers,
        "outcomes": {k: totals[k] for k in OUTCOMES}, "log_lines": totals["log lines"],
        "results": {k: totals[k] for k in RESULTS},
    }
    print("fuzz_stock summary: " + json.dumps(summary), flush=True)
    for f in findings:
        print("fuzz_stock finding: " + json.dumps({k: v for k, v in f.items() if k != "stderr"}), flush=True)
    if ns.json:
        Path(ns.json).write_text(json.dumps({**summary, "finding_list": findings}, indent=1))
    return 1 if findings else 0


# --------------------------------------------------------------------------- replay


def replay(ns: argparse.Namespace) -> int:
    """Runs files through the stock runtime in this process; one JSON line per file.
    A file's seed (for its inputs) is the start of its name; --good runs a program last and
    prints its outputs, showing the process still works after the files before it."""
    from mlx_delegate import _runtime

    from executorch.runtime import Runtime
    from seeds import seed_inputs_by_name

    _runtime.set_max_tensor_bytes(MAX_TENSOR_BYTES)
    inputs, runtime = seed_inputs_by_name(), Runtime.get()
    for name in ns.replay:
        path = Path(name)
        seed = next((s for s in inputs if path.name.startswith(s + "-")), None)
        if seed is None:
            print(json.dumps({"file": path.name, "outcome": "unknown seed"}), flush=True)
            continue
        for source in (path.read_bytes(), str(path)):
            outcome, executions, message = run_case(runtime, source, inputs[seed], 2)
            print(json.dumps({"file": path.name, "from_file": isinstance(source, str), "outcome": outcome,
                              "executions": executions, "message": message}), flush=True)
    if ns.good:
        seed, path = ns.good.split("=", 1)
        program = runtime.load_program(Path(path).read_bytes())
        outputs = program.load_method("forward").execute(inputs[seed])
        print(json.dumps({"good": seed, "outputs": [o.tolist() for o in outputs]}), flush=True)
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=10000, help="cases (mutations) to run")
    p.add_argument("--seed", type=int, default=0, help="base seed: case i is a function of (seed, i)")
    p.add_argument("--max-seconds", type=float, default=0, help="stop after this long (0: no limit)")
    p.add_argument("--progress-seconds", type=float, default=0, help="print a progress line this often")
    p.add_argument("--hang-seconds", type=float, default=60, help="a case this slow counts as a hang")
    p.add_argument("--kinds", default=",".join(DEFAULT_KINDS),
                   help=f"comma-separated mutation kinds, of: {', '.join(PTE_KINDS)}")
    p.add_argument("--artifacts", help="directory for the cases that crashed or hung")
    p.add_argument("--seeds-cache", help="pickle of the lowered seeds, reused when present")
    p.add_argument("--json", help="write the summary and findings here")
    p.add_argument("--replay", nargs="*", help="run these files instead of fuzzing")
    p.add_argument("--good", help="with --replay: SEED=PATH of a good program to run last")
    # Worker-only arguments.
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("--seeds-file", "--status", "--findings", "--workdir"):
        p.add_argument(name, help=argparse.SUPPRESS)
    p.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--stop", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=float("inf"), help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    ns.kinds = tuple(k for k in ns.kinds.split(",") if k)
    if unknown := set(ns.kinds) - set(PTE_KINDS):
        p.error(f"unknown mutation kinds: {', '.join(sorted(unknown))}")
    if ns.worker:
        worker(ns)
        return 0
    if ns.replay is not None:
        return replay(ns)
    return fuzz(ns)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
