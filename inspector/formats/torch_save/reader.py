"""torch.save files (``.pt`` / ``.pth`` / ``.bin``): the object decoded safely, flattened like DCP.

Nested dicts are flattened the way torch DCP's ``flatten_state_dict`` does (path elements
joined with dots; lists holding tensors or dicts indexed; dict subclasses, such as
Lightning's ``AttributeDict`` hyper-parameters, decoded as stand-ins holding their items,
walked like dicts), so a DCP checkpoint and its
``dcp_to_torch_save`` output list the same keys, each keeping its nested path. Opening
decodes ``data.pkl`` into descriptions (nothing runs, no tensor data is read); a read
touches only the tensor's byte range. Flattening visits at most as many values as the
file has bytes, so shared or cyclic references in a pickle cannot make it explode.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from functools import partial
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any

from inspector import dtypes
from inspector.entry import ChunkInfo, Entry
from inspector.errors import CorruptCheckpointError, InspectorError, UnsupportedError
from inspector.formats import producers
from inspector.formats.base import ChunkValue, Step, StoredRecord
from inspector.formats.safe_pickle import BrokenTensor, Opaque, SubclassRef, TensorRef
from inspector.formats.safe_pickle.dtensor import dtensor_parts
from inspector.formats.torch_archive import (
    LegacyArchive,
    Record,
    StoredTensors,
    TorchArchive,
    broken_reason,
    check_fits,
    contiguous_strides,
    is_legacy_torch,
    is_tar,
    is_zip,
    materialize,
    read_storage_tensor,
    tensor_bytes,
    tensor_refs,
    zip_members,
)
from inspector.storage.base import ByteRange, Storage, Stream

if TYPE_CHECKING:
    import torch

NestedPath = tuple[str | int, ...]
_MIN_BUDGET = 4096
_MAX_DEPTH = 256  # genuine state dicts nest a few levels; key paths this deep are damage


class TorchSaveSource:
    """A torch.save file: every leaf of its (nested) object is an entry."""

    format = "torch-save"
    nesting = "torch.save dict nesting"
    key_matching = "flattened"
    ranks: int | None = None
    steps: tuple[Step, ...] = ()
    offsets: dict[str, tuple[int, ...]] | None = (
        None  # never DCP chunks (see SafetensorsSource.offsets)
    )

    def __init__(self, storage: Storage, name: str) -> None:
        self.storage, self.name = storage, name
        self.label = storage.describe(name)
        self.metadata: dict[str, str] = {}
        self.source_files: tuple[str, ...] = (name,)
        size = storage.size(name)
        stem = PurePosixPath(name).stem
        with storage.window(name, 0, size) as f:
            archive, what = _archive(f, self.label, size)
            self._legacy = isinstance(archive, LegacyArchive)
            value = archive.load()
            self._leaves = _unique(
                flatten(value, stem, budget=max(size, _MIN_BUDGET), file=self.label)
            )
            self._records = _records(archive, self._leaves.values())
        self._entries = {key: self._entry(key, p, leaf) for key, (p, leaf) in self._leaves.items()}
        notes = [f"{name}: {what}, {len(self._entries)} values"]
        found, evidence = producers.identify((), (p for p, _ in self._leaves.values()))
        self.producer = found.name
        if found is not producers.UNKNOWN:
            notes.append(evidence)
        if not isinstance(value, (Mapping, list)):
            notes.append(f"the file holds a single value, listed under {stem!r}")
        self.notes = tuple(notes)

    def _entry(self, key: str, path: NestedPath, leaf: Any) -> Entry:
        if isinstance(leaf, _Ambiguous):
            return Entry(key, "object", nested_path=path, error=leaf.reason)
        if isinstance(leaf, BrokenTensor):
            return Entry(key, "tensor", nested_path=path, error=leaf.reason)
        problems = [p for p in map(self._problem, tensor_refs(leaf)) if p]
        error = broken_reason(leaf) or (problems[0] if problems else _partial_dtensor(leaf))
        if not isinstance(leaf, (TensorRef, SubclassRef)):
            return Entry(key, "object", nested_path=path, error=error)
        chunks = () if error else (self._chunk(leaf),)
        return Entry(key, "tensor", leaf.dtype, leaf.shape, chunks, path, error=error)

    def _problem(self, ref: TensorRef) -> str | None:
        if ref.damage is not None:
            return ref.damage
        if ref.storage is None:
            return "tensor was saved without data (meta tensor)"
        record = self._records[ref.storage.key]
        if isinstance(record, str):
            return record
        try:
            check_fits(record, ref, file=self.label, key=None)
        except InspectorError as exc:
            return exc.reason
        return None

    def _chunk(self, leaf: TensorRef | SubclassRef) -> ChunkInfo:
        """Where the leaf's bytes start, and how many its tensors hold."""
        refs = [r for r in tensor_refs(leaf) if r.storage is not None]
        starts = [self._start(r) for r in refs]
        size = sum(dtypes.itemsize(r.dtype) * math.prod(r.shape) for r in refs)
        zeros = (0,) * len(leaf.shape)
        return ChunkInfo(zeros, leaf.shape, self.name, min(starts, default=0), size)

    def _start(self, ref: TensorRef) -> int:
        record = self._records[ref.storage.key]  # type: ignore[union-attr]
        assert isinstance(record, Record)
        return record.start + ref.storage_offset * dtypes.itemsize(ref.dtype)

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def entry(self, key: str) -> Entry | None:
        return self._entries.get(key)

    def _read(
        self, f: Stream, key: str, ref: TensorRef, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        record = self._records.get(ref.storage.key) if ref.storage is not None else None
        if isinstance(record, str):
            raise CorruptCheckpointError(record, file=self.label, key=key)
        return read_storage_tensor(f, record, ref, out, file=self.label, key=key)

    def read_chunk(self, entry: Entry, index: int, out: torch.Tensor | None = None) -> ChunkValue:
        _, leaf = self._leaves[entry.key]
        with self.storage.window(self.name, 0, self.storage.size(self.name)) as f:
            if isinstance(leaf, TensorRef):
                return self._read(f, entry.key, leaf, out)
            return materialize(leaf, partial(self._read, f, entry.key))

    def read_object(self, entry: Entry) -> Any:
        _, leaf = self._leaves[entry.key]
        with self.storage.window(self.name, 0, self.storage.size(self.name)) as f:
            return materialize(leaf, partial(self._read, f, entry.key))

    def chunk_bytes(self, entry: Entry, index: int) -> ByteRange | None:
        _, leaf = self._leaves[entry.key]
        if isinstance(leaf, TensorRef) and leaf.stride == contiguous_strides(leaf.shape):
            chunk = entry.chunks[index]
            record = self._records.get(leaf.storage.key) if leaf.storage is not None else None
            crc = tensor_bytes(record, leaf).crc if isinstance(record, Record) else None
            return ByteRange(self.storage, self.name, chunk.byte_offset, chunk.byte_length, crc)
        return None

    def chunk_globals(self, entry: Entry, index: int) -> list[str]:
        """Classes the value's pickle names beyond plain tensors and containers."""
        return class_names(self._leaves[entry.key][1])

    def describe_chunk(self, entry: Entry, index: int) -> TensorRef | SubclassRef:
        """The decoded leaf itself (tensor bytes not read)."""
        return self._leaves[entry.key][1]

    def stored_records(self) -> Iterator[StoredRecord]:
        """Every zip record with its CRC-32, each storage named after the first key using it
        (pre-1.6 files: each storage's bytes, which that format keeps no checksum for)."""
        owners: dict[str, str] = {}
        for key, (_, leaf) in self._leaves.items():
            for ref in tensor_refs(leaf):
                if ref.storage is not None:
                    owners.setdefault(ref.storage.key, key)
        if self._legacy:
            for storage_key, record in self._records.items():
                owner = owners.get(storage_key)
                if isinstance(record, str):
                    what = f"storage {storage_key}"
                    yield StoredRecord(owner, self.name, 0, 0, None, what, record)
                else:
                    yield StoredRecord(
                        owner, self.name, record.start, record.size, None, record.name
                    )
            return
        size = self.storage.size(self.name)
        with self.storage.window(self.name, 0, size) as f:
            try:
                members = zip_members(f, size, file=self.label, key=None)
            except CorruptCheckpointError as exc:
                yield StoredRecord(None, self.name, 0, size, None, "zip archive", exc.reason)
                return
        for m in members:
            owner = owners.get(m.name.rpartition("/data/")[2]) if "/data/" in m.name else None
            yield StoredRecord(owner, self.name, m.start, m.size, m.crc32, f"zip record {m.name}")


def _partial_dtensor(leaf: Any) -> str | None:
    """Why a DTensor cannot be read from this one file: it holds one rank's shard only."""
    try:
        parts = dtensor_parts(leaf)
    except ValueError as exc:
        return str(exc)
    if parts is None or parts[0].shape == leaf.shape:
        return None
    return (
        f"a DTensor of {list(leaf.shape)}: this file holds one rank's shard of "
        f"{list(parts[0].shape)}; open the folder with every rank's file to read it whole"
    )


def _archive(f: Stream, label: str, size: int) -> tuple[StoredTensors, str]:
    head = f.read(512)
    f.seek(0)
    if is_zip(head):
        return TorchArchive(f, label, size, None), "torch.save zip archive"
    if is_tar(head):
        raise UnsupportedError(
            "torch.save tar archive (torch < 0.4); re-save it with a newer torch", file=label
        )
    if is_legacy_torch(head):
        return LegacyArchive(f, label, size), "torch.save file in the pre-1.6 (non-zip) format"
    raise CorruptCheckpointError("not a torch.save file (neither zip nor pickle)", file=label)


def _records(archive: StoredTensors, leaves: Any) -> dict[str, Record | str]:
    """Each referenced storage's record, or why it cannot be read (found now, not at read)."""
    records: dict[str, Record | str] = {}
    for _, leaf in leaves:
        for ref in tensor_refs(leaf):
            if ref.storage is None or ref.storage.key in records:
                continue
            try:
                records[ref.storage.key] = archive.record(ref.storage.key)
            except InspectorError as exc:
                records[ref.storage.key] = exc.reason
    return records


# --- flattening, as torch.distributed.checkpoint._traverse.traverse_state_dict does --------


def _is_tensor(value: Any) -> bool:
    return isinstance(value, (TensorRef, SubclassRef, BrokenTensor))


class _Budget:
    """Counts values visited; more than the file's bytes means shared or cyclic references."""

    def __init__(self, limit: int, file: str) -> None:
        self.left, self.limit, self.file = limit, limit, file

    def spend(self, n: int = 1) -> None:
        self.left -= n
        if self.left < 0:
            raise CorruptCheckpointError(
                f"the pickle's shared or cyclic references expand to more than {self.limit} "
                "values, more than the file could hold",
                file=self.file,
            )


def _as_mapping(value: Any) -> Mapping | None:
    """A dict, or a dict subclass's stand-in (its items are key-value pairs), as a mapping."""
    if isinstance(value, Mapping):
        return value
    if isinstance(value, Opaque) and value.items and not value.args:
        pairs = value.items
        if all(isinstance(p, tuple) and len(p) == 2 for p in pairs):
            return dict(pairs)
    return None


def _walked_lists(value: Any, budget: _Budget) -> set[int]:
    """ids of the lists DCP's rule walks: those holding a tensor, a mapping, or a walked
    list (the rest are leaf values). Decided bottom-up without recursion."""
    walked: set[int] = set()
    decided: set[int] = set()
    stack: list[tuple[Any, bool]] = [(value, False)]
    while stack:
        item, children_done = stack.pop()
        mapping = _as_mapping(item)
        if (mapping is None and not isinstance(item, list)) or (
            id(item) in decided and not children_done
        ):
            continue
        children = list(mapping.values()) if mapping is not None else item
        if not children_done:
            budget.spend(len(children) + 1)
            decided.add(id(item))
            stack.append((item, True))
            stack.extend((c, False) for c in children if _container(c))
        elif isinstance(item, list) and any(
            _is_tensor(c) or _as_mapping(c) is not None or id(c) in walked for c in item
        ):
            walked.add(id(item))
    return walked


def _container(value: Any) -> bool:
    return isinstance(value, list) or _as_mapping(value) is not None


def flatten(value: Any, name: str, *, budget: int, file: str) -> list[tuple[NestedPath, Any]]:
    """``(nested path, leaf)`` pairs; a lone non-container value is listed under ``name``.
    At most ``budget`` values are visited (the file's size: each genuine value costs bytes)."""
    meter = _Budget(budget, file)
    walked = _walked_lists(value, meter)
    if _as_mapping(value) is None and id(value) not in walked:
        return [((name,), value)]
    found: list[tuple[NestedPath, Any]] = []
    stack: list[tuple[NestedPath, Any]] = [((), value)]
    while stack:
        path, item = stack.pop()
        meter.spend()
        if len(path) > _MAX_DEPTH and _container(item):
            raise CorruptCheckpointError(
                f"the object nests deeper than {_MAX_DEPTH} levels", file=file
            )
        mapping = _as_mapping(item)
        if mapping is not None:
            stack.extend(reversed([((*path, _key_text(k, file)), v) for k, v in mapping.items()]))
        elif isinstance(item, list) and id(item) in walked:
            stack.extend(reversed([((*path, i), v) for i, v in enumerate(item)]))
        else:
            found.append((path, item))
    return found


def _key_text(key: Any, file: str) -> str:
    """A dict key as DCP spells it (``str(key)``), refusing ints too long to print."""
    if isinstance(key, int) and key.bit_length() > 1000:
        raise CorruptCheckpointError(f"a dict key is an int of {key.bit_length()} bits", file=file)
    if isinstance(key, (str, int, float, bool)) or key is None:
        return str(key)
    if isinstance(key, tuple) and len(key) < 16 and all(isinstance(k, (str, int)) for k in key):
        return str(key)
    raise CorruptCheckpointError(f"a dict key is a {type(key).__name__}", file=file)


class _Ambiguous:
    """Two nested paths that join to the same dotted key (DCP refuses such a state dict)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _unique(leaves: list[tuple[NestedPath, Any]]) -> dict[str, tuple[NestedPath, Any]]:
    by_key: dict[str, tuple[NestedPath, Any]] = {}
    for path, leaf in leaves:
        key = ".".join(map(str, path))
        if key in by_key:
            first = by_key[key][0]
            reason = f"paths {first!r} and {path!r} both flatten to this key"
            by_key[key] = (first, _Ambiguous(reason))
        else:
            by_key[key] = (path, leaf)
    return by_key


def class_names(value: Any) -> list[str]:
    """Classes a decoded value stands for beyond plain tensors and containers (never run)."""
    names: list[str] = []
    seen: set[int] = set()
    stack = [value]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, SubclassRef):
            names.append(item.cls)
            stack.extend(item.attrs.values())
        elif isinstance(item, Opaque):
            names.append(item.global_name)
            stack.extend([*item.args, *item.kwargs.values(), item.state, *item.items])
        elif isinstance(item, type) and issubclass(item, Opaque):
            names.append(item.global_name)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
    return list(dict.fromkeys(names))
