"""The `mlx-delegate` command line: subcommand discovery, inspect, ops, demo."""

import json
import subprocess
import sys
from collections import Counter

import pytest
import torch

from mlx_delegate import BACKEND_ID
from mlx_delegate.cli import _subcommand_modules, build_parser, main
from mlx_delegate.ir import nodes as N
from mlx_delegate.testing import Lambda, lower


def attention_like(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    # cumsum in float64 keeps one op on ExecuTorch, splitting the graph in two segments.
    s = torch.sigmoid(q) * k
    return torch.tanh(s.double().cumsum(-1).float()) + q


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    lowered = lower(Lambda(attention_like), (torch.randn(2, 8), torch.randn(2, 8)))
    path = tmp_path_factory.mktemp("cli") / "model.pte"
    path.write_bytes(lowered.buffer)
    return lowered, path


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_subcommands_are_discovered():
    assert {"inspect", "ops", "demo"} <= set(_subcommand_modules())
    assert not any(name.startswith("_") for name in _subcommand_modules())
    help_text = build_parser().format_help()
    assert all(cmd in help_text for cmd in ("inspect", "ops", "demo"))


def test_inspect_json_matches_lowering(program, capsys):
    lowered, path = program
    rc, out, _ = run_cli(capsys, "inspect", str(path), "--json")
    assert rc == 0
    info = json.loads(out)
    (method,) = info["methods"]
    segments, leftover = lowered.summary
    ours = [d for d in method["delegates"] if d["backend_id"] == BACKEND_ID]
    assert len(ours) == segments == 2
    assert sum(method["fallback_ops"].values()) == len(leftover)
    gm = lowered.edge.exported_program().graph_module
    programs = [N.deserialize(m.processed_bytes) for m in gm.children()
                if getattr(m, "backend_id", None) == BACKEND_ID]
    counts = [Counter(type(i.node).__name__ for i in p.instructions) for p in programs]
    expected = sorted(sorted(c.items()) for c in counts)
    assert sorted(sorted(d["mlx"]["nodes"].items()) for d in ours) == expected
    for d in ours:
        assert d["mlx"]["num_instructions"] == sum(d["mlx"]["nodes"].values())
        assert sum(d["mlx"]["ops"].get("UnaryNode", {}).values()) == d["mlx"]["nodes"].get("UnaryNode", 0)


def test_inspect_text(program, capsys):
    _, path = program
    rc, out, _ = run_cli(capsys, "inspect", str(path))
    assert rc == 0 and "delegate 1: MLXDelegateBackend" in out and "Sigmoid 1" in out
    rc, out, _ = run_cli(capsys, "inspect", "--summary", str(path))
    assert rc == 0 and "MLX: 2 segment(s)" in out


def test_inspect_corrupt_file(tmp_path, program, capsys):
    _, path = program
    bad = tmp_path / "truncated.pte"
    bad.write_bytes(path.read_bytes()[:200])
    rc, out, err = run_cli(capsys, "inspect", str(bad))
    assert rc == 2 and out == ""
    assert "error:" in err and "not a valid ExecuTorch program" in err and "Traceback" not in err


def test_module_entry_point_reports_missing_file(tmp_path):
    # The real `python -m mlx_delegate` process: one line of error, no traceback.
    r = subprocess.run([sys.executable, "-m", "mlx_delegate", "inspect", str(tmp_path / "missing.pte")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert "no such file" in r.stderr and "Traceback" not in r.stderr


def test_ops_json(capsys):
    rc, out, _ = run_cli(capsys, "ops", "--json")
    rows = json.loads(out)
    assert rc == 0 and {"target": "aten.exp.default", "family": "elementwise"}.items() <= next(
        r for r in rows if r["target"] == "aten.exp.default").items()


def test_ops_write_and_check(tmp_path, capsys):
    doc = tmp_path / "ops.md"
    assert run_cli(capsys, "ops", "--check", str(doc))[0] == 2
    assert run_cli(capsys, "ops", "--write", str(doc))[0] == 0
    assert run_cli(capsys, "ops", "--check", str(doc))[0] == 0
    rc, out, _ = run_cli(capsys, "ops")
    assert out == doc.read_text()


def test_demo_quick(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLX_DELEGATE_CACHE", str(tmp_path))
    rc, out, err = run_cli(capsys, "demo", "--quick")
    assert rc == 0, out + err
    assert "parity: max abs error" in out and "(ok," in out
    assert "latency (median of 3, interleaved)" in out and "MLX:" in out
    assert "lowering with MLXPartitioner" in err  # progress goes to stderr
    assert list(tmp_path.glob("demo-*.pte"))


def test_broken_subcommand_module_keeps_the_others(monkeypatch, capsys):
    import importlib

    import mlx_delegate.cli as cli

    real_import = importlib.import_module

    def fake_import(name, *a):
        if name == "mlx_delegate.cli.fake":
            raise ImportError("No module named 'some_optional_dependency'")
        return real_import(name, *a)

    monkeypatch.setattr(cli, "_subcommand_modules", lambda: ["fake", "ops"])
    monkeypatch.setattr(cli.importlib, "import_module", fake_import)
    rc, _, err = run_cli(capsys, "fake", "--anything")
    assert rc == 2 and "unavailable" in err and "some_optional_dependency" in err
    assert run_cli(capsys, "ops", "--json")[0] == 0
