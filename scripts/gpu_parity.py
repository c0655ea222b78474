"""Parity of lowered programs on MLX's default device (a GPU machine) against eager PyTorch.

    python scripts/gpu_parity.py prepare cases.pkl   # here: lower with the pinned CPU stack, save
    python scripts/gpu_parity.py check cases.pkl     # there: run on MLX's default device, compare
    python scripts/gpu_parity.py check cases.pkl NAME...   # only these cases (one process each after a crash)

For a GPU machine whose torch is not the pinned one: the executorch wheel's Python bindings need the
torch they were built against (with another, `execute` fails with "tensor does not have a device"), so
`check` tries the stock `executorch.runtime` first and then the delegate's own payload runner
(`_runtime.run_payload`), which needs no torch ABI. Each case saves its .pte, its delegate payload and
named data, its inputs and eager's outputs (computed where it was lowered).
"""
import copy
import operator
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


class Mixtral(torch.nn.Module):
    """Experts as one grouped product over rows sorted by expert; routing counts scattered in int64."""

    def __init__(self):
        super().__init__()
        from transformers import MixtralConfig, MixtralForCausalLM
        cfg = MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, num_local_experts=4,
                            num_experts_per_tok=2)
        self.m = MixtralForCausalLM(cfg).eval()

    def forward(self, ids):
        return self.m(input_ids=ids, use_cache=False).logits


class Int64Counts(torch.nn.Module):
    """An int64 scatter-add (MLX's GPU scatter rejects 64-bit integers)."""

    def forward(self, idx):
        return torch.zeros(8, dtype=torch.int64).scatter_add(0, idx, torch.ones_like(idx)) * 3


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


def pattern_cases() -> list:
    """The fused nodes' modules from the pattern tests (imported from the checkout: `prepare` runs there):
    the inverted-residual block (also with hard-swish / SiLU stages and squeeze-excite gates), the
    convolution epilogue (hard-swish, squeeze-excite scale) and RoPE plus KV-cache writes. On a GPU they
    run as MLX's own ops."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.patterns.test_conv_fusions import ActScale
    from tests.patterns.test_inverted_residual import _net, _v3_net
    from tests.patterns.test_rope_kv import AttentionStep, step_inputs
    return [
        ("mobilenet_blocks", _net, (torch.randn(2, 5, 13, 11),)),
        ("mobilenet_v3_blocks", _v3_net, (torch.randn(2, 5, 13, 11),)),
        ("conv_act_scale", lambda: ActScale().eval(), (torch.randn(2, 3, 12, 10),)),
        ("rope_kv_write", lambda: AttentionStep(seq_first=True).eval(), step_inputs(3, 5, seq_first=True)),
        ("rope_kv_write_bf16", lambda: AttentionStep().to(torch.bfloat16).eval(),
         tuple(x.to(torch.bfloat16) if x.is_floating_point() else x for x in step_inputs(1, 7))),
    ]


def cases() -> list:
    n = torch.nn
    return pattern_cases() + [
        ("transformer_encoder_layer", lambda: n.TransformerEncoderLayer(64, 4, 128, batch_first=True).eval(),
         (torch.randn(2, 10, 64),)),
        ("cnn", cnn, (torch.randn(2, 3, 17, 17),)),
        ("llama_tiny", lambda: Llama().eval(), (torch.randint(0, 256, (1, 12)),)),
        ("mlp_bf16", lambda: n.Sequential(n.Linear(64, 128), n.GELU(), n.Linear(128, 32)).to(torch.bfloat16).eval(),
         (torch.randn(3, 64, dtype=torch.bfloat16),)),
        ("int4_mlp", int4_mlp, (torch.randn(4, 128),)),
        ("self_attention", lambda: SelfAttention().eval(), (torch.randn(1, 9, 32),)),
        ("mixtral_tiny", lambda: Mixtral().eval(), (torch.randint(0, 128, (1, 10)),)),
        ("int64_scatter_add", lambda: Int64Counts().eval(), (torch.randint(0, 8, (13,)),)),
    ]


def delegate_io(edge) -> tuple[list[int], list[int | None]]:
    """Where the delegate's inputs come from (user input indices) and where its outputs go (user output
    indices, None for one that is not a user output): the payload's order is the delegate call's, which
    need not be the program's."""
    ep = edge.exported_program()
    nodes = list(ep.graph.nodes)
    (call,) = [n for n in nodes if n.op == "call_function" and "call_delegate" in str(n.target)]
    user_in = [n for n in nodes if n.op == "placeholder" and n.name in ep.graph_signature.user_inputs]
    flat = list(next(n for n in nodes if n.op == "output").args[0])
    user_out = flat[len(flat) - len(ep.graph_signature.user_outputs):]
    items = {u.args[1]: u for u in call.users if u.target is operator.getitem} or {0: call}
    outs = [user_out.index(items[i]) if i in items and items[i] in user_out else None
            for i in range(max(items) + 1)]
    return [user_in.index(a) for a in call.args[1:]], outs


def prepare(path: Path) -> None:
    from mlx_delegate.testing import delegate_payload, lower
    torch.manual_seed(0)
    out = []
    for name, make, inputs in cases():
        m = make()
        with torch.no_grad():
            want = copy.deepcopy(m)(*inputs)  # a stateful module's buffers stay as exported
        want = list(want) if isinstance(want, (list, tuple)) else [want]
        lowered = lower(m, inputs)
        payload, named = delegate_payload(lowered.edge)
        p_in, p_out = delegate_io(lowered.edge)
        out.append(dict(name=name, pte=lowered.buffer, payload=payload, named=named, inputs=[to_arg(x) for x in inputs],
                        expected=[to_arg(w.float()) for w in want], payload_inputs=p_in, payload_outputs=p_out))
        print(f"{name}: {lowered.summary[0]} segment(s), {len(lowered.buffer)} bytes")
    path.write_bytes(pickle.dumps(out))


def check(path: Path, names: list[str]) -> int:
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
        if names and c["name"] not in names:
            continue
        want = [from_arg(w) for w in c["expected"]]
        ins = [from_arg(x) for x in c["inputs"]]

        def stock(c=c):
            program = rt.load_program(c["pte"])  # kept alive while its method runs
            method = program.load_method("forward")
            method.execute(ins)  # the first call loads
            # The second call compiles the graph: on CUDA, MLX JIT-compiles its fused kernels with NVRTC the
            # first time a machine sees them (cached under /tmp/mlx/<version>/ptx or MLX_PTX_CACHE_DIR).
            t = time.perf_counter()
            method.execute(ins)
            compiling = time.perf_counter() - t
            t = time.perf_counter()
            outs = method.execute(ins)
            dt = time.perf_counter() - t
            print(f"{c['name']:26s} {'(second call)':19s} compiling {compiling * 1e3:.2f} ms")
            return outs, dt

        def own(c=c):
            args = [c["inputs"][i] for i in c["payload_inputs"]]
            _runtime.run_payload(c["payload"], c["named"], args)
            t = time.perf_counter()
            outs = _runtime.run_payload(c["payload"], c["named"], args)
            dt = time.perf_counter() - t
            got = {j: from_arg(o) for j, o in zip(c["payload_outputs"], outs) if j is not None}
            return [got[j] for j in range(len(want))], dt

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
    if len(sys.argv) < 3 or sys.argv[1] not in ("prepare", "check") or (sys.argv[1] == "prepare" and len(sys.argv) > 3):
        sys.exit(__doc__)
    if sys.argv[1] == "prepare":
        prepare(Path(sys.argv[2]))
    else:
        sys.exit(1 if check(Path(sys.argv[2]), sys.argv[3:]) else 0)
