"""Parity of lowered programs on MLX's default device (a GPU machine) against eager PyTorch.

    python scripts/gpu_parity.py prepare cases.pkl   # here: lower with the pinned CPU stack, save
    python scripts/gpu_parity.py check cases.pkl     # there: run on MLX's default device, compare

For a GPU machine whose torch is not the pinned one: the executorch wheel's Python bindings need the
torch they were built against (with another, `execute` fails with "tensor does not have a device"), so
`check` tries the stock `executorch.runtime` first and then the delegate's own payload runner
(`_runtime.run_payload`), which needs no torch ABI. Each case saves its .pte, its delegate payload and
named data, its inputs and eager's outputs (computed where it was lowered).
"""
import pickle
import sys
import time
from pathlib import Path

import torch

IR_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.int64: "i64",
             torch.int32: "i32", torch.bool: "bool_"}


def to_arg(t: torch.Tensor) -> tuple:
    t = t.contiguous()
    return IR_DTYPES[t.dtype], list(t.shape), t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def from_arg(a: tuple) -> torch.Tensor:
    d, shape, data = a
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return flat.view({v: k for k, v in IR_DTYPES.items()}[d]).reshape(shape)


class Llama(torch.nn.Module):
    def __init__(self):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
        self.m = LlamaForCausalLM(cfg).eval()

    def forward(self, ids):
        return self.m(input_ids=ids, use_cache=False).logits


class SelfAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False, is_causal=False)[0]


def cnn() -> torch.nn.Module:
    n = torch.nn
    return n.Sequential(n.Conv2d(3, 16, 3, padding=1), n.BatchNorm2d(16), n.ReLU(), n.MaxPool2d(2),
                        n.Conv2d(16, 16, 3, groups=16, padding=1), n.Conv2d(16, 8, 1), n.AdaptiveAvgPool2d(1),
                        n.Flatten(), n.Linear(8, 5)).eval()


def int4_mlp() -> torch.nn.Module:
    from torchao.quantization import IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerGroup
    m = torch.nn.Sequential(torch.nn.Linear(128, 96), torch.nn.SiLU(), torch.nn.Linear(96, 64)).eval()
    quantize_(m, IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)))
    return m


def cases() -> list:
    n = torch.nn
    return [
        ("transformer_encoder_layer", lambda: n.TransformerEncoderLayer(64, 4, 128, batch_first=True).eval(),
         (torch.randn(2, 10, 64),)),
        ("cnn", cnn, (torch.randn(2, 3, 17, 17),)),
        ("llama_tiny", lambda: Llama().eval(), (torch.randint(0, 256, (1, 12)),)),
        ("mlp_bf16", lambda: n.Sequential(n.Linear(64, 128), n.GELU(), n.Linear(128, 32)).to(torch.bfloat16).eval(),
         (torch.randn(3, 64, dtype=torch.bfloat16),)),
        ("int4_mlp", int4_mlp, (torch.randn(4, 128),)),
        ("self_attention", lambda: SelfAttention().eval(), (torch.randn(1, 9, 32),)),
    ]


def prepare(path: Path) -> None:
    from mlx_delegate.testing import delegate_payload, lower
    torch.manual_seed(0)
    out = []
    for name, make, inputs in cases():
        m = make()
        with torch.no_grad():
            want = m(*inputs)
        lowered = lower(m, inputs)
        payload, named = delegate_payload(lowered.edge)
        out.append(dict(name=name, pte=lowered.buffer, payload=payload, named=named, inputs=[to_arg(x) for x in inputs],
                        expected=[to_arg(want.float())]))
        print(f"{name}: {lowered.summary[0]} segment(s), {len(lowered.buffer)} bytes")
    path.write_bytes(pickle.dumps(out))


def check(path: Path) -> int:
    from mlx_delegate import _runtime  # before mlx: it sets up MLX's BLAS
    import mlx.core as mx
    print("mlx", mx.__version__, "default device", mx.default_device(), "torch", torch.__version__)
    try:
        from executorch.runtime import Runtime
        rt = Runtime.get()
    except Exception as e:  # noqa: BLE001 - report and go on with the payload runner
        rt = None
        print("executorch.runtime unavailable:", type(e).__name__, str(e)[:300])
    fails = 0
    for c in pickle.loads(path.read_bytes()):
        want = [from_arg(w) for w in c["expected"]]
        ins = [from_arg(x) for x in c["inputs"]]

        def stock(c=c):
            method = rt.load_program(c["pte"]).load_method("forward")
            method.execute(ins)  # the first call loads; time the second
            t = time.perf_counter()
            return method.execute(ins), time.perf_counter() - t

        def own(c=c):
            _runtime.run_payload(c["payload"], c["named"], list(c["inputs"]))
            t = time.perf_counter()
            outs = _runtime.run_payload(c["payload"], c["named"], list(c["inputs"]))
            return [from_arg(o) for o in outs], time.perf_counter() - t

        for pname, fn in [("executorch.runtime", stock)] * (rt is not None) + [("run_payload", own)]:
            try:
                outs, dt = fn()
                err = max(float((o.float() - w).abs().max()) for o, w in zip(outs, want))
                scale = max(float(w.abs().max()) for w in want)
                ok = err <= 2e-2 * max(1.0, scale)
                fails += not ok
                print(f"{c['name']:26s} {pname:19s} max|err| {err:.2e} (max|ref| {scale:.2e}) "
                      f"{'ok' if ok else 'MISMATCH'} {dt * 1e3:.2f} ms")
            except Exception as e:  # noqa: BLE001 - one line per failing path
                fails += 1
                print(f"{c['name']:26s} {pname:19s} FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    print("parity failures:", fails)
    return fails


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("prepare", "check"):
        sys.exit(__doc__)
    if sys.argv[1] == "prepare":
        prepare(Path(sys.argv[2]))
    else:
        sys.exit(1 if check(Path(sys.argv[2])) else 0)
