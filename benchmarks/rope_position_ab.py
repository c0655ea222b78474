"""A/B in one process: SmolLM2 fp32 prefill (64 tokens) and decode with the tensor-position RoPE
fusion off (`rope._tensor_offset` patched out: cos/sin composed node by node, as before) and on
(`rope_at`), engines interleaved per round, medians.  python benchmarks/rope_position_ab.py [rounds]"""
import sys, time, statistics, tempfile
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
import common  # noqa: F401  (mlx_delegate before mlx)
import torch
from executorch.runtime import Runtime
from mlx_delegate import _runtime
from mlx_delegate.llm import export as llm_export
from mlx_delegate.models import loading
from mlx_delegate.patterns import rope as rope_pattern

PROMPT, DECODE, ROUNDS = 64, 8, int(sys.argv[1]) if len(sys.argv) > 1 else 5
torch.set_num_threads(2)
model = loading.load("smollm2", max_seq_len=PROMPT + DECODE + 8).model.eval()

def build(fused: bool):
    saved = rope_pattern._tensor_offset
    if not fused:
        rope_pattern._tensor_offset = lambda n: None
    try:
        prog = llm_export.to_executorch(model)
    finally:
        rope_pattern._tensor_offset = saved
    f = tempfile.NamedTemporaryFile(suffix=".pte", delete=False)
    prog.write_to_file(f); f.close()
    p = Runtime.get().load_program(f.name)
    return p, p.load_method("forward")

progs = {"before (composed)": build(False), "after (rope_at)": build(True)}
tokens = torch.randint(0, 1000, (1, PROMPT))

def run_round(method, compiled):
    _runtime.set_compile(compiled)
    t0 = time.perf_counter()
    out = method.execute([tokens, torch.tensor([0])])[0]
    t1 = time.perf_counter()
    for i in range(DECODE):
        out2 = method.execute([tokens[:, i:i + 1], torch.tensor([PROMPT + i])])[0]
    t2 = time.perf_counter()
    return PROMPT / (t1 - t0), DECODE / (t2 - t1), out

res = {(k, c): ([], []) for k in progs for c in (False, True)}
outs = {}
for r in range(ROUNDS + 1):  # round 0 warms up (compiled prefill traces there)
    for k, (_, m) in progs.items():
        for c in (False, True):
            p, d, o = run_round(m, c)
            outs[(k, c)] = o
            if r:
                res[(k, c)][0].append(p); res[(k, c)][1].append(d)
print(f"SmolLM2-135M fp32, prompt {PROMPT}, decode {DECODE}, {ROUNDS} rounds, medians")
for (k, c), (p, d) in res.items():
    print(f"{k:20s} {'compiled' if c else 'nodes':9s} prefill {statistics.median(p):7.1f} tok/s  decode {statistics.median(d):6.1f} tok/s")
ref = outs[("before (composed)", False)]
for key, o in outs.items():
    print(key, "max |diff| vs before/nodes:", float((o - ref).abs().max()))
