"""The interface every place checkpoint bytes can live in provides, and its read counters.

Formats address files by a name relative to a :class:`Storage` (a folder), never by an
OS path: a local folder and an ``s3://`` prefix take the same code path above this layer.
Call order for a reader: ``kind``/``size``/``list`` to find files, then ``read`` (small
files, headers), ``window`` (a bounded seekable view, e.g. a zip item inside a ``.distcp``)
or ``read_into`` (tensor bytes straight into their buffer).
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Literal, Protocol

from inspector.errors import CorruptCheckpointError, UnsafeCheckpointError

Kind = Literal["file", "dir"]
# What a folder listing says of an entry: "other" is anything else (a FIFO, a device, a
# socket, a link that loops or leads nowhere), listed so a reader can refuse it by name.
Listed = Literal["file", "dir", "other"]
# A readable, seekable byte stream: a storage window (raw) or bytes in memory (buffered).
Window = io.RawIOBase
Stream = io.RawIOBase | io.BufferedIOBase


@dataclass(frozen=True, slots=True)
class IOCount:
    """Bytes and requests read so far (``ck.io``)."""

    bytes: int = 0
    requests: int = 0


class IOCounter:
    """Thread-safe running totals behind :class:`IOCount`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes = self._requests = 0

    def add(self, nbytes: int, requests: int = 1) -> None:
        with self._lock:
            self._bytes += nbytes
            self._requests += requests

    @property
    def count(self) -> IOCount:
        return IOCount(self._bytes, self._requests)


class WindowBase(io.RawIOBase):
    """Bytes ``[0, _length)`` of a window as a raw stream: position, seeks and reads bounded
    by the window; subclasses fill ``readinto`` from where the bytes live."""

    _length: int
    _pos: int

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        left = max(0, self._length - self._pos)
        return super().read(left if size is None or size < 0 else min(size, left)) or b""


class WindowReader(io.BufferedReader):
    """Buffered reading of a window of ``length`` bytes (for pickles read in place, which
    read a few bytes at a time). ``read(n)`` is clamped to the bytes left first:
    BufferedReader itself reserves ``n`` bytes, and ``n`` may come from damaged data."""

    def __init__(self, raw: io.RawIOBase, length: int, buffer_size: int = 1 << 16) -> None:
        super().__init__(raw, buffer_size=buffer_size)
        self._end = length

    def read(self, size: int | None = -1) -> bytes:
        left = max(0, self._end - self.tell())
        return super().read(left if size is None or size < 0 else min(size, left))


@dataclass(frozen=True, slots=True)
class ByteRange:
    """``length`` bytes at ``offset`` of file ``name`` in ``storage``; ``crc`` is the CRC-32
    the file itself records for exactly these bytes (a zip record's), when it records one."""

    storage: Storage
    name: str
    offset: int
    length: int
    crc: int | None = None


class Storage(Protocol):
    """A folder of checkpoint files. Names are relative (``"__0_0.distcp"``, ``"sub/a.bin"``)
    and checked to stay inside it; errors are InspectorErrors that name the file."""

    location: str  # what to show: a path or URL, never with credentials
    io: IOCounter

    def describe(self, name: str) -> str:
        """Where ``name`` is, for messages (``location/name``)."""
        ...

    def check(self, name: object, *, referrer: str, key: str | None = None) -> str:
        """``name`` normalised, if it is a plain relative name that stays inside this folder
        (no absolute path, no ``..``, no link leading out); else UnsafeCheckpointError."""
        ...

    def kind(self, name: str = "") -> Kind | None:
        """``"file"`` (a regular file), ``"dir"``, or None (missing, or something else)."""
        ...

    def size(self, name: str) -> int: ...

    def list(self, name: str = "") -> list[tuple[str, Listed]]:
        """The folder's entries (name, kind), sorted; special files are ``"other"``."""
        ...

    def read(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        """Exactly ``length`` bytes at ``offset`` (to the end when None); a short file is a
        CorruptCheckpointError."""
        ...

    def read_into(self, name: str, offset: int, buffer: memoryview) -> None:
        """Fill ``buffer`` from ``offset``; a short file is a CorruptCheckpointError."""
        ...

    def window(self, name: str, offset: int, length: int) -> Window:
        """A read-only, unbuffered, seekable stream over bytes ``[offset, offset+length)``;
        reads past the window return nothing. Close it when done."""
        ...

    def child(self, name: str) -> Storage:
        """The sub-folder ``name``."""
        ...

    def local_path(self, name: str) -> Path | None:
        """The OS path of ``name`` when it is local (lets writers copy in the kernel)."""
        ...

    def blocks(self, name: str, offset: int, length: int) -> Iterator[memoryview]:
        """``length`` bytes at ``offset`` in order, in blocks (each valid until the next is
        asked for): how copies and checks stream a range in bounded memory."""
        ...

    def prefetch(self, ranges: Sequence[ByteRange]) -> AbstractContextManager[None]:
        """A hint: reads inside ``ranges`` follow, until the context ends. A remote storage
        fetches them at once (neighbours coalesced, concurrently); a local one does nothing.
        Never changes what a read returns."""
        ...


def relative_name(relative: object, *, referrer: str, key: str | None) -> PurePosixPath:
    """``relative`` as a POSIX name that stays inside a folder: refuses absolute paths, drive
    letters, ``..`` and NUL bytes (links are the storage's own business)."""
    if not isinstance(relative, str) or not relative or "\x00" in relative:
        raise CorruptCheckpointError(f"bad file name {relative!r}", file=referrer, key=key)
    parts = PurePosixPath(relative.replace("\\", "/"))
    if parts.is_absolute() or PureWindowsPath(relative).drive or ".." in parts.parts:
        raise UnsafeCheckpointError(
            f"file name {relative!r} points outside the checkpoint folder", file=referrer, key=key
        )
    return parts
