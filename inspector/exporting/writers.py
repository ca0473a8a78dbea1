"""Streaming writers for exports: safetensors shards and torch.save archives, written atomically.

Both write one tensor at a time: the safetensors header is computed from dtypes and
shapes before any data is read; a ``.pt`` archive's storage records are streamed
first and its ``data.pkl`` pickled last. Files are written under temporary names in the
target folder and renamed only when everything succeeded.
"""

from __future__ import annotations

import errno
import io
import json
import math
import os
import pickle
import re
import struct
import sys
import threading
import uuid
import zipfile
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from inspector.entry import ByteRange
from inspector.errors import ExportError
from inspector.formats import safe_pickle
from inspector.formats.safetensors import DTYPES
from inspector.formats.torch_archive import contiguous_strides as _contiguous_strides
from inspector.formats.torch_archive import empty_bytes_view

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
}


# torch dtype -> safetensors name. Left out: packed float4 (headers count values, torch
# bytes) and float8_e8m0fnu, which safetensors' own loaders (and so transformers) cannot read.
SAFETENSORS_NAMES = {dtype: name for name, dtype in DTYPES.items() if name not in ("F4", "F8_E8M0")}


@dataclass
class Item:
    """One tensor to write: its name, final dtype and shape, and how to produce it.

    ``ranges``, when given and it returns ranges, lets the writer copy the stored bytes
    file-to-file (the tensor needs no conversion and is stored as plain bytes).
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]
    ranges: Callable[[], list[ByteRange] | None] | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def parse_size(value: int | str) -> int:
    """``5GB`` (decimal, like huggingface_hub), ``512MiB``, or a number of bytes."""
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE.match(str(value))
        if not match or match.group(2).upper() not in _UNITS:
            raise ValueError(f"cannot read size {value!r}; use e.g. '5GB', '500MB' or bytes")
        size = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if size <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    return size


def plan_shards(items: Sequence[Item], max_shard_size: int) -> list[list[Item]]:
    """Greedy, order-preserving split; a tensor larger than the limit gets a shard alone."""
    shards: list[list[Item]] = [[]]
    used = 0
    for item in items:
        if shards[-1] and used + item.nbytes > max_shard_size:
            shards.append([])
            used = 0
        shards[-1].append(item)
        used += item.nbytes
    return shards


class AtomicFiles:
    """Temporary files in the target folder, renamed to their final names on ``commit``."""

    def __init__(self, folder: Path, overwrite: bool) -> None:
        self.folder, self.overwrite = folder, overwrite
        self._pending: dict[Path, Path] = {}
        self._tag = f".inspector-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def temp_for(self, final: Path) -> Path:
        if final.exists() and not self.overwrite:
            raise ExportError("already exists; pass overwrite=True to replace it", file=final)
        temp = final.with_name(f"{final.name}{self._tag}.tmp")
        self._pending[final] = temp
        return temp

    def commit(self) -> list[Path]:
        done: list[Path] = []
        try:
            for final, temp in self._pending.items():
                os.replace(temp, final)
                done.append(final)
        except BaseException:
            for final in done:
                final.unlink(missing_ok=True)
            raise
        self._pending.clear()
        return done

    def discard(self) -> None:
        for temp in self._pending.values():
            temp.unlink(missing_ok=True)
        self._pending.clear()


@contextmanager
def atomic_files(folder: Path, overwrite: bool) -> Iterator[AtomicFiles]:
    """Remove every temporary file on any failure, KeyboardInterrupt included."""
    files = AtomicFiles(folder, overwrite)
    try:
        yield files
    except BaseException:
        files.discard()
        raise


def safetensors_dtype(dtype: torch.dtype, name: str) -> str:
    try:
        return SAFETENSORS_NAMES[dtype]
    except KeyError:
        raise ExportError(
            f"safetensors cannot store {str(dtype).removeprefix('torch.')}; "
            "export to .pt, or use fp8='dequantize'",
            key=name,
        ) from None


def safetensors_header(items: Sequence[Item], metadata: dict[str, str]) -> bytes:
    """The 8-byte length + JSON header (space-padded to 8 bytes, as safetensors does)."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
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
    return struct.pack("<Q", len(text)) + text


def write_safetensors(
    path: Path, items: Sequence[Item], metadata: dict[str, str], progress: Callable[[Item], None]
) -> None:
    """One safetensors file, tensors written one at a time after the header."""
    with open(path, "wb", buffering=0) as f:
        _write_all(f.fileno(), safetensors_header(items, metadata))
        for item in items:
            _write_item(f.fileno(), item, crc=False)
            progress(item)
        os.fsync(f.fileno())


def write_torch_save(path: Path, structure: Any, progress: Callable[[Item], None]) -> None:
    """A torch.save archive of ``structure`` (nested dicts/lists; Item leaves become tensors).

    torch's own zip writer lays out the archive and ``data.pkl`` spelled exactly as
    ``torch.save`` spells tensors, so ``torch.load(weights_only=True)`` (and ``mmap=True``)
    reads it with no extra globals. Each storage record is only reserved by the writer;
    the sink it writes through fills the reserved bytes there and then, one tensor at a
    time, and the records' CRC-32s are set at the end.
    """
    items = list(_items_in(structure))
    storages = [_Storage(str(i), item.dtype, math.prod(item.shape)) for i, item in enumerate(items)]
    by_id = {id(item): storage for item, storage in zip(items, storages, strict=True)}
    buffer = io.BytesIO()
    _ArchivePickler(buffer, protocol=2).dump(
        _replace_leaves(structure, lambda item: _TensorReduction(item, by_id[id(item)]))
    )
    with open(path, "w+b", buffering=0) as f:
        sink = _Sink(f, [item for item in items if item.nbytes], progress)
        writer = torch._C.PyTorchFileWriter(sink)
        try:
            for item, storage in zip(items, storages, strict=True):
                writer.write_record_metadata(f"data/{storage.key}", item.nbytes)
            for name, data in (
                ("data.pkl", buffer.getvalue()),
                (".format_version", b"1"),
                (".storage_alignment", b"64"),
                ("byteorder", sys.byteorder.encode()),
            ):
                writer.write_record(name, data, len(data))
            writer.write_end_of_file()
        finally:
            del writer  # an unfinished writer finishes the archive here, into the sink
        if sink.error is not None:
            raise sink.error
        filled = zip(sink.items, sink.crcs, strict=True)
        _set_crcs(f, {f"data/{by_id[id(item)].key}": crc for item, crc in filled})
        os.fsync(f.fileno())


class _Sink:
    """What torch's zip writer writes through.

    Where the writer skips over a reserved storage record, the next item's bytes are
    written instead, so the archive is written front to back in one pass. Any failure
    (disk full, unreadable source, an interrupt) is kept and raised by the caller once
    torch is done: torch's writer would throw again from its destructor, which aborts
    the whole process.
    """

    def __init__(self, f: BinaryIO, items: list[Item], progress: Callable[[Item], None]) -> None:
        self.f, self.items, self.progress = f, items, progress
        self.error: BaseException | None = None
        self.crcs: list[int] = []  # of the items filled so far, in order

    def write(self, data: Any) -> int:
        if self.error is None:
            try:
                _write_all(self.f.fileno(), data)
            except OSError as exc:
                self.error = exc
        return memoryview(data).nbytes

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if self.error is not None:
            return 0
        try:
            if whence == os.SEEK_CUR and offset > 0 and len(self.crcs) < len(self.items):
                item = self.items[len(self.crcs)]
                if offset != item.nbytes:
                    raise ExportError(
                        f"zip writer reserved {offset} bytes for {item.nbytes}", key=item.name
                    )
                self.crcs.append(_write_item(self.f.fileno(), item, crc=True))
                self.progress(item)
                return self.f.tell()
            return self.f.seek(offset, whence)
        except BaseException as exc:
            self.error = exc
            return 0

    def flush(self) -> None:
        """Nothing is buffered."""


def _write_item(fd: int, item: Item, *, crc: bool) -> int:
    """Write the item's bytes at the fd's position; returns their CRC-32 when asked."""
    ranges = item.ranges() if item.ranges is not None else None
    if ranges is not None and sum(r.length for r in ranges) == item.nbytes:
        value = 0
        for byte_range in ranges:
            value = _copy_range(byte_range, fd, value if crc else None)
        return value
    tensor = _checked(item)
    if not tensor.numel():
        return 0
    data = empty_bytes_view(tensor)
    _write_all(fd, data)
    return zlib.crc32(data) if crc else 0


_COPY_BLOCK = 1 << 23


def _copy_range(source: ByteRange, fd: int, crc: int | None) -> int:
    """Append ``source``'s bytes to ``fd``; returns the running CRC-32 when ``crc`` is given.

    The kernel copies (``copy_file_range``; by blocks where it cannot) while, for a CRC, a
    thread reads the same source bytes and checksums them.
    """
    with open(source.path, "rb", buffering=0) as f:
        checksum = _Checksum(f.fileno(), source, crc) if crc is not None else None
        try:
            done = 0
            if hasattr(os, "copy_file_range"):
                try:
                    while done < source.length:
                        got = os.copy_file_range(
                            f.fileno(), fd, source.length - done, source.offset + done
                        )
                        if not got:
                            break
                        done += got
                except OSError as exc:  # EXDEV and the like: copy what is left by blocks
                    if exc.errno in (errno.EFBIG, errno.ENOSPC, errno.EIO):
                        raise
            for block in _blocks(f.fileno(), source.offset + done, source.length - done, source):
                _write_all(fd, block)
        finally:
            value = checksum.result() if checksum is not None else 0
    return value


def _blocks(fd: int, offset: int, length: int, source: ByteRange) -> Iterator[memoryview]:
    """``length`` bytes from ``offset`` in blocks of one reused buffer (use each before the
    next)."""
    buffer = memoryview(bytearray(min(_COPY_BLOCK, max(length, 1))))
    done = 0
    while done < length:
        got = os.preadv(fd, [buffer[: length - done]], offset + done)
        if not got:
            raise ExportError(
                f"file ended {length - done} bytes early while copying", file=source.path
            )
        yield buffer[:got]
        done += got


class _Checksum(threading.Thread):
    """CRC-32 of a byte range, computed in a thread (zlib and reads release the GIL)."""

    def __init__(self, fd: int, source: ByteRange, start: int) -> None:
        super().__init__(daemon=True)
        self.fd, self.source, self.value = fd, source, start
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            for block in _blocks(self.fd, self.source.offset, self.source.length, self.source):
                self.value = zlib.crc32(block, self.value)
        except BaseException as exc:  # handed to the caller by result()
            self.error = exc

    def result(self) -> int:
        self.join()
        if self.error is not None:
            raise self.error
        return self.value


def _write_all(fd: int, data: Any) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _set_crcs(f: BinaryIO, crcs: dict[str, int]) -> None:
    """Store each filled record's CRC-32 (by record name below the archive's top folder) in
    its local header and central-directory entry."""
    archive = zipfile.ZipFile(f)
    central = archive.start_dir
    crcs = {
        info.filename: crcs[name]
        for info in archive.infolist()
        if (name := info.filename.partition("/")[2]) in crcs
    }
    for info in archive.infolist():
        if info.filename in crcs:
            f.seek(info.header_offset + 14)
            f.write(struct.pack("<I", crcs[info.filename]))
    f.seek(central)
    for info in archive.infolist():
        fixed = f.read(46)
        if fixed[:4] != b"PK\x01\x02":
            raise ExportError("unexpected zip layout while setting CRC-32s", file=f.name)
        name_len, extra_len, comment_len = struct.unpack("<HHH", fixed[28:34])
        if info.filename in crcs:
            f.seek(-30, os.SEEK_CUR)
            f.write(struct.pack("<I", crcs[info.filename]))
            f.seek(26, os.SEEK_CUR)
        f.seek(name_len + extra_len + comment_len, os.SEEK_CUR)


# torch.save names a storage by its legacy typed class where one exists (FloatStorage, ...);
# newer dtypes (float8, uint16, ...) go as UntypedStorage bytes plus a dtype argument.
_LEGACY_STORAGE = {dtype: name for name, dtype in safe_pickle.LEGACY_STORAGE_DTYPES.items()}


@dataclass(frozen=True)
class _Storage:
    key: str
    dtype: torch.dtype
    numel: int


class _TensorReduction:
    """Pickles as torch.save pickles a contiguous tensor whose bytes are ``storage``."""

    def __init__(self, item: Item, storage: _Storage) -> None:
        self.item, self.storage = item, storage

    def __reduce__(self) -> tuple:
        shape = tuple(self.item.shape)
        stride = tuple(_contiguous_strides(shape))
        if self.item.dtype in _LEGACY_STORAGE:
            return torch._utils._rebuild_tensor_v2, (
                self.storage,
                0,
                shape,
                stride,
                False,
                OrderedDict(),
            )
        return torch._utils._rebuild_tensor_v3, (
            self.storage,
            0,
            shape,
            stride,
            False,
            OrderedDict(),
            self.item.dtype,
        )


class _ArchivePickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> tuple | None:
        if not isinstance(obj, _Storage):
            return None
        legacy = _LEGACY_STORAGE.get(obj.dtype)
        if legacy is not None:
            return ("storage", getattr(torch, legacy), obj.key, "cpu", obj.numel)
        return ("storage", torch.UntypedStorage, obj.key, "cpu", obj.numel * obj.dtype.itemsize)


def _checked(item: Item) -> torch.Tensor:
    tensor = item.produce()
    if tensor.dtype != item.dtype or tuple(tensor.shape) != item.shape:
        raise ExportError(
            f"produced {tensor.dtype} {list(tensor.shape)}, "
            f"planned {item.dtype} {list(item.shape)}",
            key=item.name,
        )
    return tensor.contiguous()


def _replace_leaves(value: Any, fn: Callable[[Item], Any]) -> Any:
    if isinstance(value, Item):
        return fn(value)
    if isinstance(value, dict):
        return {k: _replace_leaves(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_replace_leaves(v, fn) for v in value]
    return value


def _items_in(value: Any) -> Iterator[Item]:
    if isinstance(value, Item):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _items_in(v)
    elif isinstance(value, list):
        for v in value:
            yield from _items_in(v)
