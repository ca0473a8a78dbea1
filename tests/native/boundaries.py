"""Pickles that fill each growable array of ``_metadata.c`` up to its capacity exactly when
an opcode that grows it runs, and their neighbours.

The capacities come from the C source: ``reserve()`` sizes nodes, memo and pool from the
input's length (``size / d + c``), ``grow()`` starts others at its first capacity and
doubles; so every capacity is that first one times a power of two. For each array a filler
opcode that adds one item is repeated N times before a trigger (the opcodes that add to the
array: REDUCE, NEWOBJ, BUILD, MEMOIZE, STACK_GLOBAL, a tuple, a string...), for every N
within ``SLACK`` of a capacity minus what is there before the filler: one of them reaches
the capacity exactly at the trigger (what decoding does before it is a few items, well
inside the slack).
"""

from __future__ import annotations

import functools
import re
import struct
from collections.abc import Iterator
from pathlib import Path

SOURCE = Path(__file__).parents[2] / "inspector/formats/safe_pickle/_metadata.c"
SLACK = 12
LARGEST = 1 << 13  # capacities up to here (the 4-8 KiB inputs the tests can afford)

MODULE = "torch.distributed.checkpoint.metadata"


@functools.cache
def constants() -> dict[str, int]:
    """SMALL_ID, SMALL_INTS and grow()'s first capacity, read from the C source."""
    text = SOURCE.read_text()
    found = {}
    for name, pattern in (
        ("SMALL_ID", r"#define SMALL_ID (\d+)"),
        ("SMALL_INTS", r"#define SMALL_INTS (\d+)"),
        ("FIRST_CAP", r"\*cap \? \*cap : (\d+)"),
    ):
        match = re.search(pattern, text)
        assert match, f"{pattern} is no longer in {SOURCE.name}"
        found[name] = int(match[1])
    return found


def capacities() -> list[int]:
    """Every capacity an array can have, up to LARGEST: grow()'s first one, doubled."""
    cap, found = constants()["FIRST_CAP"], []
    while cap <= LARGEST:
        found.append(cap)
        cap *= 2
    return found


def text(value: str) -> bytes:
    raw = value.encode()
    return b"\x8c" + bytes([len(raw)]) + raw


def global_(module: str, name: str) -> bytes:
    return text(module) + text(name) + b"\x93"


def state(**fields: bytes) -> bytes:
    return b"}" + b"".join(text(k) + v + b"s" for k, v in fields.items())


# What each trigger pushes before its growing opcode, then that opcode and STOP.
TRIGGERS: dict[str, bytes] = {
    "reduce_path": global_("pathlib", "PosixPath") + text("x") + b"\x85R.",
    "reduce_size": global_("torch", "Size") + b"K\x01K\x02\x86\x85R.",
    "reduce_memory_format_no_args": global_(MODULE, "_MEM_FORMAT_ENCODING") + b")R.",
    "reduce_memory_format": global_(MODULE, "_MEM_FORMAT_ENCODING") + b"K\x01\x85R.",
    "reduce_layout": global_("torch.serialization", "_get_layout")
    + text("torch.strided")
    + b"\x85R.",
    "newobj": global_(MODULE, "Metadata") + b")\x81.",
    "build_dict": global_(MODULE, "StorageMeta") + b")\x81" + state(save_id=text("a")) + b"b.",
    "build_tuple": global_(MODULE, "TensorProperties") + b")\x81(K\x01K\x02K\x03K\x04K\x05tb.",
    "stack_global": global_(MODULE, "ChunkStorageMetadata") + b".",
    "dtype": global_("torch", "float32") + b".",
    "string": text("s") + b".",
    "big_int": b"J\xff\xff\xff\x7f.",
    "long1": b"\x8a\x08" + struct.pack("<q", -(2**62)) + b".",
    "tuple_mark": b"(K\x01K\x02K\x03t.",
    "tuple3": b"K\x01K\x02K\x03\x87.",
    "list_append": b"]K\x01a.",
    "list_appends": b"](K\x01K\x02K\x03e.",
    "dict_setitems": b"}(" + text("k") + b"K\x01" + text("l") + b"K\x02u.",
    "memoize_get": b"]\x94h\x00j\x00\x00\x00\x00.",
    "frame": b"\x95\x02\x00\x00\x00\x00\x00\x00\x00N.",
}

# Per array: the filler that adds one item to it, and what is there before the filler.
FILLERS: dict[str, tuple[bytes, int]] = {
    "nodes": (b"]", -1),  # EMPTY_LIST: a node (and a stack item); -1: the fixed nodes
    "memo": (b"N\x94", 0),  # a MEMOIZE each
    "pool": (b"K\x00\x85", 0),  # TUPLE1: a pool slot (and a node)
    "stack": (b"N", 0),
    "marks": (b"(", 0),
}

HEADER = b"\x80\x04"


def _before(start: int) -> int:
    """Items in the array before the filler (-1: the fixed nodes, SMALL_ID + SMALL_INTS)."""
    return constants()["SMALL_ID"] + constants()["SMALL_INTS"] if start < 0 else start


def inputs() -> Iterator[tuple[str, bytes]]:
    """(name, pickle) for every array, trigger, capacity and N around it."""
    for array, (filler, start) in FILLERS.items():
        before = _before(start)
        for cap in capacities():
            for n in range(max(0, cap - before - SLACK), max(0, cap - before + SLACK)):
                for name, trigger in TRIGGERS.items():
                    yield f"{array}-{cap}-{n}-{name}", HEADER + filler * n + trigger


def issue_input() -> bytes:
    """The issue's 275-byte .metadata: a PosixPath REDUCE creating the node that fills the
    node array (512 after the 261 fixed ones)."""
    n = 512 - _before(-1) - 5  # pathlib, PosixPath, the global, "x", the 1-tuple
    return HEADER + b"]" * n + TRIGGERS["reduce_path"]
