"""mlx_delegate.inspect on programs lowered here: checked against the lowering's own payloads."""

from collections import Counter

import pytest
import torch

from mlx_delegate import BACKEND_ID
from mlx_delegate.inspect import (InspectError, format_summary, format_text, inspect_bytes, inspect_pte,
                                  ir_dtype_name)
from mlx_delegate.ir import nodes as N
from mlx_delegate.testing import Lambda, lower


class Stateful(torch.nn.Module):
    """A constant, a mutated buffer, and a float64 detour that must stay on ExecuTorch."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.randn(3, 4))
        self.register_buffer("total", torch.zeros(3, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.total.add_(x)
        y = torch.exp(x) * self.scale + self.total
        return y, (x.double() * 2).float()  # float64 is refused by every handler


def payloads(lowered) -> list[bytes]:
    gm = lowered.edge.exported_program().graph_module
    return [m.processed_bytes for m in gm.children() if getattr(m, "backend_id", None) == BACKEND_ID]


@pytest.fixture(scope="module")
def stateful(tmp_path_factory):
    lowered = lower(Stateful(), (torch.randn(3, 4),))
    path = tmp_path_factory.mktemp("pte") / "stateful.pte"
    path.write_bytes(lowered.buffer)
    return lowered, inspect_pte(path)


def test_segments_match_lowering(stateful):
    lowered, info = stateful
    segments, leftover = lowered.summary
    (method,) = info.methods
    assert method.name == "forward"
    ours = [d for d in method.delegates if d.backend_id == BACKEND_ID]
    assert len(ours) == segments and all(d.mlx is not None and d.calls == 1 for d in ours)
    fallback: Counter[str] = Counter()
    for op, count in method.fallback_ops.items():  # "aten::mul.out" -> "mul"
        fallback[op.split("::")[-1].split(".")[0]] += count
    assert fallback == Counter(leftover)


def test_node_counts_match_payloads(stateful):
    lowered, info = stateful
    expected = []
    for data in payloads(lowered):
        prog = N.deserialize(data)
        expected.append(Counter(type(i.node).__name__ for i in prog.instructions))
    got = [Counter(d.mlx.nodes) for d in info.methods[0].delegates if d.mlx]
    assert sorted(map(sorted, (c.items() for c in got))) == sorted(map(sorted, (c.items() for c in expected)))


def test_payload_details(stateful):
    _, info = stateful
    (p,) = [d.mlx for d in info.methods[0].delegates if d.mlx and d.mlx.buffers]
    assert p.ops["UnaryNode"] == {"Exp": 1}
    assert p.ops["BinaryNode"]["Mul"] == 1
    assert p.constants == 1 and p.constant_bytes == 3 * 4 * 4
    (buf,) = p.buffers
    assert (buf.name, buf.dtype, buf.shape, buf.bytes) == ("total", "float32", [3, 4], 48) and buf.updated
    assert p.num_tensors >= 4 and p.num_instructions == sum(p.nodes.values())
    assert all(s.kind == "tensor" and s.dtype == "float32" for s in p.inputs + p.outputs)


def test_method_signature(stateful):
    _, info = stateful
    m = info.methods[0]
    assert [(s.dtype, s.shape, s.dynamism) for s in m.inputs] == [("float32", [3, 4], "static")]
    assert len(m.outputs) == 2


def test_text_and_json(stateful):
    _, info = stateful
    text = format_text(info)
    assert BACKEND_ID in text and "UnaryNode" in text and "Exp 1" in text and "mutable buffer total" in text
    assert "aten::mul" in text  # the float64 multiply stayed on ExecuTorch
    assert "ExecuTorch kernels" in format_summary(info)
    d = info.to_dict()
    assert d["methods"][0]["delegates"][0]["backend_id"] == BACKEND_ID


def test_dynamic_dims(tmp_path):
    dim = torch.export.Dim("n", min=2, max=64)
    # Lambda.forward takes *args, hence the extra tuple level.
    lowered = lower(Lambda(torch.exp), (torch.randn(5, 3),), dynamic_shapes=(({0: dim},),))
    info = inspect_bytes(lowered.buffer)
    m = info.methods[0]
    assert m.inputs[0].dynamism == "bound" and m.inputs[0].shape == [64, 3]
    (slot,) = m.delegates[0].mlx.inputs
    assert slot.shape == [{"min": 2, "max": 64}, 3]
    assert "2..64" in format_text(info)


def test_ir_dtype_names():
    assert [ir_dtype_name(d) for d in (N.DType.f32, N.DType.bf16, N.DType.u8, N.DType.bool_)] == [
        "float32", "bfloat16", "uint8", "bool"]


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    (b"hello, this is not a program at all", "not an ExecuTorch program"),
    (b"\0\0\0\0ET12" + b"\xff" * 40, "not a valid ExecuTorch program"),
], ids=["missing", "not-pte", "corrupt"])
def test_bad_files(tmp_path, content, message):
    path = tmp_path / "bad.pte"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(InspectError, match=message):
        inspect_pte(path)


def test_corrupt_payload(stateful):
    lowered, _ = stateful
    data = bytearray(lowered.buffer)
    payload = payloads(lowered)[0]
    at = bytes(data).find(payload)
    assert at >= 0
    data[at:at + len(payload)] = b"\x07" * len(payload)
    with pytest.raises(InspectError, match="corrupt MLXDelegateBackend payload"):
        inspect_bytes(bytes(data))
