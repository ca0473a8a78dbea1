"""torch.distributed.checkpoint directories written by ``FileSystemWriter``.

``.metadata`` (decoded by safe_pickle) lists every key, its global shape and its chunks;
each chunk is a torch.save archive at a byte range of a ``__<rank>_<n>.distcp`` file.
With ``serialization_format=SAFETENSORS`` a ``.distcp`` file is instead the rank's
objects (torch.save archives) followed by one safetensors file holding all its tensor
chunks; every tensor's storage offset then points at that safetensors header, and the
real byte ranges come from the header.
"""

from __future__ import annotations

import dataclasses
import io
import math
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import torch

from inspector.entry import ChunkInfo, Entry, layout_problem
from inspector.errors import CorruptCheckpointError, InspectorError, UnsupportedError
from inspector.formats import safe_pickle
from inspector.formats.base import ChunkValue, file_sizes, resolve_inside
from inspector.formats.dcp.metadata import BytesStorageMetadata, TensorStorageMetadata
from inspector.formats.safe_pickle import SubclassRef, TensorRef
from inspector.formats.safetensors import (
    Header,
    plain_description,
    read_header,
    read_span,
)
from inspector.formats.torch_archive import TorchArchive, is_zip

METADATA_FILE = ".metadata"
_ZSTD = "stream.zstd/1"
_TRANSFORM_SLACK = 1 << 20
# zstd's densest encoding (RLE blocks) stores 128 KiB in 4 bytes: no genuine compressed item
# expands more, so a chunk claiming more is refused before anything is allocated for it.
_MAX_ZSTD_RATIO = 1 << 15


def metadata_files(root: Path) -> list[Path]:
    """``.metadata``, or the per-rank ``__<r>.metadata`` files written without collectives."""
    main = root / METADATA_FILE
    if main.is_file():
        return [main]
    return sorted(root.glob("__*" + METADATA_FILE), key=lambda p: p.name)


def is_dcp_dir(root: Path) -> bool:
    return root.is_dir() and bool(metadata_files(root))


class DcpSource:
    """A DCP checkpoint folder: metadata at open, chunk byte ranges on demand."""

    format = "dcp"

    def __init__(self, root: Path) -> None:
        self.root = root
        self._files: dict[str, Path] = {}
        files = metadata_files(root)
        self.metadata_path = files[0] if files else root / METADATA_FILE
        raw = (
            _merge([_read_metadata(p) for p in files])
            if files
            else _read_metadata(self.metadata_path)
        )
        self.notes = (
            f"{self.metadata_path.name} found: torch.distributed.checkpoint (DCP) folder",
        )
        self.nesting = (
            "DCP planner_data"
            if isinstance(raw.planner_data, dict)
            else "key names (no planner_data)"
        )
        self._entries = _entries(raw, root, self.metadata_path)
        self._safetensors = _place_safetensors_chunks(root, self._entries)
        _check_items(self._entries, self._safetensors, self.metadata_path.name)
        if self._safetensors:
            self.format = "dcp-safetensors"
            self.notes += (
                ".distcp files hold safetensors data (serialization_format=SAFETENSORS): "
                "tensor byte ranges taken from their headers",
            )
        self.source_files = tuple(
            [p.name for p in files] + sorted({f for e in self._entries for f in e.files})
        )
        storage_meta = getattr(raw, "storage_meta", None)
        self.metadata = {"version": str(getattr(raw, "version", None))}
        if storage_meta is not None and getattr(storage_meta, "checkpoint_id", None) is not None:
            self.metadata["saved_to"] = str(storage_meta.checkpoint_id)

    def entries(self) -> list[Entry]:
        return self._entries

    def _file(self, name: str, key: str) -> Path:
        """``root / name`` checked to stay inside the folder (cached: scans touch every chunk)."""
        path = self._files.get(name)
        if path is None:
            path = resolve_inside(self.root, name, referrer=self.metadata_path, key=key)
            self._files[name] = path
        return path

    @contextmanager
    def _item(self, entry: Entry, chunk: ChunkInfo):
        """The chunk's stored bytes as a seekable stream positioned for a TorchArchive."""
        path = self._file(chunk.file, entry.key)
        with open(path, "rb") as f:
            if not chunk.transforms:
                yield f, chunk.byte_offset, chunk.byte_length, str(path)
                return
            data = _untransform(f, chunk, entry, str(path))
            yield io.BytesIO(data), 0, len(data), str(path)

    def _archive(self, f: BinaryIO, offset: int, length: int, path: str, key: str) -> TorchArchive:
        f.seek(offset)
        if not is_zip(f.read(4)):
            raise CorruptCheckpointError(
                f"no torch.save archive at byte {offset} (wrong offset, or a safetensors .distcp)",
                file=path,
                key=key,
            )
        return TorchArchive(f, path, offset, length, key)

    def read_chunk(self, entry: Entry, index: int, out: torch.Tensor | None = None) -> ChunkValue:
        chunk = entry.chunks[index]
        if chunk.file in self._safetensors:
            path = self._file(chunk.file, entry.key)
            return read_span(path, chunk, entry.dtype, out, key=entry.key)
        with self._item(entry, chunk) as (f, offset, length, path):
            archive = self._archive(f, offset, length, path, entry.key)
            value = archive.load()
            if isinstance(value, SubclassRef):
                value = archive.materialize(value)
                _check_shape(value.shape, chunk, entry, path)
                return value
            if not isinstance(value, TensorRef):
                raise CorruptCheckpointError(
                    f"chunk at {list(chunk.offsets)} holds a {type(value).__name__}, not a tensor",
                    file=path,
                    key=entry.key,
                )
            _check_shape(value.shape, chunk, entry, path)
            if value.dtype != entry.dtype:
                raise CorruptCheckpointError(
                    f"chunk dtype {value.dtype} differs from metadata dtype {entry.dtype}",
                    file=path,
                    key=entry.key,
                )
            return archive.read_tensor(value, out)

    def read_object(self, entry: Entry) -> Any:
        chunk = entry.chunks[0]
        with self._item(entry, chunk) as (f, offset, length, path):
            f.seek(offset)
            if not is_zip(f.read(4)):
                f.seek(offset)
                return f.read(length)
            archive = TorchArchive(f, path, offset, length, entry.key)
            return archive.materialize(archive.load())

    def chunk_bytes(self, entry: Entry, index: int) -> tuple[Path, int] | None:
        chunk = entry.chunks[index]
        path = self._file(chunk.file, entry.key)
        if chunk.file in self._safetensors:
            return path, chunk.byte_offset
        if chunk.transforms:
            return None
        start = self._on_archive(
            entry, index, lambda a: a.contiguous_start(chunk.sizes, entry.dtype)
        )
        return None if start is None else (path, start)

    def chunk_globals(self, entry: Entry, index: int) -> list[str]:
        if entry.chunks[index].file in self._safetensors:
            return []
        return self._on_archive(entry, index, TorchArchive.pickle_globals)

    def describe_chunk(self, entry: Entry, index: int) -> TensorRef | SubclassRef:
        if entry.chunks[index].file in self._safetensors:
            return plain_description(entry, index)
        return self._on_archive(entry, index, TorchArchive.load)

    def _on_archive(self, entry: Entry, index: int, method: Callable[[TorchArchive], Any]) -> Any:
        """``method`` applied to chunk ``index``'s archive; only its small records are read."""
        chunk = entry.chunks[index]
        with self._item(entry, chunk) as (f, offset, length, path):
            return method(self._archive(f, offset, length, path, entry.key))


def _place_safetensors_chunks(root: Path, entries: list[Entry]) -> set[str]:
    """For a SAFETENSORS-format save, point tensor chunks at their bytes; return those files.

    Judged by content: the first tensor chunk's bytes start a safetensors header, not a zip.
    """
    tensors = [e for e in entries if e.kind == "tensor" and e.chunks and not e.error]
    if not tensors or not _safetensors_at(root, tensors[0].chunks[0]):
        return set()
    by_file: dict[str, list[tuple[Entry, int]]] = {}
    for entry in tensors:
        for index, chunk in enumerate(entry.chunks):
            by_file.setdefault(chunk.file, []).append((entry, index))
    for name, items in by_file.items():
        try:
            header = _blob_header(root, name, {e.chunks[i].byte_offset for e, i in items})
        except InspectorError as exc:
            for entry, _ in items:
                entry.error = entry.error or exc.located
            continue
        for entry, index in items:
            _place(entry, index, header)
    return set(by_file)


def _safetensors_at(root: Path, chunk: ChunkInfo) -> bool:
    """Whether the chunk's bytes start a safetensors header: a JSON object after the 8-byte
    length (a damaged length is reported when the header is read, not taken for a zip)."""
    try:
        with open(resolve_inside(root, chunk.file, referrer=root, key=None), "rb") as f:
            f.seek(chunk.byte_offset)
            head = f.read(9)
    except (InspectorError, OSError):
        return False
    return not is_zip(head) and head[8:9] == b"{"


def _blob_header(root: Path, name: str, starts: set[int]) -> Header:
    path = resolve_inside(root, name, referrer=root, key=None)
    if len(starts) != 1:
        raise CorruptCheckpointError(
            f"tensor chunks of {name} point at {len(starts)} different bytes, "
            "not at one safetensors header",
            file=path,
        )
    with open(path, "rb") as f:
        return read_header(f, file=str(path), offset=starts.pop())


def _place(entry: Entry, index: int, header: Header) -> None:
    """Give chunk ``index`` the byte range the safetensors header records for the key."""
    chunk = entry.chunks[index]
    span = header.tensors.get(entry.key)
    if span is None or span.error:
        entry.error = entry.error or (
            span.error if span else f"{chunk.file} does not hold this key's chunk"
        )
    elif span.dtype != entry.dtype or span.shape != chunk.sizes:
        entry.error = entry.error or (
            f"{chunk.file} stores {span.dtype} {list(span.shape)}, "
            f"metadata says {entry.dtype} {list(chunk.sizes)}"
        )
    else:
        chunks = list(entry.chunks)
        chunks[index] = dataclasses.replace(chunk, byte_offset=span.start, byte_length=span.length)
        entry.chunks = tuple(chunks)


def _check_shape(shape: tuple[int, ...], chunk: ChunkInfo, entry: Entry, path: str) -> None:
    if tuple(shape) != chunk.sizes:
        raise CorruptCheckpointError(
            f"chunk at {list(chunk.offsets)} stores shape {list(shape)}, "
            f"metadata says {list(chunk.sizes)}",
            file=path,
            key=entry.key,
        )


def _untransform(f: BinaryIO, chunk: ChunkInfo, entry: Entry, path: str) -> bytes:
    if list(chunk.transforms) != [_ZSTD]:
        raise UnsupportedError(
            f"unknown stream transforms {list(chunk.transforms)}", file=path, key=entry.key
        )
    try:
        import zstandard
    except ImportError as exc:
        raise UnsupportedError(
            "chunk is zstd-compressed; install the 'zstandard' package to read it",
            file=path,
            key=entry.key,
        ) from exc
    limit = math.prod(chunk.sizes) * (entry.dtype.itemsize if entry.dtype else 1) + _TRANSFORM_SLACK
    f.seek(chunk.byte_offset)
    compressed = f.read(chunk.byte_length)
    try:
        data = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(compressed)).read(limit + 1)
    except zstandard.ZstdError as exc:
        raise CorruptCheckpointError(
            f"zstd data is damaged ({exc})", file=path, key=entry.key
        ) from exc
    if len(data) > limit:
        raise CorruptCheckpointError(
            "zstd data expands beyond the chunk's size", file=path, key=entry.key
        )
    return data


def _read_metadata(path: Path) -> Any:
    try:
        data = path.read_bytes()
    except FileNotFoundError as exc:
        from inspector.errors import CheckpointFileMissingError

        raise CheckpointFileMissingError("DCP metadata file is missing", file=path) from exc
    return safe_pickle.load_metadata(data, file=str(path))


def _merge(parts: list[Any]) -> Any:
    """Union of per-rank metadata files (``__<r>.metadata``); one file is returned as is."""
    if len(parts) == 1:
        return parts[0]
    merged = parts[0]
    for part in parts[1:]:
        for key, md in part.state_dict_metadata.items():
            mine = merged.state_dict_metadata.setdefault(key, md)
            if mine is not md and hasattr(mine, "chunks"):
                mine.chunks.extend(md.chunks)
        if isinstance(part.storage_data, dict):
            merged.storage_data.update(part.storage_data)
        if isinstance(part.planner_data, dict) and isinstance(merged.planner_data, dict):
            merged.planner_data.update(part.planner_data)
    return merged


def _entries(md: Any, root: Path, metadata_path: Path) -> list[Entry]:
    state = getattr(md, "state_dict_metadata", None)
    if not isinstance(state, dict):
        raise CorruptCheckpointError(
            "metadata has no state_dict_metadata table", file=metadata_path
        )
    planner = md.planner_data if isinstance(md.planner_data, dict) else None
    storage = _storage_by_key(md.storage_data, metadata_path)
    sizes = file_sizes(
        root,
        {
            info.relative_path
            for per in storage.values()
            for info in per.values()
            if isinstance(getattr(info, "relative_path", None), str)
        },
        referrer=metadata_path,
    )
    entries = []
    source = metadata_path.name
    for key, item in state.items():
        if not isinstance(key, str):
            raise CorruptCheckpointError(
                f"metadata key {key!r} is not a string", file=metadata_path
            )
        nested = _nested_path(key, planner)
        where = storage.get(key, {})
        try:
            if isinstance(item, TensorStorageMetadata):
                entries.append(_tensor_entry(key, item, nested, where, sizes, source))
            elif isinstance(item, BytesStorageMetadata):
                entries.append(_object_entry(key, nested, where, sizes, source))
            else:
                raise TypeError(f"unknown storage metadata {type(item).__name__}")
        except (TypeError, ValueError, AttributeError, OverflowError) as exc:
            entries.append(
                Entry(key, "object", nested_path=nested, error=f"malformed {source} ({exc})")
            )
    return entries


def _nested_path(key: str, planner: dict | None) -> tuple:
    """The key's path from planner_data; () when the planner kept none (guessed later)."""
    if planner is None:
        return ()
    path = planner.get(key)
    return tuple(path) if isinstance(path, (tuple, list)) and path else (key,)


def _storage_by_key(storage_data: Any, metadata_path: Path) -> dict[str, dict[tuple | None, Any]]:
    if not isinstance(storage_data, dict):
        raise CorruptCheckpointError("metadata has no storage_data table", file=metadata_path)
    by_key: dict[str, dict[tuple | None, Any]] = {}
    for index, info in storage_data.items():
        fqn = getattr(index, "fqn", None)
        offset = getattr(index, "offset", None)
        if isinstance(fqn, str) and (offset is None or isinstance(offset, (tuple, list))):
            by_key.setdefault(fqn, {})[None if offset is None else tuple(offset)] = info
    return by_key


def _tensor_entry(key: str, md: Any, nested: tuple, where: dict, sizes: dict, source: str) -> Entry:
    """The entry of a tensor; problems that ``.metadata`` itself shows are named after it."""
    dtype = getattr(getattr(md, "properties", None), "dtype", None)
    shape = tuple(md.size) if isinstance(md.size, (tuple, list)) else None
    entry = Entry(
        key,
        "tensor",
        dtype=dtype if isinstance(dtype, torch.dtype) else None,
        shape=shape,
        nested_path=nested,
    )
    if entry.dtype is None or shape is None or not _valid_shape(shape):
        entry.error = f"{source} gives an invalid dtype {dtype!r} or shape {md.size!r}"
        return entry
    chunks, problems = [], []
    for chunk in md.chunks if isinstance(md.chunks, list) else []:
        offsets, csizes = tuple(chunk.offsets), tuple(chunk.sizes)
        info = where.get(offsets)
        if info is None:
            problems.append(f"{source} has no storage record for the chunk at {list(offsets)}")
            continue
        chunks.append(_chunk(offsets, csizes, info))
        problems.extend(_chunk_problems(chunks[-1], sizes, source))
    entry.chunks = tuple(chunks)
    if not problems and (layout := layout_problem(shape, entry.chunks)):
        problems.append(f"{layout} (per {source})")
    entry.error = problems[0] if problems else None
    return entry


def _object_entry(key: str, nested: tuple, where: dict, sizes: dict, source: str) -> Entry:
    info = where.get(None) or next(iter(where.values()), None)
    entry = Entry(key, "object", nested_path=nested)
    if info is None:
        entry.error = f"{source} has no storage record for this object"
        return entry
    entry.chunks = (_chunk((), (), info),)
    problems = _chunk_problems(entry.chunks[0], sizes, source)
    entry.error = problems[0] if problems else None
    return entry


def _chunk(offsets: tuple, sizes: tuple, info: Any) -> ChunkInfo:
    """The chunk an item's ``_StorageInfo`` describes (TypeError if it is not one)."""
    transforms = getattr(info, "transform_descriptors", None) or ()
    if not isinstance(info.relative_path, str) or (
        transforms and not all(isinstance(t, str) for t in transforms)
    ):
        raise TypeError(f"storage record {info!r} names no file")
    return ChunkInfo(
        offsets, sizes, info.relative_path, info.offset, info.length, tuple(transforms)
    )


def _valid_shape(shape: tuple) -> bool:
    return (
        all(isinstance(n, int) and 0 <= n < 1 << 62 for n in shape) and math.prod(shape) < 1 << 62
    )


def _chunk_problems(chunk: ChunkInfo, sizes: dict, source: str) -> list[str]:
    size = sizes.get(chunk.file, f"bad file name {chunk.file!r}")
    if isinstance(size, str):
        return [size]
    if not (isinstance(chunk.byte_offset, int) and isinstance(chunk.byte_length, int)) or (
        chunk.byte_offset < 0 or chunk.byte_length < 0
    ):
        return [f"bad byte range {chunk.byte_offset!r}+{chunk.byte_length!r} in {chunk.file}"]
    problems = []
    if chunk.byte_offset + chunk.byte_length > size:
        problems.append(
            f"{chunk.file} has {size} bytes but the chunk at {list(chunk.offsets)} ends at byte "
            f"{chunk.byte_offset + chunk.byte_length} (file truncated?)"
        )
    if not all(isinstance(n, int) for n in (*chunk.offsets, *chunk.sizes)):
        problems.append(
            f"chunk at offsets {list(chunk.offsets)} size {list(chunk.sizes)} "
            f"is not made of integers (per {source})"
        )
    return problems


def _check_items(entries: list[Entry], safetensors: set[str], source: str) -> None:
    """Mark entries whose items cannot hold what ``.metadata`` claims, and items that share
    bytes (each item of a genuine file has its own byte range)."""
    ranges = []
    for entry in entries:
        if entry.error:
            continue
        for chunk in entry.chunks:
            if entry.kind == "tensor" and chunk.file not in safetensors:
                entry.error = entry.error or _too_small(entry, chunk, source)
            end = chunk.byte_offset + chunk.byte_length
            ranges.append((chunk.file, chunk.byte_offset, end, entry))
    for (file, start, end, entry), (_, _, _, other) in _overlaps(ranges):
        for one, two in ((entry, other), (other, entry)):
            one.error = one.error or (
                f"bytes {start}..{end} of {file} overlap the item of key {two.key!r} (per {source})"
            )


def _too_small(entry: Entry, chunk: ChunkInfo, source: str) -> str | None:
    """Why the chunk's item is too small for its elements (None if it is not), so a lying
    shape is refused before anything is allocated for it. Quantized subclasses store less
    than their logical dtype, but no format stores an element in under a bit."""
    elements = math.prod(chunk.sizes)
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
