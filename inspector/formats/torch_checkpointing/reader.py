"""torch_checkpointing ("DCPv2", PyPI ``torch-checkpointing``) folders, read without the
library and without running anything from them.

Every rank writes every item (``model``, ``optimizer``, ``step``, ...) to its own file. Keys
are ``<item>.<nested path joined by ".">`` (just ``<item>`` for an item that is one value),
the library's own tensor names prefixed by the item; nested paths keep their parts (ints
stay ints). A DTensor's global shape and each rank's piece come from the pickle's own spec
(or, for safetensors items, from ``metadata.pkl``): the pieces become chunks of the whole
tensor, read through each shard's size, stride and offset (FSDP2 pads its storages).
Replicated copies are read once. Plain tensors saved by every rank are read from the lowest
rank's file; non-tensor values that differ between ranks read as :class:`PerRank`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from inspector.entry import ChunkInfo, Entry
from inspector.errors import CorruptCheckpointError, InspectorError, UnsupportedError
from inspector.formats.base import ChunkValue, Step, StoredRecord
from inspector.formats.producers import TORCH_CHECKPOINTING
from inspector.formats.safe_pickle import SubclassRef, TensorRef
from inspector.formats.safetensors import read_span
from inspector.formats.torch_archive import (
    contiguous_strides,
    is_zip,
    materialize,
    read_storage_tensor,
    tensor_refs,
    zip_members,
)
from inspector.formats.torch_checkpointing import folder as tc_folder
from inspector.formats.torch_checkpointing.entries import Entries, local_layout
from inspector.formats.torch_checkpointing.items import RawFile, Stored, Subclass, Value
from inspector.formats.torch_checkpointing.metadata import METADATA_PKL, TcMetadata, read_metadata
from inspector.formats.torch_save.reader import class_names
from inspector.reprs import bounded_repr
from inspector.storage.base import ByteRange, Storage
from inspector.words import counted, inflected

if TYPE_CHECKING:
    import torch

FORMAT = "torch-checkpointing"
PRODUCER = TORCH_CHECKPOINTING.name


class PerRank:
    """A non-tensor value that differs between the ranks that saved it: ``by_rank[r]``."""

    __slots__ = ("by_rank",)
    by_rank: Mapping[int, Any]

    def __init__(self, by_rank: dict[int, Any]) -> None:
        object.__setattr__(self, "by_rank", MappingProxyType(dict(by_rank)))

    def __setattr__(self, name: str, value: Any) -> None:
        raise TypeError("PerRank is immutable")

    def __getitem__(self, rank: int) -> Any:
        return self.by_rank[rank]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PerRank) and dict(self.by_rank) == dict(other.by_rank)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"PerRank({bounded_repr(dict(self.by_rank), 400)})"


class TorchCheckpointingSource:
    """A torch_checkpointing checkpoint folder: every item file decoded at open (pickles and
    headers only), tensor bytes read on demand."""

    format = FORMAT
    producer = PRODUCER
    name = ""
    nesting = "torch_checkpointing items and nested paths"
    key_matching = "flattened"  # the library loads each item into its own state dict
    steps: tuple[Step, ...] = ()

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        notes = [f"{PRODUCER} folder (one file per item per rank)"]
        self.tc_metadata = _metadata(storage, notes)
        found = tc_folder.scan(storage, self.tc_metadata)
        world = (self.tc_metadata.world_size if self.tc_metadata else None) or (
            max(found.ranks, default=-1) + 1
        )
        self.ranks: int | None = world or None
        built = Entries(storage, found, self.tc_metadata, world, notes)
        self._entries = built.entries
        self._pieces, self._objects, self._records = built.pieces, built.objects, built.records
        self.notes = tuple(notes + _folder_notes(storage, found))
        self.source_files = tuple(
            [METADATA_PKL] * (self.tc_metadata is not None)
            + sorted(f.name for files in found.items.values() for f in files.values())
        )
        self.metadata = {"items": ", ".join(found.items), "world_size": str(world)}
        if self.tc_metadata:
            self.metadata["version"] = self.tc_metadata.version

    # --- the Source interface -----------------------------------------------------------------
    def entries(self) -> list[Entry]:
        return self._entries

    def read_chunk(self, entry: Entry, index: int, out: torch.Tensor | None = None) -> ChunkValue:
        piece = self._pieces[entry.key][index]
        chunk = entry.chunks[index]
        leaf = piece.leaf
        if isinstance(leaf, Subclass):
            with self._file(leaf.file, entry.key) as read:
                return materialize(leaf.ref, read)
        whole = piece.local_offsets is None or (
            not any(piece.local_offsets) and chunk.sizes == local_layout(leaf)[0]
        )
        target = out if whole else None
        if isinstance(leaf, Stored):
            with self._file(leaf.file, entry.key) as read:
                local = read(leaf.ref, target)
        else:
            span = ChunkInfo(
                (), leaf.span.shape or (), leaf.file, leaf.span.start, leaf.span.length
            )
            local = read_span(
                self.storage,
                self._checked(leaf.file, entry.key),
                span,
                entry.dtype or "",
                target,
                key=entry.key,
            )
        if whole:
            return local
        starts = piece.local_offsets or ()
        return local[tuple(slice(s, s + n) for s, n in zip(starts, chunk.sizes, strict=True))]

    def read_object(self, entry: Entry) -> Any:
        by_rank = self._objects.get(entry.key)
        if by_rank is None:
            raise UnsupportedError("holds no object", file=self.storage.location, key=entry.key)
        values = {max(rank, 0): self._value(leaf, entry.key) for rank, leaf in by_rank.items()}
        first = values[min(values)]
        if self._differs(entry.key, values):
            return PerRank(values)
        return first

    def _differs(self, key: str, values: dict[int, Any]) -> bool:
        """Whether the ranks saved different values: compared as decoded (tensors by where
        they are stored, so values holding tensors count as different), raw bytes as read."""
        leaves = list(self._objects[key].values())
        if len(leaves) < 2:
            return False
        if all(isinstance(leaf, RawFile) for leaf in leaves):
            first = values[min(values)]
            return any(v != first for v in values.values())
        decoded = [leaf.value for leaf in leaves if isinstance(leaf, Value)]
        if len(decoded) != len(leaves) or any(
            next(tensor_refs(v), None) is not None for v in decoded
        ):
            return True
        return not all(_equal(decoded[0], v) for v in decoded[1:])

    def chunk_bytes(self, entry: Entry, index: int) -> ByteRange | None:
        piece = self._pieces[entry.key][index]
        chunk, leaf = entry.chunks[index], piece.leaf
        if isinstance(leaf, Subclass) or (piece.local_offsets and any(piece.local_offsets)):
            return None
        if chunk.sizes != local_layout(leaf)[0]:
            return None
        if isinstance(leaf, Stored) and leaf.ref.stride != contiguous_strides(leaf.ref.shape):
            return None
        name = self._checked(leaf.file, entry.key)
        return ByteRange(self.storage, name, chunk.byte_offset, chunk.byte_length)

    def stored_records(self) -> Iterator[StoredRecord]:
        """Each torch.save item file's zip records with their CRC-32, named after the key
        whose bytes they hold; JSON, raw and safetensors items keep no checksum: their
        entries' byte ranges."""
        by_file: dict[str, list[tuple[int, int, str]]] = {}
        for entry in self.entries():
            for chunk in entry.chunks:
                by_file.setdefault(chunk.file, []).append(
                    (chunk.byte_offset, chunk.byte_length, entry.key)
                )
        for name in self.source_files:
            spans = sorted(by_file.get(name, ()))
            size = self.storage.size(name)
            if not is_zip(self.storage.read(name, 0, min(4, size))):
                for offset, length, key in spans:
                    yield StoredRecord(key, name, offset, length, None, "stored bytes")
                continue
            with self.storage.window(name, 0, size) as f:
                try:
                    members = zip_members(f, size, file=self.storage.describe(name), key=None)
                except CorruptCheckpointError as exc:
                    yield StoredRecord(None, name, 0, size, None, "zip archive", exc.reason)
                    continue
            for m in members:
                owner = next((k for o, n, k in spans if m.start <= o < m.start + m.size), None)
                yield StoredRecord(owner, name, m.start, m.size, m.crc32, f"zip record {m.name}")

    def chunk_globals(self, entry: Entry, index: int) -> list[str]:
        leaf = self._pieces[entry.key][index].leaf
        return class_names(leaf.ref) if isinstance(leaf, Subclass) else []

    def describe_chunk(self, entry: Entry, index: int) -> TensorRef | SubclassRef:
        leaf = self._pieces[entry.key][index].leaf
        if isinstance(leaf, Subclass):
            return leaf.ref
        sizes = entry.chunks[index].sizes
        return TensorRef(None, 0, sizes, contiguous_strides(sizes), entry.dtype or "")

    # --- reading ----------------------------------------------------------------------------
    def _checked(self, name: str, key: str | None) -> str:
        return self.storage.check(name, referrer=self.storage.location, key=key)

    @contextmanager
    def _file(self, name: str, key: str) -> Iterator[Any]:
        """``read(ref, out=None)``: a tensor of the torch.save item file, by its description
        (errors name ``key``, the entry being read)."""
        checked = self._checked(name, key)
        label = self.storage.describe(checked)
        records = self._records[name]
        with self.storage.window(checked, 0, self.storage.size(checked)) as f:

            def read(ref: TensorRef, out: torch.Tensor | None = None) -> torch.Tensor:
                record = records.get(ref.storage.key) if ref.storage is not None else None
                if isinstance(record, str):
                    raise CorruptCheckpointError(record, file=label, key=key)
                return read_storage_tensor(f, record, ref, out, file=label, key=key)

            yield read

    def _value(self, leaf: Value | RawFile, key: str) -> Any:
        if isinstance(leaf, RawFile):
            return self.storage.read(self._checked(leaf.file, key))
        if leaf.file is None or next(tensor_refs(leaf.value), None) is None:
            return materialize(leaf.value, _no_tensor)
        with self._file(leaf.file, key) as read:
            return materialize(leaf.value, read)


# --- helpers ------------------------------------------------------------------------------


def _metadata(storage: Storage, notes: list[str]) -> TcMetadata | None:
    """``metadata.pkl`` decoded, or None (absent, or refused: the files still tell most)."""
    if storage.kind(METADATA_PKL) != "file":
        notes.append(f"no {METADATA_PKL}: global shapes come from each DTensor's own pickle")
        return None
    try:
        metadata = read_metadata(storage)
    except InspectorError as exc:
        notes.append(f"{METADATA_PKL} not used: {exc}")
        return None
    notes.append(
        f"{METADATA_PKL} version {metadata.version}: layouts of "
        + (
            f"{inflected(len(metadata.items), 'item')} {', '.join(metadata.items)}"
            if metadata.items
            else "no items"
        )
    )
    return metadata


def _no_tensor(ref: TensorRef) -> Any:
    raise CorruptCheckpointError("a JSON value cannot hold tensors")


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # a decoded value's __eq__ may raise on shapes it never expected
        return False


def _folder_notes(storage: Storage, found: tc_folder.Folder) -> list[str]:
    notes = []
    if storage.location.rstrip("/").rsplit("/", 1)[-1].startswith(tc_folder.TMP_PREFIX):
        notes.append(
            "uncommitted save: torch_checkpointing writes into tmp_<name>/ and renames it "
            "once every rank is done; this folder was never renamed"
        )
    if found.skipped:
        notes.append(
            f"skipped {counted(len(found.skipped), 'file')}: {', '.join(found.skipped[:5])}"
        )
    for clash in found.clashes:
        notes.append(f"two files claim one item and rank: {clash} (the first is used)")
    if len(found.ranks) > 1:
        notes.append(
            f"{len(found.ranks)} ranks: plain tensors every rank saved are read from the "
            "lowest rank's file; values that differ between ranks read as PerRank"
        )
    return notes
