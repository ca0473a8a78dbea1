"""CRC-32 digests of stored bytes: computed fast (ISA-L), combined without the bytes, and
re-read from a storage; and stamps that tell whether a file changed since a moment.

The CRC-32 is zip's (and ``zlib.crc32``'s), so a digest compares with the CRC a torch
archive records for a storage record. ``crc32_combine(a, b, len_b)`` is the CRC of two
byte strings joined, from their CRCs alone (the GF(2) matrix method).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from isal.isal_zlib import crc32, crc32_combine

from inspector.errors import InspectorError
from inspector.storage.base import ByteRange, Storage

__all__ = ["Stamp", "crc32", "crc32_combine", "range_crc", "ranges_crc", "stamps"]

# (size, mtime_ns, ctime_ns, inode) of a local file; (size,) where the storage tells no more.
Stamp = tuple[int, ...]


def range_crc(source: ByteRange, start: int = 0) -> int:
    """The CRC-32 of ``source``'s bytes (continuing ``start``), streamed by the storage's blocks."""
    value = start
    for block in source.storage.blocks(source.name, source.offset, source.length):
        value = crc32(block, value)
    return value


def ranges_crc(ranges: Iterable[ByteRange]) -> int:
    """The CRC-32 of the ranges' bytes, concatenated."""
    value = 0
    for byte_range in ranges:
        value = range_crc(byte_range, value)
    return value


def stamps(storage: Storage, names: Iterable[str]) -> dict[str, Stamp | None]:
    """Each file's stamp now (None: gone or unreadable). Writing a file changes its stamp:
    the kernel sets mtime and ctime (no user can set ctime back)."""
    found: dict[str, Stamp | None] = {}
    for name in names:
        path = storage.local_path(name)
        try:
            if path is not None:
                info = os.stat(path)
                found[name] = (info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_ino)
            else:
                found[name] = (storage.size(name),)
        except (OSError, ValueError, InspectorError):
            found[name] = None
    return found
