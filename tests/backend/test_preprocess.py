"""Lowering memory: big constants reach ExecuTorch's named data store as files, not bytes."""

import gc
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from executorch.exir import to_edge_transform_and_lower
from executorch.exir._serialize._cord import FileBackedData
from executorch.exir.lowered_backend_module import LoweredBackendModule
from executorch.runtime import Runtime

from mlx_delegate.backend import preprocess
from mlx_delegate.partitioner import MLXPartitioner


def lowered_store_buffers(edge) -> list:
    modules = [m for m in edge.exported_program().graph_module.modules() if isinstance(m, LoweredBackendModule)]
    assert len(modules) == 1
    return list(modules[0].named_data_store_output.buffers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_big_constants_are_spilled_to_files_and_run(tmp_path, monkeypatch, dtype):
    monkeypatch.setenv(preprocess.SPILL_DIR_ENV, str(tmp_path))
    big = torch.nn.Linear(1024, 512).to(dtype)  # 2 MB (fp32) / 1 MB (bf16) weight: spilled
    small = torch.nn.Linear(512, 8).to(dtype)  # 16 KB: stays bytes
    model = torch.nn.Sequential(big, torch.nn.ReLU(), small).eval()
    x = torch.randn(3, 1024, dtype=dtype)
    edge = to_edge_transform_and_lower(torch.export.export(model, (x,), strict=False),
                                       partitioner=[MLXPartitioner()])
    buffers = lowered_store_buffers(edge)
    spilled = [b for b in buffers if isinstance(b, FileBackedData)]
    assert len(spilled) == 1 and len(spilled[0]) == big.weight.numel() * big.weight.element_size()
    assert any(isinstance(b, bytes) for b in buffers)
    assert spilled[0].to_bytes() == big.weight.detach().contiguous().view(torch.uint8).numpy().tobytes()
    assert len(list(tmp_path.glob("mlx_delegate_*.const"))) == 1

    pte = tmp_path / "model.pte"
    with pte.open("wb") as f:
        edge.to_executorch().write_to_file(f)
    out = Runtime.get().load_program(pte).load_method("forward").execute([x])[0]
    torch.testing.assert_close(out, model(x), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_spilling_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(preprocess.SPILL_DIR_ENV, "off")
    model = torch.nn.Linear(1024, 512).eval()
    x = torch.randn(2, 1024)
    edge = to_edge_transform_and_lower(torch.export.export(model, (x,), strict=False),
                                       partitioner=[MLXPartitioner()])
    assert not any(isinstance(b, FileBackedData) for b in lowered_store_buffers(edge))


def test_spilled_file_is_removed_with_its_data(tmp_path, monkeypatch):
    monkeypatch.setenv(preprocess.SPILL_DIR_ENV, str(tmp_path))
    data = preprocess._named_data(torch.randn(512, 1024))
    assert isinstance(data, FileBackedData)
    path = Path(data._path)
    assert path.exists()
    del data
    gc.collect()
    assert not path.exists()


def test_spill_files_of_a_killed_process_are_swept_by_the_next_lowering(tmp_path, monkeypatch):
    # A process that dies without running its finalizers (here `os._exit`; in use, a kill or the
    # out-of-memory killer) leaves its spill files behind.
    code = ("import os, torch; from mlx_delegate.backend import preprocess as p; "
            "d = p._named_data(torch.randn(512, 1024)); os._exit(0)")
    env = {**os.environ, preprocess.SPILL_DIR_ENV: str(tmp_path)}
    dead = subprocess.run([sys.executable, "-c", code], env=env, check=True)
    (left,) = tmp_path.glob("mlx_delegate_*.const")
    old = time.time() - preprocess.STALE_SPILL_S - 60
    os.utime(left, (old, old))
    recent_dead = tmp_path / left.name.replace(".const", "x.const")  # same dead pid, but recent
    recent_dead.write_bytes(b"0")
    alive = tmp_path / f"mlx_delegate_{os.getpid()}_old.const"  # a live process's, however old
    alive.write_bytes(b"0")
    os.utime(alive, (old, old))
    other = tmp_path / "mlx_delegate_notes.const"  # not a spill file's name
    other.write_bytes(b"0")
    os.utime(other, (old, old))
    assert dead.returncode == 0

    monkeypatch.setenv(preprocess.SPILL_DIR_ENV, str(tmp_path))
    data = preprocess._named_data(torch.randn(512, 1024))
    assert not left.exists()
    assert recent_dead.exists() and alive.exists() and other.exists() and Path(data._path).exists()
