"""Where the fields a structure-aware .pte mutator targets lie in a serialized ExecuTorch program.

A minimal FlatBuffers walker over `executorch/schema/program.fbs` (field indices below are that
schema's declaration order), so mutations can hit the delegate entry, the segment table, the
named-data table and the extended header by offset without re-serializing the program.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

# program.fbs field indices.
PROGRAM_EXECUTION_PLAN, PROGRAM_SEGMENTS, PROGRAM_NAMED_DATA = 1, 4, 7
PLAN_CHAINS, PLAN_DELEGATES = 5, 7
CHAIN_INSTRUCTIONS = 2
INSTRUCTION_ARGS_TYPE, INSTRUCTION_ARGS = 0, 1
DELEGATE_CALL = 2  # InstructionArguments union tag
DELEGATE_ID, DELEGATE_PROCESSED, DELEGATE_COMPILE_SPECS = 0, 1, 2
DATAREF_LOCATION, DATAREF_INDEX = 0, 1
SEGMENT_OFFSET, SEGMENT_SIZE = 0, 1
NAMED_KEY, NAMED_SEGMENT_INDEX = 0, 1

# Extended header ("eh00" at byte 8): program_size, segment_base_offset, segment_data_size.
HEADER_FIELDS = (("header.program_size", 16), ("header.segment_base_offset", 24), ("header.segment_data_size", 32))


@dataclass(frozen=True)
class Field:
    """A scalar in the file: `width` bytes (1, 4 or 8), little-endian, at `offset`."""

    name: str
    offset: int
    width: int


@dataclass
class Layout:
    """The mutation targets of one .pte: scalar fields by group, and byte ranges by group."""

    fields: dict[str, list[Field]] = field(default_factory=dict)  # "delegate", "segments", "named_data", "header"
    regions: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # [start, end) byte ranges

    def add_field(self, group: str, f: Field | None) -> None:
        if f is not None:
            self.fields.setdefault(group, []).append(f)

    def add_region(self, group: str, start: int, end: int) -> None:
        if end > start:
            self.regions.setdefault(group, []).append((start, end))


class _Reader:
    def __init__(self, buf: bytes) -> None:
        self.buf = buf

    def u32(self, at: int) -> int:
        return struct.unpack_from("<I", self.buf, at)[0]

    def table_field(self, table: int, index: int) -> int | None:
        """Absolute position of field `index` of the table at `table`, or None when absent."""
        vtable = table - struct.unpack_from("<i", self.buf, table)[0]
        vt_size = struct.unpack_from("<H", self.buf, vtable)[0]
        if 4 + 2 * index >= vt_size:
            return None
        rel = struct.unpack_from("<H", self.buf, vtable + 4 + 2 * index)[0]
        return table + rel if rel else None

    def deref(self, at: int) -> int:
        return at + self.u32(at)

    def child(self, table: int, index: int) -> int | None:
        """Target of an offset field (table, vector or string), or None when absent."""
        at = self.table_field(table, index)
        return None if at is None else self.deref(at)

    def tables(self, vector: int | None) -> list[int]:
        if vector is None:
            return []
        return [self.deref(vector + 4 + 4 * i) for i in range(self.u32(vector))]


def layout(pte: bytes) -> Layout:
    """The mutation targets of a well-formed program (as `to_executorch().buffer` writes it)."""
    r, out = _Reader(pte), Layout()
    root = r.deref(0)
    program_size, segment_base = len(pte), 0
    if pte[8:12] == b"eh00":
        for name, at in HEADER_FIELDS:
            out.add_field("header", Field(name, at, 8))
        program_size, segment_base = struct.unpack_from("<QQ", pte, 16)
    out.add_region("flatbuffer", 0, program_size)

    def scalar(group: str, name: str, table: int, index: int, width: int) -> None:
        at = r.table_field(table, index)
        out.add_field(group, Field(name, at, width) if at is not None else None)

    def string(group: str, name: str, table: int, index: int) -> None:
        at = r.child(table, index)
        if at is not None:
            out.add_field(group, Field(f"{name}.length", at, 4))
            out.add_region(group, at + 4, at + 4 + r.u32(at))

    segments = r.tables(r.child(root, PROGRAM_SEGMENTS))
    for i, seg in enumerate(segments):
        scalar("segments", f"segments[{i}].offset", seg, SEGMENT_OFFSET, 8)
        scalar("segments", f"segments[{i}].size", seg, SEGMENT_SIZE, 8)
    vec = r.child(root, PROGRAM_SEGMENTS)
    if vec is not None:
        out.add_field("segments", Field("segments.length", vec, 4))

    def segment_range(index: int) -> tuple[int, int]:
        seg = segments[index]
        o, s = r.table_field(seg, SEGMENT_OFFSET), r.table_field(seg, SEGMENT_SIZE)
        offset = struct.unpack_from("<Q", pte, o)[0] if o is not None else 0
        size = struct.unpack_from("<Q", pte, s)[0] if s is not None else 0
        return segment_base + offset, segment_base + offset + size

    delegate_segments: set[int] = set()
    for p, plan in enumerate(r.tables(r.child(root, PROGRAM_EXECUTION_PLAN))):
        for d, delegate in enumerate(r.tables(r.child(plan, PLAN_DELEGATES))):
            name = f"plan[{p}].delegates[{d}]"
            string("delegate", f"{name}.id", delegate, DELEGATE_ID)
            ref = r.child(delegate, DELEGATE_PROCESSED)
            if ref is not None:
                scalar("delegate", f"{name}.processed.location", ref, DATAREF_LOCATION, 1)
                scalar("delegate", f"{name}.processed.index", ref, DATAREF_INDEX, 4)
                at = r.table_field(ref, DATAREF_INDEX)
                location_at = r.table_field(ref, DATAREF_LOCATION)
                if at is not None and location_at is not None and pte[location_at] == 1:  # SEGMENT
                    delegate_segments.add(r.u32(at))
            specs = r.child(delegate, DELEGATE_COMPILE_SPECS)
            if specs is not None:
                out.add_field("delegate", Field(f"{name}.compile_specs.length", specs, 4))
        for c, chain in enumerate(r.tables(r.child(plan, PLAN_CHAINS))):
            for i, ins in enumerate(r.tables(r.child(chain, CHAIN_INSTRUCTIONS))):
                tag = r.table_field(ins, INSTRUCTION_ARGS_TYPE)
                if tag is None or pte[tag] != DELEGATE_CALL:
                    continue
                call = r.child(ins, INSTRUCTION_ARGS)
                scalar("delegate", f"plan[{p}].chains[{c}].instructions[{i}].delegate_index", call, 0, 4)
                args = r.child(call, 1)
                if args is not None:
                    out.add_field("delegate", Field(f"plan[{p}].chains[{c}].instructions[{i}].args.length", args, 4))
                    for a in range(r.u32(args)):
                        out.add_field("delegate", Field(f"...instructions[{i}].args[{a}]", args + 4 + 4 * a, 4))

    named_segments: set[int] = set()
    for n, entry in enumerate(r.tables(r.child(root, PROGRAM_NAMED_DATA))):
        string("named_data", f"named_data[{n}].key", entry, NAMED_KEY)
        scalar("named_data", f"named_data[{n}].segment_index", entry, NAMED_SEGMENT_INDEX, 4)
        at = r.table_field(entry, NAMED_SEGMENT_INDEX)
        named_segments.add(r.u32(at) if at is not None else 0)

    for i in range(len(segments)):
        start, end = segment_range(i)
        if i in delegate_segments:
            out.add_region("blob", start, end)
        elif i in named_segments:
            out.add_region("named_data", start, end)
    return out
