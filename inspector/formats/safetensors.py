"""Safetensors files: the header parsed and checked here, each tensor read by its byte range.

Layout: an 8-byte little-endian header length, a JSON header ``{name: {dtype, shape,
data_offsets}, "__metadata__": {str: str}}``, then the data section. Nothing a header
claims is allocated before it is checked against the file's real size.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from inspector.entry import ChunkInfo, Entry
from inspector.errors import CorruptCheckpointError, UnsupportedError
from inspector.formats.base import ChunkValue
from inspector.formats.safe_pickle import TensorRef
from inspector.formats.torch_archive import contiguous_strides, empty_bytes_view, read_exact_into

MAX_HEADER_BYTES = 100_000_000  # the limit safetensors itself enforces
METADATA_KEY = "__metadata__"
SHARDING_KEY = "DCP_SHARDING_INFO"
_LENGTH = struct.Struct("<Q")
_MAX_INT = 1 << 62

# Names as safetensors 0.8 writes them.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
}
# Newer dtypes, where this torch has them.
DTYPES.update(
    (name, getattr(torch, attr))
    for name, attr in (("F8_E8M0", "float8_e8m0fnu"), ("F4", "float4_e2m1fn_x2"))
    if hasattr(torch, attr)
)
# Dtypes packing two values per byte: headers count values, torch counts bytes (last dim / 2).
_PACKED = {DTYPES["F4"]} if "F4" in DTYPES else set()


@dataclass(frozen=True)
class Span:
    """One tensor of a safetensors file: dtype, shape and absolute byte range, or why unusable."""

    dtype: torch.dtype | None
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


def read_header(f: BinaryIO, *, file: str, offset: int = 0, length: int | None = None) -> Header:
    """Parse and check the header of the safetensors file at bytes ``[offset, offset+length)``."""
    if length is None:
        length = os.fstat(f.fileno()).st_size - offset
    f.seek(offset)
    head = f.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        raise CorruptCheckpointError(
            f"{length} bytes: too short for a safetensors header length", file=file
        )
    (size,) = _LENGTH.unpack(head)
    if size > MAX_HEADER_BYTES or _LENGTH.size + size > length:
        raise CorruptCheckpointError(
            f"header length {size} runs past the end of the file ({length} bytes)", file=file
        )
    raw = f.read(size)
    if len(raw) != size:
        raise CorruptCheckpointError("file ends inside the safetensors header", file=file)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(
            f"safetensors header is not valid JSON ({exc})", file=file
        ) from exc
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
    if values * dtype.itemsize != end - begin:
        return Span(
            dtype,
            shape,
            0,
            0,
            f"shape {list(shape)} of {name} needs {values * dtype.itemsize} bytes, "
            f"data_offsets give {end - begin}",
        )
    if end > data_length:
        return Span(
            dtype,
            shape,
            0,
            0,
            f"data ends at byte {data_start + end}, past the end of the file "
            f"({data_start + data_length} bytes; truncated?)",
        )
    return Span(dtype, shape, data_start + begin, end - begin)


def _int_list(value: Any) -> bool:
    """A JSON list of non-negative integers small enough for any real tensor."""
    return type(value) is list and all(type(v) is int and 0 <= v < _MAX_INT for v in value)


def read_span(
    path: Path,
    chunk: ChunkInfo,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    *,
    key: str,
) -> torch.Tensor:
    """The chunk's raw bytes as a tensor (read straight into ``out`` when it fits)."""
    if not (
        out is not None
        and out.is_contiguous()
        and out.dtype == dtype
        and tuple(out.shape) == chunk.sizes
    ):
        out = torch.empty(chunk.sizes, dtype=dtype)
    with open(path, "rb") as f:
        read_exact_into(f, chunk.byte_offset, empty_bytes_view(out), file=str(path), key=key)
    return out


def plain_description(entry: Entry, index: int) -> TensorRef:
    """What a safetensors chunk is: always a plain contiguous tensor (no pickle, no subclass)."""
    sizes = entry.chunks[index].sizes
    return TensorRef(None, 0, sizes, contiguous_strides(sizes), entry.dtype)


def saved_offsets(metadata: dict[str, str], *, file: str) -> dict[str, tuple[int, ...]] | None:
    """Each tensor's offset in the whole tensor, from DCP's ``DCP_SHARDING_INFO`` (if any)."""
    if SHARDING_KEY not in metadata:
        return None
    try:
        info = json.loads(metadata[SHARDING_KEY])
        offsets = {key: tuple(value["saved_offsets"]) for key, value in info.items()}
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise CorruptCheckpointError(f"{SHARDING_KEY} is malformed ({exc!r})", file=file) from exc
    if not all(_int_list(list(v)) for v in offsets.values()):
        raise CorruptCheckpointError(f"{SHARDING_KEY} has non-integer offsets", file=file)
    return offsets


class SafetensorsSource:
    """One safetensors file: its header at open, each tensor's bytes when read."""

    format = "safetensors"
    nesting = "key names (safetensors keys are flat)"

    def __init__(self, path: Path, name: str | None = None) -> None:
        self.root = path
        self.name = name or path.name
        with open(path, "rb") as f:
            header = read_header(f, file=str(path))
        self.metadata = header.metadata
        self.source_files = (self.name,)
        self._entries = {k: self._entry(k, span) for k, span in header.tensors.items()}
        self.notes = (f"{self.name}: safetensors header lists {len(self._entries)} tensors",)
        try:
            self.offsets = saved_offsets(header.metadata, file=str(path))
        except CorruptCheckpointError as exc:
            self.offsets = {}  # DCP chunks, but where they go is unknown
            self.notes += (exc.reason,)
        if self.offsets and any(any(v) for v in self.offsets.values()):
            self.notes += (
                f"{SHARDING_KEY}: this file holds chunks of larger tensors (saved_offsets); "
                "open its folder to assemble them",
            )

    def _entry(self, key: str, span: Span) -> Entry:
        entry = Entry(key, "tensor", dtype=span.dtype, shape=span.shape, error=span.error)
        if span.error is None:
            zeros = (0,) * len(span.shape)
            entry.chunks = (ChunkInfo(zeros, span.shape, self.name, span.start, span.length),)
        return entry

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def entry(self, key: str) -> Entry | None:
        return self._entries.get(key)

    def read_chunk(self, entry: Entry, index: int, out: torch.Tensor | None = None) -> ChunkValue:
        return read_span(self.root, entry.chunks[index], entry.dtype, out, key=entry.key)

    def read_object(self, entry: Entry) -> Any:
        raise UnsupportedError("safetensors files hold tensors only", file=self.root, key=entry.key)

    def chunk_bytes(self, entry: Entry, index: int) -> tuple[Path, int] | None:
        return self.root, entry.chunks[index].byte_offset

    def chunk_globals(self, entry: Entry, index: int) -> list[str]:
        return []

    def describe_chunk(self, entry: Entry, index: int) -> TensorRef:
        return plain_description(entry, index)
