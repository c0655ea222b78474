"""Python classes for every schema type, built from `mlx_delegate.fbs` at import.

Nothing here lists nodes by hand: enums become `IntEnum`s, structs and tables
become dataclasses with the schema's field names, and `serialize`/`deserialize`
walk the parsed schema generically. Adding a node to the schema makes it
available here as `nodes.<NodeName>(...)`.
"""

from __future__ import annotations

import dataclasses
import enum
import struct as _struct
from typing import Any

import flatbuffers
from flatbuffers import number_types as nt
from flatbuffers.table import Table as _FbTable

from . import fbs

SCHEMA = fbs.load(fbs.schema_path())
VERSION = SCHEMA.version
REVISION = SCHEMA.revision
FILE_IDENTIFIER = SCHEMA.file_identifier

_FLAGS = {
    "bool": nt.BoolFlags, "byte": nt.Int8Flags, "ubyte": nt.Uint8Flags,
    "int8": nt.Int8Flags, "uint8": nt.Uint8Flags, "short": nt.Int16Flags,
    "ushort": nt.Uint16Flags, "int16": nt.Int16Flags, "uint16": nt.Uint16Flags,
    "int": nt.Int32Flags, "uint": nt.Uint32Flags, "int32": nt.Int32Flags,
    "uint32": nt.Uint32Flags, "float": nt.Float32Flags, "float32": nt.Float32Flags,
    "long": nt.Int64Flags, "ulong": nt.Uint64Flags, "int64": nt.Int64Flags,
    "uint64": nt.Uint64Flags, "double": nt.Float64Flags, "float64": nt.Float64Flags,
}

TYPES: dict[str, Any] = {}
for _e in SCHEMA.enums.values():
    TYPES[_e.name] = enum.IntEnum(_e.name, _e.values)
for _s in list(SCHEMA.structs.values()) + list(SCHEMA.tables.values()):
    TYPES[_s.name] = dataclasses.make_dataclass(
        _s.name, [(f.name, Any, dataclasses.field(default=None)) for f in _s.fields],
        kw_only=True, repr=True, eq=True)
globals().update(TYPES)

# Union member name -> type index (0 is NONE).
NODE_TYPES: list[str] = SCHEMA.unions["Node"].members
_UNION_INDEX = {u.name: {m: i + 1 for i, m in enumerate(u.members)} for u in SCHEMA.unions.values()}


def _scalar_type(type_name: str) -> str:
    return SCHEMA.enums[type_name].base if type_name in SCHEMA.enums else type_name


def _struct_layout(name: str) -> tuple[int, int, list[tuple[fbs.Field, int, int]]]:
    """(size, alignment, [(field, offset, size)]) with C-like alignment."""
    offset, align, out = 0, 1, []
    for f in SCHEMA.structs[name].fields:
        if f.type in SCHEMA.structs:
            size, a, _ = _struct_layout(f.type)
        else:
            size = a = fbs.SCALAR_SIZES[_scalar_type(f.type)]
        offset = (offset + a - 1) // a * a
        out.append((f, offset, size))
        offset += size
        align = max(align, a)
    return (offset + align - 1) // align * align, align, out


_LAYOUTS = {name: _struct_layout(name) for name in SCHEMA.structs}


# --------------------------------------------------------------------- writer
def _write_struct_body(b: flatbuffers.Builder, name: str, value: Any) -> None:
    size, align, fields = _LAYOUTS[name]
    b.Prep(align, size)
    end = size
    for f, off, fsize in reversed(fields):
        b.Pad(end - (off + fsize))
        v = getattr(value, f.name)
        if f.type in SCHEMA.structs:
            _write_struct_body(b, f.type, v)
        else:
            b.Prepend(_FLAGS[_scalar_type(f.type)], _coerce(f.type, v))
        end = off


def _coerce(type_name: str, v: Any) -> Any:
    base = _scalar_type(type_name)
    if v is None:
        v = 0
    if base == "bool":
        return bool(v)
    if base in ("float", "float32", "double", "float64"):
        return float(v)
    return int(v)


def _write_vector(b: flatbuffers.Builder, f: fbs.Field, values: list) -> int:
    kind = SCHEMA.kind(f.type)
    if kind in ("scalar", "enum"):
        flags = _FLAGS[_scalar_type(f.type)]
        b.StartVector(flags.bytewidth, len(values), flags.bytewidth)
        for v in reversed(values):
            b.Prepend(flags, _coerce(f.type, v))
    elif kind == "struct":
        size, align, _ = _LAYOUTS[f.type]
        b.StartVector(size, len(values), align)
        for v in reversed(values):
            _write_struct_body(b, f.type, v)
    else:
        offs = [b.CreateString(v) if kind == "string" else _write_table(b, f.type, v) for v in values]
        b.StartVector(4, len(offs), 4)
        for o in reversed(offs):
            b.PrependUOffsetTRelative(o)
    return b.EndVector()


def _write_table(b: flatbuffers.Builder, name: str, obj: Any) -> int:
    fields = SCHEMA.tables[name].fields
    offsets: dict[str, int] = {}
    for f in fields:  # children must be written before the table starts
        v = getattr(obj, f.name)
        if v is None:
            continue
        kind = SCHEMA.kind(f.type)
        if f.is_vector:
            offsets[f.name] = _write_vector(b, f, list(v))
        elif kind == "string":
            offsets[f.name] = b.CreateString(v)
        elif kind == "table":
            offsets[f.name] = _write_table(b, f.type, v)
        elif kind == "union":
            offsets[f.name] = _write_table(b, type(v).__name__, v)
    nslots = sum(2 if SCHEMA.kind(f.type) == "union" and not f.is_vector else 1 for f in fields)
    b.StartObject(nslots)
    slot = 0
    for f in fields:
        v = getattr(obj, f.name)
        kind = SCHEMA.kind(f.type)
        if v is not None:
            if f.name in offsets and kind == "union":
                b.PrependUint8Slot(slot, _UNION_INDEX[f.type][type(v).__name__], 0)
                b.PrependUOffsetTRelativeSlot(slot + 1, offsets[f.name], 0)
            elif f.name in offsets:
                b.PrependUOffsetTRelativeSlot(slot, offsets[f.name], 0)
            elif kind == "struct":
                _write_struct_body(b, f.type, v)
                b.PrependStructSlot(slot, b.Offset(), 0)
            else:
                # Always write scalars (force_defaults) so readers never guess.
                b.PrependSlot(_FLAGS[_scalar_type(f.type)], slot, _coerce(f.type, v), None)
        slot += 2 if kind == "union" else 1
    return b.EndObject()


def _is_default(f: fbs.Field, v: Any) -> bool:
    """Whether scalar `v` equals the field's schema default (what a reader that lacks the field sees)."""
    default = f.default or "0"
    if default in ("true", "false"):
        return bool(v) == (default == "true")
    if SCHEMA.kind(f.type) == "enum" and default in SCHEMA.enums[f.type].values:
        return int(v) == SCHEMA.enums[f.type].values[default]
    return float(v) == float(default)


def required_revision(obj: Any) -> int:
    """The highest `since` revision among the fields `obj` (a table object) uses: set, and for
    scalars different from the default, so that a reader ignoring them would compute something else."""
    name = type(obj).__name__
    if name not in SCHEMA.tables:
        return 0
    need = 0
    for f in SCHEMA.tables[name].fields:
        v = getattr(obj, f.name)
        if v is None:
            continue
        kind = SCHEMA.kind(f.type)
        if f.since and (kind not in ("scalar", "enum") or f.is_vector or not _is_default(f, v)):
            need = max(need, f.since)
        if kind in ("table", "union"):
            need = max([need] + [required_revision(c) for c in (v if f.is_vector else [v])])
    return need


def serialize(program: Any) -> bytes:
    """Serialize a root-type object (a `Program`) to FlatBuffer bytes. A `min_revision` left unset
    is filled with what the program uses (at least 1), so an older runtime rejects what it cannot read."""
    if getattr(program, "min_revision", 0) is None:
        program = dataclasses.replace(program, min_revision=max(1, required_revision(program)))
    b = flatbuffers.Builder(1024)
    root = _write_table(b, SCHEMA.root_type, program)
    b.Finish(root, file_identifier=SCHEMA.file_identifier.encode())
    return bytes(b.Output())


# --------------------------------------------------------------------- reader
def _read_struct(buf: bytes, pos: int, name: str) -> Any:
    _, _, fields = _LAYOUTS[name]
    kw = {}
    for f, off, _ in fields:
        if f.type in SCHEMA.structs:
            kw[f.name] = _read_struct(buf, pos + off, f.type)
        else:
            base = _scalar_type(f.type)
            kw[f.name] = _struct.unpack_from("<" + fbs.SCALAR_CODES[base], buf, pos + off)[0]
    return TYPES[name](**kw)


def _read_table(buf: bytes, pos: int, name: str) -> Any:
    t = _FbTable(buf, pos)
    kw: dict[str, Any] = {}
    slot = 0
    for f in SCHEMA.tables[name].fields:
        kind = SCHEMA.kind(f.type)
        o = t.Offset(4 + 2 * slot)
        if kind == "union":
            to = t.Offset(4 + 2 * (slot + 1))
            idx = t.Get(nt.Uint8Flags, t.Pos + o) if o else 0
            if idx and to:
                member = SCHEMA.unions[f.type].members[idx - 1]
                kw[f.name] = _read_table(buf, t.Indirect(t.Pos + to), member)
            slot += 2
            continue
        slot += 1
        if not o:
            continue
        if f.is_vector:
            n, start = t.VectorLen(o), t.Vector(o)
            if kind in ("scalar", "enum"):
                code = fbs.SCALAR_CODES[_scalar_type(f.type)]
                kw[f.name] = list(_struct.unpack_from(f"<{n}{code}", buf, start))
            elif kind == "struct":
                size = _LAYOUTS[f.type][0]
                kw[f.name] = [_read_struct(buf, start + i * size, f.type) for i in range(n)]
            elif kind == "string":
                kw[f.name] = [t.String(start + 4 * i).decode() for i in range(n)]
            else:
                kw[f.name] = [_read_table(buf, t.Indirect(start + 4 * i), f.type) for i in range(n)]
        elif kind == "struct":
            kw[f.name] = _read_struct(buf, t.Pos + o, f.type)
        elif kind == "string":
            kw[f.name] = t.String(t.Pos + o).decode()
        elif kind == "table":
            kw[f.name] = _read_table(buf, t.Indirect(t.Pos + o), f.type)
        else:
            v = t.Get(_FLAGS[_scalar_type(f.type)], t.Pos + o)
            kw[f.name] = TYPES[f.type](v) if kind == "enum" else v
    return TYPES[name](**kw)


def deserialize(data: bytes) -> Any:
    """Read FlatBuffer bytes written by `serialize` back into Python objects."""
    if data[4:8] != SCHEMA.file_identifier.encode():
        raise ValueError(f"not an mlx_delegate payload (identifier {data[4:8]!r})")
    root = _struct.unpack_from("<I", data, 0)[0]
    return _read_table(data, root, SCHEMA.root_type)
