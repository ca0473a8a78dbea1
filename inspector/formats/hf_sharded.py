"""Checkpoints spread over several files: Hugging Face shards (with or without an index) and
the per-rank safetensors files of torch DCP's ``HuggingFaceStorageWriter``.

Each shard is opened as its own source (headers only); this one merges their entries.
Files carrying ``DCP_SHARDING_INFO`` hold chunks at ``saved_offsets`` of larger tensors,
which are assembled like DCP chunks. Problems with one shard or one index line mark the
entries concerned; the rest stays readable.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from inspector.entry import ChunkInfo, Entry
from inspector.errors import CorruptCheckpointError, InspectorError, NotACheckpointError
from inspector.formats.base import ChunkValue, Source, Step, StoredRecord, parse_json
from inspector.formats.safe_pickle import SubclassRef, TensorRef
from inspector.formats.safetensors import SHARDING_KEY
from inspector.storage.base import ByteRange, Storage

if TYPE_CHECKING:
    import torch

MAX_INDEX_BYTES = 1 << 28
Piece = tuple[str, Entry]


class Shard(Source, Protocol):
    """One file of the set, opened: a single-file format that can look a key up and, for
    DCP's HuggingFaceStorageWriter files, says where its chunks sit (``offsets``)."""

    offsets: dict[str, tuple[int, ...]] | None

    def entry(self, key: str) -> Entry | None:
        """The file's entry for ``key``, or None."""
        ...


class ShardedSource:
    """Several files that together make one checkpoint; ``index`` maps keys to files."""

    producer = "unknown"
    ranks: int | None = None
    steps: tuple[Step, ...] = ()
    key_matching = "flattened"

    def __init__(
        self,
        storage: Storage,
        names: list[str],
        open_file: Callable[[Storage, str], Shard],
        *,
        index: str | None = None,
        notes: tuple[str, ...] = (),
    ) -> None:
        """``open_file(storage, name)`` opens one shard by its content (see ``formats.detect``)."""
        self.storage = storage
        self.name = index or ""
        referrer = storage.describe(index or "")
        weight_map, index_metadata = _read_index(storage, index) if index else (None, {})
        if weight_map is not None:
            names = list(dict.fromkeys(v for v in weight_map.values() if isinstance(v, str)))
        self.shard_names = tuple(names)
        self._shards = {name: _open_shard(storage, name, referrer, open_file) for name in names}
        opened = {n: s for n, s in self._shards.items() if not isinstance(s, str)}
        self._opened = opened
        self.dcp = any(s.offsets is not None for s in opened.values())
        pieces, extras = _pieces(weight_map, self._shards, index or storage.location)
        self._entries = [self._merge(key, p) for key, p in pieces.items()]
        self._pieces = {key: p for key, p in pieces.items() if not isinstance(p, str)}
        self._unplaced = {
            key: (_named_file(weight_map, key, index or ""), reason)
            for key, reason in pieces.items()
            if isinstance(reason, str)
        }
        self.format = self._format(opened, names)
        self.nesting = next(iter(opened.values())).nesting if opened else "key names"
        self.metadata = {**_common_metadata(opened.values()), **index_metadata}
        self.source_files = (*([index] if index else []), *opened)
        self.notes = (*notes, *self._notes(index, names, extras))
        ranks = [s for s in opened.values() if s.offsets is not None]
        self.ranks = len(ranks) if self.dcp else None

    def _format(self, opened: dict[str, Shard], names: list[str]) -> str:
        if self.dcp:
            return "dcp-safetensors"
        formats = {s.format for s in opened.values()} or {
            "safetensors" if any(n.endswith(".safetensors") for n in names) else "torch-save"
        }
        return "torch-save" if formats == {"torch-save"} else "safetensors-sharded"

    def _notes(self, index: str | None, names: list[str], extras: list[str]) -> list[str]:
        count = f"{len(names)} shard{'s' if len(names) != 1 else ''}"
        notes = [f"found {index} ({count})" if index else f"no index: used all {count}"]
        if self.dcp:
            notes.append(
                f"files carry {SHARDING_KEY} (torch DCP HuggingFaceStorageWriter): "
                "chunks placed at their saved_offsets"
            )
        notes += [f"unreadable: {s}" for s in self._shards.values() if isinstance(s, str)]
        if extras:
            shown = ", ".join(extras[:5]) + (", ..." if len(extras) > 5 else "")
            notes.append(f"{len(extras)} tensors are in shards but not in the index: {shown}")
        return notes

    def _merge(self, key: str, pieces: list[Piece] | str) -> Entry:
        if isinstance(pieces, str):
            return Entry(key, "tensor", error=pieces)
        first = pieces[0][1]
        if not self.dcp:
            if len(pieces) == 1:
                return first
            files = " and ".join(name for name, _ in pieces)
            return Entry(key, first.kind, first.dtype, first.shape, error=f"stored in {files}")
        return self._assemble(key, pieces)

    def _assemble(self, key: str, pieces: list[Piece]) -> Entry:
        """One tensor from DCP chunks: offsets from each file's ``DCP_SHARDING_INFO``."""
        chunks, problems = [], []
        for name, sub in pieces:
            offsets = (self._opened[name].offsets or {}).get(key)
            if sub.error or offsets is None or sub.shape is None or len(offsets) != len(sub.shape):
                problems.append(sub.error or f"{name} gives no saved_offsets of its rank")
                continue
            stored = sub.chunks[0]
            chunks.append(
                ChunkInfo(offsets, sub.shape, name, stored.byte_offset, stored.byte_length)
            )
        if len({sub.dtype for _, sub in pieces}) > 1 or len({len(c.sizes) for c in chunks}) > 1:
            problems.append("its chunks disagree on the dtype or the number of dimensions")
        shape = _extent(chunks) if chunks and not problems else None
        held, numel = sum(c.numel for c in chunks), math.prod(shape) if shape is not None else 0
        if not problems and held != numel:
            problems.append(f"chunks hold {held} of its {numel} elements (a rank's file missing?)")
        return Entry(
            key,
            "tensor",
            dtype=pieces[0][1].dtype,
            shape=shape,
            chunks=tuple(chunks),
            error=problems[0] if problems else None,
        )

    def entries(self) -> list[Entry]:
        return self._entries

    def _piece(self, entry: Entry, index: int) -> tuple[Shard, Entry]:
        name, sub = self._pieces[entry.key][index]
        return self._opened[name], sub

    def read_chunk(self, entry: Entry, index: int, out: torch.Tensor | None = None) -> ChunkValue:
        shard, sub = self._piece(entry, index)
        return shard.read_chunk(sub, 0, out)

    def read_object(self, entry: Entry) -> Any:
        shard, sub = self._piece(entry, 0)
        return shard.read_object(sub)

    def chunk_bytes(self, entry: Entry, index: int) -> ByteRange | None:
        shard, sub = self._piece(entry, index)
        return shard.chunk_bytes(sub, 0)

    def chunk_globals(self, entry: Entry, index: int) -> list[str]:
        shard, sub = self._piece(entry, index)
        return shard.chunk_globals(sub, 0)

    def describe_chunk(self, entry: Entry, index: int) -> TensorRef | SubclassRef:
        shard, sub = self._piece(entry, index)
        return shard.describe_chunk(sub, 0)

    def stored_records(self) -> Iterator[StoredRecord]:
        """Each shard's records, shard by shard; a shard that cannot be opened and each index
        line that places its key nowhere usable are listed with the reason."""
        for name, shard in self._shards.items():
            if isinstance(shard, str):
                yield StoredRecord(None, name, 0, 0, None, "shard", shard)
            else:
                yield from shard.stored_records()
        for key, (file, reason) in self._unplaced.items():
            yield StoredRecord(key, file, 0, 0, None, f"{self.name or 'index'} entry", reason)


def _named_file(weight_map: dict[str, Any] | None, key: str, index: str) -> str:
    """The file the index places ``key`` in, or the index itself when it names none."""
    name = (weight_map or {}).get(key)
    return name if isinstance(name, str) else index


def _extent(chunks: list[ChunkInfo]) -> tuple[int, ...]:
    """The smallest shape that holds every chunk."""
    ndim = len(chunks[0].sizes)
    return tuple(max(c.offsets[d] + c.sizes[d] for c in chunks) for d in range(ndim))


def _read_index(storage: Storage, name: str) -> tuple[dict[str, Any], dict[str, str]]:
    """``weight_map`` and ``metadata`` of a ``*.index.json`` file."""
    label = storage.describe(name)
    if storage.size(name) > MAX_INDEX_BYTES:
        raise CorruptCheckpointError("index file is implausibly large", file=label)
    data = parse_json(storage.read(name), file=label, what="index")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise NotACheckpointError("JSON without a weight_map object: not a shard index", file=label)
    metadata = data.get("metadata")
    return weight_map, {
        str(k)[:200]: str(v)[:200]
        for k, v in (metadata.items() if isinstance(metadata, dict) else ())
        if isinstance(v, (str, float)) or (type(v) is int and v.bit_length() < 200)
    }


def _open_shard(
    storage: Storage, name: str, referrer: str, open_file: Callable[[Storage, str], Shard]
) -> Shard | str:
    """The shard's reader, or why it cannot be used (missing, outside the folder, damaged)."""
    try:
        checked = storage.check(name, referrer=referrer)
        if storage.kind(checked) != "file":
            storage.size(checked)  # raises the precise reason: missing, a FIFO, ...
        return open_file(storage, checked)
    except InspectorError as exc:
        return f"shard {name}{_joined(exc.reason)}"


def _pieces(
    weight_map: dict[str, Any] | None, shards: dict[str, Shard | str], index: str
) -> tuple[dict[str, list[Piece] | str], list[str]]:
    """Each key's stored pieces (or why it has none), and keys in shards but not in the index."""
    pieces: dict[str, list[Piece] | str] = {}
    for key, name in (weight_map or {}).items():
        shard = shards.get(name) if isinstance(name, str) else None
        if not isinstance(name, str):
            pieces[key] = f"{index} maps it to {name!r}, not a file name"
        elif isinstance(shard, str) or shard is None:
            pieces[key] = shard or f"{index} maps it to {name}, which is not opened"
        elif (sub := shard.entry(key)) is None:
            pieces[key] = f"{index} puts it in {name}, which does not hold it"
        else:
            pieces[key] = [(name, sub)]
    extras = []
    for name, shard in shards.items():
        if isinstance(shard, str):
            continue
        for sub in shard.entries():
            if weight_map is not None:
                if sub.key in weight_map:
                    continue
                extras.append(sub.key)
            found = pieces.setdefault(sub.key, [])
            if isinstance(found, list):
                found.append((name, sub))
    return pieces, extras


def _common_metadata(shards: Any) -> dict[str, str]:
    """``__metadata__`` entries every shard agrees on (DCP's sharding table left out)."""
    tables = [s.metadata for s in shards]
    if not tables:
        return {}
    return {
        k: v
        for k, v in tables[0].items()
        if k != SHARDING_KEY and all(t.get(k) == v for t in tables[1:])
    }


def _joined(reason: str) -> str:
    """``" is missing"`` reads on from a file name; other reasons follow a colon."""
    return f" {reason}" if reason.startswith("is ") else f": {reason}"
