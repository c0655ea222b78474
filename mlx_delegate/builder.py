"""Program builder: walks an Edge IR graph and emits IR nodes through op handlers.

Handlers see only the small API below (`tensor`, `out`, `emit`, `args`, ...).
The builder owns slot allocation (tensor slots are recycled after their last
use), constants (stored in ExecuTorch's named data map, keyed by content hash
so methods and tied weights share one copy) and the program's signature.
"""

from __future__ import annotations

import hashlib
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from . import registry
from .errors import LoweringError, Unsupported
from .ir import nodes as N

TORCH_TO_IR = {
    torch.float32: N.DType.f32, torch.float16: N.DType.f16, torch.bfloat16: N.DType.bf16,
    torch.int8: N.DType.i8, torch.int16: N.DType.i16, torch.int32: N.DType.i32,
    torch.int64: N.DType.i64, torch.uint8: N.DType.u8, torch.bool: N.DType.bool_,
}  # float64 is left out on purpose: Metal has no float64, so we refuse it everywhere.
IR_TO_TORCH = {v: k for k, v in TORCH_TO_IR.items()}
MAX_DIM = 2**31 - 1
Tid, Vid = N.Tid, N.Vid


@dataclass
class ConstantData:
    """One constant for the named data store. A derived constant (a fused
    weight) has no tensor until `materialize` runs its producer: the caller
    writes it out and drops it, so derived constants never pile up in memory."""

    key: str
    tensor: torch.Tensor | None = None
    producer: Callable[[], torch.Tensor] | None = None

    def materialize(self) -> torch.Tensor:
        return self.tensor if self.tensor is not None else self.producer()


@dataclass
class BuiltProgram:
    program: Any  # N.Program
    constants: list[ConstantData] = field(default_factory=list)

    def serialize(self) -> bytes:
        return N.serialize(self.program)


def constant_key(t: torch.Tensor) -> str:
    """Content-addressed key: identical tensors (tied or shared across methods) are stored once."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    digest = hashlib.sha256(data.data).hexdigest()[:32]
    return _key(t.dtype, t.shape, digest)


def _key(dtype: torch.dtype, shape: Sequence[int], digest: str) -> str:
    return f"mlxd.{str(dtype).removeprefix('torch.')}.{'x'.join(map(str, shape))}.{digest}"


def derived_key(recipe: str, dtype: torch.dtype, shape: Sequence[int]) -> str:
    """Key of a constant computed from others, named by its recipe (an op and
    its parts' keys) instead of its content, so it is known without computing it."""
    return _key(dtype, shape, hashlib.sha256(recipe.encode()).hexdigest()[:32])


class ProgramBuilder:
    """Lowers fx nodes to IR. In check mode it only validates (partitioner dry run)."""

    def __init__(self, check_only: bool = False, recycle: bool = True) -> None:
        self.check_only = check_only
        self.recycle = recycle
        self.instructions: list[Any] = []
        self.num_tensors = 0
        self.num_values = 0
        self.lower_bounds: dict[str, int] = {}  # size symbol -> the user's lower bound, where lowering narrowed it
        self._free: list[int] = []
        self._temps: list[int] = []
        self._slots: dict[torch.fx.Node, Any] = {}  # node -> Tid | list[Tid]
        self._values: dict[torch.fx.Node, int] = {}
        self.current: torch.fx.Node | None = None
        self._constant_values: dict[torch.fx.Node, torch.Tensor] = {}
        self._pending: dict[torch.fx.Node, str] = {}  # constants not read yet -> their names
        self._keys: dict[torch.fx.Node, str] = {}
        self.pinned: set[torch.fx.Node] = set()  # slots that live for the whole call
        self.constant_data: list[ConstantData] = []
        self.constants: list[Any] = []  # N.Constant

    # ------------------------------------------------------------ handler API
    def unsupported(self, reason: str) -> Unsupported:
        name = registry.target_name(self.current.target) if self.current is not None else "?"
        return Unsupported(f"[{name}] {reason}")

    def args(self, n: torch.fx.Node) -> dict[str, Any]:
        """The node's arguments bound to its schema's names, defaults filled in."""
        schema = getattr(registry.canonical(n.target), "_schema", None)
        if schema is None:
            return {f"arg{i}": a for i, a in enumerate(n.args)} | dict(n.kwargs)
        out: dict[str, Any] = {}
        for i, a in enumerate(schema.arguments):
            if i < len(n.args) and not a.kwarg_only:
                out[a.name] = n.args[i]
            elif a.name in n.kwargs:
                out[a.name] = n.kwargs[a.name]
            else:
                out[a.name] = a.default_value if a.has_default_value() else None
        return out

    @staticmethod
    def meta(x: Any) -> Any:
        return x.meta.get("val") if isinstance(x, torch.fx.Node) else x

    def dtype_of(self, x: Any) -> torch.dtype:
        v = self.meta(x)
        if isinstance(v, torch.Tensor):
            return v.dtype
        if isinstance(v, (bool, torch.SymBool)):
            return torch.bool
        if isinstance(v, (int, torch.SymInt)):
            return torch.int64
        if isinstance(v, (float, torch.SymFloat)):
            return torch.float32
        raise self.unsupported(f"cannot tell the dtype of {x!r}")

    def shape_of(self, x: Any) -> list[Any]:
        v = self.meta(x)
        if not isinstance(v, torch.Tensor):
            raise self.unsupported(f"expected a tensor, got {type(v).__name__}")
        return list(v.shape)

    def ir_dtype(self, dtype: torch.dtype) -> Any:
        if dtype not in TORCH_TO_IR:
            raise self.unsupported(f"dtype {dtype} is not supported")
        return TORCH_TO_IR[dtype]

    def tensor(self, x: Any, held_as: torch.dtype | None = None) -> Any:
        """The slot holding tensor argument `x` (an fx node already lowered). `held_as`: the dtype its
        producer stores in the slot where that differs from x's own (a float64 scale made in float32)."""
        if isinstance(x, torch.fx.Node):
            if x in self._slots and not isinstance(self._slots[x], list):
                return self._slots[x]
            if x in self._pending:
                return self._register_constant(x)
            v = self.meta(x)
            if not isinstance(v, torch.Tensor):
                raise self.unsupported(f"argument {x.name} is not a tensor")
            self.ir_dtype(held_as or v.dtype)
            if self.check_only:
                return self._bind(x, self._alloc())
            raise LoweringError(f"{x.name} is used before it is lowered")
        raise self.unsupported(f"expected a tensor argument, got {x!r}")

    def out(self, n: torch.fx.Node | None = None) -> Any:
        """A fresh slot for the node's (single) tensor result."""
        n = n if n is not None else self.current
        self.ir_dtype(self.dtype_of(n))
        return self._bind(n, self._alloc())

    def outs(self, n: torch.fx.Node, count: int) -> list[Any]:
        """Fresh slots for a node returning `count` tensors (read through getitem)."""
        tids = [self._alloc() for _ in range(count)]
        self._slots[n] = tids
        return tids

    def temp(self) -> Any:
        """A scratch slot, free again once the current handler returns."""
        t = self._alloc()
        self._temps.append(t.idx)
        return t

    def value_out(self, n: torch.fx.Node | None = None) -> Any:
        """A value slot for a node producing a Python scalar (SymInt, item())."""
        n = n if n is not None else self.current
        self._values[n] = self.num_values
        self.num_values += 1
        return Vid(idx=self._values[n])

    def value_temp(self) -> Any:
        """A value slot for a scalar a handler computes on the way (no graph node names it)."""
        self.num_values += 1
        return Vid(idx=self.num_values - 1)

    def emit(self, node: Any) -> None:
        if not self.check_only:
            self.instructions.append(N.Instruction(node=node))

    def _vid_of(self, x: torch.fx.Node) -> int:
        if x not in self._values:
            if not self.check_only:
                raise LoweringError(f"scalar {x.name} is used before it is computed")
            self.value_out(x)
        return self._values[x]

    def int_or_vid(self, v: Any) -> Any:
        if isinstance(v, torch.fx.Node):
            return N.IntOrVid(literal=0, vid=self._vid_of(v))
        if isinstance(v, (bool, int)):
            return N.IntOrVid(literal=int(v), vid=-1)
        if isinstance(v, torch.SymInt) and v.node.is_constant():
            return N.IntOrVid(literal=int(v), vid=-1)
        raise self.unsupported(f"expected an int, got {v!r}")

    def float_or_vid(self, v: Any) -> Any:
        if isinstance(v, torch.fx.Node):
            return N.FloatOrVid(literal=0.0, vid=self._vid_of(v))
        if isinstance(v, (bool, int, float)):
            return N.FloatOrVid(literal=float(v), vid=-1)
        raise self.unsupported(f"expected a number, got {v!r}")

    def full(self, value: Any, dtype: torch.dtype, shape: Sequence[Any] = ()) -> Any:
        """A temp tensor filled with `value` (a number or a scalar node)."""
        t = self.temp()
        self.emit(N.FullNode(shape=[self.int_or_vid(d) for d in shape], value=self.float_or_vid(value),
                             dtype=self.ir_dtype(dtype), out=t))
        return t

    def cast(self, tid: Any, src: torch.dtype, dst: torch.dtype) -> Any:
        """`tid` converted to `dst` (a temp), or `tid` itself when already `dst`."""
        if src == dst:
            return tid
        t = self.temp()
        self.emit(N.AsTypeNode(x=tid, dtype=self.ir_dtype(dst), out=t))
        return t

    def operand(self, x: Any, dtype: torch.dtype) -> Any:
        """A tensor or scalar argument as a slot of `dtype` (casting or materialising it)."""
        if isinstance(x, torch.fx.Node) and isinstance(self.meta(x), torch.Tensor):
            return self.cast(self.tensor(x), self.dtype_of(x), dtype)
        return self.full(x, dtype)

    def concat_constant(self, parts: Sequence[torch.fx.Node | int], dtype: torch.dtype) -> Any:
        """A constant slot holding constant placeholders `parts` concatenated on axis 0,
        an int part standing for that many rows of zeros. Its data is produced only
        when written out; the parts themselves are not stored unless read elsewhere."""
        tensors = [p for p in parts if not isinstance(p, int)]
        if self.check_only:
            return self._alloc()
        missing = [p.name for p in tensors if p not in self._constant_values]
        if missing:
            raise LoweringError(f"concat_constant: {missing} are not constants")
        trailing = list(self._constant_value(tensors[0]).shape[1:]) if tensors else None
        if trailing is None or any(list(self._constant_value(p).shape[1:]) != trailing for p in tensors):
            raise LoweringError(f"concat_constant: parts {[p.name for p in tensors]} do not stack on axis 0")
        rows = [p if isinstance(p, int) else int(self._constant_value(p).shape[0]) for p in parts]
        shape = [sum(rows), *trailing]
        recipe = "concat0:" + ",".join(f"zeros{p}" if isinstance(p, int) else self._key_of(p) for p in parts)
        key = derived_key(recipe, dtype, shape)

        def produce() -> torch.Tensor:
            return torch.cat([torch.zeros([p, *trailing], dtype=dtype) if isinstance(p, int)
                              else self._constant_value(p).to(dtype) for p in parts])

        name = "+".join(p.name if not isinstance(p, int) else f"zeros{p}" for p in parts)
        return self._add_constant(key, name, dtype, shape, ConstantData(key, producer=produce))

    # -------------------------------------------------------------- internals
    def add_constant_placeholder(self, n: torch.fx.Node, name: str, t: torch.Tensor) -> None:
        """Declare constant placeholder `n`; it is stored on its first read only."""
        self._constant_values[n] = t
        self._pending[n] = name

    def _constant_value(self, n: torch.fx.Node) -> torch.Tensor:
        return self._constant_values[n]

    def _key_of(self, n: torch.fx.Node) -> str:
        if n not in self._keys:
            self._keys[n] = constant_key(self._constant_values[n])
        return self._keys[n]

    def _register_constant(self, n: torch.fx.Node) -> Any:
        t = self._constant_values[n]
        tid = self._add_constant(self._key_of(n), self._pending.pop(n), t.dtype, list(t.shape),
                                 ConstantData(self._key_of(n), t))
        self.pinned.add(n)
        return self._bind(n, tid)

    def _add_constant(self, key: str, name: str, dtype: torch.dtype, shape: list[int], data: ConstantData) -> Any:
        ir_dtype = self.ir_dtype(dtype)
        # A fresh slot, never a recycled one: constants are set before the call
        # starts, so their slot must hold nothing else at any point of it.
        tid = Tid(idx=self.num_tensors)
        self.num_tensors += 1
        self.constant_data.append(data)
        self.constants.append(N.Constant(tid=tid, key=key, dtype=ir_dtype, shape=shape, name=name))
        return tid

    def _alloc(self) -> Any:
        if self._free and self.recycle:
            return Tid(idx=self._free.pop())
        self.num_tensors += 1
        return Tid(idx=self.num_tensors - 1)

    def _bind(self, n: torch.fx.Node, tid: Any) -> Any:
        self._slots[n] = tid
        return tid

    def release(self, n: torch.fx.Node) -> None:
        if n in self.pinned:
            return
        slot = self._slots.pop(n, None)
        for t in slot if isinstance(slot, list) else [slot] if slot is not None else []:
            if t is not None:
                self._free.append(t.idx)

    def lower_node(self, n: torch.fx.Node) -> None:
        """Run the handler for `n` (raises Unsupported when it cannot be lowered)."""
        self.current = n
        try:
            if n.target is operator.getitem:
                self._getitem(n)
                return
            handler = registry.lookup(n.target)
            if handler is None:
                raise self.unsupported("no handler")
            handler(self, n)
        finally:
            self._free.extend(self._temps)
            self._temps.clear()
            self.current = None

    def _getitem(self, n: torch.fx.Node) -> None:
        src, idx = n.args
        slots = self._slots.get(src)
        if not isinstance(slots, list):
            if self.check_only:
                return
            raise LoweringError(f"getitem on {src.name}, which has no tuple result")
        # The getitem node takes ownership of the element's slot.
        self._slots[n] = slots[idx]
        slots[idx] = None


# ---------------------------------------------------------------- whole graph
def _dims(builder: ProgramBuilder, ep: ExportedProgram, val: torch.Tensor) -> list[Any]:
    dims = []
    for d in val.shape:
        if isinstance(d, int) or (isinstance(d, torch.SymInt) and d.node.is_constant()):
            dims.append(N.Dim(size=int(d), min=int(d), max=int(d), dynamic=False))
            continue
        vr = ep.range_constraints.get(d.node.expr)
        lo = int(vr.lower) if vr is not None and vr.lower.is_finite else 0
        # Re-tracing while lowering narrows Dim(min=1) to [2, max] (torch's 0/1 specialisation);
        # the user's own lower bound, recorded by the partitioner, is the contract.
        lo = min(lo, builder.lower_bounds.get(str(d.node.expr), lo))
        hi = int(vr.upper) if vr is not None and vr.upper.is_finite else MAX_DIM
        hint = d.node.hint if d.node.hint is not None else lo
        dims.append(N.Dim(size=int(hint), min=lo, max=min(hi, MAX_DIM), dynamic=True))
    return dims


def _io_slot(b: ProgramBuilder, ep: ExportedProgram, n: torch.fx.Node, name: str) -> Any:
    v = b.meta(n)
    if isinstance(v, torch.Tensor):
        return N.IOSlot(kind=N.SlotKind.Tensor, tid=b.tensor(n), dtype=b.ir_dtype(v.dtype),
                        shape=_dims(b, ep, v), name=name)
    kind = N.SlotKind.Float if isinstance(v, (float, torch.SymFloat)) else N.SlotKind.Int
    if n not in b._values:
        b.value_out(n)
    return N.IOSlot(kind=kind, vid=Vid(idx=b._values[n]), dtype=N.DType.i64, name=name)


def _last_uses(graph: torch.fx.Graph) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """For each node, the nodes whose value is dead after it runs."""
    last: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in graph.nodes:
        for a in n.all_input_nodes:
            last[a] = n
    dead: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for value, user in last.items():
        dead.setdefault(user, []).append(value)
    return dead


def build_program(ep: ExportedProgram, method: str = "", keep_intermediates: bool = False,
                  lower_bounds: dict[str, int] | None = None) -> BuiltProgram:
    """Lower a whole (delegated) exported program into an IR program.

    keep_intermediates (debugging) gives every value its own slot and keeps it
    alive until the call ends, instead of releasing it after its last use.
    """
    b = ProgramBuilder(recycle=not keep_intermediates)
    b.lower_bounds = dict(lower_bounds or {})
    sig = ep.graph_signature
    state = {**ep.state_dict, **ep.constants}
    mutated = {spec.target: spec.arg.name for spec in sig.output_specs if spec.kind == OutputKind.BUFFER_MUTATION}
    inputs, buffers = [], []
    built = BuiltProgram(program=None)
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    for spec, n in zip(sig.input_specs, placeholders):
        if spec.kind == InputKind.USER_INPUT:
            if isinstance(b.meta(n), torch.Tensor):
                b._bind(n, b._alloc())
            inputs.append(_io_slot(b, ep, n, n.name))
            continue
        if spec.target not in state:
            raise LoweringError(f"no data for {spec.kind.name.lower()} '{spec.target}'")
        t = state[spec.target]
        t = t.detach() if isinstance(t, torch.Tensor) else torch.as_tensor(t)
        b.current = n
        dtype = b.ir_dtype(t.dtype)
        b.current = None
        if spec.kind == InputKind.BUFFER and spec.target in mutated:
            tid = b._bind(n, b._alloc())
            b.pinned.add(n)
            key = constant_key(t)
            b.constant_data.append(ConstantData(key, t))
            buffers.append(N.MutableBuffer(tid=tid, key=key, dtype=dtype, shape=list(t.shape), name=spec.target))
        else:  # stored when a node reads it: one that only a fused op consumed is not
            b.add_constant_placeholder(n, spec.target, t)

    dead_after = _last_uses(ep.graph)
    output_node = next(n for n in ep.graph.nodes if n.op == "output")
    keep = set(output_node.all_input_nodes)
    for n in ep.graph.nodes:
        if n.op != "call_function":
            continue
        try:
            b.lower_node(n)
        except Unsupported as e:
            raise LoweringError(f"node {n.name} was delegated but cannot be lowered: {e}") from e
        # Tuple results nobody reads are released at once.
        if isinstance(b._slots.get(n), list) and not n.users:
            b.release(n)
        for dead in dead_after.get(n, []):
            if dead not in keep:
                b.release(dead)

    outputs = []
    for i, a in enumerate(output_node.args[0]):
        spec = sig.output_specs[i]
        if spec.kind == OutputKind.BUFFER_MUTATION:
            buf = next(x for x in buffers if x.name == spec.target)
            buf.update = b.tensor(a)
        elif isinstance(a, torch.fx.Node):
            outputs.append(_io_slot(b, ep, a, spec.arg.name))
        else:
            raise LoweringError(f"output {i} is a constant ({a!r}); only tensors and ints can be returned")
    built.program = N.Program(
        version=N.VERSION, method=method, num_tensors=b.num_tensors, num_values=b.num_values,
        inputs=inputs, outputs=outputs, constants=b.constants, buffers=buffers, instructions=b.instructions,
        keep_intermediates=keep_intermediates)
    built.constants = b.constant_data
    return built

