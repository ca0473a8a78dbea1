"""Are the checkpoint's bytes the ones that were written? Files present and long enough,
every record's CRC-32 checked against its bytes.

The format lists its records (``Source.stored_records``: file, byte range, stored CRC);
this module only reads bytes and compares. Each file is read once, front to back, in
large blocks (``BlockReader``), so checking costs about what reading the files and
computing their CRC-32 costs, in memory of one block.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from inspector.analysis.findings import Problem
from inspector.errors import InspectorError
from inspector.formats.base import Source, StoredRecord, chunk_records
from inspector.storage.blocks import BlockReader


@dataclass
class IntegrityCounts:
    """What the integrity check covered (``AuditReport.checked``)."""

    files: int = 0
    records: int = 0
    verified: int = 0  # records whose CRC-32 matched
    unchecked: int = 0  # saved with CRC-32 turned off
    without_checksum: int = 0  # the format keeps none (sizes and offsets checked only)
    bytes_checksummed: int = 0


_NOT_VERIFIED = {
    "unchecked": "saved without CRC-32 (torch.serialization.set_crc32_options(False)): "
    "their bytes cannot be verified",
    "no-checksums": "without checksums in this format: sizes and offsets checked, not the bytes",
}


def check_integrity(
    source: Source, *, checksums: bool = True, advance: Callable[[int], None] | None = None
) -> tuple[list[Problem], IntegrityCounts]:
    """Problems with the source's files and records, and what was covered. ``checksums``:
    also read every record with a stored CRC-32 and compare; ``advance(n)`` is told of
    each ``n`` bytes read (progress)."""
    check = _Check(source, checksums, advance)
    listed = getattr(source, "stored_records", None)  # a format that lists none: its chunks
    check.run(listed() if listed is not None else chunk_records(source))
    return check.problems, check.counts


class _Check:
    def __init__(
        self, source: Source, checksums: bool, advance: Callable[[int], None] | None
    ) -> None:
        self.storage = source.storage
        self.referrer = source.storage.describe(source.name)
        self.checksums, self.advance = checksums, advance
        self.reader = BlockReader(self.storage)
        self.sizes: dict[str, int | str] = {}
        self.tallies: dict[tuple[str, str], tuple[list[int], set[str]]] = {}
        self.problems: list[Problem] = []
        self.counts = IntegrityCounts()

    def run(self, records: Iterable[StoredRecord]) -> None:
        for record in records:
            self.counts.records += 1
            self.one(record)
        self.counts.files = len(self.sizes)
        self.problems.extend(self._summaries())

    def one(self, record: StoredRecord) -> None:
        size = self._size(record.file)
        end = record.offset + record.length
        if isinstance(size, str):
            self._add(record, "missing-file", f"{record.what}: {size}")
        elif record.problem:
            self._add(record, "damaged", f"{record.what}: {record.problem}")
        elif end > size:
            self._add(
                record,
                "truncated",
                f"{record.file} has {size:,} bytes but {record.what} ends at byte {end:,}: "
                "the file is truncated (or the metadata belongs to another save)",
            )
        elif record.crc32 is None:
            self._tally(record, "no-checksums")
            self.counts.without_checksum += 1
        elif self.checksums:
            self._verify(record, size)

    def _verify(self, record: StoredRecord, size: int) -> None:
        crc = 0
        try:
            for piece in self.reader.pieces(record.file, record.offset, record.length, end=size):
                crc = zlib.crc32(piece, crc)
        except InspectorError as exc:  # the file changed or went away while being read
            self._add(record, "truncated", f"{record.what}: {exc.reason}")
            return
        self.counts.bytes_checksummed += record.length
        if self.advance is not None:
            self.advance(record.length)
        if crc == record.crc32:
            self.counts.verified += 1
        elif record.crc32 == 0:
            self._tally(record, "unchecked")
            self.counts.unchecked += 1
        else:
            self._add(
                record,
                "crc-mismatch",
                f"{record.what} (bytes {record.offset:,}..{record.offset + record.length:,} of "
                f"{record.file}) fails its CRC-32 check: stored {record.crc32:08x}, the bytes "
                f"give {crc:08x}; they changed after they were written",
            )

    def _size(self, file: str) -> int | str:
        if file not in self.sizes:
            try:
                name = self.storage.check(file, referrer=self.referrer)
                self.sizes[file] = self.storage.size(name)
            except InspectorError as exc:
                joined = f" {exc.reason}" if exc.reason.startswith("is ") else f": {exc.reason}"
                self.sizes[file] = f"file {file}{joined}"
        return self.sizes[file]

    def _tally(self, record: StoredRecord, kind: str) -> None:
        count, keys = self.tallies.setdefault((record.file, kind), ([0], set()))
        count[0] += 1
        if record.key is not None:
            keys.add(record.key)

    def _add(self, record: StoredRecord, kind: str, message: str) -> None:
        self.problems.append(Problem(record.key, record.file, kind, message))

    def _summaries(self) -> list[Problem]:
        """One line per file and kind for what could not be verified (not damage)."""
        found = []
        for (file, kind), (count, keys) in self.tallies.items():
            owners = f" ({_count(len(keys), 'key')})" if keys else ""
            message = f"{_count(count[0], 'record')} in {file}{owners} {_NOT_VERIFIED[kind]}"
            found.append(Problem(None, file, kind, message))
        return found


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"
