"""The format-independent description of a checkpoint: entries and their chunks (no I/O)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

Kind = Literal["tensor", "object"]
COMPONENTS = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state")


@dataclass(frozen=True, slots=True)
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
