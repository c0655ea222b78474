"""`MLXDelegateBackend.preprocess`: lower a delegated subgraph to an IR payload."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import final

import torch
from executorch.exir._serialize._cord import FileBackedData
from executorch.exir._serialize._named_data_store import NamedDataStore
from executorch.exir.backend.backend_details import BackendDetails, PreprocessResult
from executorch.exir.backend.compile_spec_schema import CompileSpec
from torch.export import ExportedProgram

from .. import progress
from ..builder import build_program
from ..passes import run_graph_passes
from ..patterns import ALL_FUSIONS, FUSIONS, IN_PREPROCESS, PATTERN_SWITCHES, apply_fusions, apply_patterns

CONSTANT_ALIGNMENT = 64  # lets the runtime wrap constants without copying
# Constants from this size on go to the named data store as temporary files,
# not bytes: the store would otherwise hold a second in-memory copy of every
# weight until serialization, and `write_to_file` streams them from disk.
SPILL_MIN_BYTES = 1 << 20
SPILL_DIR_ENV = "MLX_DELEGATE_SPILL_DIR"  # where they go (default: the system temp dir)


SPILL_PREFIX = "mlx_delegate_"
SPILL_SUFFIX = ".const"
STALE_SPILL_S = 3600  # a dead process's spill files are removed once this old (see `_sweep_spills`)
_swept_dirs: set[str] = set()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. another user's process: it exists
        pass
    return True


def _sweep_spills(directory: str) -> None:
    """Remove spill files left by processes that died before their finalizers ran (killed,
    out of memory, `os._exit`): without this, each such lowering leaves its weights in the
    temp dir. Files are named by their process id; only those of dead processes and older than
    `STALE_SPILL_S` go (the age guards against a pid that another namespace reuses)."""
    if directory in _swept_dirs:
        return
    _swept_dirs.add(directory)
    now = time.time()
    for path in Path(directory).glob(f"{SPILL_PREFIX}*{SPILL_SUFFIX}"):
        pid = path.name[len(SPILL_PREFIX):].split("_", 1)[0]
        try:
            if pid.isdigit() and not _pid_alive(int(pid)) and now - path.stat().st_mtime > STALE_SPILL_S:
                path.unlink()
        except OSError:  # gone already, or not ours to remove
            pass


def _named_data(tensor: torch.Tensor) -> torch.Tensor | FileBackedData:
    """What the named data store keeps for one constant: the tensor itself when
    small (the store copies it to bytes), else a file holding its bytes."""
    tensor = tensor.detach().contiguous()
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes < SPILL_MIN_BYTES or os.environ.get(SPILL_DIR_ENV) == "off":
        return tensor
    directory = os.environ.get(SPILL_DIR_ENV) or tempfile.gettempdir()
    _sweep_spills(directory)
    fd, path = tempfile.mkstemp(prefix=f"{SPILL_PREFIX}{os.getpid()}_", suffix=SPILL_SUFFIX, dir=directory)
    with os.fdopen(fd, "wb") as f:
        # A byte view of the tensor's own memory: written without a copy.
        f.write(memoryview(tensor.view(torch.uint8).reshape(-1).numpy()))
    return FileBackedData(path, cleanup=True)  # removed when the last reference goes


@final
class MLXDelegateBackend(BackendDetails):
    """ExecuTorch backend id `MLXDelegateBackend` (the C++ runtime registers the same name)."""

    @staticmethod
    def preprocess(edge_program: ExportedProgram, compile_specs: list[CompileSpec]) -> PreprocessResult:
        specs = {s.key: s.value for s in compile_specs}
        method = specs.get("method", b"").decode()
        disabled = frozenset(filter(None, specs.get("disable", b"").decode().split(",")))
        # What `MLXPatternPass` did not already fuse (a lowering without it), then the fusions;
        # both before CSE: a match's nodes must have no outside readers.
        patterns = disabled & set(PATTERN_SWITCHES)
        apply_patterns(edge_program, patterns, IN_PREPROCESS)
        apply_fusions(edge_program, disabled)
        run_graph_passes(edge_program.graph, disabled - FUSIONS.keys() - {ALL_FUSIONS} - patterns)
        bounds = dict(item.split("=") for item in filter(None, specs.get("lower_bounds", b"").decode().split(",")))
        start = time.perf_counter()
        built = build_program(edge_program, method=method, keep_intermediates="early_release" in disabled,
                              lower_bounds={sym: int(lo) for sym, lo in bounds.items()})
        progress.log.info("delegate segment: %d graph nodes -> %d instructions, %d constants (%.1f s)",
                          len(edge_program.graph.nodes), len(built.program.instructions or []),
                          len(built.constants), time.perf_counter() - start)
        store = NamedDataStore()
        seen: set[str] = set()
        for c in built.constants:
            if c.key not in seen:  # derived ones (fused weights) are computed here, one at a time
                seen.add(c.key)
                store.add_named_data(c.key, _named_data(c.materialize()), alignment=CONSTANT_ALIGNMENT)
        return PreprocessResult(processed_bytes=built.serialize(),
                                data_store_output=store.get_named_data_store_output())


BACKEND_ID = MLXDelegateBackend.__name__
