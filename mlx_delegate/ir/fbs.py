"""A small parser for the FlatBuffers schema subset that `schema/*.fbs` uses.

Both the Python serializer (at import) and `schema/codegen.py` (at build time,
for the C++ dispatch table) read the schema through this module, so the schema
stays the only place where nodes are declared.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

SCALAR_SIZES = {
    "bool": 1, "byte": 1, "ubyte": 1, "int8": 1, "uint8": 1,
    "short": 2, "ushort": 2, "int16": 2, "uint16": 2,
    "int": 4, "uint": 4, "int32": 4, "uint32": 4, "float": 4, "float32": 4,
    "long": 8, "ulong": 8, "int64": 8, "uint64": 8, "double": 8, "float64": 8,
}
# struct.pack codes, used by the Python serializer.
SCALAR_CODES = {
    "bool": "?", "byte": "b", "ubyte": "B", "int8": "b", "uint8": "B",
    "short": "h", "ushort": "H", "int16": "h", "uint16": "H",
    "int": "i", "uint": "I", "int32": "i", "uint32": "I", "float": "f", "float32": "f",
    "long": "q", "ulong": "Q", "int64": "q", "uint64": "Q", "double": "d", "float64": "d",
}


@dataclass
class Field:
    name: str
    type: str  # element type name ("int32", "Tid", "UnaryOp", "string", ...)
    is_vector: bool = False
    default: str | None = None
    since: int = 0  # the schema revision that appended it, where ignoring it changes results


@dataclass
class Enum:
    name: str
    base: str
    values: dict[str, int]


@dataclass
class Struct:
    name: str
    fields: list[Field]


@dataclass
class Table:
    name: str
    fields: list[Field]


@dataclass
class Union:
    name: str
    members: list[str]  # member i has type index i + 1 (0 is NONE)


@dataclass
class Schema:
    namespace: str = ""
    file_identifier: str = ""
    root_type: str = ""
    version: int = 0
    revision: int = 0
    enums: dict[str, Enum] = field(default_factory=dict)
    structs: dict[str, Struct] = field(default_factory=dict)
    tables: dict[str, Table] = field(default_factory=dict)
    unions: dict[str, Union] = field(default_factory=dict)

    def kind(self, type_name: str) -> str:
        """Classify a field's element type: scalar, string, enum, struct, table or union."""
        if type_name in SCALAR_SIZES:
            return "scalar"
        if type_name == "string":
            return "string"
        for kind, table in (("enum", self.enums), ("struct", self.structs),
                            ("table", self.tables), ("union", self.unions)):
            if type_name in table:
                return kind
        raise KeyError(f"unknown type {type_name!r} in schema")


_COMMENT = re.compile(r"//[^\n]*")
_BLOCK = re.compile(r"\b(enum|struct|table|union)\s+(\w+)\s*(?::\s*(\w+))?\s*\{(.*?)\}", re.S)
_FIELD = re.compile(r"(\w+)\s*:\s*(\[?\s*\w+\s*\]?)\s*(?:=\s*([^;(]+?))?\s*(?:\(([^)]*)\))?\s*;")
_SINCE = re.compile(r"\bsince\s*:\s*(\d+)")


def parse(text: str) -> Schema:
    """Parse schema text into a `Schema`."""
    version = re.search(r"SCHEMA_VERSION:\s*(\d+)", text)
    revision = re.search(r"SCHEMA_REVISION:\s*(\d+)", text)
    body = _COMMENT.sub("", text)
    schema = Schema(version=int(version.group(1)) if version else 0,
                    revision=int(revision.group(1)) if revision else 0)
    if m := re.search(r"namespace\s+([\w.]+)\s*;", body):
        schema.namespace = m.group(1)
    if m := re.search(r'file_identifier\s+"(\w+)"\s*;', body):
        schema.file_identifier = m.group(1)
    if m := re.search(r"root_type\s+(\w+)\s*;", body):
        schema.root_type = m.group(1)
    for kind, name, base, inner in _BLOCK.findall(body):
        if kind == "enum":
            values, nxt = {}, 0
            for item in filter(None, (s.strip() for s in inner.split(","))):
                key, _, val = (p.strip() for p in item.partition("="))
                nxt = int(val) if val else nxt
                values[key] = nxt
                nxt += 1
            schema.enums[name] = Enum(name, base, values)
        elif kind == "union":
            members = [s.strip() for s in inner.split(",") if s.strip()]
            schema.unions[name] = Union(name, members)
        else:
            fields = []
            for fname, ftype, default, attrs in _FIELD.findall(inner):
                ftype = ftype.replace(" ", "")
                vec = ftype.startswith("[")
                since = _SINCE.search(attrs)
                fields.append(Field(fname, ftype.strip("[]"), vec, default.strip() or None,
                                    int(since.group(1)) if since else 0))
            (schema.structs if kind == "struct" else schema.tables)[name] = (
                Struct(name, fields) if kind == "struct" else Table(name, fields))
    return schema


def load(path: str | Path) -> Schema:
    return parse(Path(path).read_text())


def schema_path() -> Path:
    """Locate `mlx_delegate.fbs`: installed beside this module, or in the source tree."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "mlx_delegate.fbs", here.parents[1] / "schema" / "mlx_delegate.fbs"):
        if candidate.exists():
            return candidate
    raise FileNotFoundError("mlx_delegate.fbs not found beside mlx_delegate/ir or in schema/")
