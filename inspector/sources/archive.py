"""torch.save zip archives: find their records, decode ``data.pkl`` safely, read storages.

A DCP item and a ``.pt`` file are both such archives; DCP's sit at a byte range inside a
``.distcp`` file. Only the byte ranges a tensor needs are read, straight into its buffer.
"""

from __future__ import annotations

import io
import math
import os
import struct
import zipfile
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from inspector import safe_pickle
from inspector.errors import CorruptCheckpointError, UnsupportedError
from inspector.safe_pickle import SubclassRef, TensorRef

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

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self._length - self._pos))
        if n == 0:
            return 0
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(view[:n]) or 0
        self._pos += got
        return got


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


class TorchArchive:
    """The torch.save archive stored in bytes ``[offset, offset + length)`` of ``path``."""

    def __init__(self, f: BinaryIO, path: str, offset: int, length: int, key: str | None) -> None:
        self.f, self.path, self.offset, self.key = f, path, offset, key
        try:
            self._zip = zipfile.ZipFile(FileWindow(f, offset, length))
            infos = self._zip.infolist()
        except (zipfile.BadZipFile, OSError, ValueError, EOFError, struct.error) as exc:
            raise CorruptCheckpointError(
                f"not a readable torch.save archive at bytes {offset}..{offset + length} ({exc})",
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
        except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError) as exc:
            raise CorruptCheckpointError(
                f"cannot read record {name!r} ({exc})", file=self.path, key=self.key
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
        return Record(name, start, info.file_size)

    def read_tensor(self, ref: TensorRef, out: torch.Tensor | None = None) -> torch.Tensor:
        """Materialise ``ref``; with ``out`` (same shape and dtype, contiguous) read into it."""
        if ref.storage is None:
            raise UnsupportedError(
                "tensor was saved without data (meta tensor)", file=self.path, key=self.key
            )
        numel = math.prod(ref.shape)
        if numel == 0:
            return torch.empty(ref.shape, dtype=ref.dtype)
        extent = 1 + sum((n - 1) * s for n, s in zip(ref.shape, ref.stride, strict=True))
        itemsize = ref.dtype.itemsize
        record = self.record(ref.storage.key)
        if (
            ref.storage_offset + extent > ref.storage.numel
            or ref.storage.numel * itemsize > record.size
        ):
            raise CorruptCheckpointError(
                f"tensor {list(ref.shape)} at element {ref.storage_offset} does not fit storage "
                f"{record.name!r} ({record.size} bytes)",
                file=self.path,
                key=self.key,
            )
        start = record.start + ref.storage_offset * itemsize
        contiguous = ref.stride == _contiguous_strides(ref.shape)
        if contiguous and out is not None and _fits(out, ref):
            read_exact_into(self.f, start, empty_bytes_view(out), file=self.path, key=self.key)
            return out
        buffer = torch.empty(numel if contiguous else extent, dtype=ref.dtype)
        read_exact_into(self.f, start, empty_bytes_view(buffer), file=self.path, key=self.key)
        if contiguous:
            return buffer.view(ref.shape)
        return buffer.as_strided(ref.shape, ref.stride)

    def materialize(self, value: Any) -> Any:
        """Replace every TensorRef in ``value`` (containers, subclass attributes) by a tensor."""
        if isinstance(value, TensorRef):
            return self.read_tensor(value)
        if isinstance(value, SubclassRef):
            attrs = {k: self.materialize(v) for k, v in value.attrs.items()}
            data = self.read_tensor(value.data) if value.data is not None else None
            return SubclassRef(value.cls, value.dtype, value.shape, attrs, data)
        if isinstance(value, dict):
            copy = value.copy()
            for k, v in copy.items():
                copy[k] = self.materialize(v)
            return copy
        if type(value) in (list, tuple):
            return type(value)(self.materialize(v) for v in value)
        return value


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _fits(out: torch.Tensor, ref: TensorRef) -> bool:
    return out.is_contiguous() and tuple(out.shape) == ref.shape and out.dtype == ref.dtype


def is_zip(head: bytes) -> bool:
    return head[:4] == b"PK\x03\x04"
