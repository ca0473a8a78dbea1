"""The format-independent records of a checkpoint: entries and their chunks (no I/O).

Records are immutable once a format builds them; what is learnt later (a scan's subclass
detections, damage a read finds) lives in the Checkpoint, not in them. Dtypes are names
(:mod:`inspector.dtypes`), so records never need torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from inspector import dtypes

Kind = Literal["tensor", "object"]
COMPONENTS = (
    "model",
    "optimizer",
    "lr_scheduler",
    "dataloader",
    "train_state",
    "loops",
    "callbacks",
    "common",
    "rng",
)


class ChunkInfo(NamedTuple):
    """One stored piece of a tensor: where it sits in the whole tensor and in which file.

    A named tuple: immutable, and cheap to build by the hundred thousand when a large
    ``.metadata`` is opened.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    byte_offset: int
    byte_length: int
    transforms: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True, slots=True)
class Entry:
    """One stored value: a tensor (possibly in chunks) or a non-tensor object.

    ``dtype`` is a dtype name (``"float32"``); ``nested_path`` is the key's path before it
    was joined with dots, e.g. ``("model", "layers.0.wq.weight")``; ``component`` is what it
    belongs to (one of COMPONENTS, or other);
    ``error`` is why it cannot be read, when the format saw that while opening.
    """

    key: str
    kind: Kind
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    chunks: tuple[ChunkInfo, ...] = ()
    nested_path: tuple[Any, ...] = ()
    component: str = "other"
    error: str | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape) if self.shape is not None else 0

    @property
    def nbytes(self) -> int:
        if self.kind != "tensor":
            return sum(c.byte_length for c in self.chunks)
        return self.numel * dtypes.itemsize(self.dtype) if self.dtype is not None else 0

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(c.file for c in self.chunks))


_new = object.__new__
(_key, _kind, _dtype, _shape, _chunks, _nested, _component, _error) = (
    Entry.__dict__[field].__set__ for field in Entry.__slots__
)


def make_entry(
    key: str,
    kind: Kind,
    dtype: str | None = None,
    shape: tuple[int, ...] | None = None,
    chunks: tuple[ChunkInfo, ...] = (),
    nested_path: tuple[Any, ...] = (),
    component: str = "other",
    error: str | None = None,
) -> Entry:
    """``Entry(...)`` for formats that build entries by the hundred thousand: the same frozen
    record, its slots filled directly instead of by the dataclass ``__init__`` (which goes
    through ``object.__setattr__`` per field: 2-3x slower). Pass arguments by position."""
    entry = _new(Entry)
    _key(entry, key)
    _kind(entry, kind)
    _dtype(entry, dtype)
    _shape(entry, shape)
    _chunks(entry, chunks)
    _nested(entry, nested_path)
    _component(entry, component)
    _error(entry, error)
    return entry


def layout_problem(shape: tuple[int, ...], chunks: tuple[ChunkInfo, ...]) -> str | None:
    """Why ``chunks`` do not tile a tensor of ``shape`` exactly (a chunk outside it, elements
    missing or stored twice), or None."""
    if len(chunks) == 1 and chunks[0].sizes == shape and chunks[0].offsets == (0,) * len(shape):
        return None  # the whole tensor in one chunk (most keys): the checks below agree
    for c in chunks:
        ends = zip(c.offsets, c.sizes, shape, strict=True)
        if (
            len(c.offsets) != len(shape)
            or len(c.sizes) != len(shape)
            or any(o < 0 or n < 0 or o + n > dim for o, n, dim in ends)
        ):
            return (
                f"chunk at offsets {list(c.offsets)} size {list(c.sizes)} "
                f"lies outside shape {list(shape)}"
            )
    total, numel = sum(c.numel for c in chunks), math.prod(shape)
    if total != numel:
        return f"chunks hold {total} elements, the tensor has {numel}"
    boxes = [(c.offsets, c.sizes) for c in chunks if c.numel]
    if not shape or len(boxes) < 2:
        return None
    # Sweep along the dimension the chunks are split on most, so disjoint chunks part early.
    dim = max(range(len(shape)), key=lambda d: len({off[d] for off, _ in boxes}))
    boxes.sort(key=lambda box: box[0][dim])
    for i, (a_off, a_size) in enumerate(boxes):
        for b_off, b_size in boxes[i + 1 :]:
            if b_off[dim] >= a_off[dim] + a_size[dim]:
                break
            if all(
                bo < ao + an and ao < bo + bn
                for ao, an, bo, bn in zip(a_off, a_size, b_off, b_size, strict=True)
            ):
                return f"chunks at {list(a_off)} and {list(b_off)} overlap"
    return None
