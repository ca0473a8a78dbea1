"""Reading many byte ranges of a storage's files in large blocks, each byte once.

Checksums and content hashes need every byte of many records, most of them small and back
to back (a DCP item is a handful of zip records). Reading each record on its own costs a
request per record; reading a file whole costs memory. ``BlockReader`` reads one reused
block at a time and hands out views into it, so consecutive records share one read and
memory stays at one block whatever the file's size.
"""

from __future__ import annotations

from collections.abc import Iterator

from inspector.storage.base import Storage

BLOCK = 1 << 22  # 4 MiB: per-read costs vanish, and the block is still in cache when checked


class BlockReader:
    """Views of byte ranges of ``storage``'s files, read through one reused block (of at
    most ``block`` bytes, grown as reads need it).

    ``pieces`` hands out successive views of a range; a view is valid until the next one is
    asked for. Ranges asked for in increasing offset within a file are read once: a read
    fills the block ahead (up to ``end``, the file's size, when given) so the ranges after
    it come from memory.
    """

    def __init__(self, storage: Storage, block: int = BLOCK) -> None:
        self.storage, self.block = storage, block
        self._view = memoryview(bytearray())  # grown on demand, up to ``block``
        self._file: str | None = None
        self._start = self._stop = 0

    def pieces(
        self, name: str, offset: int, length: int, *, end: int | None = None
    ) -> Iterator[memoryview]:
        """Bytes ``[offset, offset + length)`` of ``name``, as views in order; with ``end``
        the block is filled ahead to at most byte ``end`` (else only the range is read)."""
        position, stop = offset, offset + length
        limit = stop if end is None else max(stop, end)
        while position < stop:
            if not (self._file == name and self._start <= position < self._stop):
                self._fill(name, position, min(self.block, limit - position))
            take = min(stop, self._stop) - position
            yield self._view[position - self._start : position - self._start + take]
            position += take

    def _fill(self, name: str, offset: int, length: int) -> None:
        self._file = None  # a failed read leaves nothing cached
        if len(self._view) < length:
            self._view = memoryview(bytearray(min(self.block, max(length, 2 * len(self._view)))))
        self.storage.read_into(name, offset, self._view[:length])
        self._file, self._start, self._stop = name, offset, offset + length
