"""One item file of one rank, decoded into leaves: ``(nested path, leaf)`` pairs, walked as
torch_checkpointing walks items (into mappings, lists and tuples; everything else is a
leaf), with tensors described (never built) and their bytes located.

Formats: torch.save (the default ``<item>_<rank>.pt``; DTensors come with their spec),
safetensors (per-rank local tensors under dot-joined names), JSON, and raw bytes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from inspector import dtypes
from inspector.errors import CorruptCheckpointError, InspectorError
from inspector.formats.safe_pickle import SubclassRef, TensorRef
from inspector.formats.safe_pickle.dtensor import DTensorSpec, dtensor_parts
from inspector.formats.safetensors import Span, looks_like_safetensors, read_header
from inspector.formats.torch_archive import (
    Record,
    TorchArchive,
    check_fits,
    is_legacy_torch,
    is_zip,
    tensor_refs,
)
from inspector.formats.torch_checkpointing.placements import Place
from inspector.storage.base import Storage

NestedPath = tuple[str | int, ...]
_MAX_JSON_BYTES = 1 << 26
_MIN_BUDGET = 4096
_MAX_DEPTH = 256
FORMATS = ("torch", "safetensors", "json", "raw")


@dataclass(frozen=True, slots=True)
class Stored:
    """A plain tensor of a torch.save item file: its view and its storage's record."""

    file: str
    ref: TensorRef
    record: Record

    @property
    def start(self) -> int:
        """Where the view's first element lies in the file."""
        return self.record.start + self.ref.storage_offset * dtypes.itemsize(self.ref.dtype)


@dataclass(frozen=True, slots=True)
class Sharded:
    """A DTensor: the rank's local shard and where the rank sits (the pickle's own spec)."""

    local: Stored
    shape: tuple[int, ...]
    dtype: str
    mesh_shape: tuple[int, ...]
    coordinate: tuple[int, ...]
    placements: tuple[Place, ...]


@dataclass(frozen=True, slots=True)
class InFile:
    """A tensor of a safetensors item file (a rank's local shard, or the whole tensor)."""

    file: str
    span: Span


@dataclass(frozen=True, slots=True)
class Subclass:
    """A tensor subclass (not a DTensor) of a torch.save item file, described."""

    file: str
    ref: SubclassRef


@dataclass(frozen=True, slots=True)
class Value:
    """A non-tensor leaf, decoded; ``file`` is the torch.save file whose tensors it may hold."""

    value: Any
    file: str | None = None


@dataclass(frozen=True, slots=True)
class RawFile:
    """A raw-bytes item file: its bytes are the value (read when asked for)."""

    file: str
    size: int


@dataclass(frozen=True, slots=True)
class Broken:
    """A leaf that cannot be used, and why."""

    file: str
    reason: str


Leaf = Stored | Sharded | InFile | Subclass | Value | RawFile | Broken


def sniff(storage: Storage, name: str) -> str:
    """The file's format by its content (the extension decides only between JSON and raw)."""
    head = storage.read(name, 0, min(512, storage.size(name)))
    if looks_like_safetensors(head):  # before pickles: a header length may start with 0x80
        return "safetensors"
    if is_zip(head) or is_legacy_torch(head):
        return "torch"
    return "json" if name.endswith(".json") else "raw"


@dataclass(frozen=True)
class ItemLeaves:
    """A decoded item file: its leaves in stored order and, for a torch.save file, the
    record (or the reason it is unreadable) of each storage its tensors use."""

    leaves: list[tuple[NestedPath, Leaf]]
    records: dict[str, Record | str]


def read_item(storage: Storage, name: str, fmt: str) -> ItemLeaves:
    """The file's leaves; InspectorError when the file as a whole cannot be decoded."""
    if fmt == "torch":
        return _torch_leaves(storage, name)
    if fmt == "safetensors":
        header = read_header(storage, name)
        leaves: list[tuple[NestedPath, Leaf]] = [
            ((key,), Broken(name, span.error) if span.error else InFile(name, span))
            for key, span in header.tensors.items()
        ]
        return ItemLeaves(leaves, {})
    if fmt == "json":
        found = walk(_json(storage, name), name, _MIN_BUDGET)
        return ItemLeaves([(path, Value(v)) for path, v in found], {})
    return ItemLeaves([((), RawFile(name, storage.size(name)))], {})


def _json(storage: Storage, name: str) -> Any:
    label = storage.describe(name)
    size = storage.size(name)
    if size > _MAX_JSON_BYTES:
        raise CorruptCheckpointError(f"a JSON item of {size} bytes is too large", file=label)
    try:
        return json.loads(storage.read(name).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"not valid JSON ({exc})", file=label) from exc


def _torch_leaves(storage: Storage, name: str) -> ItemLeaves:
    label = storage.describe(name)
    size = storage.size(name)
    with storage.window(name, 0, size) as f:
        if not is_zip(f.read(4)):
            raise CorruptCheckpointError(
                "a torch.save file in the pre-1.6 format: torch_checkpointing writes zips",
                file=label,
            )
        f.seek(0)
        archive = TorchArchive(f, label, size, None)
        value = archive.load_whole()
        records = _records(archive, value)
    leaves = [
        (path, _leaf(name, leaf, records))
        for path, leaf in walk(value, label, max(size, _MIN_BUDGET))
    ]
    return ItemLeaves(leaves, records)


def _records(archive: TorchArchive, value: Any) -> dict[str, Record | str]:
    """Each storage's record, or why it cannot be read (found now, not at read time). A
    DTensor's local shard counts; its spec is a record, so the mesh's rank map does not."""
    records: dict[str, Record | str] = {}
    for ref in tensor_refs(value):
        if ref.storage is not None and ref.storage.key not in records:
            try:
                records[ref.storage.key] = archive.record(ref.storage.key)
            except InspectorError as exc:
                records[ref.storage.key] = exc.reason
    return records


def _parts(value: Any) -> tuple[TensorRef, DTensorSpec] | str | None:
    try:
        return dtensor_parts(value)
    except ValueError as exc:
        return str(exc)


def _stored(file: str, ref: TensorRef, records: dict[str, Record | str]) -> Stored | Broken:
    if ref.storage is None:
        return Broken(file, "tensor was saved without data (meta tensor)")
    record = records.get(ref.storage.key)
    if not isinstance(record, Record):
        return Broken(file, record or f"storage {ref.storage.key!r} has no record")
    try:
        check_fits(record, ref, file=file, key=None)
    except CorruptCheckpointError as exc:
        return Broken(file, exc.reason)
    return Stored(file, ref, record)


def _leaf(file: str, value: Any, records: dict[str, Record | str]) -> Leaf:
    if isinstance(value, TensorRef):
        return _stored(file, value, records)
    parts = _parts(value)
    if isinstance(parts, str):
        return Broken(file, parts)
    if parts is not None:
        return _sharded(file, value, *parts, records=records)
    if isinstance(value, SubclassRef):
        return Subclass(file, value)
    return Value(value, file)


def _sharded(
    file: str, value: SubclassRef, local: TensorRef, spec: DTensorSpec, *, records: dict
) -> Leaf:
    stored = _stored(file, local, records)
    if isinstance(stored, Broken):
        return stored
    try:
        mesh = spec.mesh
        if spec.shard_order and any(
            list(e.mesh_dims) != sorted(e.mesh_dims) for e in spec.shard_order
        ):
            raise ValueError("its shard order is not left to right, which is not supported")
        meta = spec.tensor_meta
        shape = meta.shape if meta is not None else value.shape
        if shape != value.shape:
            raise ValueError(f"spec shape {list(shape)} differs from size {list(value.shape)}")
        placements = tuple(_place(p) for p in spec.placements)
        sharded = Sharded(
            stored, shape, value.dtype or local.dtype, mesh.shape, mesh.coordinate, placements
        )
    except ValueError as exc:
        return Broken(file, f"DTensor: {exc}")
    if sharded.dtype != local.dtype:
        return Broken(file, f"DTensor of {sharded.dtype} holds a {local.dtype} local shard")
    return sharded


def _place(record: Any) -> Place:
    if record.kind in ("shard", "strided"):
        factor = record.split_factor if record.kind == "strided" else 1
        return Place(record.kind, record.dim, factor)
    return Place(record.kind)


def walk(value: Any, file: str, budget: int) -> list[tuple[NestedPath, Any]]:
    """``(nested path, leaf)`` pairs in stored order: mappings and lists/tuples are walked,
    the rest are leaves; empty containers have none. At most ``budget`` values are visited
    (shared or cyclic references in a pickle cannot make the walk explode)."""
    found: list[tuple[NestedPath, Any]] = []
    stack: list[tuple[NestedPath, Any]] = [((), value)]
    while stack:
        path, item = stack.pop()
        budget -= 1
        if budget < 0:
            raise CorruptCheckpointError(
                "shared or cyclic references expand to more values than the file holds",
                file=file,
            )
        if isinstance(item, (Mapping, list, tuple)) and len(path) > _MAX_DEPTH:
            raise CorruptCheckpointError(f"nests deeper than {_MAX_DEPTH} levels", file=file)
        if isinstance(item, Mapping):
            children = [((*path, _component(k, file)), v) for k, v in item.items()]
            stack.extend(reversed(children))
        elif type(item) in (list, tuple):
            stack.extend(reversed([((*path, i), v) for i, v in enumerate(item)]))
        else:
            found.append((path, item))
    return found


def _component(key: Any, file: str) -> str | int:
    """A mapping key as a path component: names and indices kept, others as text."""
    if type(key) in (str, int):
        if type(key) is int and key.bit_length() > 64:
            raise CorruptCheckpointError(f"a key is an int of {key.bit_length()} bits", file=file)
        return key
    if isinstance(key, (float, bool)) or key is None:
        return str(key)
    raise CorruptCheckpointError(f"a key is a {type(key).__name__}", file=file)
