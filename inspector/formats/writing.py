"""What a format's writer is handed: one tensor at a time, as bytes to copy or to produce."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from inspector import dtypes
from inspector.errors import ExportError
from inspector.formats.base import bytes_view
from inspector.storage.base import ByteRange
from inspector.storage.copy import copy_range, write_all

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
    """Write the item's bytes at the fd's position; returns their CRC-32 when asked."""
    ranges = item.ranges() if item.ranges is not None else None
    if ranges is not None and sum(r.length for r in ranges) == item.nbytes:
        value = 0
        for byte_range in ranges:
            value = copy_range(byte_range, fd, value if crc else None)
        return value
    tensor = produced(item)
    if not tensor.numel():
        return 0
    data = bytes_view(tensor)
    write_all(fd, data)
    return zlib.crc32(data) if crc else 0


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
