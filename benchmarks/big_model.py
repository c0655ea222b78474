"""Memory of a 1.2B-parameter model through export, lowering and execution.

A Llama-3.2-1B-shaped model (hidden 2048, 16 layers, 32 heads, 8 KV heads,
intermediate 8192, vocab 128256, tied embeddings) with random fp32 weights
(4.9 GB) is exported, lowered to one mlx_delegate method and written to a
.pte file in this process; a second process then loads the file with the stock
ExecuTorch runtime and runs a prefill and a few decode steps, as a deployment
would. For each phase the script prints the peak resident memory (VmHWM, reset
between phases via /proc/self/clear_refs) and the resident memory after it, in
GB and as a multiple of the weights over what the imports take. Nothing passes
or fails here; run it alone (it needs ~11 GB free):

    python benchmarks/big_model.py [--layers 16] [--vocab 128256] [--steps 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import peak_rss_mb, rss_mb  # first: mlx_delegate before mlx

import torch  # noqa: E402
from executorch.runtime import Runtime  # noqa: E402

from mlx_delegate.pipelines.llm import export as llm_export  # noqa: E402
from mlx_delegate.memory import reset_peak_rss  # noqa: E402
from mlx_delegate.models.llama import Model, ModelArgs  # noqa: E402

GB = 1e9


class Phases:
    """Per phase: peak and after-phase resident memory; the multiple is of the weights,
    over the resident memory before the model was built (the imports)."""

    def __init__(self, weights_bytes: int, base_bytes: float) -> None:
        self.weights = weights_bytes
        self.base = base_bytes
        self.rows: list[tuple[str, float, float, float]] = []
        self.start = time.perf_counter()

    def done(self, name: str) -> None:
        gc.collect()
        now = time.perf_counter()
        self.rows.append((name, peak_rss_mb() * 2**20, rss_mb() * 2**20, now - self.start))
        _, peak, after, _ = self.rows[-1]
        print(f"{name:<32} peak {peak / GB:6.2f} GB ({(peak - self.base) / self.weights:4.2f}x weights)  "
              f"after {after / GB:6.2f} GB ({(after - self.base) / self.weights:4.2f}x)  {now - self.start:6.1f} s",
              flush=True)
        reset_peak_rss()
        self.start = time.perf_counter()

    def as_dicts(self) -> list[dict]:
        return [{"phase": n, "peak_bytes": peak, "after_bytes": after, "seconds": sec}
                for n, peak, after, sec in self.rows]


def export_phases(args: argparse.Namespace, path: Path) -> dict:
    reset_peak_rss()
    start_rss = rss_mb() * 2**20
    print(f"export process: {start_rss / GB:.2f} GB resident after imports (torch, executorch, mlx)")
    torch.manual_seed(0)
    model = Model(ModelArgs(vocab_size=args.vocab, hidden_size=2048, intermediate_size=8192,
                            num_hidden_layers=args.layers, num_attention_heads=32, num_key_value_heads=8,
                            tie_word_embeddings=True, rope_theta=500000.0, max_seq_len=args.max_seq_len)).eval()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() dedupes tied
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e9:.3f} B parameters, {weights / GB:.2f} GB fp32 weights")
    phases = Phases(weights, start_rss)
    phases.done("build model")
    ep = llm_export.export_model(model, max_len=8)
    phases.done("torch.export")
    edge = llm_export.lower(ep, constant_methods=llm_export.metadata(model))
    phases.done("to_edge + lower (preprocess)")
    del ep
    et_program = edge.to_executorch()
    phases.done("to_executorch")
    with path.open("wb") as f:
        et_program.write_to_file(f)  # streams the constants; `.buffer` would join them into one bytes
    phases.done("write .pte (streamed)")
    return {"weights_bytes": weights, "parameters": n_params, "imports_bytes": start_rss,
            "phases": phases.as_dicts(), "pte_bytes": path.stat().st_size}


def run_phases(path: Path, weights: int, steps: int) -> dict:
    """In a fresh process (see main): load the .pte file and run it."""
    reset_peak_rss()
    start_rss = rss_mb() * 2**20
    print(f"run process: {start_rss / GB:.2f} GB resident after imports")
    phases = Phases(weights, start_rss)
    program = Runtime.get().load_program(path)
    method = program.load_method("forward")
    phases.done("load program + method")
    tokens = [1, 2, 3, 4]
    t = time.perf_counter()
    logits = method.execute([torch.tensor([tokens]), torch.tensor([0])])[0]
    prefill = time.perf_counter() - t
    pos = len(tokens)
    t = time.perf_counter()
    for _ in range(steps):
        token = int(logits[0, -1].argmax())
        logits = method.execute([torch.tensor([[token]]), torch.tensor([pos])])[0]
        pos += 1
    decode = (time.perf_counter() - t) / max(steps, 1)
    assert torch.isfinite(logits).all()
    phases.done(f"run ({len(tokens)}-token prefill + {steps} steps)")
    print(f"prefill {prefill:.2f} s, decode {decode * 1e3:.0f} ms/step")
    return {"imports_bytes": start_rss, "phases": phases.as_dicts(), "prefill_s": prefill, "decode_s": decode}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--steps", type=int, default=4, help="decode steps to run")
    p.add_argument("--max-seq-len", type=int, default=128)
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    p.add_argument("--run", nargs=2, metavar=("PTE", "WEIGHT_BYTES"), help=argparse.SUPPRESS)  # the run process
    args = p.parse_args()
    if args.run:
        print(json.dumps(run_phases(Path(args.run[0]), int(args.run[1]), args.steps)), flush=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "big_model.pte"
        exported = export_phases(args, path)
        gc.collect()
        # A fresh process: the export process still holds the torch model (and its allocator's freed pages).
        out = subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--run", str(path),
                              str(exported["weights_bytes"])], check=True, capture_output=True, text=True)
        lines = out.stdout.strip().splitlines()
        print("\n".join(lines[:-1]))
        ran = json.loads(lines[-1])
    peak = max(r["peak_bytes"] for r in exported["phases"])
    w = exported["weights_bytes"]
    print(f"export: peak {peak / GB:.2f} GB = imports + {(peak - exported['imports_bytes']) / w:.2f}x weights; "
          f"run: peak {max(r['peak_bytes'] for r in ran['phases']) / GB:.2f} GB = imports + "
          f"{(max(r['peak_bytes'] for r in ran['phases']) - ran['imports_bytes']) / w:.2f}x weights; "
          f".pte {exported['pte_bytes'] / GB:.2f} GB")
    if args.json:
        Path(args.json).write_text(json.dumps({"export": exported, "run": ran}, indent=1))


if __name__ == "__main__":
    main()
