"""What every on-disk format provides, and the path checks they all share."""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Protocol

import torch

from inspector.entry import Entry
from inspector.errors import (
    CheckpointFileMissingError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
)
from inspector.formats.safe_pickle import SubclassRef, TensorRef

ChunkValue = torch.Tensor | SubclassRef


class Source(Protocol):
    """One on-disk format, opened: its entries (metadata only) and lazy reads of their data."""

    format: str
    root: Path
    source_files: tuple[str, ...]
    notes: tuple[str, ...]
    metadata: dict[str, str]
    nesting: str  # where entries' nested paths come from (shown with the layout)

    def entries(self) -> list[Entry]:
        """Every stored value, in stored order, with ``nested_path`` filled in where known."""
        ...

    def read_chunk(self, entry: Entry, index: int, out: torch.Tensor | None = None) -> ChunkValue:
        """Chunk ``index`` of a tensor entry: a plain tensor (written into ``out`` when it can)
        or a materialised tensor-subclass description."""
        ...

    def read_object(self, entry: Entry) -> Any:
        """A non-tensor value, decoded through safe_pickle."""
        ...

    def chunk_bytes(self, entry: Entry, index: int) -> tuple[Path, int] | None:
        """Where the chunk's row-major bytes start (file, offset), when stored as plain
        contiguous bytes; None otherwise (subclass, strided view, compressed)."""
        ...

    def chunk_globals(self, entry: Entry, index: int) -> list[str]:
        """Classes and functions the chunk's pickle names (read without running it)."""
        ...

    def describe_chunk(self, entry: Entry, index: int) -> TensorRef | SubclassRef:
        """The chunk as its pickle describes it (class, dtypes, shapes, attributes), decoded
        through safe_pickle without reading tensor bytes. Detection calls it only for chunks
        whose ``chunk_globals`` name a class outside torch."""
        ...


def resolve_inside(
    root: Path, relative: Any, *, referrer: str | os.PathLike, key: str | None
) -> Path:
    """``root / relative``, refusing absolute paths, ``..`` and symlinks that lead outside.

    One kind of outside link is genuine: in a Hugging Face hub cache, a snapshot's files
    link to the same repository's ``blobs/`` folder; those are followed.
    """
    if not isinstance(relative, str) or not relative or "\x00" in relative:
        raise CorruptCheckpointError(f"bad file name {relative!r}", file=referrer, key=key)
    parts = PurePosixPath(relative.replace("\\", "/"))
    if parts.is_absolute() or PureWindowsPath(relative).drive or ".." in parts.parts:
        raise UnsafeCheckpointError(
            f"file name {relative!r} points outside the checkpoint folder", file=referrer, key=key
        )
    path = root / parts
    real_root = root.resolve()
    real = path.resolve()
    if real != real_root and real_root not in real.parents and real.parent != _hub_blobs(root):
        raise UnsafeCheckpointError(
            f"{relative!r} is a link to {real}, outside the checkpoint folder",
            file=referrer,
            key=key,
        )
    return path


def _hub_blobs(root: Path) -> Path | None:
    """``<repo>/blobs`` (resolved) when ``root`` lies in ``<repo>/snapshots/<revision>``."""
    here = root.absolute()
    for folder in (here, *here.parents):
        blobs = folder.parent.parent / "blobs"
        if folder.parent.name == "snapshots" and blobs.is_dir():
            return blobs.resolve()
    return None


def file_sizes(root: Path, names: set[str], *, referrer: str | os.PathLike) -> dict[str, int | str]:
    """Size of each referenced file, or the reason it cannot be used (missing, escaping)."""
    sizes: dict[str, int | str] = {}
    for name in names:
        try:
            path = resolve_inside(root, name, referrer=referrer, key=None)
            sizes[name] = path.stat().st_size if path.is_file() else f"file {name} is missing"
        except (UnsafeCheckpointError, CorruptCheckpointError) as exc:
            sizes[name] = exc.reason
        except OSError as exc:
            sizes[name] = f"file {name} cannot be read ({exc.strerror})"
    return sizes


def require_file(path: Path, what: str) -> None:
    if not path.is_file():
        raise CheckpointFileMissingError(f"{what} is missing", file=path)
