"""Memory of a 1.2B-parameter model through export, lowering and execution.

A Llama-3.2-1B-shaped model (hidden 2048, 16 layers, 32 heads, 8 KV heads,
intermediate 8192, vocab 128256, tied embeddings) with random fp32 weights
(4.9 GB) is exported, lowered to one mlx_delegate method, serialized, loaded
by the stock ExecuTorch runtime and run for a few decode steps. For each phase
the script prints the peak resident memory (VmHWM, reset between phases via
/proc/self/clear_refs) and the resident memory after it, in GB and as a
multiple of the weights. Nothing passes or fails here; run it alone (it needs
~15 GB free):

    python benchmarks/big_model.py [--layers 16] [--vocab 128256] [--steps 4]
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path

from common import peak_rss_mb, rss_mb  # first: mlx_delegate before mlx

import torch  # noqa: E402
from executorch.runtime import Runtime  # noqa: E402

from mlx_delegate.llm import export as llm_export  # noqa: E402
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--steps", type=int, default=4, help="decode steps to run")
    p.add_argument("--max-seq-len", type=int, default=128)
    args = p.parse_args()

    reset_peak_rss()
    start_rss = rss_mb() * 2**20
    print(f"start: {start_rss / GB:.2f} GB resident (torch, executorch, mlx imported)")
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
    pte = et_program.buffer
    del et_program, edge
    phases.done("serialize (.buffer)")
    del model
    phases.done("free torch model")
    # Loading from bytes keeps the bytes referenced and copies them once more
    # (Runtime.load_program -> _load_program_from_buffer): 2x the weights at run
    # time. From a file, the runtime reads the constants into the buffers MLX then
    # wraps without copying.
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "big_model.pte"
        path.write_bytes(pte)
        del pte
        phases.done("write .pte, free bytes")
        program = Runtime.get().load_program(path)
        method = program.load_method("forward")
        phases.done("load program + method")

    tokens = [1, 2, 3, 4]
    t = time.perf_counter()
    logits = method.execute([torch.tensor([tokens]), torch.tensor([0])])[0]
    prefill = time.perf_counter() - t
    pos = len(tokens)
    t = time.perf_counter()
    for _ in range(args.steps):
        token = int(logits[0, -1].argmax())
        logits = method.execute([torch.tensor([[token]]), torch.tensor([pos])])[0]
        pos += 1
    decode = (time.perf_counter() - t) / max(args.steps, 1)
    assert torch.isfinite(logits).all()
    phases.done(f"run ({len(tokens)}-token prefill + {args.steps} steps)")
    print(f"prefill {prefill:.2f} s, decode {decode * 1e3:.0f} ms/step")
    print(f"peak over lowering phases: {max(r[1] for r in phases.rows[:7]) / GB:.2f} GB; "
          f"over loading and running: {max(r[1] for r in phases.rows[7:]) / GB:.2f} GB; "
          f"weights {weights / GB:.2f} GB, imports {start_rss / GB:.2f} GB")


if __name__ == "__main__":
    main()
