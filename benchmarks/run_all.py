"""Every issue-7 benchmark in one command: per-call overhead, LLM prefill/decode, speech.

Runs `overhead.py` (a tiny graph: ours vs MLX Python vs eager torch vs the ExecuTorch floor),
`llm.py` (SmolLM2-135M and a 1.2B Llama-3.2-shaped model: fp32, bf16, int8, int4 against eager
torch, ExecuTorch XNNPACK and MLX Python, with the memory bandwidth measured in the same run and
each decode rate as a share of it) and `speech.py` (Whisper base encoder and decoder step, a
Parakeet-shaped CTC model) one after another, each in its own process (a crash or an out-of-memory
kill in one leaves the others' tables), printing each table as it finishes and writing all of them
into one JSON file.

    python benchmarks/run_all.py [--quick] [--json out.json] [--only overhead,llm,speech]

A full run takes about an hour on the 2-core reference machine (most of it exporting and lowering);
`--quick` runs every script's smoke mode (a few minutes). Pass a script's own options by running it
directly (see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = {"overhead": "overhead.py", "llm": "llm.py", "speech": "speech.py"}


def run(name: str, quick: bool, out_dir: Path) -> dict:
    out = out_dir / f"{name}.json"
    cmd = [sys.executable, str(HERE / SCRIPTS[name]), "--json", str(out)] + (["--quick"] if quick else [])
    print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=HERE)
    result = {"returncode": done.returncode, "wall_s": round(time.perf_counter() - started, 1)}
    if out.exists():
        result |= json.loads(out.read_text())
    else:
        print(f"== {name}: no results (exit status {done.returncode})", flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="every script's smoke mode")
    p.add_argument("--json", metavar="PATH", help="write every script's meta and rows as one JSON file")
    p.add_argument("--only", default=",".join(SCRIPTS), help=f"comma-separated subset of {','.join(SCRIPTS)}")
    args = p.parse_args()
    names = [n for n in args.only.split(",") if n]
    if unknown := set(names) - SCRIPTS.keys():
        p.error(f"--only takes a subset of {','.join(SCRIPTS)}, not {','.join(sorted(unknown))}")
    with tempfile.TemporaryDirectory() as tmp:
        results = {name: run(name, args.quick, Path(tmp)) for name in names}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
        print(f"wrote {args.json}")
    sys.exit(max((r["returncode"] != 0 for r in results.values()), default=0))


if __name__ == "__main__":
    main()
