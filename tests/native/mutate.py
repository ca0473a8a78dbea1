"""Structure-aware mutations of a pickle, aimed at the native decoders' weak spots: memo
indices re-pointed (0, the last, one past it, the byte and word limits), filler runs that
bring the node, memo, pool, stack or mark count to a capacity (a power of two, see
boundaries.py) just before an opcode, FRAME lengths at and around the data's end and
2^63 / 2^64 - 1, deep nesting, and plain byte changes."""

from __future__ import annotations

import pickletools
import random
import shutil
import struct
from pathlib import Path

from tests.native import boundaries

FRAME_LENGTHS = (0, 1, 7, 8, 2**31, 2**32, 2**63 - 1, 2**64 - 1)


def ops(data: bytes) -> list[tuple[str, int, object]]:
    """(opcode name, position, argument) of each opcode, as far as the pickle parses."""
    found = []
    try:
        for op, arg, pos in pickletools.genops(data):
            found.append((op.name, pos or 0, arg))
    except Exception:  # a damaged pickle: its readable prefix
        pass
    return found or [("PROTO", 0, 4)]


def _memo(data: bytes, ops: list, rng: random.Random) -> bytes:
    gets = [(n, p) for n, p, _ in ops if n in ("BINGET", "LONG_BINGET")]
    if not gets:
        return data
    name, pos = rng.choice(gets)
    memoized = sum(1 for n, _, _ in ops if n == "MEMOIZE")
    index = rng.choice((0, memoized - 1, memoized, memoized + 1, 255, 256, 2**31, 2**32 - 1))
    if name == "BINGET" and 0 <= index < 256:
        return data[:pos] + b"h" + bytes([index]) + data[pos + 2 :]
    return data[:pos] + b"j" + struct.pack("<I", max(0, index) % 2**32) + data[pos + 2 :]


def _fill(data: bytes, ops: list, rng: random.Random) -> bytes:
    filler, _ = rng.choice(list(boundaries.FILLERS.values()))
    cap = rng.choice(boundaries.capacities()[:6])
    count = max(0, cap - rng.randrange(0, 300))
    _, pos, _ = rng.choice(ops)
    return data[:pos] + filler * count + data[pos:]


def _frame(data: bytes, ops: list, rng: random.Random) -> bytes:
    frames = [p for n, p, _ in ops if n == "FRAME"]
    pos = rng.choice(frames) if frames and rng.random() < 0.7 else rng.choice(ops)[1]
    left = len(data) - pos - 9
    length = rng.choice((*FRAME_LENGTHS, left - 1, left, left + 1, max(0, left) // 2))
    new = b"\x95" + struct.pack("<Q", length % 2**64)
    return data[:pos] + new + data[pos + (9 if pos in frames else 0) :]


def _nest(data: bytes, ops: list, rng: random.Random) -> bytes:
    depth = rng.choice((1, 63, 64, 65, 255, 256, 1000))
    first, last = sorted(rng.sample(range(len(ops)), 2)) if len(ops) > 1 else (0, 0)
    start, end = ops[first][1], ops[last][1]
    opener, closer = rng.choice(((b"(", b"t"), (b"]", b"a"), (b"(", b"l"), (b"}(", b"u")))
    return data[:start] + opener * depth + data[start:end] + closer * depth + data[end:]


def _bytes(data: bytes, ops: list, rng: random.Random) -> bytes:
    if not data:
        return bytes([rng.randrange(256)])
    at = rng.randrange(len(data))
    if rng.random() < 0.5:
        return data[:at] + bytes([rng.randrange(256)]) + data[at + 1 :]
    n = rng.randrange(1, 16)
    return data[:at] + data[at : at + n] * rng.randrange(2, 5) + data[at + n :]


MUTATIONS = (_memo, _fill, _frame, _nest, _bytes)


def mutant(data: bytes, rng: random.Random, parsed: list | None = None) -> bytes:
    """`data` changed once (mostly) to three times; `parsed`: its ops(), if known."""
    for k in range(rng.choice((1, 1, 1, 2, 3))):
        data = rng.choice(MUTATIONS)(data, parsed if k == 0 and parsed else ops(data), rng)
    return data


def place(folder: Path, work: Path, data: bytes) -> Path:
    """A copy of the checkpoint `folder` under `work` (made once) with `data` as its .metadata."""
    copy = work / folder.name
    if not copy.exists():
        shutil.copytree(folder, copy)
    (copy / ".metadata").write_bytes(data)
    return copy
