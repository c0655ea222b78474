"""Run by tests/test_packaging.py and by the wheel CI jobs with the interpreter of a fresh
venv holding the installed wheel (`python -I tests/packaging_smoke.py`, from outside the
source tree): lowers a small model with MLXPartitioner, runs it with the stock
executorch.runtime, compares with eager, and prints where the package was loaded from."""

import torch

import mlx_delegate
from executorch.exir import to_edge_transform_and_lower
from executorch.runtime import Runtime


class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 8)

    def forward(self, x):
        return torch.nn.functional.gelu(self.lin(x)) * 2 + x[:, :8]


torch.manual_seed(0)
m = M().eval()
x = torch.randn(4, 16)
ep = torch.export.export(m, (x,))
prog = to_edge_transform_and_lower(ep, partitioner=[mlx_delegate.MLXPartitioner()]).to_executorch()
delegates = [d.id for d in prog.executorch_program.execution_plan[0].delegates]
assert delegates == [mlx_delegate.BACKEND_ID], delegates
out = Runtime.get().load_program(prog.buffer).load_method("forward").execute([x])[0]
torch.testing.assert_close(out, m(x), rtol=1e-4, atol=1e-4)
print("mlx_delegate", mlx_delegate.__file__)
print("runtime", mlx_delegate._runtime.__file__)
print("ok")
