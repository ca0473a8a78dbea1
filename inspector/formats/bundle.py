"""A checkpoint saved one file (or DCP folder) per component, opened as one: a Hugging Face
Trainer ``checkpoint-N/`` (model files, ``optimizer.pt``, ``scheduler.pt``, ``rng_state*.pth``,
``trainer_state.json``) or an accelerate ``save_state`` folder (``model.safetensors`` or
``pytorch_model_fsdp_0/``, ``optimizer.bin`` or ``optimizer_0/``, ``scheduler.bin``,
``random_states_<r>.pkl``).

Which file holds which component is the producer profile's ``component_files``; the model
files are what the folder's own rules pick (``open_model``). Each part keeps its own reader;
its keys are prefixed by the file's stem (``optimizer.state.0.exp_avg``) unless its paths
already start with its component (a DCP ``optimizer_0/`` saved as ``{"optimizer": ...}``). A
part that does not open is a note and an unreadable entry; the rest stays browsable.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from inspector.components import component_name
from inspector.entry import Entry, make_entry
from inspector.errors import CorruptCheckpointError, InspectorError
from inspector.formats.base import (
    ChunkValue,
    Source,
    Step,
    StoredRecord,
    chunk_records,
    parse_json,
)
from inspector.formats.producers import Producer
from inspector.formats.safe_pickle import SubclassRef, TensorRef
from inspector.storage.base import ByteRange, Storage

if TYPE_CHECKING:
    import torch

Opener = Callable[[Storage, str], Source]
_MAX_JSON_BYTES = 1 << 26


@dataclass(frozen=True)
class Part:
    """One file or folder of the bundle, opened: its prefix in keys (``""``: none), the
    component it holds, the folder it lies in (``""``: the bundle's own) and its reader."""

    name: str
    prefix: str
    component: str
    folder: str
    source: Source


def component_files(profile: Producer, names: list[str]) -> dict[str, str]:
    """The folder's files and folders (``/`` at the end) the profile assigns a component."""
    return {
        name: component
        for name in names
        for pattern, component in profile.component_files.items()
        if fnmatch.fnmatchcase(name, pattern)
    }


class BundleSource:
    """Several component files of one producer's save, as one checkpoint."""

    key_matching = "flattened"
    steps: tuple[Step, ...] = ()

    def __init__(
        self,
        storage: Storage,
        profile: Producer,
        evidence: str,
        model: Source | None,
        parts: dict[str, str],
        open_part: Opener,
    ) -> None:
        """``model``: the model's files, opened (None: none, or a part holds it); ``parts``:
        file or folder name -> component; ``open_part(storage, name)`` opens one by content."""
        self.storage, self.name, self.producer = storage, "", profile.name
        notes = [f"{profile.title} save: {len(parts) + (model is not None)} parts", evidence]
        self._parts: list[Part] = []
        self._where: dict[str, tuple[int, Entry]] = {}  # key -> its part, and its entry there
        self._errors: list[StoredRecord] = []
        entries: list[Entry] = []
        if model is not None:
            notes.extend(model.notes)
            entries += self._add(Part("model", "", "model", "", model))
        for name, component in parts.items():
            try:
                part = self._open(name, component, open_part)
            except InspectorError as exc:
                notes.append(f"{name}: cannot be opened ({exc.reason})")
                self._errors.append(StoredRecord(name, name, 0, 0, None, "part", exc.reason))
                entries.append(Entry(name, "object", nested_path=(name,), error=str(exc)))
                continue
            entries += self._add(part)
        self._entries = entries
        self.notes = tuple(notes)
        opened = [p.source for p in self._parts]
        self.format = model.format if model is not None else _first_format(opened)
        self.nesting = f"{profile.title}'s files (one per component)"
        self.metadata = {k: v for s in opened for k, v in s.metadata.items()}
        self.ranks = max((s.ranks for s in opened if s.ranks), default=None)
        self.source_files = tuple(
            _inside(p.folder, f) for p in self._parts for f in p.source.source_files
        )

    def _open(self, name: str, component: str, open_part: Opener) -> Part:
        folder = name.rstrip("/") if name.endswith("/") else ""
        if folder:
            source = open_part(self.storage.child(folder), "")
        elif name.endswith(".json"):
            source = JsonSource(self.storage, name)
        else:
            source = open_part(self.storage, name)
        paths = [e.nested_path for e in source.entries() if e.nested_path]
        headed = bool(paths) and all(component_name(p[0]) == component for p in paths)
        stem = (folder or name).split(".", 1)[0]
        return Part(name, "" if headed else stem, component, folder, source)

    def _add(self, part: Part) -> list[Entry]:
        """The part's entries under the bundle's keys (their files inside its folder)."""
        index = len(self._parts)
        self._parts.append(part)
        out = []
        for e in part.source.entries():
            key = f"{part.prefix}.{e.key}" if part.prefix else e.key
            path = (part.prefix, *(e.nested_path or (e.key,))) if part.prefix else e.nested_path
            component = part.component if part.prefix else e.component
            chunks = tuple(c._replace(file=_inside(part.folder, c.file)) for c in e.chunks)
            out.append(make_entry(key, e.kind, e.dtype, e.shape, chunks, path, component, e.error))
            self._where[key] = (index, e)
        return out

    def _part(self, entry: Entry) -> tuple[Source, Entry]:
        index, inner = self._where[entry.key]
        return self._parts[index].source, inner

    def entries(self) -> list[Entry]:
        return self._entries

    def read_chunk(self, entry: Entry, index: int, out: torch.Tensor | None = None) -> ChunkValue:
        source, inner = self._part(entry)
        return source.read_chunk(inner, index, out)

    def read_object(self, entry: Entry) -> Any:
        source, inner = self._part(entry)
        return source.read_object(inner)

    def chunk_bytes(self, entry: Entry, index: int) -> ByteRange | None:
        source, inner = self._part(entry)
        return source.chunk_bytes(inner, index)

    def chunk_globals(self, entry: Entry, index: int) -> list[str]:
        source, inner = self._part(entry)
        return source.chunk_globals(inner, index)

    def describe_chunk(self, entry: Entry, index: int) -> TensorRef | SubclassRef:
        source, inner = self._part(entry)
        return source.describe_chunk(inner, index)

    def stored_records(self) -> Iterator[StoredRecord]:
        """Each part's records (files inside the bundle's folder), then the parts that did
        not open."""
        for part in self._parts:
            listed = getattr(part.source, "stored_records", None)
            for r in listed() if listed is not None else chunk_records(part.source):
                key = f"{part.prefix}.{r.key}" if part.prefix and r.key else r.key
                yield r._replace(key=key, file=_inside(part.folder, r.file))
        yield from self._errors


def _inside(folder: str, name: str) -> str:
    return f"{folder}/{name}" if folder else name


def _first_format(sources: list[Source]) -> str:
    return sources[0].format if sources else "unknown"


class JsonSource:
    """A JSON file of a bundle (the Trainer's ``trainer_state.json``): each leaf an object
    entry, keys dotted as DCP flattens dicts; values come from the parsed text."""

    format = "json"
    producer = "unknown"
    nesting = "JSON nesting"
    key_matching = "flattened"
    ranks: int | None = None
    steps: tuple[Step, ...] = ()

    def __init__(self, storage: Storage, name: str) -> None:
        from inspector.formats.torch_save.reader import flatten

        self.storage, self.name = storage, name
        label = storage.describe(name)
        size = storage.size(name)
        if size > _MAX_JSON_BYTES:
            raise CorruptCheckpointError(f"{size:,} bytes of JSON: too large", file=label)
        value = parse_json(storage.read(name), file=label, what="JSON")
        stem = name.rsplit("/", 1)[-1].split(".", 1)[0]
        leaves = flatten(value, stem, budget=max(size, 4096), file=label)
        self._leaves = {".".join(map(str, p)): (p, v) for p, v in leaves}
        self._entries = [
            Entry(key, "object", nested_path=p) for key, (p, _) in self._leaves.items()
        ]
        self.metadata: dict[str, str] = {}
        self.notes: tuple[str, ...] = (f"{name}: JSON, {len(self._entries)} values",)
        self.source_files: tuple[str, ...] = (name,)

    def entries(self) -> list[Entry]:
        return self._entries

    def read_object(self, entry: Entry) -> Any:
        return self._leaves[entry.key][1]

    def read_chunk(self, entry: Entry, index: int, out: torch.Tensor | None = None) -> ChunkValue:
        raise TypeError("a JSON value is not a tensor")

    def chunk_bytes(self, entry: Entry, index: int) -> ByteRange | None:
        return None

    def chunk_globals(self, entry: Entry, index: int) -> list[str]:
        return []

    def describe_chunk(self, entry: Entry, index: int) -> TensorRef | SubclassRef:
        raise TypeError("a JSON value is not a tensor")

    def stored_records(self) -> Iterator[StoredRecord]:
        yield StoredRecord(None, self.name, 0, self.storage.size(self.name), None, "JSON file")
