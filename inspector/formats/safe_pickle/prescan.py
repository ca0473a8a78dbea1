"""Sizes a pickle claims, checked before the C unpickler acts on them."""

from __future__ import annotations

import os
import pickletools
import re
from collections.abc import Callable, Iterator
from typing import IO, cast

from inspector.errors import CorruptCheckpointError
from inspector.storage.base import Stream

# The C unpickler sizes (and zeroes) its memo table up to the largest index a PUT names, so
# one opcode can take gigabytes; a FRAME announces its length. Genuine pickles number their
# memo entries from 0 and frame their own bytes, so anything beyond the pickle's size is a
# lie. The opcodes are read without building anything: by the C walk of _opscan.c where
# it is built (about 0.5 GB/s), which only ever accepts; whatever it does not accept, and
# every pickle where it is not built, by the Python scan below (runs of fixed-size opcodes
# by one regular expression, the rest one by one), which says what is wrong.


def _code(op: pickletools.OpcodeInfo) -> int:
    return op.code.encode("latin-1")[0]


_OPS = {op.name: _code(op) for op in pickletools.opcodes}
_FIXED = {
    _code(op): op.arg.n if op.arg else 0
    for op in pickletools.opcodes
    if not op.arg or op.arg.n >= 0
}
_VARIABLE = {_code(op): op.arg.n for op in pickletools.opcodes if op.arg and op.arg.n < 0}
_CHECKED = {_OPS["LONG_BINPUT"]: "LONG_BINPUT", _OPS["FRAME"]: "FRAME"}
_LENGTH_BYTES = {
    pickletools.TAKEN_FROM_ARGUMENT1: 1,
    pickletools.TAKEN_FROM_ARGUMENT4: 4,
    pickletools.TAKEN_FROM_ARGUMENT4U: 4,
    pickletools.TAKEN_FROM_ARGUMENT8U: 8,
}
_TWO_LINES = {_OPS["GLOBAL"], _OPS["INST"]}


def _opcode_run() -> re.Pattern[bytes]:
    """Any run of opcodes that need no check: fixed-size ones, and those with a one-byte
    length (spelled out per length, so short strings stay inside the run). Counted
    repeats (``.{n}``) keep the pattern small: it compiles in milliseconds at import.
    Alternatives go most frequent first (zero-argument opcodes as whole runs, one- and
    four-byte arguments, short strings): genuine metadata scans 1.6x faster so."""

    def one_of(codes: list[int]) -> bytes:
        return b"[" + b"".join(re.escape(bytes([c])) for c in codes) + b"]"

    def skip(n: int) -> bytes:
        return b".{%d}" % n if n else b""

    fixed = {c: n for c, n in _FIXED.items() if c not in _CHECKED and c != _OPS["STOP"]}
    by_size = {
        size: one_of([c for c, n in fixed.items() if n == size]) + skip(size)
        for size in sorted(set(fixed.values()))
    }
    short = [c for c, n in _VARIABLE.items() if n == pickletools.TAKEN_FROM_ARGUMENT1]
    lengths = b"|".join(re.escape(bytes([n])) + skip(n) for n in range(256))
    tokens = [by_size.pop(0) + b"+", by_size.pop(1), by_size.pop(4)]
    tokens += [one_of(short) + b"(?:" + lengths + b")", *by_size.values()]
    return re.compile(b"(?:" + b"|".join(tokens) + b")*", re.DOTALL)


_UNCHECKED_RUN = _opcode_run()


def _opscan_table() -> bytes:
    """What ``_opscan.clean`` needs to know of each opcode (see _opscan.c): its kind in the
    high nibble, its argument's size or length width in the low one."""
    fixed, counted, line, two_lines, put, long_binput, frame, stop = range(1, 9)
    special = {"STOP": stop << 4, "PUT": put << 4, "LONG_BINPUT": long_binput << 4 | 4}
    special |= {"FRAME": frame << 4 | 8, "GLOBAL": two_lines << 4, "INST": two_lines << 4}
    table = bytearray(256)
    for op in pickletools.opcodes:
        n = op.arg.n if op.arg else 0
        if op.name in special:
            table[_code(op)] = special[op.name]
        elif n >= 0:
            table[_code(op)] = fixed << 4 | n
        elif n == pickletools.UP_TO_NEWLINE:
            table[_code(op)] = line << 4
        else:
            table[_code(op)] = counted << 4 | _LENGTH_BYTES[n]
    return bytes(table)


_clean: Callable[[bytes, int, int, bytes], bool] | None
try:
    from inspector.formats.safe_pickle._opscan import clean as _clean
except ImportError:  # installed without a C compiler: the Python scan does it all
    _clean = None
_OPSCAN_TABLE = _opscan_table()


def fast_scan_clean(data: bytes, start: int) -> bool | None:
    """Whether the C scan finds the pickle at ``start`` well-formed with no claim beyond its
    size (then the Python scan would too); None without the C scan. False decides nothing."""
    if _clean is None:
        return None
    return bool(_clean(data, start, len(data) - start, _OPSCAN_TABLE))


def _claimed_sizes(data: bytes, start: int) -> Iterator[tuple[str, int]]:
    """(opcode, claimed size) for every LONG_BINPUT, PUT and FRAME of the pickle at byte
    ``start`` of ``data`` (BINPUT's one-byte index needs no check)."""
    i, end, frame_end = start, len(data), 0
    while True:
        run = _UNCHECKED_RUN.match(data, i)
        i = run.end() if run else i
        if i >= end:
            raise ValueError("the pickle ends without a STOP opcode")
        op = data[i]
        if op == _OPS["STOP"]:
            return
        if op in _CHECKED and i + 1 + _FIXED[op] <= end:
            claimed = int.from_bytes(data[i + 1 : i + 1 + _FIXED[op]], "little")
            if op == _OPS["FRAME"]:
                if i < frame_end:  # the C unpickler answers a nested frame with MemoryError
                    raise ValueError(f"a frame begins at byte {i}, inside the previous one")
                frame_end = i + 9 + claimed
            yield _CHECKED[op], claimed
            i += 1 + _FIXED[op]
        elif _VARIABLE.get(op) == pickletools.UP_TO_NEWLINE:
            line_end = data.index(b"\n", i + 1)
            if op == _OPS["PUT"]:
                yield "PUT", int(data[i + 1 : line_end])
            i = line_end + 1
            if op in _TWO_LINES:
                i = data.index(b"\n", i) + 1
        elif op in _VARIABLE:
            width = _LENGTH_BYTES[_VARIABLE[op]]
            length = int.from_bytes(data[i + 1 : i + 1 + width], "little")
            if i + 1 + width + length > end:
                raise ValueError(f"opcode {op:#04x} at byte {i} claims {length} bytes past its end")
            i += 1 + width + length
        else:
            known = "ends inside" if op in _FIXED else "has an unknown"
            raise ValueError(f"the pickle {known} opcode {op:#04x} at byte {i}")


def check_sizes(stream: Stream, *, file: str, key: str | None, data: bytes | None = None) -> int:
    """Refuse the pickle at ``stream``'s position if it claims more than its own size could
    justify (see above); the stream is left where it was. ``data``: the bytes ``stream``
    reads, when in memory (scanned in place, never copied). Returns the pickle's size: the
    most bytes it can use."""
    start = stream.tell()
    if data is not None and fast_scan_clean(data, start):
        return len(data) - start
    if data is not None:
        claims = _claimed_sizes(data, start)
        limit = len(data) - start
    else:  # a pre-1.6 file's pickles, read in place: pickletools finds their ends
        limit = stream.seek(0, os.SEEK_END) - start
        stream.seek(start)
        claims = (
            (op.name, int(arg or 0))
            for op, arg, _ in pickletools.genops(cast(IO[bytes], stream))
            if op.name in ("PUT", "BINPUT", "LONG_BINPUT", "FRAME")
        )
    try:
        for name, claimed in claims:
            if claimed > limit:
                raise CorruptCheckpointError(
                    f"pickle opcode {name} claims {claimed}, more than its {limit} bytes "
                    "could ever need",
                    file=file,
                    key=key,
                )
    except (ValueError, IndexError) as exc:
        raise CorruptCheckpointError(
            f"not a well-formed pickle ({exc})", file=file, key=key
        ) from exc
    finally:
        stream.seek(start)
    return limit
