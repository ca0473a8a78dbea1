"""Writing torch.save archives that ``torch.load(weights_only=True)`` reads (``mmap=True`` too).

torch's own zip writer lays out the archive and ``data.pkl`` is spelled exactly as
``torch.save`` spells tensors, so no extra globals are needed to load it. Each storage
record is only reserved by the writer; the sink it writes through fills the reserved
bytes there and then, one tensor at a time (a single front-to-back pass), and the
records' CRC-32s are set at the end.

While torch's writer exists, Ctrl-C (SIGINT) is recorded, not raised: a KeyboardInterrupt
inside a callback from C++ would leave the writer half-done, and its destructor would then
abort the whole process. The copy in hand stops at its next step (at most 64 MiB), the sink
writes nothing more once the interrupt is recorded (the writer finishes at once, into
nothing), and the interrupt is delivered as soon as the writer is gone; the caller removes
the partial file.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import signal
import struct
import sys
import threading
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from inspector import dtypes
from inspector.errors import ExportError
from inspector.formats.safe_pickle import LEGACY_STORAGE_DTYPES
from inspector.formats.torch_archive import contiguous_strides
from inspector.formats.writing import Item, write_item
from inspector.storage.copy import halting, write_all
from inspector.storage.writeback import durable


def write_torch_save(
    path: Path, structure: Any, progress: Callable[[Item], None]
) -> dict[str, int]:
    """A torch.save archive of ``structure`` (nested dicts/lists; Item leaves become tensors);
    returns each item's CRC-32 by name, as its record stores it (see :func:`write_item`)."""
    with open(path, "w+b", buffering=0) as f, durable(f.fileno(), progress) as written:
        _, crcs = append_archive(f, structure, written)
    return crcs


def append_archive(
    f: BinaryIO, structure: Any, progress: Callable[[Item], None]
) -> tuple[int, dict[str, int]]:
    """Write a torch.save archive of ``structure`` at the end of ``f`` (opened ``w+b``,
    unbuffered): the archive's offsets count from its own start, as when torch.save writes
    into a stream (DCP's ``.distcp`` files are such archives back to back). Returns its length
    and each item's CRC-32 by name.
    """
    start = f.seek(0, os.SEEK_END)
    items, records, sink = _write_archive(f, structure, _Sink(f, progress))
    filled = dict(zip(sink.items, sink.crcs, strict=True))
    _set_crcs(f, {records[name]: crc for name, crc in filled.items()})
    crcs = {item.name: 0 for item in items} | filled
    return f.seek(0, os.SEEK_END) - start, crcs


def reserve_torch_save(path: Path, structure: Any) -> dict[str, int]:
    """Write the torch.save archive of ``structure`` with every tensor's bytes left as a
    hole, so other processes can fill them (:func:`write_item` at the offset) in any order;
    returns each item's offset in the file by name (items of no bytes have none). Set the
    records' CRC-32s afterwards with :func:`set_torch_save_crcs`."""
    with open(path, "w+b", buffering=0) as f:
        sink = _Reserving(f)
        _write_archive(f, structure, sink)
        os.fsync(f.fileno())
    return dict(zip(sink.items, sink.offsets, strict=True))


def set_torch_save_crcs(path: Path, structure: Any, crcs: dict[str, int]) -> None:
    """Store each item's CRC-32 (by item name) in the records of the archive ``path`` that
    :func:`reserve_torch_save` wrote for the same ``structure``."""
    records = {item.name: f"data/{i}" for i, item in enumerate(_items_in(structure))}
    with open(path, "r+b", buffering=0) as f:
        _set_crcs(f, {records[name]: crc for name, crc in crcs.items() if name in records})
        os.fsync(f.fileno())


def _write_archive(
    f: BinaryIO, structure: Any, sink: _Sink
) -> tuple[list[Item], dict[str, str], _Sink]:
    """Lay out the archive of ``structure`` through ``sink`` (which fills or reserves each
    storage record); returns the items, each item's record name, and the sink."""
    items = list(_items_in(structure))
    storages = [_Storage(str(i), item.dtype, math.prod(item.shape)) for i, item in enumerate(items)]
    by_id = {id(item): storage for item, storage in zip(items, storages, strict=True)}
    buffer = io.BytesIO()
    _ArchivePickler(buffer, protocol=2).dump(
        _replace_leaves(structure, lambda item: _TensorReduction(item, by_id[id(item)]))
    )
    sink.pending = [item for item in items if item.nbytes]
    with _DeferredInterrupt() as sink.interrupt, halting(sink.halt):
        writer = torch._C.PyTorchFileWriter(sink)  # type: ignore[call-overload]  # a file-like
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
    return items, {item.name: f"data/{by_id[id(item)].key}" for item in items}, sink


class _DeferredInterrupt:
    """SIGINT recorded instead of raised inside the block (main thread only: no other
    thread ever gets a KeyboardInterrupt), then delivered as the handler it replaced would
    have: that handler called (Python's raises KeyboardInterrupt), or the signal raised
    again (ignored, or the default action)."""

    def __init__(self) -> None:
        self.pending = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> _DeferredInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._record)
            self._installed = True
        return self

    def _record(self, signum: int, frame: Any) -> None:
        self.pending = True

    def __exit__(self, *exc: object) -> None:
        if not self._installed:
            return
        signal.signal(signal.SIGINT, self._previous)
        if not self.pending:
            return
        if callable(self._previous):
            self._previous(signal.SIGINT, None)
        else:
            signal.raise_signal(signal.SIGINT)


class _Sink:
    """What torch's zip writer writes through.

    Where the writer skips over a reserved storage record, the next item's bytes are
    written instead, so the archive is written front to back in one pass. Any failure
    (disk full, unreadable source, the progress callback's) is kept and raised by the
    caller once torch is done: torch's writer would throw again from its destructor, which
    aborts the whole process. After a failure or an interrupt nothing more is written.
    """

    def __init__(self, f: BinaryIO, progress: Callable[[Item], None] | None = None) -> None:
        self.f, self.progress = f, progress
        self.pending: list[Item] = []  # the items of bytes, in record order
        self.interrupt = _DeferredInterrupt()  # replaced by the one active while writing
        self.error: BaseException | None = None
        self.items: list[str] = []  # the names of the items filled (or reserved) so far
        self.crcs: list[int] = []

    @property
    def stopped(self) -> bool:
        return self.error is not None or self.interrupt.pending

    def halt(self) -> None:
        """Stop the copy in hand once Ctrl-C is recorded (kept as the sink's error)."""
        if self.interrupt.pending:
            raise KeyboardInterrupt

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        if not self.stopped:
            try:
                write_all(self.f.fileno(), data)
            except BaseException as exc:
                self.error = exc
        return size

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if self.stopped:
            return 0
        try:
            if whence == os.SEEK_CUR and offset > 0 and len(self.items) < len(self.pending):
                item = self.pending[len(self.items)]
                if offset != item.nbytes:
                    raise ExportError(
                        f"zip writer reserved {offset} bytes for {item.nbytes}", key=item.name
                    )
                self.fill(item)
                self.items.append(item.name)
                return self.f.tell()
            return self.f.seek(offset, whence)
        except BaseException as exc:
            self.error = exc
            return 0

    def fill(self, item: Item) -> None:
        self.crcs.append(write_item(self.f.fileno(), item, crc=True))
        if self.progress is not None:
            self.progress(item)

    def flush(self) -> None:
        """Nothing is buffered."""


class _Reserving(_Sink):
    """A sink that leaves each record's bytes as a hole and notes where it starts."""

    def __init__(self, f: BinaryIO) -> None:
        super().__init__(f)
        self.offsets: list[int] = []

    def fill(self, item: Item) -> None:
        self.offsets.append(self.f.tell())
        self.f.seek(item.nbytes, os.SEEK_CUR)


def _set_crcs(f: BinaryIO, crcs: dict[str, int]) -> None:
    """Store each filled record's CRC-32 (by record name below the archive's top folder) in
    its local header and central-directory entry (of the archive that ends ``f``: zipfile
    adds the bytes in front of it to its offsets)."""
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
_LEGACY_STORAGE = {dtype: name for name, dtype in LEGACY_STORAGE_DTYPES.items()}


@dataclass(frozen=True)
class _Storage:
    key: str
    dtype: str
    numel: int


class _TensorReduction:
    """Pickles as torch.save pickles a contiguous tensor whose bytes are ``storage``."""

    def __init__(self, item: Item, storage: _Storage) -> None:
        self.item, self.storage = item, storage

    def __reduce__(self) -> tuple:
        shape = tuple(self.item.shape)
        stride = tuple(contiguous_strides(shape))
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
            dtypes.to_torch(self.item.dtype),
        )


class _ArchivePickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> tuple | None:
        if not isinstance(obj, _Storage):
            return None
        legacy = _LEGACY_STORAGE.get(obj.dtype)
        if legacy is not None:
            return ("storage", getattr(torch, legacy), obj.key, "cpu", obj.numel)
        size = obj.numel * dtypes.itemsize(obj.dtype)
        return ("storage", torch.UntypedStorage, obj.key, "cpu", size)


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


_WEIGHTS_ONLY_TYPES = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.Size)


def weights_only_problem(value: Any) -> str | None:
    """Why ``value`` cannot round-trip through ``torch.load(weights_only=True)``, or None."""
    if isinstance(value, _WEIGHTS_ONLY_TYPES):
        return None
    if isinstance(value, torch.Tensor):
        return "holds a tensor inside an object"
    if isinstance(value, dict):
        for k, v in value.items():
            problem = weights_only_problem(k) or weights_only_problem(v)
            if problem:
                return problem
        return None
    if isinstance(value, (list, tuple, set, frozenset)):
        return next((p for p in map(weights_only_problem, value) if p), None)
    return f"a {type(value).__module__}.{type(value).__qualname__}"
