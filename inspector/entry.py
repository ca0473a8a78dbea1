"""The format-independent description of a checkpoint: entries and their chunks (no I/O)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

Kind = Literal["tensor", "object"]
COMPONENTS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state")


@dataclass(slots=True)  # not frozen: opening builds one per chunk, hundreds of thousands
class ChunkInfo:
    """One stored piece of a tensor: where it sits in the whole tensor and in which file."""

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
class ByteRange:
    """``length`` bytes at ``offset`` of the file at ``path``."""

    path: Path
    offset: int
    length: int


@dataclass(slots=True)
class Entry:
    """One stored value: a tensor (possibly in chunks) or a non-tensor object.

    ``nested_path`` is the key's path before it was joined with dots, e.g.
    ``("model", "layers.0.wq.weight")``; ``component`` is what it belongs to
    (model / optimizer / lr_scheduler / dataloader / train_state / other).
    """

    key: str
    kind: Kind
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] | None = None
    chunks: tuple[ChunkInfo, ...] = ()
    nested_path: tuple[Any, ...] = ()
    component: str = "other"
    subclass: str | None = None
    fp8: str | None = None
    error: str | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape) if self.shape is not None else 0

    @property
    def nbytes(self) -> int:
        if self.kind != "tensor":
            return sum(c.byte_length for c in self.chunks)
        return self.numel * self.dtype.itemsize if self.dtype is not None else 0

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(c.file for c in self.chunks))

    @property
    def dtype_name(self) -> str | None:
        return None if self.dtype is None else str(self.dtype).removeprefix("torch.")

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready summary (the ``ckpt-inspect ls --json`` entry shape)."""
        return {
            "key": self.key,
            "component": self.component,
            "kind": self.kind,
            "dtype": self.dtype_name,
            "shape": list(self.shape) if self.shape is not None else None,
            "numel": self.numel,
            "nbytes": self.nbytes,
            "chunks": len(self.chunks),
            "files": list(self.files),
            "subclass": self.subclass,
            "fp8": self.fp8,
            "error": self.error,
        }


def layout_problem(shape: tuple[int, ...], chunks: tuple[ChunkInfo, ...]) -> str | None:
    """Why ``chunks`` do not tile a tensor of ``shape`` exactly (a chunk outside it, elements
    missing or stored twice), or None."""
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
