"""Mutations shared by the fuzzers: FlatBuffers-aware byte/word changes, and whole-.pte mutations
aimed at the parts of a program the stock runtime hands to the delegate (see `pte.layout`)."""

from __future__ import annotations

import random
import struct

from pte import Field, Layout

BOUNDARY_WORDS = (0, 1, 2, 3, 7, 0xFF, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0xFFFFFFFE, 1 << 16, 1 << 24)


def set_word(buf: bytearray, rng: random.Random, lo: int = 0, hi: int | None = None) -> None:
    """An aligned 32-bit word in [lo, hi) set to a boundary value or nudged (slot ids, offsets, sizes)."""
    hi = len(buf) if hi is None else hi
    if hi - lo < 4:
        return
    at = lo + ((rng.randrange(0, hi - lo - 3)) & ~3)
    value = rng.choice(BOUNDARY_WORDS) if rng.random() < 0.7 else struct.unpack_from("<I", buf, at)[0] + rng.randint(-3, 3)
    struct.pack_into("<I", buf, at, value & 0xFFFFFFFF)


def set_byte(buf: bytearray, rng: random.Random, lo: int = 0, hi: int | None = None) -> None:
    """One byte in [lo, hi) set to a boundary or random value (dtypes, enum tags, name bytes)."""
    hi = len(buf) if hi is None else hi
    if hi > lo:
        buf[rng.randrange(lo, hi)] = rng.choice((0, 1, 2, 0x7F, 0x80, 0xBE, 0xFF, rng.randrange(256)))


def _field_value(f: Field, old: int, size: int, rng: random.Random) -> int:
    top = (1 << (8 * f.width)) - 1
    choice = rng.random()
    if choice < 0.35:
        value = rng.choice((0, 1, 2, top, top - 1, top >> 1, (top >> 1) + 1, 0xFF, 0xFFFF, 1 << 16))
    elif choice < 0.65:
        value = old + rng.choice((-1, 1)) * rng.choice((1, 2, 4, 8, 16, 64, 4096))
    elif choice < 0.8:
        value = rng.choice((size, size - 1, size + 1, size // 2, old * 2, old // 2))  # file-relative offsets/sizes
    else:
        value = rng.getrandbits(8 * f.width)
    return value & top


def set_field(buf: bytearray, f: Field, rng: random.Random) -> None:
    if f.offset + f.width > len(buf):
        return
    fmt = {1: "<B", 4: "<I", 8: "<Q"}[f.width]
    old = struct.unpack_from(fmt, buf, f.offset)[0]
    struct.pack_into(fmt, buf, f.offset, _field_value(f, old, len(buf), rng))


def _in_region(buf: bytearray, rng: random.Random, regions: list[tuple[int, int]]) -> None:
    lo, hi = rng.choice(regions)
    hi = min(hi, len(buf))
    for _ in range(rng.randint(1, 4)):
        (set_word if rng.random() < 0.5 else set_byte)(buf, rng, lo, hi)


def _truncate(buf: bytearray, rng: random.Random, layout: Layout) -> bytearray:
    # Near a boundary between sections (header, flatbuffer, segments) or anywhere.
    if not buf:
        return buf
    edges = [end for group in layout.regions.values() for _, end in group] + [start for group in
                                                                              layout.regions.values() for start, _ in group]
    cut = rng.choice(edges) + rng.randint(-16, 16) if edges and rng.random() < 0.6 else rng.randrange(len(buf))
    return buf[: max(0, min(cut, len(buf) - 1))]


# Relative weights of what a mutation of a whole .pte targets. "flatbuffer" (any word of the
# ExecuTorch program table) is off by default: it mostly finds ExecuTorch's own unchecked indices
# (e.g. an ExecutionPlan input index past the value table aborts in Method::get_value), which no
# delegate can guard against.
PTE_KINDS = {"blob": 30, "named_data": 12, "segments": 14, "delegate": 16, "header": 6, "truncate": 10,
             "flatbuffer": 12}
DEFAULT_KINDS = ("blob", "named_data", "segments", "delegate", "header", "truncate")


def mutate_pte(pte: bytes, layout: Layout, rng: random.Random,
               allowed: tuple[str, ...] = DEFAULT_KINDS) -> tuple[bytes, str]:
    """One mutant of a well-formed program and the kinds of change made ("blob+segments", ...)."""
    buf = bytearray(pte)
    kinds, weights = zip(*((k, PTE_KINDS[k]) for k in allowed))
    picked = rng.choices(kinds, weights, k=2 if rng.random() < 0.2 else 1)
    done = []
    for kind in picked:
        if kind == "truncate":
            buf = _truncate(buf, rng, layout)
        elif kind in ("blob", "flatbuffer") and layout.regions.get(kind):
            _in_region(buf, rng, layout.regions[kind])
        elif kind == "named_data" and (layout.regions.get(kind) or layout.fields.get(kind)):
            if layout.fields.get(kind) and (rng.random() < 0.4 or not layout.regions.get(kind)):
                set_field(buf, rng.choice(layout.fields[kind]), rng)
            else:
                _in_region(buf, rng, layout.regions[kind])
        elif kind == "delegate" and layout.regions.get(kind) and rng.random() < 0.3:
            _in_region(buf, rng, layout.regions[kind])  # the backend id's bytes
        elif layout.fields.get(kind):
            for _ in range(rng.randint(1, 2)):
                set_field(buf, rng.choice(layout.fields[kind]), rng)
        else:
            continue
        done.append(kind)
    return bytes(buf), "+".join(done) or "none"
