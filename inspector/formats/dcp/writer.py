"""Writing DCP folders that ``torch.distributed.checkpoint`` loads, one tensor chunk at a time.

The layout is what ``FileSystemWriter`` writes from one process: ``__0_0.distcp`` holds each
chunk as a torch.save archive (back to back, offsets counted from each archive's start),
and ``.metadata`` is torch's own ``Metadata`` pickled (built from torch's dataclasses: this
is our data, never a user's). A tensor may be stored as several chunks (experts of a
stacked tensor, say); together they must tile it exactly. Files get their final names
only when everything was written (``.metadata`` last), so a failed export leaves nothing.
"""

from __future__ import annotations

import math
import os
import pickle
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inspector import dtypes
from inspector.errors import ExportError
from inspector.formats.torch_save.writer import append_archive
from inspector.formats.writing import Item
from inspector.storage.local import atomic_files, new_folder
from inspector.storage.writeback import durable

DATA_FILE = "__0_0.distcp"
METADATA_FILE = ".metadata"


@dataclass(frozen=True)
class Chunk:
    """``item`` is the piece of tensor ``fqn`` (of ``shape``) that starts at ``offsets``.

    A whole tensor is one chunk at offsets 0 with ``shape`` equal to the item's shape.
    """

    fqn: str
    item: Item
    offsets: tuple[int, ...]
    shape: tuple[int, ...]


def write_dcp(
    folder: Path,
    chunks: Sequence[Chunk],
    progress: Callable[[Item], None],
    overwrite: bool,
    objects: Mapping[str, bytes] | None = None,
    extra_files: Mapping[str, bytes] | None = None,
) -> list[Path]:
    """Write ``chunks`` (in order) as a DCP checkpoint in ``folder``; returns the files.

    ``objects``: byte items (key -> the bytes DCP's loader hands ``torch.load``), stored
    after the tensors; ``extra_files``: small files written beside (a producer's marker).
    """
    layout = _layout(chunks)
    with new_folder(folder), atomic_files(folder, overwrite) as files:
        data = files.temp_for(folder / DATA_FILE)
        places = []
        with open(data, "w+b", buffering=0) as f, durable(f.fileno(), progress) as written:
            for chunk in chunks:
                offset = f.seek(0, os.SEEK_END)
                places.append((offset, append_archive(f, chunk.item, written)[0]))
            spans = {}
            for key, body in (objects or {}).items():
                spans[key] = (f.seek(0, os.SEEK_END), len(body))
                f.write(body)
        meta = _metadata(folder, chunks, places, layout, spans)
        written_files = {METADATA_FILE: pickle.dumps(meta), **(extra_files or {})}
        for name, body in written_files.items():
            with open(files.temp_for(folder / name), "wb") as out:
                out.write(body)
                os.fsync(out.fileno())
        return files.commit()


def _layout(chunks: Sequence[Chunk]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each tensor's (dtype, shape), after checking that its chunks agree on them and tile it."""
    layout: dict[str, tuple[str, tuple[int, ...]]] = {}
    pieces: dict[str, list[Chunk]] = {}
    for chunk in chunks:
        form = (chunk.item.dtype, chunk.shape)
        if layout.setdefault(chunk.fqn, form) != form:
            raise ExportError(
                f"chunks disagree: {layout[chunk.fqn]} and {form} (dtype, shape)", key=chunk.fqn
            )
        inside = len(chunk.offsets) == len(chunk.shape) == len(chunk.item.shape) and all(
            o >= 0 and o + s <= n
            for o, s, n in zip(chunk.offsets, chunk.item.shape, chunk.shape, strict=True)
        )
        if not inside:
            raise ExportError(
                f"chunk {list(chunk.item.shape)} at {list(chunk.offsets)} lies outside "
                f"{list(chunk.shape)}",
                key=chunk.fqn,
            )
        pieces.setdefault(chunk.fqn, []).append(chunk)
    for fqn, found in pieces.items():
        _check_tiling(fqn, found)
    return layout


def _check_tiling(fqn: str, chunks: list[Chunk]) -> None:
    """The chunks cover the tensor once: their sizes add up and no two overlap."""
    total = math.prod(chunks[0].shape)
    if sum(math.prod(c.item.shape) for c in chunks) != total:
        raise ExportError(f"{len(chunks)} chunks do not add up to the whole tensor", key=fqn)
    boxes = sorted((c.offsets, c.item.shape) for c in chunks)
    for i, (a_at, a_size) in enumerate(boxes):
        for b_at, b_size in boxes[i + 1 :]:
            if b_at[0] >= a_at[0] + a_size[0]:
                break
            if all(
                x < y + m and y < x + n
                for x, n, y, m in zip(a_at, a_size, b_at, b_size, strict=True)
            ):
                raise ExportError(f"chunks at {list(a_at)} and {list(b_at)} overlap", key=fqn)


def _metadata(
    folder: Path,
    chunks: Sequence[Chunk],
    places: list[tuple[int, int]],
    layout: dict[str, tuple[str, tuple[int, ...]]],
    spans: Mapping[str, tuple[int, int]],
) -> Any:
    """torch's Metadata for the written chunks, as ``FileSystemWriter.finish`` builds it."""
    import torch
    from torch.distributed.checkpoint import metadata as md
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo

    tensors = {
        fqn: md.TensorStorageMetadata(
            md.TensorProperties(dtype=dtypes.to_torch(dtype)), torch.Size(shape), []
        )
        for fqn, (dtype, shape) in layout.items()
    }
    storage = {}
    for chunk, (offset, length) in zip(chunks, places, strict=True):
        entry = tensors[chunk.fqn]
        at = torch.Size(chunk.offsets)
        index = md.MetadataIndex(chunk.fqn, at, len(entry.chunks))
        entry.chunks.append(md.ChunkStorageMetadata(at, torch.Size(chunk.item.shape)))
        storage[index] = _StorageInfo(DATA_FILE, offset, length)
    items: dict[str, Any] = dict(tensors)
    for key, (offset, length) in spans.items():
        items[key] = md.BytesStorageMetadata()
        storage[md.MetadataIndex(key)] = _StorageInfo(DATA_FILE, offset, length)
    return md.Metadata(
        state_dict_metadata=items,
        planner_data={fqn: (fqn,) for fqn in items},
        storage_data=storage,
        storage_meta=md.StorageMeta(checkpoint_id=str(folder), save_id=uuid.uuid4().hex),
        version=CURRENT_DCP_VERSION,
    )
