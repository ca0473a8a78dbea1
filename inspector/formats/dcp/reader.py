"""torch.distributed.checkpoint directories written by ``FileSystemWriter``.

``.metadata`` (decoded by safe_pickle) lists every key, its global shape and its chunks;
each chunk is a torch.save archive at a byte range of a ``__<rank>_<n>.distcp`` file.
With ``serialization_format=SAFETENSORS`` a ``.distcp`` file is instead the rank's
objects (torch.save archives) followed by one safetensors file holding all its tensor
chunks; every tensor's storage offset then points at that safetensors header, and the
real byte ranges come from the header.
"""

from __future__ import annotations

import array
import dataclasses
import functools
import io
import itertools
import math
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import TYPE_CHECKING, Any

from inspector import dtypes
from inspector.components import component_of
from inspector.entry import ChunkInfo, Entry, Kind, layout_problem, make_entry
from inspector.errors import CorruptCheckpointError, InspectorError, UnsupportedError
from inspector.formats import producers, safe_pickle
from inspector.formats.base import ChunkValue, Step, StoredRecord, file_sizes
from inspector.formats.dcp import megatron
from inspector.formats.dcp.metadata import (
    BytesStorageMetadata,
    Metadata,
    StorageInfo,
    TensorStorageMetadata,
)
from inspector.formats.safe_pickle import DtypeName, SubclassRef, TensorRef, UnknownDtype, direct
from inspector.formats.safe_pickle.direct import MetadataEntries
from inspector.formats.safetensors import Header, plain_description, read_header, read_span
from inspector.formats.torch_archive import TorchArchive, is_zip, zip_members
from inspector.reprs import bounded_repr
from inspector.storage.base import ByteRange, Storage, Stream
from inspector.words import inflected

if TYPE_CHECKING:
    import torch

METADATA_FILE = ".metadata"
RANK_METADATA = re.compile(r"__(\d+)\.metadata$")
RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp$")
_ZSTD = "stream.zstd/1"
_TRANSFORM_SLACK = 1 << 20
# zstd's densest encoding (RLE blocks) stores 128 KiB in 4 bytes: no genuine compressed item
# expands more, so a chunk claiming more is refused before anything is allocated for it.
_MAX_ZSTD_RATIO = 1 << 15
_MAX_DIMS = 64
_MAX_INT = 1 << 62
_FEW_CHUNKS = 8  # up to this many chunks per key, offsets and sizes are checked one by one
# A torch archive's local headers lie in its first bytes (data.pkl is small), its directory
# in its last; an audit prefetches these for this many items at a time.
_ARCHIVE_HEAD, _ARCHIVE_TAIL, _RECORD_BATCH = 1 << 13, 1 << 12, 512

_table: ModuleType | None
try:
    from inspector.formats.dcp import _table
except ImportError:  # installed without a C compiler: the Python below builds every entry
    _table = None
_TABLE_CONSTS = (  # what _table.entries needs from Python, in the order _table.c names them
    TensorStorageMetadata,
    BytesStorageMetadata,
    StorageInfo,
    DtypeName,
    {name: name for name in dtypes.NAMES},
    ChunkInfo,
    Entry,
    layout_problem,
)


def metadata_files(storage: Storage, folder: str = "") -> list[str]:
    """``.metadata``, or the per-rank ``__<r>.metadata`` files written without collectives
    (whatever they are: one that is not a regular file is refused when read, by name)."""
    try:
        listed = storage.list(folder)
    except InspectorError:
        # A storage that cannot list (a web server without index pages) may still hold it.
        whole = f"{folder}/{METADATA_FILE}" if folder else METADATA_FILE
        return [METADATA_FILE] if storage.kind(whole) == "file" else []
    names = {name for name, _kind in listed}
    if METADATA_FILE in names:
        return [METADATA_FILE]
    return sorted(
        (n for n in names if RANK_METADATA.fullmatch(n)),
        key=lambda n: int(RANK_METADATA.fullmatch(n).group(1)),  # type: ignore[union-attr]
    )


def is_dcp_dir(storage: Storage) -> bool:
    return storage.kind() == "dir" and bool(metadata_files(storage))


def _unfinished_ranks(storage: Storage, files: list[str]) -> list[str]:
    """Ranks whose data files exist but whose ``__<rank>.metadata`` does not (saves without
    collectives only: each rank writes its metadata when its own save is done)."""
    listed = {m.group(1) for f in files if (m := RANK_METADATA.fullmatch(f))}
    if not listed:
        return []
    data = {m.group(1) for n, _ in storage.list() if (m := RANK_FILE.fullmatch(n))}
    return sorted(data - listed, key=int)


class DcpSource:
    """A DCP checkpoint folder: metadata at open, chunk byte ranges on demand."""

    name = ""
    key_matching = "stored"  # DCP's loader matches keys as stored
    steps: tuple[Step, ...] = ()

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        files = metadata_files(storage) or [METADATA_FILE]
        self.metadata_name = files[0]
        referrer = storage.describe(self.metadata_name)
        left_out: list[str] = []
        read = _read(storage, files, referrer, left_out)
        notes = [f"{self.metadata_name} found: torch.distributed.checkpoint (DCP) folder"]
        if len(files) > 1:
            notes.append(f"{len(files)} per-rank metadata files (saved without collectives)")
        self.nesting = "DCP planner_data" if read.has_planner else "key names (no planner_data)"
        entries = read.entries
        self.megatron = megatron.read_marker(storage) is not None
        legacy_common = megatron.legacy_common_entry(storage) if self.megatron else None
        entries, self._safetensors = _place_safetensors_chunks(storage, entries)
        entries = _check_items(entries, self._safetensors, self.metadata_name)
        unfinished = _unfinished_ranks(storage, files)
        whys = [f"unreadable per-rank metadata {', '.join(left_out)}: its chunks are not listed"]
        if unfinished:
            whys.append(
                f"the save of {inflected(len(unfinished), 'rank')} {', '.join(unfinished)} "
                "did not finish (no "
                f"{', '.join(f'__{r}.metadata' for r in unfinished)}): their chunks are not listed"
            )
        for why in whys[0 if left_out else 1 :]:
            notes.append(why)
            entries = [
                dataclasses.replace(e, error=f"{e.error}; {why}") if e.error else e for e in entries
            ]
        self._entries = [*entries, *([legacy_common] if legacy_common else [])]
        self.format = "dcp-safetensors" if self._safetensors else "dcp"
        if self._safetensors:
            notes.append(
                ".distcp files hold safetensors data (serialization_format=SAFETENSORS): "
                "tensor byte ranges taken from their headers"
            )
        self.notes = tuple(notes)
        data_files = sorted({c.file for e in self._entries for c in e.chunks})
        self.source_files = (*files, *data_files)
        ranks = {m.group(1) for f in data_files if (m := RANK_FILE.fullmatch(f))}
        ranks |= {m.group(1) for f in files if (m := RANK_METADATA.fullmatch(f))}
        self.ranks = len(ranks) or None
        self.metadata = {"version": _text(read.version)}
        if read.checkpoint_id is not None:
            self.metadata["saved_to"] = _text(read.checkpoint_id)
        self.producer, evidence = self._producer(storage)
        self.notes = (*self.notes, evidence)
        if self.megatron:
            shown, more = megatron.describe(self._entries, self._decoded)
            self.metadata |= shown
            self.notes = (*self.notes, *more)

    def _producer(self, storage: Storage) -> tuple[str, str]:
        """Who wrote it, by evidence (Megatron's marker, the folder's files, the keys);
        a DCP folder with none is torch DCP's own."""
        if self.megatron:
            name = producers.MEGATRON.name
            return name, f"producer: {name}, from {megatron.MARKER}"
        try:
            files = [n + "/" * (kind == "dir") for n, kind in storage.list()]
        except InspectorError:
            files = []
        paths = (e.nested_path for e in self._entries)
        found, evidence = producers.identify(files, paths, fallback=producers.TORCH_DCP)
        return found.name, evidence

    def entries(self) -> list[Entry]:
        return self._entries

    @functools.cached_property
    def run_args(self) -> dict[str, Any]:
        """The training run's arguments where the checkpoint saved them (Megatron's common
        state ``args``, plain values only); empty otherwise."""
        return megatron.run_args(self._entries, self._decoded) if self.megatron else {}

    def _name(self, chunk: ChunkInfo, key: str) -> str:
        """The chunk's file, checked to stay inside the folder (cached by the storage)."""
        return self.storage.check(chunk.file, referrer=self.metadata_name, key=key)

    @contextmanager
    def _item(self, entry: Entry, chunk: ChunkInfo) -> Iterator[tuple[Stream, int, str]]:
        """The chunk's stored bytes as a bounded stream (its length and the file's label)."""
        name = self._name(chunk, entry.key)
        label = self.storage.describe(name)
        if chunk.transforms:
            data = _untransform(self.storage, name, chunk, entry)
            yield io.BytesIO(data), len(data), label
            return
        with self.storage.window(name, chunk.byte_offset, chunk.byte_length) as window:
            yield window, chunk.byte_length, label

    def _archive(
        self, f: Stream, length: int, label: str, chunk: ChunkInfo, key: str
    ) -> TorchArchive:
        if not is_zip(f.read(4)):
            raise CorruptCheckpointError(
                f"no torch.save archive at byte {chunk.byte_offset} "
                "(wrong offset, or a safetensors .distcp)",
                file=label,
                key=key,
            )
        f.seek(0)
        return TorchArchive(f, label, length, key)

    def read_chunk(self, entry: Entry, index: int, out: torch.Tensor | None = None) -> ChunkValue:
        chunk = entry.chunks[index]
        dtype = _dtype(entry)
        if chunk.file in self._safetensors:
            return read_span(
                self.storage, self._name(chunk, entry.key), chunk, dtype, out, key=entry.key
            )
        with self._item(entry, chunk) as (f, length, label):
            archive = self._archive(f, length, label, chunk, entry.key)
            value = archive.load_whole()
            if isinstance(value, SubclassRef):
                _check_shape(value.shape, chunk, entry, label)
                return archive.materialize(value)
            if not isinstance(value, TensorRef):
                raise CorruptCheckpointError(
                    f"chunk at {list(chunk.offsets)} holds a {type(value).__name__}, not a tensor",
                    file=label,
                    key=entry.key,
                )
            _check_shape(value.shape, chunk, entry, label)
            if value.dtype != dtype:
                raise CorruptCheckpointError(
                    f"chunk dtype {value.dtype} differs from metadata dtype {dtype}",
                    file=label,
                    key=entry.key,
                )
            return archive.read_tensor(value, out)

    def read_object(self, entry: Entry) -> Any:
        return self._object(entry, materialize=True)

    def _decoded(self, entry: Entry) -> Any:
        """The object as decoded, tensors left as descriptions (nothing of torch loads)."""
        return self._object(entry, materialize=False)

    def _object(self, entry: Entry, *, materialize: bool) -> Any:
        chunk = entry.chunks[0]
        with self._item(entry, chunk) as (f, length, label):
            if not is_zip(f.read(4)):
                f.seek(0)
                return f.read(length)
            f.seek(0)
            archive = TorchArchive(f, label, length, entry.key)
            value = archive.load_whole()
            value = archive.materialize(value) if materialize else value
        return megatron.unwrap(entry.key, value) if self.megatron else value

    def chunk_bytes(self, entry: Entry, index: int) -> ByteRange | None:
        chunk = entry.chunks[index]
        name = self._name(chunk, entry.key)
        if chunk.file in self._safetensors:
            return ByteRange(self.storage, name, chunk.byte_offset, chunk.byte_length)
        if chunk.transforms:
            return None
        dtype = _dtype(entry)
        where = self._on_archive(entry, index, lambda a: a.contiguous_bytes(chunk.sizes, dtype))
        if where is None:
            return None
        return ByteRange(self.storage, name, chunk.byte_offset + where.start, where.size, where.crc)

    def chunk_globals(self, entry: Entry, index: int) -> list[str]:
        if entry.chunks[index].file in self._safetensors:
            return []
        return self._on_archive(entry, index, TorchArchive.pickle_globals)

    def describe_chunk(self, entry: Entry, index: int) -> TensorRef | SubclassRef:
        if entry.chunks[index].file in self._safetensors:
            return plain_description(entry, index)
        return self._on_archive(entry, index, TorchArchive.load)

    def stored_records(self) -> Iterator[StoredRecord]:
        """Each item's zip records with their CRC-32 (safetensors-format tensor chunks and raw
        byte items: the item itself, no checksum), file by file in offset order. An item
        that runs past its file's end, or whose file is missing, is listed whole, unopened."""
        items = sorted(
            (
                (chunk.file, chunk.byte_offset, i, entry)
                for entry in self._entries
                for i, chunk in enumerate(entry.chunks)
                if type(chunk.byte_offset) is int and type(chunk.byte_length) is int
            ),
            key=lambda item: item[:2],
        )
        sizes: dict[str, int | None] = {}
        for start in range(0, len(items), _RECORD_BATCH):
            batch = items[start : start + _RECORD_BATCH]
            with self.storage.prefetch(self._archive_ends(batch)):
                for file, _, index, entry in batch:
                    if file not in sizes:
                        sizes[file] = self._size(file)
                    yield from self._item_records(entry, index, sizes[file])

    def _archive_ends(self, batch: list[tuple[str, int, int, Entry]]) -> list[ByteRange]:
        """What parsing the items' zip directories reads: each item's head (its first local
        headers) and tail (the directory), so a remote storage fetches a batch's at once."""
        ranges = []
        for file, offset, index, entry in batch:
            try:
                name = self.storage.check(file, referrer=self.metadata_name, key=entry.key)
            except InspectorError:
                continue  # listed whole, unopened
            length = entry.chunks[index].byte_length
            ranges.append(ByteRange(self.storage, name, offset, min(length, _ARCHIVE_HEAD)))
            if length > _ARCHIVE_HEAD:
                tail = min(length - _ARCHIVE_HEAD, _ARCHIVE_TAIL)
                ranges.append(ByteRange(self.storage, name, offset + length - tail, tail))
        return ranges

    def _size(self, file: str) -> int | None:
        try:
            return self.storage.size(self.storage.check(file, referrer=self.metadata_name))
        except InspectorError:
            return None

    def _item_records(self, entry: Entry, index: int, size: int | None) -> Iterator[StoredRecord]:
        chunk = entry.chunks[index]
        where = f"the item of chunk {list(chunk.offsets)}" if entry.kind == "tensor" else "the item"
        whole = StoredRecord(
            entry.key, chunk.file, chunk.byte_offset, chunk.byte_length, None, where
        )
        if size is None or chunk.byte_offset + chunk.byte_length > size or chunk.transforms:
            yield whole
            return
        if chunk.file in self._safetensors and entry.kind == "tensor":
            yield whole._replace(what=f"safetensors data of chunk {list(chunk.offsets)}")
            return
        name = self.storage.check(chunk.file, referrer=self.metadata_name, key=entry.key)
        label = self.storage.describe(name)
        with self.storage.window(name, chunk.byte_offset, chunk.byte_length) as f:
            if not is_zip(f.read(4)):
                yield whole._replace(what=f"{where} (raw bytes)")
                return
            try:
                members = zip_members(f, chunk.byte_length, file=label, key=entry.key)
            except InspectorError as exc:
                yield whole._replace(problem=exc.reason)
                return
        for m in members:
            yield StoredRecord(
                entry.key,
                chunk.file,
                chunk.byte_offset + m.start,
                m.size,
                m.crc32,
                f"zip record {m.name} of {where} at byte {chunk.byte_offset}",
            )

    def _on_archive(self, entry: Entry, index: int, method: Callable[[TorchArchive], Any]) -> Any:
        """``method`` applied to chunk ``index``'s archive; only its small records are read."""
        chunk = entry.chunks[index]
        with self._item(entry, chunk) as (f, length, label):
            return method(self._archive(f, length, label, chunk, entry.key))


def _dtype(entry: Entry) -> str:
    if entry.dtype is None:
        raise CorruptCheckpointError("has no dtype", key=entry.key)
    return entry.dtype


def _text(value: Any) -> str:
    """A metadata value as text, bounded (a lying file can hold a 5000-digit int)."""
    return bounded_repr(value, 200) if not isinstance(value, str) else value[:200]


# --- safetensors-format saves ---------------------------------------------------------------


def _place_safetensors_chunks(
    storage: Storage, entries: list[Entry]
) -> tuple[list[Entry], set[str]]:
    """For a SAFETENSORS-format save, point tensor chunks at their bytes and return those
    files. Judged by content: the first tensor chunk's bytes start a safetensors header."""
    first = next((e for e in entries if e.kind == "tensor" and e.chunks and not e.error), None)
    if first is None or not _safetensors_at(storage, first.chunks[0]):
        return entries, set()
    tensors = [e for e in entries if e.kind == "tensor" and e.chunks and not e.error]
    by_file: dict[str, list[Entry]] = {}
    for entry in tensors:
        for chunk in entry.chunks:
            by_file.setdefault(chunk.file, []).append(entry)
    headers: dict[str, Header | str] = {}
    for name, users in by_file.items():
        try:
            starts = {c.byte_offset for e in users for c in e.chunks if c.file == name}
            headers[name] = _blob_header(storage, name, starts)
        except InspectorError as exc:
            headers[name] = exc.located
    placed = {id(e) for e in tensors}
    return [_placed(e, headers) if id(e) in placed else e for e in entries], set(by_file)


def _safetensors_at(storage: Storage, chunk: ChunkInfo) -> bool:
    """Whether the chunk's bytes start a safetensors header: a JSON object after the 8-byte
    length (a damaged length is reported when the header is read, not taken for a zip)."""
    try:
        name = storage.check(chunk.file, referrer=storage.location)
        head = storage.read(name, chunk.byte_offset, 9)
    except InspectorError:
        return False
    return not is_zip(head) and head[8:9] == b"{"


def _blob_header(storage: Storage, name: str, starts: set[int]) -> Header:
    checked = storage.check(name, referrer=storage.location)
    if len(starts) != 1:
        raise CorruptCheckpointError(
            f"tensor chunks of {name} point at {len(starts)} different bytes, "
            "not at one safetensors header",
            file=storage.describe(checked),
        )
    return read_header(storage, checked, offset=starts.pop())


def _placed(entry: Entry, headers: dict[str, Header | str]) -> Entry:
    """The entry with each chunk given the byte range its file's header records for the key."""
    chunks = []
    for chunk in entry.chunks:
        header = headers[chunk.file]
        if isinstance(header, str):
            return dataclasses.replace(entry, error=header)
        span = header.tensors.get(entry.key)
        if span is None or span.error:
            problem = span.error if span else f"{chunk.file} does not hold this key's chunk"
            return dataclasses.replace(entry, error=problem)
        if span.dtype != entry.dtype or span.shape != chunk.sizes:
            return dataclasses.replace(
                entry,
                error=f"{chunk.file} stores {span.dtype} {list(span.shape or ())}, "
                f"metadata says {entry.dtype} {list(chunk.sizes)}",
            )
        chunks.append(chunk._replace(byte_offset=span.start, byte_length=span.length))
    return dataclasses.replace(entry, chunks=tuple(chunks))


def _check_shape(shape: tuple[int, ...], chunk: ChunkInfo, entry: Entry, label: str) -> None:
    if tuple(shape) != chunk.sizes:
        raise CorruptCheckpointError(
            f"chunk at {list(chunk.offsets)} stores shape {list(shape)}, "
            f"metadata says {list(chunk.sizes)}",
            file=label,
            key=entry.key,
        )


def _untransform(storage: Storage, name: str, chunk: ChunkInfo, entry: Entry) -> bytes:
    label = storage.describe(name)
    if list(chunk.transforms) != [_ZSTD]:
        raise UnsupportedError(
            f"unknown stream transforms {list(chunk.transforms)}", file=label, key=entry.key
        )
    try:
        import zstandard
    except ImportError as exc:
        raise UnsupportedError(
            "chunk is zstd-compressed; install the 'zstandard' package to read it",
            file=label,
            key=entry.key,
        ) from exc
    limit = chunk.numel * (dtypes.itemsize(entry.dtype) if entry.dtype else 1) + _TRANSFORM_SLACK
    compressed = storage.read(name, chunk.byte_offset, chunk.byte_length)
    try:
        data = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(compressed)).read(limit + 1)
    except zstandard.ZstdError as exc:
        raise CorruptCheckpointError(
            f"zstd data is damaged ({exc})", file=label, key=entry.key
        ) from exc
    if len(data) > limit:
        raise CorruptCheckpointError(
            "zstd data expands beyond the chunk's size", file=label, key=entry.key
        )
    return data


# --- metadata --------------------------------------------------------------------------------


def _read(
    storage: Storage, files: list[str], referrer: str, left_out: list[str]
) -> MetadataEntries:
    """The entries the metadata files describe: one sound ``.metadata`` read straight into
    them (safe_pickle.direct); any other, or per-rank files, unpickled, merged, and their
    entries built by _table.c and Python (this path names every problem). Unreadable
    per-rank files are named in ``left_out``."""
    if len(files) == 1:
        first = storage.read(files[0])
        found = direct.metadata_entries(
            first, lambda names: file_sizes(storage, names, referrer=referrer)
        )
        if found is not None:
            return found
        parts = [_read_metadata(storage, files[0], first)]
    else:
        parts = _rank_metadata(storage, files, left_out)
    raw, problems = _merge(parts, referrer)
    entries = [_with_component(e) for e in _entries(raw, problems, storage, referrer)]
    checkpoint_id = getattr(getattr(raw, "storage_meta", None), "checkpoint_id", None)
    return MetadataEntries(
        entries, isinstance(raw.planner_data, dict), getattr(raw, "version", None), checkpoint_id
    )


def _with_component(entry: Entry) -> Entry:
    """The entry with its component, where planner_data gave its path (as the direct reader
    builds it; keys.components guesses the others)."""
    if not entry.nested_path:
        return entry
    e, component = entry, component_of(entry.kind, entry.nested_path)
    return make_entry(e.key, e.kind, e.dtype, e.shape, e.chunks, e.nested_path, component, e.error)


def _rank_metadata(
    storage: Storage, files: list[str], left_out: list[str]
) -> list[tuple[Metadata, dict[str, str]]]:
    """Each readable per-rank metadata file, checked; one that is not a regular file or
    lacks its tables is left out and named in ``left_out`` with why (its rank's chunks are
    then missing, which marks the keys they belong to), unless none is readable."""
    parts, failures = [], []
    for name in files:
        try:
            parts.append(_read_metadata(storage, name, storage.read(name)))
        except InspectorError as exc:
            failures.append(exc)
            left_out.append(f"{name} ({exc.reason})")
    if not parts:
        raise failures[0]
    return parts


def _read_metadata(storage: Storage, name: str, data: bytes) -> tuple[Metadata, dict[str, str]]:
    """One metadata file (``data``), its tables checked; and the keys it describes in a way
    that cannot be genuine, each with why."""
    metadata = safe_pickle.load_metadata(data, file=storage.describe(name))
    for table in ("state_dict_metadata", "storage_data"):
        if not isinstance(getattr(metadata, table, None), dict):
            raise CorruptCheckpointError(
                f"metadata has no {table} table", file=storage.describe(name)
            )
    return metadata, _shared_chunk_lists(metadata.state_dict_metadata, name)


def _shared_chunk_lists(table: dict, source: str) -> dict[str, str]:
    """Keys whose chunk list is also another key's. Each key of a genuine file has its own;
    one list shared through the pickle's memo by thousands of keys would be walked (and
    merged) once per key."""
    firsts = (
        _table.shared_chunk_lists(table, TensorStorageMetadata) if _table else _first_owners(table)
    )
    return {
        key: f"{source} gives this key the chunk list of key {_text(first)}"
        for key, first in firsts.items()
    }


def _first_owners(table: dict) -> dict[Any, Any]:
    """{key: the first key with the same chunk list object}, for keys that share one."""
    owner: dict[int, Any] = {}
    found = {}
    for key, md in table.items():
        chunks = md.chunks if isinstance(md, TensorStorageMetadata) else None
        if isinstance(chunks, list) and (first := owner.setdefault(id(chunks), key)) is not key:
            found[key] = first
    return found


def _merge(
    parts: list[tuple[Metadata, dict[str, str]]], referrer: str
) -> tuple[Metadata, dict[str, str]]:
    """Union of per-rank metadata files (``__<r>.metadata``); one file is returned as is.
    Keys found malformed in any file keep the first reason and are not merged."""
    merged, problems = parts[0][0], dict(parts[0][1])
    for part, found in parts[1:]:
        for key, why in found.items():
            problems.setdefault(key, why)
        for key, md in part.state_dict_metadata.items():
            mine = merged.state_dict_metadata.setdefault(key, md)
            if mine is md or key in problems or not isinstance(mine, TensorStorageMetadata):
                continue
            if not (
                isinstance(mine.chunks, list) and isinstance(getattr(md, "chunks", None), list)
            ):
                raise CorruptCheckpointError(
                    f"per-rank chunk lists of {_text(key)} are malformed", file=referrer
                )
            have = {_box(c) for c in mine.chunks}
            # Without collectives nothing is de-duplicated: a replicated tensor's chunk
            # is in every rank's file; one copy is read.
            mine.chunks.extend(c for c in md.chunks if _box(c) not in have)
        merged.storage_data.update(part.storage_data)
        if isinstance(part.planner_data, dict) and isinstance(merged.planner_data, dict):
            merged.planner_data.update(part.planner_data)
    return merged, problems


def _box(chunk: Any) -> tuple:
    """A chunk record's place (offsets, sizes), comparable across files."""
    offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
    return (
        tuple(offsets) if isinstance(offsets, (tuple, list)) else id(chunk),
        tuple(sizes) if isinstance(sizes, (tuple, list)) else id(chunk),
    )


def _entries(
    md: Metadata, problems: dict[str, str], storage: Storage, referrer: str
) -> list[Entry]:
    planner = md.planner_data if isinstance(md.planner_data, dict) else None
    storage_by_key, names = (_table.storage_by_key if _table else _storage_by_key)(md.storage_data)
    sizes = file_sizes(storage, names, referrer=referrer)
    source = referrer.rsplit("/", 1)[-1]
    entries: list[Entry] = []
    append = entries.append
    no_records: dict[tuple | None, Any] = {}
    table = md.state_dict_metadata
    fast = _fast_entries(table, storage_by_key, sizes, planner, problems)
    for (key, item), done in zip(table.items(), fast, strict=True):
        if done is not None:
            append(done)
            continue
        if not isinstance(key, str):
            raise CorruptCheckpointError(
                f"metadata key {_text(key)} is not a string", file=referrer
            )
        where = storage_by_key.get(key, no_records)
        kind: Kind = "tensor" if isinstance(item, TensorStorageMetadata) else "object"
        if key in problems:
            append(Entry(key, kind, error=problems[key]))
            continue
        try:
            nested = _nested_path(key, planner)
            if isinstance(item, TensorStorageMetadata):
                append(_tensor_entry(key, item, nested, where, sizes, source))
            elif isinstance(item, BytesStorageMetadata):
                append(_object_entry(key, nested, where, sizes, source))
            else:
                raise TypeError(f"unknown storage metadata {type(item).__name__}")
        except (TypeError, ValueError, AttributeError, OverflowError) as exc:
            append(Entry(key, kind, error=f"malformed {source} ({_text(str(exc))})"))
    return entries


def _fast_entries(
    table: dict, by_key: dict, sizes: dict, planner: dict | None, problems: dict[str, str]
) -> Iterable[Entry | None]:
    """Each key's entry as the C table builds it where the key's records are well-formed;
    None where the Python below must build it (every key, without the C extension)."""
    if _table is None or type(planner) not in (dict, type(None)):
        return itertools.repeat(None, len(table))
    return _table.entries(table, by_key, sizes, planner, problems, _TABLE_CONSTS)


def _nested_path(key: str, planner: dict | None) -> tuple:
    """The key's path from planner_data; () when the planner kept none (guessed later).
    Path elements must be strings or small ints (a lying file can hold anything there)."""
    if planner is None:
        return ()
    path = planner.get(key)
    if not isinstance(path, (tuple, list)) or not path:
        return (key,)
    if len(path) > 64:
        raise ValueError("planner_data path is not a list of names and small indices")
    for p in path:
        if not (isinstance(p, str) or (type(p) is int and 0 <= p < 1 << 20)):
            raise ValueError("planner_data path is not a list of names and small indices")
    return tuple(path)


def _storage_by_key(storage_data: dict) -> tuple[dict[str, dict[tuple | None, Any]], set[str]]:
    """Storage records by key, then by chunk offsets (None for objects), and the file names
    they refer to. Offsets are checked where chunks look them up (only valid ones are looked
    up); a record whose offsets cannot even be a key is left out (its chunk has no record)."""
    by_key: dict[str, dict[tuple | None, Any]] = {}
    names = set()
    for index, info in storage_data.items():
        fqn = getattr(index, "fqn", None)
        offset = getattr(index, "offset", None)
        if not isinstance(fqn, str):
            continue
        per = by_key.get(fqn)
        if per is None:
            per = by_key[fqn] = {}
        try:
            per[None if offset is None else tuple(offset)] = info
        except TypeError:  # not a sequence, or holding unhashable values
            continue
        name = getattr(info, "relative_path", None)
        if isinstance(name, str):
            names.add(name)
    return by_key, names


def _tensor_entry(key: str, md: Any, nested: tuple, where: dict, sizes: dict, source: str) -> Entry:
    """The entry of a tensor; problems that ``.metadata`` itself shows are named after it."""
    dtype = getattr(getattr(md, "properties", None), "dtype", None)
    name = _dtype_name(dtype)
    shape = _dims(md.size)
    if name is None or shape is None or math.prod(shape) >= _MAX_INT:
        shown = _text(repr(dtype) if isinstance(dtype, (DtypeName, UnknownDtype)) else dtype)
        problem = f"{source} gives an invalid dtype {shown} or shape {_text(md.size)}"
        return Entry(key, "tensor", dtype=name, nested_path=nested, error=problem)
    boxes = _boxes(md.chunks if isinstance(md.chunks, list) else [], len(shape))
    if boxes is None:
        problem = f"{source} gives a chunk malformed offsets or sizes"
        return Entry(key, "tensor", dtype=name, shape=shape, nested_path=nested, error=problem)
    chunks = []
    error = None
    for offsets, csizes in boxes:
        info = where.get(offsets)
        if info is None:
            error = error or f"{source} has no storage record for the chunk at {_text(offsets)}"
            continue
        chunks.append(stored := _chunk(offsets, csizes, info))
        error = error or _chunk_problem(stored, sizes, source)
    found = tuple(chunks)
    if error is None and (layout := layout_problem(shape, found)):
        error = f"{layout} (per {source})"
    return make_entry(key, "tensor", name, shape, found, nested, "other", error)


_DTYPE_NAMES: dict[str, str | None] = {}


def _dtype_name(dtype: Any) -> str | None:
    """The dtype's name when a pickle gave a known one (looked up once per name)."""
    if not isinstance(dtype, DtypeName):
        return None
    name = _DTYPE_NAMES.get(dtype, "")
    if name == "":
        name = _DTYPE_NAMES[str(dtype)] = str(dtype) if dtypes.is_known(str(dtype)) else None
    return name


def _object_entry(key: str, nested: tuple, where: dict, sizes: dict, source: str) -> Entry:
    info = where.get(None) or next(iter(where.values()), None)
    if info is None:
        return Entry(
            key,
            "object",
            nested_path=nested,
            error=f"{source} has no storage record for this object",
        )
    chunk = _chunk((), (), info)
    error = _chunk_problem(chunk, sizes, source)
    return make_entry(key, "object", None, None, (chunk,), nested, "other", error)


def _chunk(offsets: tuple, sizes: tuple, info: Any) -> ChunkInfo:
    """The chunk an item's ``_StorageInfo`` describes (TypeError if it is not one)."""
    transforms = getattr(info, "transform_descriptors", None) or ()
    if not isinstance(info.relative_path, str) or (
        transforms and not all(isinstance(t, str) for t in transforms)
    ):
        raise TypeError("storage record names no file")
    fields = (offsets, sizes, info.relative_path, info.offset, info.length, tuple(transforms))
    return _new_chunk(ChunkInfo, fields)  # ChunkInfo(*fields), without its Python __new__


_new_chunk = tuple.__new__


def _boxes(chunks: list, ndim: int) -> list[tuple[tuple, tuple]] | None:
    """Each chunk record's (offsets, sizes): ``ndim`` ints in ``[0, 2**62)`` each; None when
    any is not. This runs for every chunk of every key: a few chunks are checked in a loop,
    many at once as one int64 array."""
    boxes = []
    for chunk in chunks:
        offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
        if not (
            isinstance(offsets, (tuple, list))
            and isinstance(sizes, (tuple, list))
            and len(offsets) == len(sizes) == ndim
        ):
            return None
        boxes.append((tuple(offsets), tuple(sizes)))
    if len(boxes) > _FEW_CHUNKS:
        try:
            numbers = array.array("q", itertools.chain.from_iterable(itertools.chain(*boxes)))
        except (TypeError, OverflowError):  # not ints, or past int64
            return None
        return boxes if not numbers or (min(numbers) >= 0 and max(numbers) < _MAX_INT) else None
    for box in boxes:
        for dims in box:
            for n in dims:
                if type(n) is not int or n < 0 or n >= _MAX_INT:
                    return None
    return boxes


def _dims(value: Any) -> tuple[int, ...] | None:
    """A shape, offsets or sizes: at most 64 ints in ``[0, 2**62)`` (so any message can
    print them); None if not."""
    if not isinstance(value, (tuple, list)) or len(value) > _MAX_DIMS:
        return None
    for n in value:  # a loop, not all(...): this runs for every chunk of every key
        if type(n) is not int or n < 0 or n >= _MAX_INT:
            return None
    return tuple(value)


def _chunk_problem(chunk: ChunkInfo, sizes: dict, source: str) -> str | None:
    """What is wrong with the chunk's storage record, as far as ``.metadata`` shows; None."""
    size = sizes.get(chunk.file)
    if size is None:
        return f"bad file name {_text(chunk.file)}"
    if isinstance(size, str):
        return size
    if _dims((chunk.byte_offset, chunk.byte_length)) is None:  # two plain ints in range
        return (
            f"bad byte range {_text(chunk.byte_offset)}+{_text(chunk.byte_length)} in {chunk.file}"
        )
    if chunk.byte_offset + chunk.byte_length > size:
        return (
            f"{chunk.file} has {size} bytes but the chunk at {list(chunk.offsets)} ends at byte "
            f"{chunk.byte_offset + chunk.byte_length} (file truncated?)"
        )
    return None


def _check_items(entries: list[Entry], safetensors: set[str], source: str) -> list[Entry]:
    """Entries whose items cannot hold what ``.metadata`` claims, or share bytes with another
    item (each item of a genuine file has its own byte range), get their error set."""
    if _table is not None and _table.items_fit(entries, safetensors, _MAX_ZSTD_RATIO):
        return entries  # the C check found nothing to set (the loops below would agree)
    problems: dict[int, str] = {}
    ranges = []
    for i, entry in enumerate(entries):
        if entry.error:
            continue
        for chunk in entry.chunks:
            if entry.kind == "tensor" and chunk.file not in safetensors:
                problem = _too_small(entry, chunk, source)
                if problem:
                    problems.setdefault(i, problem)
            end = chunk.byte_offset + chunk.byte_length
            ranges.append((chunk.file, chunk.byte_offset, end, i))
    for (file, start, end, one), (_, _, _, two) in _overlaps(ranges):
        for a, b in ((one, two), (two, one)):
            problems.setdefault(
                a,
                f"bytes {start}..{end} of {file} overlap the item of key "
                f"{entries[b].key!r} (per {source})",
            )
    return [
        dataclasses.replace(e, error=problems[i]) if i in problems else e
        for i, e in enumerate(entries)
    ]


def _too_small(entry: Entry, chunk: ChunkInfo, source: str) -> str | None:
    """Why the chunk's item is too small for its elements (None if it is not), so a lying
    shape is refused before anything is allocated for it. Quantized subclasses store less
    than their logical dtype, but no format stores an element in under a bit."""
    elements = chunk.numel
    room = chunk.byte_length * 8 * (_MAX_ZSTD_RATIO if chunk.transforms else 1)
    if elements <= room:
        return None
    return (
        f"the chunk at {list(chunk.offsets)} has {elements} elements but its item in "
        f"{chunk.file} has only {chunk.byte_length} bytes (per {source})"
    )


def _overlaps(ranges: list[tuple]) -> list[tuple[tuple, tuple]]:
    """Pairs of (file, start, end, ...) ranges that share bytes; empty ranges share none."""
    found = []
    last: tuple | None = None
    for item in sorted((r for r in ranges if r[2] > r[1]), key=lambda r: (r[0], r[1])):
        if last is not None and last[0] == item[0] and item[1] < last[2]:
            found.append((item, last))
        if last is None or last[0] != item[0] or item[2] > last[2]:
            last = item
    return found
