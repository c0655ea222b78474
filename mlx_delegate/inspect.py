"""Inspect a serialized ExecuTorch program (.pte): what runs on MLX and what does not.

`inspect_pte(path)` reads the file with ExecuTorch's own deserializer and
returns a `ProgramInfo`: per method, the delegate segments (ours decoded down
to IR node counts, slots, I/O, constants and mutable buffers) and the operators
left to ExecuTorch's kernels. `format_text` renders it for people,
`ProgramInfo.to_dict` for machines.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from executorch.exir._serialize._program import deserialize_pte_binary
from executorch.exir.schema import DataLocation, DelegateCall, ExecutionPlan, KernelCall, ScalarType, Tensor

from .backend import BACKEND_ID
from .ir import nodes as N

# ExecuTorch programs carry the flatbuffer file identifier "ET<version>" at byte 4.
_PTE_MAGIC = b"ET"
_ET_DTYPES = {
    "BYTE": "uint8", "CHAR": "int8", "SHORT": "int16", "INT": "int32", "LONG": "int64", "HALF": "float16",
    "FLOAT": "float32", "DOUBLE": "float64", "BOOL": "bool", "BFLOAT16": "bfloat16",
}
_IR_DTYPE_PREFIX = {"bf": "bfloat", "f": "float", "i": "int", "u": "uint"}


class InspectError(Exception):
    """The file cannot be inspected (missing, not a .pte, or a corrupt payload)."""


# ---------------------------------------------------------------------- records
@dataclass
class SlotInfo:
    """One program or delegate input/output."""

    kind: str  # tensor | int | float | bool | ...
    dtype: str | None = None
    # Ints for fixed dims; {"min", "max"} for dynamic ones (delegate) or the upper bound (method).
    shape: list[Any] | None = None
    dynamism: str | None = None  # method tensors: static | bound | unbound
    name: str | None = None


@dataclass
class BufferInfo:
    name: str
    dtype: str
    shape: list[int]
    bytes: int
    updated: bool  # the delegate writes a new value back after each call


@dataclass
class PayloadInfo:
    """A decoded mlx_delegate payload."""

    version: int
    method: str
    num_tensors: int
    num_values: int
    num_instructions: int
    nodes: dict[str, int]  # node type -> count
    ops: dict[str, dict[str, int]]  # enum-selected node type -> {op: count}
    inputs: list[SlotInfo]
    outputs: list[SlotInfo]
    constants: int
    constant_bytes: int
    buffers: list[BufferInfo]


@dataclass
class DelegateInfo:
    index: int
    backend_id: str
    payload_bytes: int
    calls: int  # DelegateCall instructions in the plan
    compile_specs: dict[str, str] = field(default_factory=dict)
    mlx: PayloadInfo | None = None  # only for our backend


@dataclass
class MethodInfo:
    name: str
    inputs: list[SlotInfo]
    outputs: list[SlotInfo]
    instructions: int
    delegates: list[DelegateInfo]
    fallback_ops: dict[str, int]  # ExecuTorch kernel -> number of calls


@dataclass
class ProgramInfo:
    path: str
    file_bytes: int
    version: int
    named_data_bytes: int
    methods: list[MethodInfo]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------- readers
def ir_dtype_name(d: Any) -> str:
    """IR dtype enum -> torch-style name (`f32` -> `float32`)."""
    name = N.DType(d).name.rstrip("_")
    m = re.fullmatch(r"(bf|f|i|u)(\d+)", name)
    return _IR_DTYPE_PREFIX[m.group(1)] + m.group(2) if m else name


def _et_dtype_name(t: ScalarType) -> str:
    return _ET_DTYPES.get(t.name, t.name.lower())


def _dim(d: Any) -> Any:
    return {"min": d.min, "max": d.max} if d.dynamic else d.size


def _io_slot(s: Any) -> SlotInfo:
    kind = N.SlotKind(s.kind).name.lower()
    if kind != "tensor":
        return SlotInfo(kind=kind, name=s.name)
    return SlotInfo(kind=kind, dtype=ir_dtype_name(s.dtype), shape=[_dim(d) for d in s.shape or []],
                    name=s.name)


def _nbytes(dtype: Any, shape: list[int]) -> int:
    bits = int(re.sub(r"\D", "", ir_dtype_name(dtype)) or 8)  # bool is stored as one byte
    return math.prod(shape) * bits // 8


def _count_nodes(instructions: list[Any]) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    nodes: Counter[str] = Counter()
    ops: dict[str, Counter[str]] = {}
    for ins in instructions:
        name = type(ins.node).__name__
        nodes[name] += 1
        op = getattr(ins.node, "op", None)
        if isinstance(op, enum.Enum):  # enum-selected families: UnaryNode, BinaryNode, ...
            ops.setdefault(name, Counter())[op.name] += 1
    return dict(nodes.most_common()), {k: dict(v.most_common()) for k, v in sorted(ops.items())}


def summarize_payload(data: bytes) -> PayloadInfo:
    """Decode one mlx_delegate payload into counts and signatures."""
    try:
        prog = N.deserialize(data)
    except Exception as e:  # a truncated flatbuffer fails anywhere in the reader
        raise InspectError(f"corrupt {BACKEND_ID} payload: {e}") from e
    instructions = prog.instructions or []
    nodes, ops = _count_nodes(instructions)
    constants = {c.key: _nbytes(c.dtype, list(c.shape or [])) for c in prog.constants or []}
    buffers = [BufferInfo(name=b.name, dtype=ir_dtype_name(b.dtype), shape=list(b.shape or []),
                          bytes=_nbytes(b.dtype, list(b.shape or [])), updated=b.update is not None)
               for b in prog.buffers or []]
    return PayloadInfo(
        version=prog.version, method=prog.method or "", num_tensors=prog.num_tensors,
        num_values=prog.num_values, num_instructions=len(instructions), nodes=nodes, ops=ops,
        inputs=[_io_slot(s) for s in prog.inputs or []], outputs=[_io_slot(s) for s in prog.outputs or []],
        constants=len(prog.constants or []), constant_bytes=sum(constants.values()), buffers=buffers)


def _value_slot(plan: ExecutionPlan, idx: int) -> SlotInfo:
    v = plan.values[idx].val
    if isinstance(v, Tensor):
        return SlotInfo(kind="tensor", dtype=_et_dtype_name(v.scalar_type), shape=list(v.sizes),
                        dynamism=v.shape_dynamism.name.lower().removeprefix("dynamic_"))
    return SlotInfo(kind=type(v).__name__.lower())


def _payload_bytes(program: Any, processed: Any) -> bytes:
    if processed.location != DataLocation.INLINE:
        raise InspectError(f"delegate data stored at {processed.location.name} cannot be read")
    return bytes(program.backend_delegate_data[processed.index].data)


def _method_info(program: Any, plan: ExecutionPlan) -> MethodInfo:
    kernels: Counter[str] = Counter()
    calls: Counter[int] = Counter()
    instructions = [i for chain in plan.chains for i in chain.instructions]
    for ins in instructions:
        args = ins.instr_args
        if isinstance(args, KernelCall):
            op = plan.operators[args.op_index]
            kernels[f"{op.name}.{op.overload}" if op.overload else op.name] += 1
        elif isinstance(args, DelegateCall):
            calls[args.delegate_index] += 1
    delegates = []
    for i, d in enumerate(plan.delegates):
        payload = _payload_bytes(program, d.processed)
        specs = {s.key: s.value.decode(errors="replace") for s in d.compile_specs}
        delegates.append(DelegateInfo(
            index=i, backend_id=d.id, payload_bytes=len(payload), calls=calls[i], compile_specs=specs,
            mlx=summarize_payload(payload) if d.id == BACKEND_ID else None))
    return MethodInfo(
        name=plan.name, inputs=[_value_slot(plan, i) for i in plan.inputs],
        outputs=[_value_slot(plan, i) for i in plan.outputs], instructions=len(instructions),
        delegates=delegates, fallback_ops=dict(kernels.most_common()))


def _named_data_bytes(pte: Any) -> int:
    store = pte.named_data
    return sum(len(b.buffer) if hasattr(b, "buffer") else len(b) for b in store.buffers) if store else 0


def inspect_bytes(data: bytes, path: str = "<bytes>") -> ProgramInfo:
    """Inspect a serialized program held in memory."""
    if len(data) < 8 or data[4:6] != _PTE_MAGIC:
        raise InspectError(f"{path} is not an ExecuTorch program (.pte): no ET file identifier")
    try:
        pte = deserialize_pte_binary(data)
        program = pte.program
        return ProgramInfo(
            path=path, file_bytes=len(data), version=program.version, named_data_bytes=_named_data_bytes(pte),
            methods=[_method_info(program, plan) for plan in program.execution_plan])
    except InspectError:
        raise
    except Exception as e:  # the deserializer does not validate: corrupt files fail anywhere
        raise InspectError(f"{path} is not a valid ExecuTorch program: {type(e).__name__}: {e}") from e


def inspect_pte(path: str | Path) -> ProgramInfo:
    """Inspect a .pte file; raises `InspectError` with a readable message."""
    p = Path(path)
    if not p.exists():
        raise InspectError(f"{p}: no such file")
    if not p.is_file():
        raise InspectError(f"{p} is not a file")
    return inspect_bytes(p.read_bytes(), str(p))


# ---------------------------------------------------------------------- text
def _shape_text(shape: list[Any] | None, dynamism: str | None = None) -> str:
    dims = [f"{d['min']}..{d['max']}" if isinstance(d, dict) else str(d) for d in shape or []]
    # ExecuTorch records dynamism per tensor, not per dim; bounded tensors list their largest sizes.
    suffix = {"bound": " (upper bound)", "unbound": " (unbounded)"}.get(dynamism or "", "")
    return "[" + ", ".join(dims) + "]" + suffix


def slot_text(s: SlotInfo) -> str:
    if s.kind != "tensor":
        text = s.kind
    else:
        text = f"{s.dtype}{_shape_text(s.shape, s.dynamism)}"
    return f"{s.name}: {text}" if s.name else text


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _payload_lines(p: PayloadInfo) -> list[str]:
    lines = [f"slots: {p.num_tensors} tensor, {p.num_values} value; {p.num_instructions} instructions",
             f"inputs:  {', '.join(slot_text(s) for s in p.inputs) or '-'}",
             f"outputs: {', '.join(slot_text(s) for s in p.outputs) or '-'}",
             f"constants: {p.constants} ({_human_bytes(p.constant_bytes)})"]
    for b in p.buffers:
        lines.append(f"mutable buffer {b.name}: {b.dtype}{_shape_text(b.shape)} ({_human_bytes(b.bytes)})"
                     + ("" if b.updated else ", read only"))
    width = max((len(k) for k in p.nodes), default=0)
    lines.append("nodes:")
    for name, count in p.nodes.items():
        by_op = ", ".join(f"{op} {c}" for op, c in p.ops.get(name, {}).items())
        lines.append(f"  {name:<{width}} {count:>5}  {by_op}".rstrip())
    return lines


def _delegate_lines(d: DelegateInfo) -> list[str]:
    head = f"delegate {d.index}: {d.backend_id}, {_human_bytes(d.payload_bytes)} payload, {d.calls} call(s)"
    specs = [f"compile spec {k} = {v}" for k, v in d.compile_specs.items()]
    body = specs + (_payload_lines(d.mlx) if d.mlx else [])
    return [head] + ["  " + line for line in body]


def format_text(info: ProgramInfo) -> str:
    """A human-readable report of `info`."""
    out = [f"{info.path}: {_human_bytes(info.file_bytes)}, program version {info.version}, "
           f"{len(info.methods)} method(s), named data {_human_bytes(info.named_data_bytes)}"]
    for m in info.methods:
        out += [f"method {m.name}: {m.instructions} instructions, {len(m.delegates)} delegate segment(s)",
                f"  inputs:  {', '.join(slot_text(s) for s in m.inputs) or '-'}",
                f"  outputs: {', '.join(slot_text(s) for s in m.outputs) or '-'}"]
        for d in m.delegates:
            out += ["  " + line for line in _delegate_lines(d)]
        total = sum(m.fallback_ops.values())
        out.append(f"  ExecuTorch kernels: {total} call(s)" + (":" if total else " (fully delegated)"))
        out += [f"    {count:>5}  {op}" for op, count in m.fallback_ops.items()]
    return "\n".join(out)


def _merged_nodes(payloads: list[PayloadInfo]) -> tuple[Counter[str], dict[str, Counter[str]]]:
    nodes: Counter[str] = Counter()
    ops: dict[str, Counter[str]] = {}
    for p in payloads:
        nodes.update(p.nodes)
        for name, by_op in p.ops.items():
            ops.setdefault(name, Counter()).update(by_op)
    return nodes, ops


def _counts_text(counts: dict[str, int] | Counter[str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in Counter(counts).most_common())


def format_summary(info: ProgramInfo) -> str:
    """A few lines per method: MLX totals across segments, other delegates, ExecuTorch kernels."""
    out = [f"{info.path}: {_human_bytes(info.file_bytes)}"]
    for m in info.methods:
        ours = [d.mlx for d in m.delegates if d.mlx is not None]
        others = Counter(d.backend_id for d in m.delegates if d.mlx is None)
        nodes, ops = _merged_nodes(ours)
        kernels = sum(m.fallback_ops.values())
        constant_bytes = _human_bytes(sum(p.constant_bytes for p in ours))
        out += [f"method {m.name}: {m.instructions} instructions",
                f"  MLX: {len(ours)} segment(s), {sum(nodes.values())} IR instructions, "
                f"{sum(p.constants for p in ours)} constants ({constant_bytes}), "
                f"{sum(len(p.buffers) for p in ours)} mutable buffer(s)"]
        out += [f"    {name} {count}" + (f" ({_counts_text(ops[name])})" if name in ops else "")
                for name, count in nodes.most_common()]
        if others:
            out.append(f"  other delegates: {_counts_text(others)}")
        out.append(f"  ExecuTorch kernels: {kernels} call(s)"
                   + (f": {_counts_text(m.fallback_ops)}" if kernels else " (fully delegated)"))
    return "\n".join(out)
