"""What a format's writer is handed: one tensor at a time, as bytes to copy or to produce."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from inspector import dtypes
from inspector.errors import ExportError
from inspector.formats.base import bytes_view
from inspector.storage.base import ByteRange
from inspector.storage.copy import copy_range, write_all
from inspector.storage.digest import crc32, crc32_combine

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Item:
    """One tensor to write: its name, final dtype (a name) and shape, and how to get it.

    ``produce()`` makes the tensor; ``ranges()``, when given and it returns ranges, are
    its stored bytes, copied file to file as they are (no conversion needed, no torch).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]
    ranges: Callable[[], list[ByteRange] | None] | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtypes.itemsize(self.dtype)


def write_item(fd: int, item: Item, *, crc: bool) -> int:
    """Write the item's bytes at the fd's position; returns their CRC-32 when asked (else 0).

    Copied bytes whose source records their CRC-32 are not read at all: that CRC (combined
    over the item's ranges) stands for them, so the digest is what the producer saved.
    Other copied bytes are checksummed while the kernel copies them; produced ones from
    the tensor in hand.
    """
    ranges = item.ranges() if item.ranges is not None else None
    if ranges is not None and sum(r.length for r in ranges) == item.nbytes:
        value = 0
        for byte_range in ranges:
            if crc and byte_range.crc is not None:
                copy_range(byte_range, fd)
                value = crc32_combine(value, byte_range.crc, byte_range.length)
            else:
                value = copy_range(byte_range, fd, value if crc else None)
        return value
    tensor = produced(item)
    if not tensor.numel():
        return 0
    data = bytes_view(tensor)
    write_all(fd, data)
    return crc32(data) if crc else 0


def produced_ahead(items: Sequence[Item]) -> Iterator[Item]:
    """``items`` in order, each one made by ``produce()`` (no stored bytes to copy) made in
    a thread while the caller writes the one before it, when that one was made so too:
    converting overlaps writing, one tensor ahead at most, and items are still produced in
    order, one at a time (a weight's FP8 values before its scale)."""
    from concurrent.futures import Future, ThreadPoolExecutor

    pool = ThreadPoolExecutor(1, "inspector-produce")
    futures: dict[int, Future[torch.Tensor]] = {}

    def submit(index: int) -> None:
        if index < len(items) and items[index].ranges is None and index not in futures:
            futures[index] = pool.submit(items[index].produce)

    def taken(box: list[Future[torch.Tensor]]) -> torch.Tensor:
        return box.pop().result()  # forgets the tensor: the writer holds the only reference

    try:
        for index, item in enumerate(items):
            submit(index)
            if index in futures:
                submit(index + 1)
            if index in futures:
                box = [futures.pop(index)]
                item = dataclasses.replace(item, produce=functools.partial(taken, box))
            yield item
    finally:
        pool.shutdown(wait=False, cancel_futures=True)


def produced(item: Item) -> torch.Tensor:
    """``item.produce()``, checked to be what was planned, contiguous."""
    tensor = item.produce()
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype != item.dtype or tuple(tensor.shape) != item.shape:
        raise ExportError(
            f"produced {dtype} {list(tensor.shape)}, planned {item.dtype} {list(item.shape)}",
            key=item.name,
        )
    return tensor.contiguous()
