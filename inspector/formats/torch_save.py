"""torch.save files (``.pt`` / ``.pth`` / ``.bin``): the object decoded safely, flattened like DCP.

Nested dicts are flattened the way torch DCP's ``flatten_state_dict`` does (path elements
joined with dots; lists holding tensors or dicts indexed), so a DCP checkpoint and its
``dcp_to_torch_save`` output list the same keys, each keeping its nested path. Opening
decodes ``data.pkl`` into descriptions (nothing runs, no tensor data is read); a read
touches only the tensor's byte range.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

import torch

from inspector.entry import ChunkInfo, Entry
from inspector.errors import CorruptCheckpointError, InspectorError, UnsupportedError
from inspector.formats.base import ChunkValue
from inspector.formats.safe_pickle import Opaque, SubclassRef, TensorRef
from inspector.formats.torch_archive import (
    LegacyArchive,
    Record,
    StoredTensors,
    TorchArchive,
    check_fits,
    contiguous_strides,
    is_legacy_torch,
    is_tar,
    is_zip,
    materialize,
    read_storage_tensor,
    tensor_refs,
)

NestedPath = tuple[str | int, ...]


class TorchSaveSource:
    """A torch.save file: every leaf of its (nested) object is an entry."""

    format = "torch-save"
    nesting = "torch.save dict nesting"
    offsets = None  # never DCP chunks (see SafetensorsSource.offsets)

    def __init__(self, path: Path, name: str | None = None) -> None:
        self.root = path
        self.name = name or path.name
        self.metadata: dict[str, str] = {}
        self.source_files = (self.name,)
        with open(path, "rb") as f:
            archive, what = _archive(f, path)
            value = archive.load()
            try:
                self._leaves = _unique(flatten(value, path.stem))
            except RecursionError as exc:
                raise CorruptCheckpointError("object nests too deeply", file=path) from exc
            self._records = _records(archive, self._leaves.values())
        self._entries = {key: self._entry(key, p, leaf) for key, (p, leaf) in self._leaves.items()}
        self.notes = (f"{self.name}: {what}, {len(self._entries)} values",)
        if not isinstance(value, (Mapping, list)):
            self.notes += (f"the file holds a single value, listed under {path.stem!r}",)

    def _entry(self, key: str, path: NestedPath, leaf: Any) -> Entry:
        if isinstance(leaf, _Ambiguous):
            return Entry(key, "object", nested_path=path, error=leaf.reason)
        problems = [p for p in map(self._problem, tensor_refs(leaf)) if p]
        if not isinstance(leaf, (TensorRef, SubclassRef)):
            return Entry(key, "object", nested_path=path, error=problems[0] if problems else None)
        entry = Entry(key, "tensor", dtype=leaf.dtype, shape=leaf.shape, nested_path=path)
        entry.error = problems[0] if problems else None
        if entry.error is None:
            entry.chunks = (self._chunk(leaf),)
        return entry

    def _problem(self, ref: TensorRef) -> str | None:
        if ref.storage is None:
            return "tensor was saved without data (meta tensor)"
        record = self._records[ref.storage.key]
        if isinstance(record, str):
            return record
        try:
            check_fits(record, ref, file=str(self.root), key=None)
        except CorruptCheckpointError as exc:
            return exc.reason
        return None

    def _chunk(self, leaf: TensorRef | SubclassRef) -> ChunkInfo:
        """Where the leaf's bytes start, and how many its tensors hold."""
        refs = [r for r in tensor_refs(leaf) if r.storage is not None]
        starts = [
            self._records[r.storage.key].start + r.storage_offset * r.dtype.itemsize for r in refs
        ]
        size = sum(r.dtype.itemsize * math.prod(r.shape) for r in refs)
        zeros = (0,) * len(leaf.shape)
        return ChunkInfo(zeros, leaf.shape, self.name, min(starts, default=0), size)

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def entry(self, key: str) -> Entry | None:
        return self._entries.get(key)

    def _read(
        self, f: BinaryIO, key: str, ref: TensorRef, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        record = self._records.get(ref.storage.key) if ref.storage is not None else None
        if isinstance(record, str):
            raise CorruptCheckpointError(record, file=self.root, key=key)
        return read_storage_tensor(f, record, ref, out, file=str(self.root), key=key)

    def read_chunk(self, entry: Entry, index: int, out: torch.Tensor | None = None) -> ChunkValue:
        _, leaf = self._leaves[entry.key]
        with open(self.root, "rb") as f:
            if isinstance(leaf, TensorRef):
                return self._read(f, entry.key, leaf, out)
            return materialize(leaf, partial(self._read, f, entry.key))

    def read_object(self, entry: Entry) -> Any:
        _, leaf = self._leaves[entry.key]
        with open(self.root, "rb") as f:
            return materialize(leaf, partial(self._read, f, entry.key))

    def chunk_bytes(self, entry: Entry, index: int) -> tuple[Path, int] | None:
        _, leaf = self._leaves[entry.key]
        if isinstance(leaf, TensorRef) and leaf.stride == contiguous_strides(leaf.shape):
            return self.root, entry.chunks[index].byte_offset
        return None

    def chunk_globals(self, entry: Entry, index: int) -> list[str]:
        """Classes the value's pickle names beyond plain tensors and containers."""
        return class_names(self._leaves[entry.key][1])

    def describe_chunk(self, entry: Entry, index: int) -> TensorRef | SubclassRef:
        """The decoded leaf itself (tensor bytes not read)."""
        return self._leaves[entry.key][1]


def _archive(f: BinaryIO, path: Path) -> tuple[StoredTensors, str]:
    head = f.read(512)
    size = path.stat().st_size
    if is_zip(head):
        return TorchArchive(f, str(path), 0, size, None), "torch.save zip archive"
    if is_tar(head):
        raise UnsupportedError(
            "torch.save tar archive (torch < 0.4); re-save it with a newer torch", file=path
        )
    if is_legacy_torch(head):
        return LegacyArchive(f, str(path), size), "torch.save file in the pre-1.6 (non-zip) format"
    raise CorruptCheckpointError("not a torch.save file (neither zip nor pickle)", file=path)


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
    return isinstance(value, (TensorRef, SubclassRef))


def _is_terminal(value: Any) -> bool:
    """DCP's rule: mappings are walked; lists only when they hold tensors or containers."""
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    return not any(
        (isinstance(v, (Mapping, list)) and not _is_terminal(v)) or _is_tensor(v) for v in value
    )


def _walk(path: NestedPath, value: Any) -> Iterator[tuple[NestedPath, Any]]:
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _walk((*path, str(k)), v)
    elif _is_terminal(value):
        yield path, value
    else:
        for i, v in enumerate(value):
            yield from _walk((*path, i), v)


def flatten(value: Any, name: str) -> list[tuple[NestedPath, Any]]:
    """``(nested path, leaf)`` pairs; a lone non-container value is listed under ``name``."""
    if isinstance(value, Mapping) or (isinstance(value, list) and not _is_terminal(value)):
        return list(_walk((), value))
    return [((name,), value)]


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
