"""Checking an export: the output re-opened and compared, tensor by tensor, with what was
meant to be written (the source's bytes for copies, a fresh production for conversions)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inspector.exporting.plan import Planned
from inspector.formats.base import bytes_view
from inspector.formats.writing import Item
from inspector.storage.base import ByteRange

if TYPE_CHECKING:
    from inspector.checkpoint import Checkpoint

@dataclass(frozen=True)
class Verification:
    """How the output compared: tensors checked, those that differ, seconds taken."""

    checked: int
    mismatched: tuple[str, ...]
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.mismatched

    def __str__(self) -> str:
        if self.ok:
            return f"verified {self.checked} tensors bit-exact in {self.seconds:.1f} s"
        shown = list(self.mismatched[:5])
        return f"{len(self.mismatched)} of {self.checked} tensors differ: {shown}"


def verify(
    path: Path, planned: list[Planned], nested: bool, progress: Callable[[Item], None]
) -> Verification:
    """Re-open ``path`` and compare each planned tensor's bytes (``progress`` per tensor)."""
    from inspector.checkpoint import open as open_checkpoint

    started = time.perf_counter()
    written = open_checkpoint(path)
    mismatched = []
    for p in planned:
        key = ".".join(map(str, p.path)) if nested else p.item.name
        if not _written_as_planned(written, key, p.item):
            mismatched.append(p.item.name)
        progress(p.item)
    return Verification(len(planned), tuple(mismatched), time.perf_counter() - started)


def _written_as_planned(written: Checkpoint, key: str, item: Item) -> bool:
    if key not in written:
        return False
    entry = written.entry(key)
    if (entry.dtype, entry.shape) != (item.dtype, item.shape):
        return False
    ours = written.byte_ranges(key)
    source = item.ranges() if item.ranges is not None else None
    if ours is None:
        return False
    if source is not None:
        return _same_stream(_range_blocks(ours), _range_blocks(source))
    tensor = item.produce().contiguous()
    return _same_stream(_range_blocks(ours), iter([bytes_view(tensor)]))


def _range_blocks(ranges: list[ByteRange]) -> Iterator[memoryview]:
    """The ranges' bytes in blocks, each valid until the next is taken (as _same_stream does)."""
    for r in ranges:
        yield from r.storage.blocks(r.name, r.offset, r.length)


def _same_stream(a: Iterator[Any], b: Iterator[Any]) -> bool:
    """Whether two streams of byte blocks (cut anywhere) hold the same bytes."""
    left, right = memoryview(b""), memoryview(b"")
    while True:
        if not left:
            left = memoryview(next(a, b"")).cast("B")
        if not right:
            right = memoryview(next(b, b"")).cast("B")
        if not left or not right:
            return not left and not right
        n = min(len(left), len(right))
        if left[:n] != right[:n]:
            return False
        left, right = left[n:], right[n:]
