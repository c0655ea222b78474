"""Schema revisions: a program records the newest appended field it uses (`Program.min_revision`), and a
runtime that reads an older revision rejects it through `executorch.runtime` with an error naming both
revisions, instead of ignoring the field and computing something else."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mlx_delegate import _runtime
from mlx_delegate.ir import fbs
from mlx_delegate.ir import nodes as N
from mlx_delegate.testing import delegate_payload, lower


class LinearResidual(nn.Module):
    """`x + fc(x)`: the add is fused into the LinearNode's `residual` (a revision-2 field)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(24, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x)


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(24, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


def _linear_nodes(program) -> list:
    return [i.node for i in program.instructions if type(i.node).__name__ == "LinearNode"]


def test_schema_marks_are_consistent():
    assert N.REVISION >= 2
    for table in N.SCHEMA.tables.values():
        marks = [f.since for f in table.fields]
        assert all(0 <= s <= N.REVISION for s in marks), table.name
        # Marked fields were appended: none comes before an unmarked one.
        assert marks == sorted(marks), table.name


def test_parser_reads_revision_and_since():
    s = fbs.parse("// SCHEMA_REVISION: 7\nattribute \"since\";\n"
                  "table T { a: int; b: bool = true (since: 5); c: [int] (deprecated, since: 7); }")
    assert s.revision == 7
    assert [(f.name, f.since, f.default) for f in s.tables["T"].fields] == [("a", 0, None), ("b", 5, "true"),
                                                                             ("c", 7, None)]


@pytest.mark.parametrize("model, want", [(LinearResidual, 2), (Plain, 1)], ids=["residual", "plain"])
def test_program_records_the_revision_it_uses_and_runs(model, want):
    torch.manual_seed(0)
    m, x = model().eval(), torch.randn(5, 24)
    lowered = lower(m, (x,))
    program = N.deserialize(delegate_payload(lowered.edge)[0])
    assert program.min_revision == want
    assert any(n.residual is not None for n in _linear_nodes(program)) == (want == 2)
    with torch.no_grad():
        torch.testing.assert_close(lowered.method().execute([x])[0], m(x), rtol=1e-4, atol=1e-5)


def test_unset_scalar_at_its_default_needs_no_revision():
    node = N.LinearNode(x=N.Tid(idx=0), weight=N.Tid(idx=1), out=N.Tid(idx=2), act=False)
    assert N.required_revision(node) == 0
    assert N.required_revision(N.dataclasses.replace(node, residual=N.Tid(idx=3))) == 2
    # Nested tables count: a Program holding that instruction needs revision 2.
    program = N.Program(instructions=[N.Instruction(node=N.dataclasses.replace(node, residual=N.Tid(idx=3)))])
    assert N.required_revision(program) == 2


def _pte_needing(revision: int) -> tuple[bytes, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    m, x = LinearResidual().eval(), torch.randn(5, 24)
    lowered = lower(m, (x,))
    payload = delegate_payload(lowered.edge)[0]
    program = N.deserialize(payload)
    patched = N.serialize(N.dataclasses.replace(program, min_revision=revision))
    assert len(patched) == len(payload)  # only a scalar's value changed: splice it into the .pte
    buf = bytes(lowered.buffer)
    start = buf.find(payload)
    assert start >= 0
    return buf[:start] + patched + buf[start + len(payload):], m, x


@pytest.mark.parametrize("source", ["bytes", "file"])
def test_newer_revision_is_rejected_by_the_stock_runtime(tmp_path, capfd, source):
    from executorch.runtime import Runtime

    pte, _, x = _pte_needing(N.REVISION + 1)
    path = tmp_path / "newer.pte"
    path.write_bytes(pte)
    program = Runtime.get().load_program(pte if source == "bytes" else path)
    with pytest.raises(RuntimeError):
        program.load_method("forward").execute([x])
    err = capfd.readouterr().err + _runtime.last_error()
    assert f"schema revision {N.REVISION + 1}" in err and f"reads up to {N.REVISION}" in err, err[-2000:]
    # The same program at the runtime's own revision loads and runs.
    ok, m, x = _pte_needing(N.REVISION)
    out = Runtime.get().load_program(ok).load_method("forward").execute([x])[0]
    with torch.no_grad():
        torch.testing.assert_close(out, m(x), rtol=1e-4, atol=1e-5)
