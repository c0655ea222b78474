"""Export a `models.llama.Model` to one .pte with a single dynamic method:

    forward(tokens [1, L] int64, input_pos [1] int64) -> logits [1, 1, vocab] (last position)

or, with a sampler inside the method, the next token id:

    sampler="greedy":  forward(tokens, input_pos) -> token id [1] int64 (the argmax)
    sampler="sample":  forward(tokens, input_pos, temperature [1], top_k [1] int64, top_p [1], u [1])
                       -> token id [1] int64 (`llm.sampling.sample_next`; temperature 0 is greedy)

A "sample" program serves every setting, but sorts the whole vocabulary every step, greedy or not
(a static graph has no branch to skip it): greedy generation uses the "greedy" program.

L runs from 1 (decode) to the cache length (prefill); the KV cache lives in the
delegate between calls. The position is a tensor the graph never reads on the
host (see `models.llama`), so the program's shapes depend on L only: every
single-token step has one signature and, from the second step on, runs one
compiled MLX graph. One method, not a prefill and a decode method: the
delegate keeps mutable buffers per loaded method, so two methods would each
have their own cache. The lowered program is cached under
$MLX_DELEGATE_CACHE (default ~/.cache/mlx_delegate), keyed by the weights'
files, the export options and this package's code.

`quantize="int8" | "int4"` (with `group_size`) quantizes the linear layers and
the embedding with torchao before export; the delegate runs them on MLX's
quantized kernels (see `mlx_delegate.quantization`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from executorch.exir import EdgeCompileConfig, EdgeProgramManager, ExecutorchProgramManager, to_edge_transform_and_lower
from executorch.exir.pass_base import ExportedProgramPassBase, ExportedProgramPassResult
from torch.export import Dim, ExportedProgram

from ...models.llama import Model
from .sampling import sample_next
from ... import quantization
from ...partitioner import MLXPartitioner
from ...progress import stage
from ...patterns import MLXPatternPass, preprocess_switches


class RestoreExportedRanges(ExportedProgramPassBase):
    """Put back the size ranges torch.export verified.

    to_edge recomputes them from its shape environment, which turns an exported
    [1, N] into [2, N] (size-1 specialisation); the delegate enforces the lower
    bound, so a length-1 decode step would be refused.
    """

    def __init__(self, exported: ExportedProgram) -> None:
        self.ranges = dict(exported.range_constraints)

    def call(self, exported_program: ExportedProgram) -> ExportedProgramPassResult:
        changed = False
        for sym, vr in self.ranges.items():
            if sym in exported_program.range_constraints and exported_program.range_constraints[sym] != vr:
                exported_program._range_constraints[sym] = vr
                changed = True
        return ExportedProgramPassResult(exported_program, changed)


def size_oblivious() -> Any:
    """Tracing without assuming dynamic sizes are >= 2. Otherwise `start + L <= max_seq_len`
    becomes the runtime check `start <= max_seq_len - 2`, refusing a decode step into the
    last cache slot."""
    return torch.fx.experimental._config.patch(backed_size_oblivious=True)


def lower(ep: ExportedProgram, partitioner: MLXPartitioner | None = None,
          constant_methods: dict[str, Any] | None = None,
          pattern_pass: MLXPatternPass | None = None) -> EdgeProgramManager:
    """to_edge + the pattern pass + MLXPartitioner, keeping the exported size ranges.

    The Edge IR validity check is off, as in ExecuTorch's own LLM export: it re-runs every node on
    fake tensors after each of about a dozen passes (10 of SmolLM2-135M's 43 s of lowering), and this
    fixed architecture's program is checked end to end against eager by the tests instead."""
    pattern_pass = pattern_pass or MLXPatternPass()
    partitioner = partitioner or MLXPartitioner(disable=preprocess_switches(pattern_pass.disabled))
    with size_oblivious():
        return to_edge_transform_and_lower(
            ep, transform_passes=[RestoreExportedRanges(ep), pattern_pass],
            partitioner=[partitioner], constant_methods=constant_methods,
            compile_config=EdgeCompileConfig(_check_ir_validity=False))


class LastLogits(torch.nn.Module):
    """The exported entry point: only the last position's logits leave the delegate."""

    def __init__(self, model: Model) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        return self.model(tokens, input_pos, last_only=True)


class GreedyToken(torch.nn.Module):
    """The exported entry point returning the argmax token id: the logits stay in the delegate."""

    def __init__(self, model: Model) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        return self.model(tokens, input_pos, last_only=True)[:, -1].argmax(-1)


class SampledToken(torch.nn.Module):
    """The exported entry point with the sampler inside: the next token id leaves the delegate.
    The sampling settings and the uniform draw are inputs, so one program serves every setting."""

    def __init__(self, model: Model) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, temperature: torch.Tensor,
                top_k: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        logits = self.model(tokens, input_pos, last_only=True)[:, -1]
        return sample_next(logits, temperature, top_k, top_p, u)


SAMPLERS = {"greedy": GreedyToken, "sample": SampledToken}
# The sampler's inputs after (tokens, input_pos) in a sampler="sample" program.
SAMPLER_INPUTS = 4


def export_model(model: Model, *, full_logits: bool = False, max_len: int | None = None,
                 sampler: str | None = None) -> ExportedProgram:
    """torch.export with a dynamic token count in [1, max_len] (default: the cache length);
    `sampler` ("greedy" / "sample") puts the token choice in the method, which then returns the token id."""
    if sampler is not None and sampler not in SAMPLERS:
        raise ValueError(f"sampler {sampler!r} is not one of {', '.join(SAMPLERS)} (or None for logits)")
    if sampler and full_logits:
        raise ValueError("a sampler returns the next token, not logits: it excludes full_logits")
    max_len = max_len or model.args.max_seq_len
    module = SAMPLERS[sampler](model) if sampler else model if full_logits else LastLogits(model)
    # Two example tokens: a length of 1 would be specialised.
    example: tuple[torch.Tensor, ...] = (torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    if sampler == "sample":
        example += (torch.ones(1), torch.zeros(1, dtype=torch.long), torch.ones(1), torch.zeros(1))
    seq = Dim("seq_len", min=1, max=max_len)
    dynamic = ({1: seq},) + (None,) * (len(example) - 1)
    # Non-strict: strict (dynamo) tracing holds a transient copy of every parameter (~1.4x the weights).
    with torch.no_grad(), size_oblivious():
        return torch.export.export(module.eval(), example, dynamic_shapes=dynamic, strict=False)


def metadata(model: Model) -> dict[str, Any]:
    """Constant methods stored in the .pte (ExecuTorch's LLM runner convention)."""
    return {"get_max_seq_len": model.args.max_seq_len, "get_vocab_size": model.args.vocab_size,
            "use_kv_cache": True}


def quantize_weights(model: Model, mode: str | None, group_size: int | None = None) -> Model:
    """Weight-only quantization in place: mode "int8" (per channel unless group_size) or "int4"
    (group_size 32 / 64 / 128, default 64); None leaves the model as it is. Returns `model`."""
    if mode is None:
        return model
    return quantization.quantize_model(model, mode, group_size)


def to_executorch(model: Model, *, full_logits: bool = False, quantize: str | None = None,
                  group_size: int | None = None, sampler: str | None = None) -> ExecutorchProgramManager:
    """The program for `model`; `quantize` (int8 / int4) quantizes it first, in place (see `quantize_weights`);
    `sampler` ("greedy" / "sample") returns the next token instead of logits (see `export_model`)."""
    if quantize:
        with stage(f"quantizing weights ({quantize})"):
            quantize_weights(model, quantize, group_size)
    with stage("exporting (torch.export)"):
        ep = export_model(model, full_logits=full_logits, sampler=sampler)
    with stage("lowering to the MLX delegate"):
        edge = lower(ep, constant_methods=metadata(model))
    with stage("serialising the program"):
        return edge.to_executorch()


def to_pte(model: Model, **options: Any) -> bytes:
    """The .pte bytes for `model` (options as `to_executorch`). For big models prefer `save_pte`:
    the bytes are one more copy of the weights."""
    return to_executorch(model, **options).buffer


def save_pte(model: Model, path: Path, **options: Any) -> None:
    """Write the .pte for `model` to `path`, streaming the weights (options as `to_executorch`)."""
    program = to_executorch(model, **options)
    with Path(path).open("wb") as f:
        program.write_to_file(f)
