"""torch.save files: find their storage records, decode their pickles safely, read storages.

A DCP item and a ``.pt`` file are both zip archives; DCP's sit at a byte range inside a
``.distcp`` file. Files from torch < 1.6 use the older flat layout (``LegacyArchive``).
Only the byte ranges a tensor needs are read, straight into its buffer.
"""

from __future__ import annotations

import io
import math
import os
import struct
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from inspector.errors import CorruptCheckpointError, UnsupportedError
from inspector.formats import safe_pickle
from inspector.formats.safe_pickle import SubclassRef, TensorRef

_LOCAL_HEADER = struct.Struct("<4s22xHH")
_MAX_PICKLE_BYTES = 1 << 30


class FileWindow(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes of ``f`` starting at ``start``."""

    def __init__(self, f: BinaryIO, start: int, length: int) -> None:
        self._f, self._start, self._length, self._pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        """At most the bytes left in the window: a size read from damaged data (a zip's
        central directory length, say) allocates no more than the window holds."""
        left = max(0, self._length - self._pos)
        return super().read(left if size is None or size < 0 else min(size, left))

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._length - self._pos))
        if n == 0:
            return 0
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(view[:n]) or 0
        self._pos += got
        return got


class WindowReader(io.BufferedReader):
    """Buffered reading of a FileWindow. ``read(n)`` is clamped to the bytes left first:
    BufferedReader itself reserves ``n`` bytes, and ``n`` may come from damaged data."""

    def __init__(self, window: FileWindow) -> None:
        super().__init__(window)
        self._end = window.seek(0, os.SEEK_END)
        window.seek(0)

    def read(self, size: int | None = -1) -> bytes:
        left = max(0, self._end - self.tell())
        return super().read(left if size is None or size < 0 else min(size, left))


@dataclass(frozen=True)
class Record:
    """A stored (uncompressed) zip member: ``size`` bytes at absolute file offset ``start``."""

    name: str
    start: int
    size: int


def read_exact_into(
    f: BinaryIO, start: int, buffer: memoryview, *, file: str, key: str | None
) -> None:
    """Fill ``buffer`` from ``f`` at ``start``; a short read means the file is truncated."""
    f.seek(start)
    done = 0
    while done < len(buffer):
        got = f.readinto(buffer[done:])
        if not got:
            raise CorruptCheckpointError(
                f"file ends {len(buffer) - done} bytes short of the data at byte {start}",
                file=file,
                key=key,
            )
        done += got


def empty_bytes_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous tensor's memory (any dtype, float8 included)."""
    flat = tensor.reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


class StoredTensors:
    """Reading tensors out of a torch.save file's storages; subclasses locate the records."""

    f: BinaryIO
    path: str
    key: str | None

    def record(self, storage_key: str) -> Record:
        raise NotImplementedError

    def read_tensor(self, ref: TensorRef, out: torch.Tensor | None = None) -> torch.Tensor:
        """Materialise ``ref``; with ``out`` (same shape and dtype, contiguous) read into it."""
        needed = ref.storage is not None and math.prod(ref.shape)
        record = self.record(ref.storage.key) if needed else None
        return read_storage_tensor(self.f, record, ref, out, file=self.path, key=self.key)

    def materialize(self, value: Any) -> Any:
        """Replace every TensorRef in ``value`` (containers, subclass attributes) by a tensor."""
        return materialize(value, self.read_tensor)

    def contiguous_start(self, shape: tuple[int, ...], dtype: torch.dtype) -> int | None:
        """File offset of the archive's tensor bytes when it holds one plain contiguous
        tensor of ``shape`` and ``dtype`` (checked against its record); else None."""
        ref = self.load()
        if not isinstance(ref, TensorRef) or ref.storage is None:
            return None
        if (ref.shape, ref.dtype) != (tuple(shape), dtype) or ref.stride != contiguous_strides(
            ref.shape
        ):
            return None
        record = self.record(ref.storage.key)
        check_fits(record, ref, file=self.path, key=self.key)
        return record.start + ref.storage_offset * dtype.itemsize


class TorchArchive(StoredTensors):
    """The torch.save archive stored in bytes ``[offset, offset + length)`` of ``path``."""

    def __init__(self, f: BinaryIO, path: str, offset: int, length: int, key: str | None) -> None:
        self.f, self.path, self.offset, self.length, self.key = f, path, offset, length, key
        try:
            self._zip = zipfile.ZipFile(FileWindow(f, offset, length))
            infos = self._zip.infolist()
        except _ZIP_ERRORS as exc:
            raise CorruptCheckpointError(
                f"not a readable torch.save archive at bytes {offset}..{offset + length} "
                f"({_describe(exc)})",
                file=path,
                key=key,
            ) from exc
        pickles = [i.filename for i in infos if i.filename.endswith("data.pkl")]
        top = [p for p in pickles if p.count("/") == 1] or pickles
        if not top:
            raise CorruptCheckpointError("torch archive has no data.pkl record", file=path, key=key)
        self.prefix = top[0][: -len("data.pkl")]
        self._infos = {i.filename: i for i in infos}
        order = (
            self._record_bytes("byteorder")
            if self.prefix + "byteorder" in self._infos
            else b"little"
        )
        if order.strip() != b"little":
            raise UnsupportedError(f"big-endian torch archive ({order!r})", file=path, key=key)

    def _record_bytes(self, name: str, limit: int = _MAX_PICKLE_BYTES) -> bytes:
        info = self._infos.get(self.prefix + name)
        if info is None:
            raise CorruptCheckpointError(
                f"torch archive lacks record {name!r}", file=self.path, key=self.key
            )
        if info.file_size > limit:
            raise CorruptCheckpointError(
                f"record {name!r} claims {info.file_size} bytes", file=self.path, key=self.key
            )
        try:
            return self._zip.read(info)
        except _ZIP_ERRORS as exc:
            raise CorruptCheckpointError(
                f"cannot read record {name!r} ({_describe(exc)})", file=self.path, key=self.key
            ) from exc

    def load(self) -> Any:
        """The archive's object, with TensorRef / SubclassRef standing in for tensors."""
        return safe_pickle.load_data_pickle(
            self._record_bytes("data.pkl"), file=self.path, key=self.key
        )

    def pickle_globals(self) -> list[str]:
        """Globals named by ``data.pkl``, found without running it."""
        return safe_pickle.referenced_globals(self._record_bytes("data.pkl"))

    def record(self, storage_key: str) -> Record:
        name = f"{self.prefix}data/{storage_key}"
        info = self._infos.get(name)
        if info is None:
            raise CorruptCheckpointError(
                f"torch archive lacks storage record {name!r}", file=self.path, key=self.key
            )
        if info.compress_type != zipfile.ZIP_STORED:
            raise UnsupportedError(
                f"storage record {name!r} is compressed", file=self.path, key=self.key
            )
        self.f.seek(self.offset + info.header_offset)
        header = self.f.read(_LOCAL_HEADER.size)
        if len(header) != _LOCAL_HEADER.size:
            raise CorruptCheckpointError(
                f"record {name!r} header is cut off", file=self.path, key=self.key
            )
        magic, name_len, extra_len = _LOCAL_HEADER.unpack(header)
        if magic != b"PK\x03\x04":
            raise CorruptCheckpointError(
                f"record {name!r} has a bad local header", file=self.path, key=self.key
            )
        start = self.offset + info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
        if info.compress_size != info.file_size or start + info.file_size > self.end:
            raise CorruptCheckpointError(
                f"record {name!r} claims {info.file_size} bytes at byte {start}, past the end "
                f"of the archive (byte {self.end})",
                file=self.path,
                key=self.key,
            )
        return Record(name, start, info.file_size)

    @property
    def end(self) -> int:
        """The file offset just past the archive."""
        return self.offset + self.length


# What zipfile raises on damaged archives (NotImplementedError: an unknown zip version).
_ZIP_ERRORS = (
    zipfile.BadZipFile,
    OSError,
    ValueError,
    EOFError,
    struct.error,
    OverflowError,
    NotImplementedError,
)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def check_fits(record: Record, ref: TensorRef, *, file: str, key: str | None) -> None:
    """The tensor's elements must lie inside its storage, and the storage inside its record."""
    if ref.storage_offset + _extent(ref) > ref.storage.numel or (
        ref.storage.numel * ref.dtype.itemsize > record.size
    ):
        raise CorruptCheckpointError(
            f"tensor {list(ref.shape)} at element {ref.storage_offset} does not fit storage "
            f"{record.name!r} ({record.size} bytes)",
            file=file,
            key=key,
        )


def read_storage_tensor(
    f: BinaryIO,
    record: Record | None,
    ref: TensorRef,
    out: torch.Tensor | None = None,
    *,
    file: str,
    key: str | None,
) -> torch.Tensor:
    """Read ``ref``'s elements from ``record`` of ``f`` (``out`` is filled when it fits)."""
    if not math.prod(ref.shape):
        return torch.empty(ref.shape, dtype=ref.dtype)
    if record is None or ref.storage is None:
        raise UnsupportedError("tensor was saved without data (meta tensor)", file=file, key=key)
    check_fits(record, ref, file=file, key=key)
    start = record.start + ref.storage_offset * ref.dtype.itemsize
    contiguous = ref.stride == contiguous_strides(ref.shape)
    if contiguous and out is not None and _fits(out, ref):
        read_exact_into(f, start, empty_bytes_view(out), file=file, key=key)
        return out
    buffer = torch.empty(math.prod(ref.shape) if contiguous else _extent(ref), dtype=ref.dtype)
    read_exact_into(f, start, empty_bytes_view(buffer), file=file, key=key)
    if contiguous:
        return buffer.view(ref.shape)
    return buffer.as_strided(ref.shape, ref.stride)


def materialize(value: Any, read: Callable[[TensorRef], torch.Tensor]) -> Any:
    """Replace every TensorRef in ``value`` (containers, subclass attributes) by ``read(ref)``."""
    if isinstance(value, TensorRef):
        return read(value)
    if isinstance(value, SubclassRef):
        attrs = {k: materialize(v, read) for k, v in value.attrs.items()}
        data = read(value.data) if value.data is not None else None
        return SubclassRef(value.cls, value.dtype, value.shape, attrs, data)
    if isinstance(value, dict):
        copy = value.copy()
        for k, v in copy.items():
            copy[k] = materialize(v, read)
        return copy
    if type(value) in (list, tuple):
        return type(value)(materialize(v, read) for v in value)
    return value


def tensor_refs(value: Any) -> Iterator[TensorRef]:
    """Every TensorRef that ``materialize`` would read, in the same order."""
    if isinstance(value, TensorRef):
        yield value
    elif isinstance(value, SubclassRef):
        for v in value.attrs.values():
            yield from tensor_refs(v)
        if value.data is not None:
            yield value.data
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensor_refs(v)
    elif type(value) in (list, tuple):
        for v in value:
            yield from tensor_refs(v)


def _extent(ref: TensorRef) -> int:
    """Elements spanned from the first to the last one (strides allowed)."""
    return 1 + sum((n - 1) * s for n, s in zip(ref.shape, ref.stride, strict=True))


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _fits(out: torch.Tensor, ref: TensorRef) -> bool:
    return out.is_contiguous() and tuple(out.shape) == ref.shape and out.dtype == ref.dtype


def is_zip(head: bytes) -> bool:
    return head[:4] == b"PK\x03\x04"


def is_legacy_torch(head: bytes) -> bool:
    """A pickle stream: what torch.save wrote before 1.6 (confirmed by its magic number)."""
    return head[:1] == b"\x80"


def is_tar(head: bytes) -> bool:
    return head[257:262] == b"ustar"


_LENGTH = struct.Struct("<q")


class LegacyArchive(StoredTensors):
    """A pre-1.6 torch.save file: pickles, then each storage as an int64 length and its bytes."""

    def __init__(self, f: BinaryIO, path: str, length: int) -> None:
        self.f, self.path, self.key = f, path, None
        pickles = WindowReader(FileWindow(f, 0, length))
        self._value, storages = safe_pickle.load_legacy_torch(pickles, file=path)
        self._records: dict[str, Record | str] = {}
        position = pickles.tell()
        for storage in storages:
            record = self._walk(storage, position, length)
            self._records[storage.key] = record
            if isinstance(record, str):
                for later in storages[len(self._records) :]:
                    self._records.setdefault(
                        later.key,
                        f"storage {later.key!r} lies after storage {storage.key!r}, "
                        "which cannot be read, so its place in the file is unknown",
                    )
                break
            position = record.start + record.size

    def _walk(self, storage: Any, position: int, length: int) -> Record | str:
        self.f.seek(position)
        head = self.f.read(_LENGTH.size)
        if len(head) < _LENGTH.size:
            return f"storage {storage.key!r} lies past the end of the file (truncated?)"
        (numel,) = _LENGTH.unpack(head)
        if numel != storage.numel:
            return (
                f"storage {storage.key!r} holds {numel} elements in the file, "
                f"{storage.numel} in the pickle"
            )
        start = position + _LENGTH.size
        size = numel * storage.dtype.itemsize
        if start + size > length:
            return f"storage {storage.key!r} ends at byte {start + size}, past the end of the file"
        return Record(f"storage {storage.key}", start, size)

    def load(self) -> Any:
        return self._value

    def record(self, storage_key: str) -> Record:
        record = self._records.get(storage_key, f"storage {storage_key!r} is not in the file")
        if isinstance(record, str):
            raise CorruptCheckpointError(record, file=self.path, key=self.key)
        return record
