"""Checking an export at about the cost of one read of the output: digests, not bytes.

What each comparison proves:

- While writing, every tensor gets a CRC-32 of what was meant to be written (``crcs``,
  :func:`~inspector.formats.writing.write_item`): for a plain copy whose source records
  a CRC-32 for exactly those bytes (a DCP item's or a ``.pt``'s storage record), that
  recorded CRC, combined over the tensor's chunks, so the bytes are not read at all: it
  is what the *producer* saved. For other copies, the CRC of the source bytes read
  beside the kernel's copy; for conversions, of the produced tensor in hand.
- Verifying re-opens the output and re-reads each tensor's bytes into a CRC: equal to
  the write-time CRC means the output holds exactly those bytes. A flipped byte in the
  output, a torn write or a wrong offset differs; so does a source damaged before the
  copy when its recorded CRC stood in (the copy of damaged bytes misses the producer's
  CRC); so do bytes that changed under a copy (the kernel's copy and the CRC's read disagree).
- A change to the source after its bytes were read cannot show in any digest of the
  output. The source files' stamps (size, mtime, ctime, inode) are taken before writing
  and compared now: when one changed, every tensor is also checked against the source as
  it is now (re-read, or re-produced for conversions), so a changed source is reported as
  the tensors it changed, never silently accepted. (Changes that leave a file's stamp
  alone, such as bit rot on the disk itself, are what the source's own CRCs are for.)
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from inspector.errors import InspectorError
from inspector.exporting.plan import Planned
from inspector.formats.base import bytes_view
from inspector.formats.writing import Item, produced
from inspector.storage.base import ByteRange
from inspector.storage.digest import Stamp, crc32, ranges_crc, stamps

if TYPE_CHECKING:
    from inspector.checkpoint import Checkpoint

_READERS = 4  # tensors re-read at once while verifying (each holds one 8 MiB block)


@dataclass(frozen=True)
class Verification:
    """How the output compared: tensors checked, those that differ (and why), seconds taken."""

    checked: int
    mismatched: tuple[str, ...]
    seconds: float
    reasons: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.mismatched

    def __str__(self) -> str:
        if self.ok:
            return f"verified {self.checked} tensors bit-exact in {self.seconds:.1f} s"
        shown = "; ".join(f"{k}: {self.reasons.get(k, 'differs')}" for k in self.mismatched[:3])
        return f"{len(self.mismatched)} of {self.checked} tensors differ: {shown}"


class SourceState:
    """The stamps of a checkpoint's files at one moment (taken before an export reads them)."""

    def __init__(self, ck: Checkpoint) -> None:
        self.storage = ck.source.storage
        self.stamps: dict[str, Stamp | None] = stamps(self.storage, ck.source_files)

    def changed(self) -> list[str]:
        """The files whose stamp differs now."""
        now = stamps(self.storage, self.stamps)
        return [name for name, stamp in self.stamps.items() if now[name] != stamp]


def verify(
    path: Path,
    planned: list[Planned],
    nested: bool,
    progress: Callable[[Item], None],
    crcs: dict[str, int],
    before: SourceState,
) -> Verification:
    """Re-open ``path`` and compare each planned tensor's bytes with the CRC-32 they were
    written with (``progress`` per tensor); re-check against the source if it changed."""
    started = time.perf_counter()
    reasons = problems(path, planned, nested, progress, crcs, before.changed())
    return Verification(len(planned), tuple(reasons), time.perf_counter() - started, reasons)


def problems(
    path: Path | str,
    planned: Sequence[Planned],
    nested: bool,
    progress: Callable[[Item], None],
    crcs: Mapping[str, int],
    changed: Sequence[str],
) -> dict[str, str]:
    """Why each of the ``planned`` tensors of the output ``path`` differs (the tensors that
    do not), checked against the source too when source files ``changed``; one share of a
    verification split across processes."""
    from inspector.checkpoint import open as open_checkpoint

    written = open_checkpoint(path)

    def check(p: Planned) -> str | None:
        key = ".".join(map(str, p.path)) if nested else p.item.name
        return _written_problem(written, key, p.item, crcs[p.item.name])

    reasons = {}
    for p, reason in _ahead(check, planned):
        if reason is None and changed:
            reason = _source_problem(p.item, crcs[p.item.name], list(changed))
        if reason is not None:
            reasons[p.item.name] = reason
        progress(p.item)
    return reasons


def _ahead(
    check: Callable[[Planned], str | None], planned: Sequence[Planned]
) -> Iterator[tuple[Planned, str | None]]:
    """``(p, check(p))`` in order, the next few checks already running in threads (reads and
    CRC-32s release the GIL); stopping early (a cancel) waits only for those few."""
    readers = min(_READERS, os.cpu_count() or 1)
    pool = ThreadPoolExecutor(readers, "inspector-verify")
    queued: deque[tuple[Planned, Future[str | None]]] = deque()
    try:
        for p in planned:
            queued.append((p, pool.submit(check, p)))
            if len(queued) > readers:
                first, done = queued.popleft()
                yield first, done.result()
        while queued:
            first, done = queued.popleft()
            yield first, done.result()
    finally:
        pool.shutdown(cancel_futures=True)


def _written_problem(written: Checkpoint, key: str, item: Item, crc: int) -> str | None:
    """Why the output's tensor ``key`` is not what was written, or None."""
    if key not in written:
        return "missing from the output"
    entry = written.stored_entry(key)  # a quantized weight's stored part, not its value
    if (entry.dtype, entry.shape) != (item.dtype, item.shape):
        return f"output holds {entry.dtype} {list(entry.shape or ())}"
    ranges = written.byte_ranges(key, stored=True)
    if ranges is None:
        return "output bytes are not plain"
    found = ranges_crc(ranges)
    return None if found == crc else _differs(item, found)


def _differs(item: Item, found: int) -> str:
    """Which side is wrong when the output misses its write-time CRC: a source whose own
    recorded CRC stood in may itself hold other bytes (then the output copied them)."""
    ranges = _copied(item)
    if ranges and all(r.crc is not None for r in ranges) and ranges_crc(ranges) == found:
        return "the source's bytes do not match the CRC-32 it records for them (damaged source)"
    return "output bytes differ from those written (CRC-32)"


def _copied(item: Item) -> list[ByteRange] | None:
    """The source ranges a plain copy of ``item`` reads (None when it is produced)."""
    ranges = item.ranges() if item.ranges is not None else None
    return ranges if ranges is not None and sum(r.length for r in ranges) == item.nbytes else None


def _source_problem(item: Item, crc: int, changed: list[str]) -> str | None:
    """Why the source, which changed since it was read, no longer gives these bytes."""
    try:
        ranges = _copied(item)
        if ranges is not None:
            now = ranges_crc(ranges)
        else:
            tensor = produced(item)
            now = crc32(bytes_view(tensor)) if tensor.numel() else 0
    except InspectorError as exc:
        return f"source changed since it was read ({', '.join(changed[:3])}): {exc.reason}"
    if now != crc:
        return f"source changed since it was read ({', '.join(changed[:3])})"
    return None

