"""Safetensors files: the header parsed and checked, each tensor read by its byte range;
and the writer (header first, then each tensor's bytes).

Layout: an 8-byte little-endian header length, a JSON header ``{name: {dtype, shape,
data_offsets}, "__metadata__": {str: str}}``, then the data section. Nothing a header
claims is allocated before it is checked against the file's real size.
"""

from __future__ import annotations

import json
import math
import struct
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

from inspector import dtypes
from inspector.entry import ChunkInfo, Entry
from inspector.errors import CorruptCheckpointError, ExportError, UnsupportedError
from inspector.formats.base import ChunkValue, Step, StoredRecord, bytes_view, parse_json
from inspector.formats.safe_pickle import TensorRef
from inspector.formats.torch_archive import contiguous_strides
from inspector.formats.writing import Item, produced_ahead, write_item
from inspector.storage.base import ByteRange, Storage
from inspector.storage.copy import write_all
from inspector.storage.writeback import durable

if TYPE_CHECKING:
    import torch

MAX_HEADER_BYTES = 100_000_000  # the limit safetensors itself enforces
METADATA_KEY = "__metadata__"
SHARDING_KEY = "DCP_SHARDING_INFO"
_LENGTH = struct.Struct("<Q")
_MAX_INT = 1 << 62

# safetensors 0.8 names -> dtype names.
DTYPES: dict[str, str] = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
    "F4": "float4_e2m1fn_x2",
}
# Dtypes packing two values per byte: headers count values, torch counts bytes (last dim / 2).
_PACKED = {"float4_e2m1fn_x2"}


@dataclass(frozen=True)
class Span:
    """One tensor of a safetensors file: dtype, shape and absolute byte range, or why unusable
    (the range is then 0, 0, or the one claimed when it runs past the end of the file)."""

    dtype: str | None
    shape: tuple[int, ...] | None
    start: int
    length: int
    error: str | None = None


@dataclass(frozen=True)
class Header:
    """A parsed header: tensors in header order, ``__metadata__``, where the data starts."""

    tensors: dict[str, Span]
    metadata: dict[str, str]
    data_start: int


def looks_like_safetensors(head: bytes) -> bool:
    """First bytes of a safetensors file: a sane header length, then a JSON object."""
    if len(head) < 9:
        return False
    (size,) = _LENGTH.unpack(head[:8])
    return 2 <= size <= MAX_HEADER_BYTES and head[8:9] == b"{"


def read_header(storage: Storage, name: str, offset: int = 0, length: int | None = None) -> Header:
    """Parse and check the header of the safetensors file at bytes ``[offset, offset+length)``
    of ``name`` (to the end of the file when ``length`` is None)."""
    file = storage.describe(name)
    if length is None:
        length = storage.size(name) - offset
    head = storage.read(name, offset, min(_LENGTH.size, max(length, 0)))
    if len(head) < _LENGTH.size:
        raise CorruptCheckpointError(
            f"{length} bytes: too short for a safetensors header length", file=file
        )
    (size,) = _LENGTH.unpack(head)
    if size > MAX_HEADER_BYTES or _LENGTH.size + size > length:
        raise CorruptCheckpointError(
            f"header length {size} runs past the end of the file ({length} bytes)", file=file
        )
    raw = storage.read(name, offset + _LENGTH.size, size)
    header = parse_json(raw, file=file, what="safetensors header", object_pairs_hook=_unique_keys)
    if not isinstance(header, dict):
        raise CorruptCheckpointError(
            f"safetensors header is a JSON {type(header).__name__}, not an object", file=file
        )
    metadata = header.pop(METADATA_KEY, None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise CorruptCheckpointError(
            f"safetensors {METADATA_KEY} must map strings to strings", file=file
        )
    data_start = offset + _LENGTH.size + size
    data_length = length - _LENGTH.size - size
    tensors = {name: _span(info, data_start, data_length) for name, info in header.items()}
    return Header(tensors, metadata, data_start)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        twice = next(k for k, n in Counter(k for k, _ in pairs).items() if n > 1)
        raise ValueError(f"key {twice!r} appears twice")
    return result


def _span(info: Any, data_start: int, data_length: int) -> Span:
    """Check one header entry; a bad one becomes a Span with ``error`` set."""
    if not isinstance(info, dict):
        return Span(None, None, 0, 0, f"header entry is a {type(info).__name__}, not an object")
    name, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    dtype = DTYPES.get(name) if isinstance(name, str) else None
    if not _int_list(shape):
        return Span(dtype, None, 0, 0, f"bad shape {shape!r}")
    shape = tuple(shape)
    if dtype is None:
        return Span(None, shape, 0, 0, f"unknown safetensors dtype {name!r}")
    if not (_int_list(offsets) and len(offsets) == 2 and offsets[0] <= offsets[1]):
        return Span(dtype, shape, 0, 0, f"bad data_offsets {offsets!r}")
    begin, end = offsets
    values = math.prod(shape)
    if dtype in _PACKED:
        if not shape or shape[-1] % 2:
            return Span(dtype, shape, 0, 0, f"{name} needs an even last dimension, got {shape}")
        shape = (*shape[:-1], shape[-1] // 2)
        values //= 2
    if values * dtypes.itemsize(dtype) != end - begin:
        return Span(
            dtype,
            shape,
            0,
            0,
            f"shape {list(shape)} of {name} needs {values * dtypes.itemsize(dtype)} bytes, "
            f"data_offsets give {end - begin}",
        )
    if end > data_length:
        return Span(
            dtype,
            shape,
            data_start + begin,
            end - begin,
            f"data ends at byte {data_start + end}, past the end of the file "
            f"({data_start + data_length} bytes; truncated?)",
        )
    return Span(dtype, shape, data_start + begin, end - begin)


def _int_list(value: Any) -> TypeGuard[list[int]]:
    """A JSON list of non-negative integers small enough for any real tensor."""
    return type(value) is list and all(type(v) is int and 0 <= v < _MAX_INT for v in value)


def read_span(
    storage: Storage,
    name: str,
    chunk: ChunkInfo,
    dtype: str,
    out: torch.Tensor | None = None,
    *,
    key: str,
) -> torch.Tensor:
    """The chunk's raw bytes as a tensor (read straight into ``out`` when it fits)."""
    import torch

    torch_dtype = dtypes.to_torch(dtype)
    if not (
        out is not None
        and out.is_contiguous()
        and out.dtype == torch_dtype
        and tuple(out.shape) == chunk.sizes
    ):
        out = torch.empty(chunk.sizes, dtype=torch_dtype)
    try:
        storage.read_into(name, chunk.byte_offset, bytes_view(out))
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(exc.reason, file=exc.file, key=key) from None
    return out


def plain_description(entry: Entry, index: int) -> TensorRef:
    """What a safetensors chunk is: always a plain contiguous tensor (no pickle, no subclass)."""
    sizes = entry.chunks[index].sizes
    return TensorRef(None, 0, sizes, contiguous_strides(sizes), _dtype(entry))


def saved_offsets(metadata: dict[str, str], *, file: str) -> dict[str, tuple[int, ...]] | None:
    """Each tensor's offset in the whole tensor, from DCP's ``DCP_SHARDING_INFO`` (if any)."""
    if SHARDING_KEY not in metadata:
        return None
    info = parse_json(metadata[SHARDING_KEY], file=file, what=SHARDING_KEY)
    try:
        offsets = {key: tuple(value["saved_offsets"]) for key, value in info.items()}
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise CorruptCheckpointError(f"{SHARDING_KEY} is malformed ({exc!r})", file=file) from exc
    if not all(_int_list(list(v)) for v in offsets.values()):
        raise CorruptCheckpointError(f"{SHARDING_KEY} has non-integer offsets", file=file)
    return offsets


class SafetensorsSource:
    """One safetensors file: its header at open, each tensor's bytes when read."""

    format = "safetensors"
    producer = "unknown"
    nesting = "key names (safetensors keys are flat)"
    key_matching = "flattened"
    ranks: int | None = None
    steps: tuple[Step, ...] = ()

    def __init__(self, storage: Storage, name: str) -> None:
        self.storage, self.name = storage, name
        header = read_header(storage, name)
        self._header = header
        self.metadata = header.metadata
        self.source_files: tuple[str, ...] = (name,)
        self._entries = {k: self._entry(k, span) for k, span in header.tensors.items()}
        notes = [f"{name}: safetensors header lists {len(self._entries)} tensors"]
        self.offsets: dict[str, tuple[int, ...]] | None
        try:
            self.offsets = saved_offsets(header.metadata, file=storage.describe(name))
        except CorruptCheckpointError as exc:
            self.offsets = {}  # DCP chunks, but where they go is unknown
            notes.append(exc.reason)
        if self.offsets and any(any(v) for v in self.offsets.values()):
            notes.append(
                f"{SHARDING_KEY}: this file holds chunks of larger tensors (saved_offsets); "
                "open its folder to assemble them"
            )
        self.notes = tuple(notes)

    def _entry(self, key: str, span: Span) -> Entry:
        if span.error is not None or span.shape is None:
            return Entry(key, "tensor", dtype=span.dtype, shape=span.shape, error=span.error)
        zeros = (0,) * len(span.shape)
        chunk = ChunkInfo(zeros, span.shape, self.name, span.start, span.length)
        return Entry(key, "tensor", dtype=span.dtype, shape=span.shape, chunks=(chunk,))

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def entry(self, key: str) -> Entry | None:
        return self._entries.get(key)

    def read_chunk(self, entry: Entry, index: int, out: torch.Tensor | None = None) -> ChunkValue:
        chunk = entry.chunks[index]
        return read_span(self.storage, self.name, chunk, _dtype(entry), out, key=entry.key)

    def read_object(self, entry: Entry) -> Any:
        raise UnsupportedError(
            "safetensors files hold tensors only",
            file=self.storage.describe(self.name),
            key=entry.key,
        )

    def chunk_bytes(self, entry: Entry, index: int) -> ByteRange:
        chunk = entry.chunks[index]
        return ByteRange(self.storage, self.name, chunk.byte_offset, chunk.byte_length)

    def chunk_globals(self, entry: Entry, index: int) -> list[str]:
        return []

    def describe_chunk(self, entry: Entry, index: int) -> TensorRef:
        return plain_description(entry, index)

    def stored_records(self) -> Iterator[StoredRecord]:
        """Each tensor's bytes (safetensors keeps no checksums) in offset order, and what its
        own loader refuses: header lines it cannot use, holes, overlaps or bytes after the
        last tensor (the data section must be exactly the tensors, back to back)."""
        yield from _data_section_records(self._header, self.name, self.storage.size(self.name))


def _data_section_records(header: Header, file: str, end: int) -> Iterator[StoredRecord]:
    """The records of a safetensors data section ending at byte ``end`` of ``file``."""
    what = "safetensors data"
    spans = sorted(header.tensors.items(), key=lambda item: item[1].start)
    position = header.data_start
    for key, span in spans:
        if span.error and not span.length:
            yield StoredRecord(key, file, 0, 0, None, "header entry", span.error)
            continue
        if span.start > position:
            yield _layout_record(file, position, span.start, "belong to no tensor (a hole)")
        elif span.start < position and span.length:
            yield StoredRecord(
                key,
                file,
                span.start,
                span.length,
                None,
                what,
                f"bytes {span.start}..{position} also belong to the tensor before it",
            )
            position = max(position, span.start + span.length)
            continue
        yield StoredRecord(key, file, span.start, span.length, None, what)
        position = max(position, span.start + span.length)
    if position < end:
        yield _layout_record(file, position, end, "follow the last tensor")


def _layout_record(file: str, start: int, end: int, why: str) -> StoredRecord:
    return StoredRecord(
        None,
        file,
        start,
        end - start,
        None,
        "data section",
        f"bytes {start}..{end} of the data section {why}; safetensors' own loader refuses "
        "such a file",
    )


def _dtype(entry: Entry) -> str:
    if entry.dtype is None:
        raise CorruptCheckpointError("has no dtype", key=entry.key)
    return entry.dtype


# --- writing ---------------------------------------------------------------------------------

# dtype name -> safetensors name. Left out: packed float4 (headers count values, torch bytes)
# and float8_e8m0fnu, which safetensors' own loaders (and so transformers) cannot read.
SAFETENSORS_NAMES = {name: st for st, name in DTYPES.items() if st not in ("F4", "F8_E8M0")}


def safetensors_dtype(dtype: str, key: str) -> str:
    """The safetensors name of a dtype; an ExportError for one safetensors cannot store."""
    try:
        return SAFETENSORS_NAMES[dtype]
    except KeyError:
        raise ExportError(
            f"safetensors cannot store {dtype}; export to .pt, or use fp8='dequantize'", key=key
        ) from None


def header_bytes(items: Sequence[Item], metadata: dict[str, str]) -> bytes:
    """The 8-byte length + JSON header (space-padded to 8 bytes, as safetensors does)."""
    header: dict[str, Any] = {METADATA_KEY: metadata} if metadata else {}
    offset = 0
    for item in items:
        header[item.name] = {
            "dtype": safetensors_dtype(item.dtype, item.name),
            "shape": list(item.shape),
            "data_offsets": [offset, offset + item.nbytes],
        }
        offset += item.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return _LENGTH.pack(len(text)) + text


def index_text(weight_map: Mapping[str, str], total_size: int) -> str:
    """The ``model.safetensors.index.json`` of shards (as huggingface_hub writes it): each
    tensor's shard and the tensors' total bytes."""
    body = {"metadata": {"total_size": total_size}, "weight_map": dict(weight_map)}
    return json.dumps(body, indent=2) + "\n"


def write_safetensors(
    path: Path,
    items: Sequence[Item],
    metadata: dict[str, str],
    progress: Callable[[Item], None],
    *,
    checksums: bool = False,
) -> dict[str, int]:
    """One safetensors file, tensors written one at a time after the header; with
    ``checksums``, each item's CRC-32 by name (see :func:`write_item`), else ``{}``."""
    crcs = {}
    with open(path, "wb", buffering=0) as f, durable(f.fileno(), progress) as written:
        write_all(f.fileno(), header_bytes(items, metadata))
        for item in produced_ahead(items):
            crc = write_item(f.fileno(), item, crc=checksums)
            if checksums:
                crcs[item.name] = crc
            written(item)
    return crcs
