"""Hand-written pickle opcodes spliced into genuine pickles, and torch zips rewritten around
them: what a hostile author does to a real ``data.pkl`` or ``.metadata``.

Genuine pickles are produced with protocol 2 (no frames), so bytes can be swapped in
place: a marker string the producer pickled (``BINUNICODE``) is replaced by opcodes that
leave one object on the stack, and the producer's own ``BINPUT`` after it memoizes that
object instead.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import struct
import zipfile
from pathlib import Path
from typing import Any

import torch

MARKER = "HOSTILE-MARKER"

EMPTY_DICT, EMPTY_LIST, EMPTY_TUPLE = b"}", b"]", b")"
SETITEM, APPEND, BUILD, REDUCE, POP, MARK, TUPLE, TUPLE1, TUPLE2 = (
    b"s",
    b"a",
    b"b",
    b"R",
    b"0",
    b"(",
    b"t",
    b"\x85",
    b"\x86",
)
NONE, NEWTRUE, NEWFALSE = b"N", b"\x88", b"\x89"


def glob(module: str, name: str) -> bytes:
    """``GLOBAL``: push ``module.name`` as the unpickler resolves it."""
    return b"c" + f"{module}\n{name}\n".encode()


def text(value: str) -> bytes:
    raw = value.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def raw_bytes(value: bytes) -> bytes:
    """``SHORT_BINBYTES``/``BINBYTES`` (protocol 3 opcodes; every unpickler accepts them)."""
    if len(value) < 256:
        return b"C" + bytes([len(value)]) + value
    return b"B" + struct.pack("<I", len(value)) + value


def integer(value: int) -> bytes:
    """``BININT`` when it fits, else ``LONG4`` (any size: a 5000-digit int is 2 KB)."""
    if -(1 << 31) <= value < 1 << 31:
        return b"J" + struct.pack("<i", value)
    encoded = pickle.encode_long(value)
    return b"\x8b" + struct.pack("<I", len(encoded)) + encoded


def put(index: int) -> bytes:
    return b"r" + struct.pack("<I", index)


def get(index: int) -> bytes:
    return b"j" + struct.pack("<I", index)


def call(func: bytes, *args: bytes) -> bytes:
    """``func(*args)`` by REDUCE."""
    return func + MARK + b"".join(args) + TUPLE + REDUCE


def dictionary(items: dict[str, bytes]) -> bytes:
    return EMPTY_DICT + b"".join(text(k) + v + SETITEM for k, v in items.items())


def deep_list(depth: int) -> bytes:
    """``[[[...[]...]]]`` nested ``depth`` times, built without recursion (2 bytes a level)."""
    return EMPTY_LIST * (depth + 1) + APPEND * depth


def deep_tuple(depth: int) -> bytes:
    return EMPTY_TUPLE + TUPLE1 * depth


def deep_dict(depth: int) -> bytes:
    """``{'a': {'a': ... {}}}`` nested ``depth`` times."""
    return (EMPTY_DICT + text("a")) * depth + EMPTY_DICT + SETITEM * depth


def memo_top(data: bytes) -> int:
    """One past the largest memo index the pickle uses (free slots for spliced opcodes)."""
    top = -1
    for opcode, arg, _ in pickletools.genops(data):
        if opcode.name in ("PUT", "BINPUT", "LONG_BINPUT"):
            top = max(top, int(arg))
    return top + 1


class Reduce:
    """Pickles as ``func(*args)``, then ``BUILD`` with ``state`` when given."""

    def __init__(self, func: Any, args: tuple, state: Any = None) -> None:
        self.func, self.args, self.state = func, args, state

    def __reduce__(self) -> tuple:
        return (self.func, self.args) if self.state is None else (self.func, self.args, self.state)


_PUTS = ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE")
_GETS = ("GET", "BINGET", "LONG_BINGET")


def relocate(sub: bytes, base: int) -> bytes:
    """The opcodes of pickle ``sub`` without PROTO and STOP, its memo slots moved up by
    ``base`` so they cannot overwrite the slots of the pickle it is spliced into."""
    out, puts = [], 0
    ops = list(pickletools.genops(sub))
    for (opcode, arg, pos), nxt in zip(ops, [*ops[1:], (None, None, len(sub))], strict=True):
        if opcode.name in ("PROTO", "STOP", "FRAME"):
            continue
        if opcode.name in _PUTS:
            index = puts if opcode.name == "MEMOIZE" else int(arg)
            puts += 1
            out.append(put(base + index))
        elif opcode.name in _GETS:
            out.append(get(base + int(arg)))
        else:
            out.append(sub[pos : nxt[2]])
    return b"".join(out)


def embed(host: bytes, value: Any, marker: str = MARKER) -> bytes:
    """``host`` with the pickled ``marker`` replaced by ``value`` as Python pickles it."""
    return splice(host, relocate(pickle.dumps(value, protocol=2), memo_top(host)), marker)


def splice(data: bytes, snippet: bytes, marker: str = MARKER) -> bytes:
    """``data`` with the pickled string ``marker`` replaced by ``snippet``."""
    token = text(marker)
    if data.count(token) != 1:
        raise ValueError(f"{marker!r} is pickled {data.count(token)} times, not once")
    return data.replace(token, snippet)


def append_opcodes(data: bytes, tail: bytes) -> bytes:
    """``tail`` run on the finished object, just before STOP (it must leave the stack as is)."""
    if not data.endswith(b"."):
        raise ValueError("not a pickle ending in STOP")
    return data[:-1] + tail + b"."


# --- torch.save zips ------------------------------------------------------------------------


def torch_saved(value: Any) -> bytes:
    """``torch.save(value)`` as bytes (torch pickles ``data.pkl`` with protocol 2)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def records(archive: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        return {info.filename: z.read(info) for info in z.infolist()}


def data_pkl(archive: bytes) -> bytes:
    return next(v for k, v in records(archive).items() if k.endswith("/data.pkl"))


def rezip(
    archive: bytes,
    replace: dict[str, bytes] | None = None,
    compress: dict[str, int] | None = None,
) -> bytes:
    """The torch zip rewritten by ``zipfile``: records ending in a ``replace`` suffix get new
    bytes, those ending in a ``compress`` suffix that compression (others stay STORED)."""
    replace, compress = replace or {}, compress or {}
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for name, value in records(archive).items():
            for suffix, new in replace.items():
                if name.endswith(suffix):
                    value = new
            kind = next((c for s, c in compress.items() if name.endswith(s)), zipfile.ZIP_STORED)
            dst.writestr(zipfile.ZipInfo(name), value, compress_type=kind)
    return out.getvalue()


def _local_data_start(archive: bytes, suffix: str) -> tuple[zipfile.ZipInfo, int]:
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(suffix))
    name_len, extra_len = struct.unpack_from("<HH", archive, info.header_offset + 26)
    return info, info.header_offset + 30 + name_len + extra_len


def corrupt_compressed(archive: bytes, suffix: str, kind: int) -> bytes:
    """The archive with record ``suffix`` compressed (``ZIP_DEFLATED``/``ZIP_LZMA``) and its
    compressed stream broken: a reserved deflate block type, or garbage after LZMA's
    properties."""
    data = bytearray(rezip(archive, compress={suffix: kind}))
    _, start = _local_data_start(bytes(data), suffix)
    if kind == zipfile.ZIP_DEFLATED:
        data[start] = 0xFF
    else:
        data[start + 9 : start + 40] = b"\xff" * 31
    return bytes(data)


def flag_encrypted(archive: bytes, suffix: str) -> bytes:
    """Record ``suffix`` marked encrypted (general-purpose bit 0, local and central)."""
    data = bytearray(archive)
    info, _ = _local_data_start(archive, suffix)
    data[info.header_offset + 6] |= 1
    at = data.index(b"PK\x01\x02")
    while True:
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", data, at + 28)
        if bytes(data[at + 46 : at + 46 + name_len]).decode().endswith(suffix):
            data[at + 8] |= 1
            return bytes(data)
        at = data.index(b"PK\x01\x02", at + 46 + name_len + extra_len + comment_len)


def with_data_pkl(archive: bytes, pickle_bytes: bytes) -> bytes:
    return rezip(archive, replace={"/data.pkl": pickle_bytes})


def spliced_save(value: Any, snippet: bytes | Reduce, marker: str = MARKER) -> bytes:
    """``torch.save(value)`` whose pickled ``marker`` string became ``snippet`` (opcodes, or
    an object Python pickles)."""
    archive = torch_saved(value)
    host = data_pkl(archive)
    return with_data_pkl(archive, place(host, snippet, marker))


def place(host: bytes, snippet: bytes | Reduce, marker: str = MARKER) -> bytes:
    """``host`` with its pickled ``marker`` replaced by opcodes, or by an object."""
    if isinstance(snippet, bytes):
        return splice(host, snippet, marker)
    return embed(host, snippet, marker)


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path
