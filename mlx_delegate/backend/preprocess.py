"""`MLXDelegateBackend.preprocess`: lower a delegated subgraph to an IR payload."""

from __future__ import annotations

from typing import final

from executorch.exir._serialize._named_data_store import NamedDataStore
from executorch.exir.backend.backend_details import BackendDetails, PreprocessResult
from executorch.exir.backend.compile_spec_schema import CompileSpec
from torch.export import ExportedProgram

from ..builder import build_program
from ..passes import run_graph_passes
from ..patterns import ALL_FUSIONS, FUSIONS, apply_fusions

CONSTANT_ALIGNMENT = 64  # lets the runtime wrap constants without copying


@final
class MLXDelegateBackend(BackendDetails):
    """ExecuTorch backend id `MLXDelegateBackend` (the C++ runtime registers the same name)."""

    @staticmethod
    def preprocess(edge_program: ExportedProgram, compile_specs: list[CompileSpec]) -> PreprocessResult:
        specs = {s.key: s.value for s in compile_specs}
        method = specs.get("method", b"").decode()
        disabled = frozenset(filter(None, specs.get("disable", b"").decode().split(",")))
        apply_fusions(edge_program, disabled)  # before CSE: a match's nodes must have no outside readers
        run_graph_passes(edge_program.graph, disabled - FUSIONS.keys() - {ALL_FUSIONS})
        built = build_program(edge_program, method=method,
                              keep_intermediates="early_release" in disabled)
        store = NamedDataStore()
        seen: set[str] = set()
        for c in built.constants:
            if c.key not in seen:
                seen.add(c.key)
                store.add_named_data(c.key, c.tensor.contiguous(), alignment=CONSTANT_ALIGNMENT)
        return PreprocessResult(processed_bytes=built.serialize(),
                                data_store_output=store.get_named_data_store_output())


BACKEND_ID = MLXDelegateBackend.__name__
