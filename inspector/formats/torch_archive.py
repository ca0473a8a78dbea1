"""torch.save archives: find their storage records, decode their pickles safely, read storages.

A DCP item and a ``.pt`` file are both zip archives; DCP's sit at a byte range inside a
``.distcp`` file. Files from torch < 1.6 use the older flat layout (``LegacyArchive``).
An archive is read through a bounded stream (a storage window, positions relative to the
archive's first byte); only the byte ranges a tensor needs are read, straight into its
buffer. torch is imported only when a tensor is materialised.
"""

from __future__ import annotations

import collections
import math
import struct
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from inspector import dtypes
from inspector.errors import CorruptCheckpointError, UnsupportedError
from inspector.formats import safe_pickle
from inspector.formats.base import bytes_view
from inspector.formats.safe_pickle import (
    BrokenTensor,
    DtypeName,
    NumpyArray,
    SubclassRef,
    TensorRef,
)
from inspector.formats.safe_pickle.stdlib import Namespace
from inspector.storage.base import Stream, WindowReader
from inspector.storage.digest import crc32

if TYPE_CHECKING:
    import torch

_LOCAL_HEADER = struct.Struct("<4s22xHH")
_ENCRYPTED = 0x1  # zip general-purpose flag bit 0
_MAX_PICKLE_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class Record:
    """A stored (uncompressed) zip member: ``size`` bytes at ``start`` of the archive stream;
    ``crc``: the CRC-32 the archive records for them (None when it records none: torch.save
    with CRCs turned off writes 0)."""

    name: str
    start: int
    size: int
    crc: int | None = None


def read_exact_into(
    f: Stream, start: int, buffer: memoryview, *, file: str, key: str | None
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


class StoredTensors:
    """Reading tensors out of a torch.save file's storages; subclasses locate the records.

    ``f`` is the archive's stream; ``path`` names the file in messages.
    """

    f: Stream
    path: str
    key: str | None

    def load(self) -> Any:
        raise NotImplementedError

    def load_whole(self) -> Any:
        """:meth:`load`, refused when a tensor in it is described by arguments that describe
        none (a reader of one value at a time has no other keys to keep browsable)."""
        value = self.load()
        why = broken_reason(value)
        if why is not None:
            raise CorruptCheckpointError(why, file=self.path, key=self.key)
        return value

    def record(self, storage_key: str) -> Record:
        raise NotImplementedError

    def read_tensor(self, ref: TensorRef, out: torch.Tensor | None = None) -> torch.Tensor:
        """Materialise ``ref``; with ``out`` (same shape and dtype, contiguous) read into it."""
        needed = ref.storage is not None and ref.extent > 0
        record = self.record(ref.storage.key) if needed and ref.storage else None
        return read_storage_tensor(self.f, record, ref, out, file=self.path, key=self.key)

    def materialize(self, value: Any) -> Any:
        """Replace every TensorRef in ``value`` (containers, subclass attributes) by a tensor."""
        return materialize(value, self.read_tensor)

    def contiguous_bytes(self, shape: tuple[int, ...], dtype: str) -> Record | None:
        """Where the archive's tensor bytes lie (stream offsets) when it holds one plain
        contiguous tensor of ``shape`` and ``dtype`` (checked against its record); else None.
        The record's CRC-32 comes along when the tensor's bytes are the whole record."""
        ref = self.load_whole()
        if not isinstance(ref, TensorRef) or ref.storage is None:
            return None
        if (ref.shape, ref.dtype) != (tuple(shape), dtype) or ref.stride != contiguous_strides(
            ref.shape
        ):
            return None
        record = self.record(ref.storage.key)
        check_fits(record, ref, file=self.path, key=self.key)
        return tensor_bytes(record, ref)


class TorchArchive(StoredTensors):
    """The torch.save zip archive that ``f`` (a bounded stream of ``length`` bytes) holds."""

    def __init__(self, f: Stream, path: str, length: int, key: str | None) -> None:
        self.f, self.path, self.length, self.key = f, path, length, key
        try:
            self._zip = zipfile.ZipFile(f)
            infos = self._zip.infolist()
        except _ZIP_ERRORS as exc:
            raise CorruptCheckpointError(
                f"not a readable torch.save archive ({_describe(exc)})", file=path, key=key
            ) from exc
        packed = next(  # a compressed storage record marks only its keys (see ``record``)
            (
                i
                for i in infos
                if i.flag_bits & _ENCRYPTED or (i.compress_type and "/data/" not in i.filename)
            ),
            None,
        )
        if packed is not None:
            how = "encrypted" if packed.flag_bits & _ENCRYPTED else "compressed"
            raise UnsupportedError(
                f"record {packed.filename!r} is {how}; torch.save stores every record as is",
                file=path,
                key=key,
            )
        # torch.load reads the folder of the archive's first record, and refuses an archive
        # with any record outside it.
        first = infos[0].filename if infos else ""
        folder, slash, _ = first.partition("/")
        stray = next((i.filename for i in infos if not i.filename.startswith(folder + "/")), None)
        if not slash or stray is not None:
            raise CorruptCheckpointError(
                f"record {stray or first!r} is not in folder {folder + '/'!r} of the archive's "
                "first record (torch.load refuses such an archive)",
                file=path,
                key=key,
            )
        self.prefix = folder + "/"
        if self.prefix + "data.pkl" not in {i.filename for i in infos}:
            raise CorruptCheckpointError(
                f"torch archive has no data.pkl record in folder {self.prefix!r}", file=path,
                key=key,
            )
        self._infos = {i.filename: i for i in infos}
        # Records sharing a name: torch's reader finds one by binary search over the sorted
        # directory (first or last depending on the other names), zipfile takes the last.
        # Neither is the answer: such a record is refused (a storage only for its keys).
        counts = collections.Counter(i.filename for i in infos)
        self._shared_names = {name: n for name, n in counts.items() if n > 1}
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
        self._check_unique(info.filename)
        if info.file_size > limit or info.compress_size > self.length:
            raise CorruptCheckpointError(
                f"record {name!r} claims {info.file_size} bytes", file=self.path, key=self.key
            )
        if info.compress_type == zipfile.ZIP_STORED:
            return self._stored_bytes(info)
        try:
            return self._zip.read(info)
        except _ZIP_ERRORS as exc:
            raise CorruptCheckpointError(
                f"cannot read record {name!r} ({_describe(exc)})", file=self.path, key=self.key
            ) from exc

    def _check_unique(self, name: str) -> None:
        if name in self._shared_names:
            raise CorruptCheckpointError(
                f"the archive holds {self._shared_names[name]} records named {name!r}; "
                "which one torch.load reads depends on the other names: refusing it",
                file=self.path,
                key=self.key,
            )

    def _stored_bytes(self, info: zipfile.ZipInfo) -> bytes:
        """A stored record's bytes, checked against its CRC-32 unless the writer turned CRCs
        off (``torch.serialization.set_crc32_options(False)`` writes 0; zipfile would refuse)."""
        start = _data_start(self.f, info, self.length, file=self.path, key=self.key)
        data = bytearray(info.file_size)
        read_exact_into(self.f, start, memoryview(data), file=self.path, key=self.key)
        if info.CRC and crc32(data) != info.CRC:
            raise CorruptCheckpointError(
                f"cannot read record {info.filename!r} (its bytes fail their CRC-32 check)",
                file=self.path,
                key=self.key,
            )
        return bytes(data)

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
        self._check_unique(name)
        if info.compress_type != zipfile.ZIP_STORED:
            raise UnsupportedError(
                f"storage record {name!r} is compressed", file=self.path, key=self.key
            )
        start = _data_start(self.f, info, self.length, file=self.path, key=self.key)
        return Record(name, start, info.file_size, info.CRC or None)


@dataclass(frozen=True, slots=True)
class Member:
    """A zip member as an integrity check sees it: its stored bytes (``size`` at ``start`` of
    the archive stream) and the CRC-32 the central directory keeps (None when compressed:
    the CRC is then of the inflated bytes)."""

    name: str
    start: int
    size: int
    crc32: int | None


def zip_members(f: Stream, length: int, *, file: str, key: str | None) -> list[Member]:
    """Every member of the zip archive ``f`` (a stream of ``length`` bytes) holds, in stored
    order; a CorruptCheckpointError when its directory or a local header is damaged."""
    try:
        infos = zipfile.ZipFile(f).infolist()
    except _ZIP_ERRORS as exc:
        raise CorruptCheckpointError(
            f"not a readable zip archive ({_describe(exc)})", file=file, key=key
        ) from exc
    members = []
    for info in sorted(infos, key=lambda i: i.header_offset):
        start = _data_start(f, info, length, file=file, key=key)
        stored = info.compress_type == zipfile.ZIP_STORED
        members.append(
            Member(info.filename, start, info.compress_size, info.CRC if stored else None)
        )
    return members


def _data_start(
    f: Stream, info: zipfile.ZipInfo, length: int, *, file: str, key: str | None
) -> int:
    """Where the member's stored bytes start, from its local header; they must end inside the
    archive (and, stored, take as many bytes as they hold)."""
    name = info.filename
    f.seek(info.header_offset)
    header = f.read(_LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size:
        raise CorruptCheckpointError(f"record {name!r} header is cut off", file=file, key=key)
    magic, name_len, extra_len = _LOCAL_HEADER.unpack(header)
    if magic != b"PK\x03\x04":
        raise CorruptCheckpointError(f"record {name!r} has a bad local header", file=file, key=key)
    start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
    stored = info.compress_type == zipfile.ZIP_STORED
    if (stored and info.compress_size != info.file_size) or start + info.compress_size > length:
        raise CorruptCheckpointError(
            f"record {name!r} claims {info.compress_size} bytes at byte {start}, past the end "
            f"of the archive (byte {length})",
            file=file,
            key=key,
        )
    return start


# What zipfile raises on damaged archives (NotImplementedError: an unknown zip version).
# Compressed and encrypted records are refused before any is read.
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
    """The tensor's elements must lie inside its storage, and the storage fill its record
    exactly (as torch.load checks); no two elements may share storage except by repeating
    along a stride-0 dimension."""
    if ref.overlapping:
        raise UnsupportedError(
            f"tensor {list(ref.shape)} with strides {list(ref.stride)} is a view whose "
            "elements overlap in storage: not supported",
            file=file,
            key=key,
        )
    storage = ref.storage
    if storage is not None and storage.numel * dtypes.itemsize(storage.dtype) != record.size:
        # torch.load refuses a storage whose record holds more or fewer bytes than it claims
        raise CorruptCheckpointError(
            f"storage {record.name!r} claims {storage.numel} elements of {storage.dtype} but its "
            f"record holds {record.size} bytes (torch.load refuses it)",
            file=file,
            key=key,
        )
    if storage is None or ref.storage_offset + ref.extent > storage.numel:
        raise CorruptCheckpointError(
            f"tensor {list(ref.shape)} at element {ref.storage_offset} does not fit storage "
            f"{record.name!r} ({record.size} bytes)",
            file=file,
            key=key,
        )


def tensor_bytes(record: Record, ref: TensorRef) -> Record:
    """The bytes of a contiguous ``ref`` inside ``record`` (which it fits), with the record's
    CRC-32 when they are all of it."""
    start = record.start + ref.storage_offset * dtypes.itemsize(ref.dtype)
    size = math.prod(ref.shape) * dtypes.itemsize(ref.dtype)
    whole = start == record.start and size == record.size
    return Record(record.name, start, size, record.crc if whole else None)


def read_storage_tensor(
    f: Stream,
    record: Record | None,
    ref: TensorRef,
    out: torch.Tensor | None = None,
    *,
    file: str,
    key: str | None,
) -> torch.Tensor:
    """Read ``ref``'s elements from ``record`` of ``f`` (``out`` is filled when it fits).

    Only the elements the view spans are allocated: a stride-0 view (``expand``) of one
    stored element is read as that element and expanded, not copied out."""
    import torch

    if ref.damage is not None:  # torch would not load the described values
        raise CorruptCheckpointError(ref.damage, file=file, key=key)
    dtype = dtypes.to_torch(ref.dtype)
    if not math.prod(ref.shape):
        return torch.empty(ref.shape, dtype=dtype)
    if record is None or ref.storage is None:
        raise UnsupportedError("tensor was saved without data (meta tensor)", file=file, key=key)
    check_fits(record, ref, file=file, key=key)
    start = record.start + ref.storage_offset * dtypes.itemsize(ref.dtype)
    contiguous = ref.stride == contiguous_strides(ref.shape)
    if contiguous and out is not None and _fits(out, ref):
        read_exact_into(f, start, bytes_view(out), file=file, key=key)
        return out
    buffer = torch.empty(math.prod(ref.shape) if contiguous else ref.extent, dtype=dtype)
    read_exact_into(f, start, bytes_view(buffer), file=file, key=key)
    if contiguous:
        return buffer.view(ref.shape)
    return buffer.as_strided(ref.shape, ref.stride)


def materialize(value: Any, read: Callable[[TensorRef], Any]) -> Any:
    """Replace every TensorRef in ``value`` (containers, subclass attributes, a saved
    namespace's fields) by ``read(ref)``, every dtype name a pickle gave by the
    ``torch.dtype`` and every numpy array record by the array. Shared sub-objects are
    materialised once and stay shared; cycles are kept as they are."""
    done: dict[int, Any] = {}
    return _materialize(value, read, done)


def _materialize(value: Any, read: Callable[[TensorRef], Any], done: dict[int, Any]) -> Any:
    if id(value) in done:
        return done[id(value)]
    if isinstance(value, TensorRef):
        result = done[id(value)] = read(value)
        return result
    if isinstance(value, DtypeName):
        return dtypes.to_torch(str(value))
    if isinstance(value, NumpyArray):  # checked bytes of a plain dtype: numpy.frombuffer
        result = done[id(value)] = value.to_numpy()
        return result
    if isinstance(value, SubclassRef):
        attrs = {k: _materialize(v, read, done) for k, v in value.attrs.items()}
        data = read(value.data) if isinstance(value.data, TensorRef) else value.data
        result = done[id(value)] = SubclassRef(value.cls, value.dtype, value.shape, attrs, data)
        return result
    if isinstance(value, Namespace):
        fields = {k: _materialize(v, read, done) for k, v in value.fields.items()}
        result = done[id(value)] = Namespace.of(fields)
        return result
    if isinstance(value, dict):
        copy = done[id(value)] = value.copy()
        for k, v in value.items():
            copy[k] = _materialize(v, read, done)
        return copy
    if type(value) is list:
        items: list[Any] = []
        done[id(value)] = items
        items.extend(_materialize(v, read, done) for v in value)
        return items
    if type(value) is tuple:
        result = done[id(value)] = tuple(_materialize(v, read, done) for v in value)
        return result
    return value


def tensor_refs(value: Any) -> Iterator[TensorRef]:
    """Every distinct TensorRef that ``materialize`` would read, each once, in order
    (a walk bounded by the decoded object's size, shared parts visited once)."""
    return (item for item in _items(value) if isinstance(item, TensorRef))


def broken_reason(value: Any) -> str | None:
    """Why a tensor in ``value`` cannot be read: the first BrokenTensor's reason, if any."""
    broken = next((i for i in _items(value) if isinstance(i, BrokenTensor)), None)
    return None if broken is None else broken.reason


def _items(value: Any) -> Iterator[Any]:
    """``value`` and everything ``materialize`` walks into, each once, in order."""
    seen: set[int] = set()
    stack = [value]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        yield item
        if isinstance(item, SubclassRef):
            stack.extend(reversed([*item.attrs.values(), item.data]))
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, Namespace):
            stack.extend(reversed(list(item.fields.values())))
        elif type(item) in (list, tuple):
            stack.extend(reversed(item))


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _fits(out: torch.Tensor, ref: TensorRef) -> bool:
    return (
        out.is_contiguous()
        and tuple(out.shape) == ref.shape
        and str(out.dtype).removeprefix("torch.") == ref.dtype
    )


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

    def __init__(self, f: Stream, path: str, length: int) -> None:
        self.f, self.path, self.key = f, path, None
        f.seek(0)
        reader = WindowReader(f, length)  # type: ignore[arg-type]
        try:
            self._value, storages = safe_pickle.load_legacy_torch(reader, file=path)
            position = reader.tell()
        finally:
            reader.detach()  # the window stays open: its owner closes it
        self._records: dict[str, Record | str] = {}
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
        size = numel * dtypes.itemsize(storage.dtype)
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
