"""The entries of a torch_checkpointing folder, from every rank's decoded item files.

Per item and nested path, the ranks' leaves become one entry: a DTensor's pieces placed by
each rank's own spec (or a safetensors item's by ``metadata.pkl``), replicated blocks taken
once and the tiling checked; a plain tensor from the lowest rank; a non-tensor value from
every rank (compared when read). What a chunk is read from is kept beside it (``pieces``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from inspector import dtypes
from inspector.entry import ChunkInfo, Entry, layout_problem
from inspector.errors import InspectorError
from inspector.formats.torch_archive import Record
from inspector.formats.torch_checkpointing import folder as tc_folder
from inspector.formats.torch_checkpointing.items import (
    Broken,
    InFile,
    Leaf,
    NestedPath,
    RawFile,
    Sharded,
    Stored,
    Subclass,
    Value,
    read_item,
    sniff,
)
from inspector.formats.torch_checkpointing.metadata import (
    METADATA_PKL,
    ItemMetadata,
    Sharding,
    TcMetadata,
)
from inspector.formats.torch_checkpointing.placements import Box, shard_boxes
from inspector.storage.base import Storage

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Piece:
    """Where chunk ``i`` of an entry comes from: a leaf of one rank's file and, for a block
    of a sharded tensor, the block's place in the local shard."""

    leaf: Stored | InFile | Subclass
    local_offsets: tuple[int, ...] | None = None


class Entries:
    """The folder's entries and, for reading them, what each chunk and object comes from:
    ``pieces`` (per tensor key, aligned with its chunks), ``objects`` (per key, each rank's
    value) and ``records`` (per torch.save file, its storages). Problems found are appended
    to ``notes``."""

    def __init__(
        self,
        storage: Storage,
        found: tc_folder.Folder,
        metadata: TcMetadata | None,
        world: int,
        notes: list[str],
    ) -> None:
        self.storage, self.notes = storage, notes
        self.pieces: dict[str, tuple[Piece, ...]] = {}
        self.objects: dict[str, dict[int, Value | RawFile]] = {}
        self.records: dict[str, dict[str, Record | str]] = {}
        entries: list[Entry] = []
        for item, files in found.items.items():
            meta = metadata.items.get(item) if metadata else None
            entries += self._item(item, files, meta, world)
        self.entries = _unique(entries)

    def _item(
        self,
        item: str,
        files: dict[int | None, tc_folder.ItemFile],
        meta: ItemMetadata | None,
        world: int,
    ) -> list[Entry]:
        leaves: dict[int, dict[NestedPath, Leaf]] = {}
        broken: dict[int, str] = {}
        for rank, found in sorted(files.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
            key = -1 if rank is None else rank
            try:
                decoded = read_item(self.storage, found.name, sniff(self.storage, found.name))
            except InspectorError as exc:
                broken[key] = f"{found.name}: {exc.reason}"
                self.notes.append(f"item {item!r}: {broken[key]}")
                continue
            self.records[found.name] = decoded.records
            leaves[key] = dict(_named_paths(decoded.leaves, meta))
        missing = _missing(files, world)
        if missing:
            self.notes.append(f"item {item!r}: {'; '.join(missing.values())}")
        gaps = [*missing.values(), *broken.values()]
        if not leaves:
            return [Entry(item, "object", nested_path=(item,), error="; ".join(gaps))]
        paths = list(dict.fromkeys(p for per in leaves.values() for p in per))
        out = []
        for path in paths:
            by_rank = {r: per[path] for r, per in leaves.items() if path in per}
            records = meta.records.get(path, ()) if meta else ()
            out += self._entries_for(item, path, by_rank, records, gaps)
        return out

    def _entries_for(
        self,
        item: str,
        path: NestedPath,
        by_rank: dict[int, Leaf],
        records: tuple[Sharding, ...],
        gaps: list[str],
    ) -> list[Entry]:
        key = ".".join([item, *map(str, path)])
        nested = (item, *path)
        broken = [leaf for leaf in by_rank.values() if isinstance(leaf, Broken)]
        if broken:
            return [_error(key, nested, f"{broken[0].file}: {broken[0].reason}")]
        objects: dict[int, Value | RawFile] | None = _only(by_rank, (Value, RawFile))
        if objects is not None:
            self.objects[key] = objects
            return [Entry(key, "object", nested_path=nested, chunks=_object_chunks(objects))]
        if (sharded := _only(by_rank, Sharded)) is not None:
            return [self._sharded(key, nested, sharded, records, gaps)]
        if (in_files := _only(by_rank, InFile)) is not None:
            if records:
                return [self._placed(key, nested, in_files, records, gaps)]
            if len(in_files) > 1:
                self._note_local(item)
                return [
                    self._whole(f"{key}@rank{rank}", nested, leaf)
                    for rank, leaf in in_files.items()
                ]
        whole: dict[int, Stored | InFile | Subclass] | None = _only(
            by_rank, (Stored, InFile, Subclass)
        )
        if whole is None or len({type(leaf) for leaf in whole.values()}) > 1:
            return [_error(key, nested, f"the ranks hold different kinds: {_kinds(by_rank)}")]
        return [self._whole(key, nested, whole[min(whole)])]

    def _note_local(self, item: str) -> None:
        note = (
            f"item {item!r} holds per-rank safetensors and {METADATA_PKL} records no layout "
            "for it: the global shapes are unknown, so each rank's local tensor is listed "
            "as <key>@rank<r>"
        )
        if note not in self.notes:
            self.notes.append(note)

    def _whole(self, key: str, nested: tuple, leaf: Stored | InFile | Subclass) -> Entry:
        """An entry held whole by one file."""
        if isinstance(leaf, Subclass):
            shape, dtype = leaf.ref.shape, leaf.ref.dtype
        else:
            shape, dtype = local_layout(leaf)
        chunk = _chunk(leaf, (0,) * len(shape), shape)
        self.pieces[key] = (Piece(leaf),)
        return Entry(key, "tensor", dtype, shape, (chunk,), nested)

    def _sharded(
        self,
        key: str,
        nested: tuple,
        by_rank: dict[int, Sharded],
        records: tuple[Sharding, ...],
        gaps: list[str],
    ) -> Entry:
        """A DTensor from each rank's pickle: its pieces placed by its own spec."""
        first = by_rank[min(by_rank)]
        shape, dtype = first.shape, first.dtype
        for rank, leaf in by_rank.items():
            if (leaf.shape, leaf.dtype) != (shape, dtype):
                problem = (
                    f"rank {rank} saved it as {leaf.dtype} {list(leaf.shape)}, "
                    f"rank {min(by_rank)} as {dtype} {list(shape)}"
                )
                return _error(key, nested, problem, dtype, shape)
        recorded = next((r.shape for r in records if r.shape is not None), None)
        if recorded is not None and recorded != shape:
            problem = f"{METADATA_PKL} records shape {list(recorded)}, the files {list(shape)}"
            return _error(key, nested, problem, dtype, shape)
        placed = []
        for rank, leaf in sorted(by_rank.items()):
            try:
                local_shape, boxes = shard_boxes(
                    shape, leaf.mesh_shape, leaf.coordinate, leaf.placements
                )
            except ValueError as exc:
                return _error(key, nested, f"rank {rank}'s DTensor: {exc}", dtype, shape)
            if local_shape != leaf.local.ref.shape:
                problem = (
                    f"{leaf.local.file} holds a local shard of {list(leaf.local.ref.shape)}, "
                    f"its placements give {list(local_shape)}"
                )
                return _error(key, nested, problem, dtype, shape)
            placed += [(leaf.local, box) for box in boxes]
        return self._assembled(key, nested, dtype, shape, placed, gaps)

    def _placed(
        self,
        key: str,
        nested: tuple,
        by_rank: dict[int, InFile],
        records: tuple[Sharding, ...],
        gaps: list[str],
    ) -> Entry:
        """Local shards of a safetensors item, placed by ``metadata.pkl``'s records."""
        record = records[0]
        shape, dtype = record.shape, record.dtype
        if shape is None or dtype is None:
            problem = f"{METADATA_PKL} has a {record.kind!r} record this reader does not know"
            return _error(key, nested, problem)
        placed = []
        try:
            for group in records:
                placed += _record_pieces(group, by_rank)
        except ValueError as exc:
            return _error(key, nested, f"{METADATA_PKL}: {exc}", dtype, shape)
        for leaf, _ in placed:
            if leaf.span.dtype != dtype:
                problem = f"{leaf.file} stores {leaf.span.dtype}, {METADATA_PKL} says {dtype}"
                return _error(key, nested, problem, dtype, shape)
        return self._assembled(key, nested, dtype, shape, placed, gaps)

    def _assembled(
        self,
        key: str,
        nested: tuple,
        dtype: str,
        shape: tuple[int, ...],
        placed: Sequence[tuple[Stored | InFile, Box]],
        gaps: list[str],
    ) -> Entry:
        """The entry whose chunks are the placed boxes, each replicated block taken once."""
        chunks, pieces, seen = [], [], set()
        for leaf, box in placed:
            if (box.offsets, box.sizes) in seen:
                continue
            seen.add((box.offsets, box.sizes))
            chunks.append(_chunk(leaf, box.offsets, box.sizes))
            pieces.append(Piece(leaf, box.local_offsets))
        problem = layout_problem(shape, tuple(chunks))
        if problem:
            cause = f" ({'; '.join(gaps)})" if gaps else ""
            return _error(
                key, nested, f"the ranks' shards do not tile it: {problem}{cause}", dtype, shape
            )
        self.pieces[key] = tuple(pieces)
        return Entry(key, "tensor", dtype, shape, tuple(chunks), nested)


# --- helpers ---------------------------------------------------------------------------------


def _named_paths(
    leaves: list[tuple[NestedPath, Leaf]], meta: ItemMetadata | None
) -> list[tuple[NestedPath, Leaf]]:
    """A safetensors item's dot-joined names back to the nested paths ``metadata.pkl`` knows."""
    if meta is None or not meta.records:
        return leaves
    paths = {".".join(map(str, path)): path for path in meta.records}
    return [
        (paths.get(str(path[0]), path) if isinstance(leaf, InFile) else path, leaf)
        for path, leaf in leaves
    ]


def _missing(files: dict[int | None, tc_folder.ItemFile], world: int) -> dict[int, str]:
    """Rank -> "rank r's file NAME is missing", for each rank without a file of the item."""
    if not any(rank is not None for rank in files):
        return {}
    return {
        rank: f"rank {rank}'s file {tc_folder.missing_file(files, rank)} is missing"
        for rank in range(world)
        if rank not in files
    }


def _error(
    key: str,
    nested: tuple,
    problem: str,
    dtype: str | None = None,
    shape: tuple[int, ...] | None = None,
) -> Entry:
    return Entry(key, "tensor", dtype, shape, (), nested, error=problem)


def local_layout(leaf: Stored | InFile) -> tuple[tuple[int, ...], str]:
    """The shape and dtype of the local tensor a leaf stores."""
    if isinstance(leaf, Stored):
        return leaf.ref.shape, leaf.ref.dtype
    return leaf.span.shape or (), leaf.span.dtype or ""


def _chunk(
    leaf: Stored | InFile | Subclass, offsets: tuple[int, ...], sizes: tuple[int, ...]
) -> ChunkInfo:
    """The chunk record: the block's place, and the bytes of the local tensor it is cut from."""
    if isinstance(leaf, Subclass):
        return ChunkInfo(offsets, sizes, leaf.file, 0, 0)
    if isinstance(leaf, InFile):
        return ChunkInfo(offsets, sizes, leaf.file, leaf.span.start, leaf.span.length)
    shape, dtype = local_layout(leaf)
    length = dtypes.itemsize(dtype) * math.prod(shape)
    return ChunkInfo(offsets, sizes, leaf.file, leaf.start, length)


def _object_chunks(by_rank: Mapping[int, Leaf]) -> tuple[ChunkInfo, ...]:
    """One record per rank's file (raw items count their bytes)."""
    return tuple(
        ChunkInfo((), (), leaf.file, 0, leaf.size if isinstance(leaf, RawFile) else 0)
        for leaf in by_rank.values()
        if isinstance(leaf, (Value, RawFile)) and leaf.file is not None
    )


def _only(by_rank: dict[int, Leaf], kind: type[T] | tuple[type, ...]) -> dict[int, T] | None:
    """``by_rank`` when every rank's leaf is of ``kind``, else None."""
    if all(isinstance(leaf, kind) for leaf in by_rank.values()):
        return by_rank  # type: ignore[return-value]  # every value checked just above
    return None


def _kinds(by_rank: Mapping[int, Leaf]) -> str:
    return ", ".join(f"rank {max(r, 0)}: {type(leaf).__name__}" for r, leaf in by_rank.items())


def _record_pieces(group: Sharding, by_rank: Mapping[int, InFile]) -> list[tuple[InFile, Box]]:
    """Each rank's boxes of one ``metadata.pkl`` record (ranks without a file are left out:
    the tiling check names them)."""
    shape = group.shape or ()
    placed: list[tuple[InFile, Box]] = []
    if group.kind == "dtensor":
        for rank in group.mesh_ranks:
            leaf = by_rank.get(rank)
            if leaf is None:
                continue
            local, boxes = shard_boxes(
                shape, group.mesh_shape, group.coordinate(rank), group.placements
            )
            held = local_layout(leaf)[0]
            if local != held:
                raise ValueError(f"{leaf.file} holds {list(held)}, the record gives {list(local)}")
            placed += [(leaf, box) for box in boxes]
    elif group.kind == "default":
        for rank in group.ranks:
            leaf = by_rank.get(rank)
            if leaf is not None:
                placed += [(leaf, Box(at, sizes, local)) for at, local, sizes in group.shards]
    else:
        raise ValueError(f"unknown record type {group.kind!r}")
    return placed


def _unique(entries: list[Entry]) -> list[Entry]:
    """Entries by key; two nested paths joined to one key make that key an error (the
    library itself refuses such an item: "FQN collision")."""
    by_key: dict[str, Entry] = {}
    for entry in entries:
        first = by_key.get(entry.key)
        if first is None:
            by_key[entry.key] = entry
            continue
        reason = f"paths {first.nested_path!r} and {entry.nested_path!r} both join to this key"
        by_key[entry.key] = dataclasses.replace(first, chunks=(), error=reason)
    return list(by_key.values())
