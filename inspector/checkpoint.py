"""``Checkpoint``: one opened checkpoint, whatever its format, with lazy reads; ``open``.

Opening reads metadata only and never imports torch; a tensor's bytes are read (and torch
loaded) when it is asked for. Entries are immutable; what is learnt after opening (a scan's
subclass detections, damage a read runs into) is kept here, by key.
"""

from __future__ import annotations

import copy
import difflib
import itertools
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inspector import dtypes
from inspector.entry import ChunkInfo, Entry, layout_problem
from inspector.errors import (
    CorruptCheckpointError,
    InspectorError,
    MissingKeyError,
    StorageAccessError,
    UnsupportedError,
    UsageError,
)
from inspector.formats.base import LogicalWeight, Source, Step
from inspector.formats.detect import logical_weights, open_source
from inspector.formats.producers import Producer
from inspector.formats.producers import profile as producer_profile
from inspector.gc_pause import paused_gc
from inspector.keys.components import component_counts, with_components
from inspector.keys.layouts import detect_layout
from inspector.keys.tree import KeyNode, build_tree, sizes_of
from inspector.storage import IOCount, open_location
from inspector.storage.base import ByteRange
from inspector.tensors.detection import PLAIN, Detection, detect
from inspector.tensors.scales import ScalePairs, scaled_pairs

if TYPE_CHECKING:
    import pandas
    import torch

    from inspector.analysis.audit import AuditReport
    from inspector.analysis.consistency import Consistency
    from inspector.analysis.stats import Histogram, TensorStats

SMALL_OBJECT = 1 << 16  # bytes: read_objects compares objects up to this size (hyper-parameters)
COALESCED = 1 << 20  # bytes: the most read_objects reads in one request
RECORD = 64  # bytes: a scalar tensor stored in at least this many is a self-describing record
SKIPPED = 1 << 12  # bytes: the largest gap between two values it reads in one request
_UNREAD = object()
TABLE_COLUMNS = (
    "key",
    "component",
    "kind",
    "dtype",
    "shape",
    "numel",
    "nbytes",
    "chunks",
    "files",
    "subclass",
    "fp8",
    "error",
)


def open(
    path: str | os.PathLike, storage_options: Mapping[str, Any] | None = None
) -> Checkpoint:
    """Open a checkpoint (DCP folder, .pt/.pth/.bin, .safetensors, HF sharded folder or index)
    from a local path or an s3://, gs://, hf://, http(s):// URL; ``storage_options`` are the
    fsspec filesystem's (endpoint_url, key, secret, token, anon, ...), for URLs."""
    storage, name = open_location(path, storage_options)
    with paused_gc():
        return Checkpoint(open_source(storage, name))


@dataclass(frozen=True, slots=True)
class Facts:
    """What is known about an entry beyond its record, so far: its subclass and FP8 facts
    (from a scan and from scale pairing), why it cannot be read (found while opening,
    scanning or reading), its quantization ``scheme`` when it is a quantized weight (a
    logical weight's, or a scanned torchao payload's class: what the app badges) and, for a
    stored part of a logical weight, that weight's key (``part_of``)."""

    subclass: str | None
    fp8: str | None
    error: str | None
    scheme: str | None = None
    part_of: str | None = None


class Checkpoint:
    """An opened checkpoint: metadata is in memory, tensor bytes are read when asked for."""

    def __init__(self, source: Source) -> None:
        self.source = source
        entries = with_components(source.entries())
        self._stored = {e.key: e for e in entries}
        self._sizes: list[tuple[str, int, int]] | None = None
        self.scale_pairs: ScalePairs = scaled_pairs(self._stored)
        self.logical: dict[str, LogicalWeight] = logical_weights(source, self._stored)
        self._part_of = {
            part: w.key for w in self.logical.values() for part in w.parts.values() if part != w.key
        }
        self._entries = with_logical(self._stored, self.logical)
        self._detections: dict[str, Detection] = {}
        self._damage: dict[str, str] = {}
        self._layout = detect_layout(
            entries, nesting=source.nesting, profile=producer_profile(source.producer)
        )

    # --- what it is ---------------------------------------------------------------------
    @property
    def location(self) -> str:
        """Where it is: a path or URL (what was opened)."""
        return self.source.storage.describe(self.source.name)

    @property
    def path(self) -> Path:
        """The local path of what was opened; a UsageError for a URL (see ``location``)."""
        path = self.source.storage.local_path(self.source.name)
        if path is None:
            raise UsageError("is not on a local disk: ck.path is for local checkpoints, "
                             "ck.location is its URL", file=self.location)
        return path

    @property
    def is_local(self) -> bool:
        """Whether it was opened from a local path (else from a URL)."""
        return self.source.storage.local_path(self.source.name) is not None

    @property
    def format(self) -> str:
        return self.source.format

    @property
    def producer(self) -> str:
        """Which program wrote it, judged by evidence in its files (``"torch-dcp"``: a DCP
        folder nothing else claims; ``"unknown"``: no evidence)."""
        return self.source.producer

    @property
    def profile(self) -> Producer:
        """The producer's profile: what it saves, what a resume needs, what its layouts mean."""
        return producer_profile(self.source.producer)

    @property
    def layout(self) -> str:
        return self._layout.name

    @property
    def layout_reason(self) -> str:
        """Why the layout is what it is (the deciding evidence)."""
        return self._layout.verdict

    @property
    def ranks(self) -> int | None:
        """How many processes wrote it, when its files tell."""
        return self.source.ranks

    @property
    def source_files(self) -> tuple[str, ...]:
        return self.source.source_files

    @property
    def steps(self) -> tuple[Step, ...]:
        """The saved steps of the training run this was opened from (which one is open is
        marked); empty when a checkpoint folder itself was opened."""
        return self.source.steps

    @property
    def metadata(self) -> dict[str, str]:
        return self.source.metadata

    @property
    def run_args(self) -> dict[str, Any]:
        """The training run's arguments the checkpoint saved (Megatron's ``args``: plain
        values by name); empty when it saved none."""
        return dict(getattr(self.source, "run_args", {}))

    @property
    def io(self) -> IOCount:
        """Bytes and requests read so far."""
        return self.source.storage.io.count

    def describe_layout(self) -> str:
        """The layout and the evidence it was decided from, as text."""
        notes = "\n".join(f"- {n}" for n in self.source.notes)
        return f"format: {self.format}\n{notes}\n{self._layout.describe()}"

    def components(self) -> dict[str, int]:
        """Number of keys per component (model, optimizer, lr_scheduler, ...)."""
        return component_counts(self._entries.values())

    def tree(self, view: str = "stored") -> KeyNode:
        """The key tree's root in a view: stored, flattened (model keys at top) or prefixed."""
        return build_tree(self.entries(), view, self.sizes())

    def sizes(self) -> list[tuple[str, int, int]]:
        """(dtype, or "object" / "unknown"; numel; nbytes) of each entry in ``entries()``
        order: what totals count, worked out once (the header and the tree both use it).
        Bytes are stored bytes: a logical weight stored as parts counts none of its own, one
        stored under its own key counts its stored record."""
        if self._sizes is None:
            with paused_gc():
                self._sizes = (
                    stored_sizes(self._entries, self._stored)
                    if self.logical
                    else sizes_of(self._entries.values())
                )
        return self._sizes

    def audit(self, checksums: bool = True, values: bool = False) -> AuditReport:
        """Integrity, unfinished saves, completeness, resume readiness (``inspector.audit``)."""
        from inspector.analysis.audit import audit

        return audit(self, checksums, values)

    def consistency(self) -> Consistency:
        """Optimizer names the model part lacks, and weights stored under several spellings."""
        from inspector.analysis.consistency import consistency

        return consistency(self)

    def __repr__(self) -> str:
        size = sum(e.nbytes for e in self._stored.values() if e.kind == "tensor")
        return (
            f"<Checkpoint {self.format} {self.layout} {self.location!r}: "
            f"{len(self._entries)} keys, {size / 1e6:.1f} MB of tensors>"
        )

    # --- keys and entries ---------------------------------------------------------------
    def keys(self) -> list[str]:
        """Keys in stored order; a logical weight stored as parts (``ck.logical``) is one key,
        placed before its first part (the parts keep their own keys)."""
        return list(self._entries)

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def entry(self, key: str) -> Entry:
        try:
            return self._entries[key]
        except KeyError:
            close = difflib.get_close_matches(
                key, list(itertools.islice(self._entries, 200_000)), n=3
            )
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise MissingKeyError(f"no such key{hint}", file=self.location, key=key) from None

    def stored_entry(self, key: str) -> Entry:
        """The entry as the checkpoint stores it: ``entry(key)`` except for a logical weight
        stored under its own key (a compressed-tensors float8 ``weight``), whose raw record
        this is; a logical weight with no stored tensor of its own is refused."""
        return self._readable_stored(key) if key in self.logical else self.entry(key)

    def facts(self, key: str) -> Facts:
        """Subclass and FP8 facts known so far (``scan`` finds subclasses), and the error."""
        entry = self.entry(key)
        found = self._detections.get(key)
        subclass = found.subclass if found else None
        fp8 = (
            (found.fp8 if found and found.subclass else None)
            or self._logical_label(key)
            or self.scale_pairs.fp8_label(entry)
        )
        error = entry.error or self._damage.get(key) or (found.error if found else None)
        scheme = self.logical[key].scheme.label if key in self.logical else None
        if scheme is None and found is not None and found.kind == "payload":
            scheme = found.subclass
        return Facts(subclass, fp8, error, scheme, self._part_of.get(key))

    def part_of(self, key: str) -> str | None:
        """The logical weight (``ck.logical``) whose stored part ``key`` is, or None."""
        return self._part_of.get(key)

    def _logical_label(self, key: str) -> str | None:
        if key in self.logical:
            return self.logical[key].scheme.label
        if key in self._part_of:
            return f"part of {self._part_of[key]}"
        return None

    def scan(self, keys: str | Iterable[str] | None = None, *, progress: bool = True) -> None:
        """Detect subclasses in tensor entries (all, or ``keys``) from their chunks' small
        pickle records; cached, so later calls and reads do not repeat it."""
        from tqdm.auto import tqdm

        wanted = self._entries if keys is None else [keys] if isinstance(keys, str) else keys
        todo = [k for k in wanted if k not in self._detections]
        for key in tqdm(
            todo, desc="scanning chunks", unit="key", disable=not progress or len(todo) < 2
        ):
            self.detection(key)

    def scanned(self, key: str) -> Detection | None:
        """``key``'s detection when it was scanned already, else None (reads nothing)."""
        return self._detections.get(key)

    def detection(self, key: str) -> Detection:
        """What ``key``'s chunks hold (plain, FP8 wrapper, quantized payload, unknown
        subclass), scanned on first use."""
        self.entry(key)  # an unknown key: MissingKeyError
        if key not in self._detections:
            stored = self._stored.get(key)
            self._detections[key] = detect(self.source, stored) if stored else PLAIN
        return self._detections[key]

    def records(self) -> list[dict[str, Any]]:
        """One JSON-ready dict per entry, the TABLE_COLUMNS as keys (``ckpt-inspect ls --json``)."""
        return [
            dict(zip(TABLE_COLUMNS, row, strict=True))
            for row in self._rows(lambda shape: list(shape), list)
        ]

    def table(self) -> pandas.DataFrame:
        """One row per entry (see TABLE_COLUMNS); ``subclass`` is filled for entries scanned
        so far (``ck.scan()`` scans all)."""
        import pandas

        return pandas.DataFrame.from_records(
            list(self._rows(lambda shape: shape, tuple)), columns=list(TABLE_COLUMNS)
        )

    def _rows(self, shape_as: Any, files_as: Any) -> Iterator[tuple]:
        for e in self._entries.values():
            facts = self.facts(e.key)
            yield (
                e.key,
                e.component,
                e.kind,
                e.dtype,
                None if e.shape is None else shape_as(e.shape),
                e.numel,
                e.nbytes,
                len(e.chunks),
                files_as(e.files),
                facts.subclass,
                facts.fp8,
                facts.error,
            )

    # --- reading ------------------------------------------------------------------------
    def read(self, key: str, dtype: torch.dtype | str | None = None) -> torch.Tensor:
        """The whole tensor as a plain ``torch.Tensor``: chunks assembled, FP8 wrappers unwrapped,
        quantized payloads dequantized (straight to ``dtype`` when given, like torchao's
        ``dequantize(dtype)``; else to their logical dtype), a weight stored in parts
        (``ck.logical``: compressed-tensors, MXFP4) as its logical value. ``dtype``: a
        torch.dtype or name."""
        if key in self.logical:
            with self._marking(key):
                return self._read_logical(self.logical[key], dtype)
        return self.read_stored(key, dtype)

    def read_stored(self, key: str, dtype: torch.dtype | str | None = None) -> torch.Tensor:
        """Like ``read``, but a stored entry as it is stored even when it is a part of a
        logical weight (the float8 ``weight`` of a compressed-tensors module)."""
        from inspector.tensors import broadcast
        from inspector.tensors.convert import to_plain

        target = dtypes.optional_name(dtype)
        entry = self._readable_stored(key)
        with self._marking(key), self._prefetching(entry, entry.chunks):
            if len(entry.chunks) == 1 and entry.chunks[0].sizes == entry.shape:
                value = self.source.read_chunk(entry, 0)
                tensor = to_plain(value, target, file=self._file_of(entry, 0), key=key)
            else:
                tensor = self._assemble(entry, target)
        return tensor if target is None else broadcast.cast(tensor, dtypes.to_torch(target))

    def _read_logical(self, weight: LogicalWeight, dtype: torch.dtype | str | None) -> torch.Tensor:
        from inspector.tensors.packed import SchemeError, logical

        target = dtypes.optional_name(dtype)
        if not weight.scheme.known:
            raise UnsupportedError(unknown_scheme(weight), file=self.location, key=weight.key)
        parts = {role: self.read_stored(key) for role, key in weight.parts.items()}
        where = f"{weight.scheme.label}: "
        try:
            value = logical(
                parts, weight.scheme, None if target is None else dtypes.to_torch(target)
            )
        except SchemeError as exc:
            raise CorruptCheckpointError(
                where + str(exc), file=self.location, key=weight.key
            ) from None
        except (KeyError, ValueError, RuntimeError, IndexError) as exc:
            raise CorruptCheckpointError(
                f"{where}parts do not fit the scheme ({exc!r})", file=self.location, key=weight.key
            ) from exc
        expected = self._entries[weight.key].shape
        if expected is not None and tuple(value.shape) != expected:
            raise CorruptCheckpointError(
                f"{where}parts make a weight of shape {list(value.shape)}, "
                f"its metadata says {list(expected)}",
                file=self.location,
                key=weight.key,
            )
        return value

    def read_object(self, key: str) -> Any:
        """A non-tensor value (optimizer hyper-parameters, scheduler state, ...), decoded safely."""
        entry = self._readable(key, "object")
        with self._marking(key), self._prefetching(entry, entry.chunks):
            return self.source.read_object(entry)

    def read_objects(self, keys: Iterable[str]) -> dict[str, Any]:
        """``read_object`` of each key, or ``read`` of a tensor key (the first error raised),
        read together: small values stored as identical bytes under keys that agree after
        their last ``/`` and in their metadata (every parameter group's ``lr``, every
        parameter's ``step``: a scalar tensor saved as its own archive) are decoded once and
        copied, their bytes fetched together."""
        wanted = {key: self._small_range(key) for key in keys}
        ranges = [r for r in wanted.values() if r is not None]
        found: dict[str, Any] = {}
        decoded: dict[tuple[Any, ...], Any] = {}
        with self.source.storage.prefetch(ranges):
            stored = _stored_bytes(ranges)
            for key, where in wanted.items():
                raw = stored.get(where) if where is not None else None
                if raw is None:
                    found[key] = self._read_value(key)
                    continue
                e = self.entry(key)
                tail = key[key.rfind("/") :] if "/" in key else ""
                same = (raw, tail, e.kind, e.dtype, e.shape, e.chunks[0][:2])
                copied = _copied(decoded[same]) if same in decoded else _UNREAD
                found[key] = self._read_value(key) if copied is _UNREAD else copied
                decoded.setdefault(same, found[key])
        return found

    def _read_value(self, key: str) -> Any:
        return self.read(key) if self.entry(key).kind == "tensor" else self.read_object(key)

    def _small_range(self, key: str) -> ByteRange | None:
        """Where ``key``'s stored bytes lie when it is one small untransformed stored chunk."""
        entry = self.entry(key)
        entry = self._checked(entry, "tensor" if entry.kind == "tensor" else "object")
        if len(entry.chunks) != 1 or key in self.logical:
            return None
        chunk = entry.chunks[0]
        if chunk.transforms or not 0 < chunk.byte_length <= SMALL_OBJECT:
            return None
        if entry.kind == "tensor" and not (entry.numel <= 1 and chunk.byte_length >= RECORD):
            return None  # bare bytes: a view's strides and offset are not in them
        storage = self.source.storage
        try:
            name = storage.check(chunk.file, referrer=self.location, key=key)
        except InspectorError:
            return None  # the read says what is wrong
        return ByteRange(storage, name, chunk.byte_offset, chunk.byte_length)

    def iter_chunks(self, key: str) -> Iterator[tuple[ChunkInfo, torch.Tensor]]:
        """Each stored chunk of a tensor as a plain tensor, one at a time (bounded memory);
        a logical weight (``ck.logical``) as one chunk holding its value."""
        if key in self.logical:
            value = self.read(key)
            yield ChunkInfo((0,) * value.dim(), tuple(value.shape), "", 0, 0), value
            return
        entry = self._readable_stored(key)
        for index, chunk in enumerate(entry.chunks):
            yield chunk, self.read_chunk(key, index)

    def read_chunk(self, key: str, index: int) -> torch.Tensor:
        """Stored chunk ``index`` of a tensor as a plain tensor (``entry(key).chunks[index]``
        says where it lies in the whole tensor); a logical weight's one chunk is its value."""
        from inspector.tensors.convert import to_plain

        if key in self.logical and index == 0:
            return self.read(key)
        entry = self._readable_stored(key)
        with self._marking(key), self._prefetching(entry, (entry.chunks[index],)):
            value = self.source.read_chunk(entry, index)
            return to_plain(value, file=self._file_of(entry, index), key=key)

    def byte_ranges(self, key: str, *, stored: bool = False) -> list[ByteRange] | None:
        """The byte ranges that, concatenated, are the tensor's row-major bytes; None when
        its chunks are not plain bytes tiling it along dim 0 (or it is a subclass, or a
        logical weight made from parts). ``stored``: a logical weight's own stored part's
        ranges (its raw float8 ``weight``), as ``stored_entry`` describes it."""
        if key in self.logical and not stored:
            self._readable(key, "tensor")
            return None
        entry = self._readable_stored(key) if stored else self._readable(key, "tensor")
        chunks = sorted(enumerate(entry.chunks), key=lambda pair: pair[1].offsets)
        shape, row = entry.shape or (), 0
        ranges = []
        for index, chunk in chunks:
            if not chunk.numel:
                continue
            if shape and (chunk.offsets[0] != row or chunk.sizes[1:] != shape[1:]):
                return None
            where = self.source.chunk_bytes(entry, index)
            if where is None or where.length != chunk.numel * dtypes.itemsize(entry.dtype or ""):
                return None
            ranges.append(where)
            row += chunk.sizes[0] if shape else 1
        complete = row == shape[0] if shape else len(ranges) == 1
        return ranges if complete or not entry.numel else None

    def _readable_stored(self, key: str) -> Entry:
        """The stored tensor entry ``key`` (a logical weight's own stored part, when it has
        one), checked readable; a logical weight with no stored tensor of its own is refused."""
        stored = self._stored.get(key)
        if stored is None and key in self.logical:
            raise UsageError(
                "is a logical weight with no stored tensor of its own; use ck.read() for its "
                f"value, its parts ({', '.join(self.logical[key].parts.values())}) for the "
                "stored bytes",
                file=self.location,
                key=key,
            )
        return self._checked(stored or self.entry(key), "tensor")

    def _readable(self, key: str, kind: str) -> Entry:
        return self._checked(self.entry(key), kind)

    def _checked(self, entry: Entry, kind: str) -> Entry:
        """``entry`` when it is of ``kind`` and not known to be damaged."""
        key = entry.key
        if entry.kind != kind:
            what = "read_object" if entry.kind == "object" else "read"
            raise InspectorError(f"is a {entry.kind}; use ck.{what}()", file=self.location, key=key)
        error = entry.error or self._damage.get(key)
        if error:
            raise CorruptCheckpointError(error, file=self.location, key=key)
        return entry

    def _marking(self, key: str) -> _Marking:
        return _Marking(self._damage, key)

    def _prefetching(self, entry: Entry, chunks: Iterable[ChunkInfo]) -> Any:
        """Tell the storage which bytes the read of ``chunks`` is about to need (a remote
        storage fetches them at once; a local one ignores it)."""
        storage = self.source.storage
        ranges = []
        for chunk in chunks:
            try:
                name = storage.check(chunk.file, referrer=self.location, key=entry.key)
            except InspectorError:
                continue  # the read itself says what is wrong
            ranges.append(ByteRange(storage, name, chunk.byte_offset, chunk.byte_length))
        return storage.prefetch(ranges)

    # --- numbers ------------------------------------------------------------------------
    def stats(self, key: str) -> TensorStats:
        """min / max / mean / std / absmax / L2 / zeros / NaN / Inf, computed chunk by chunk."""
        from inspector.analysis.stats import stats

        return stats(self, key)

    def stats_table(
        self, include: Iterable[str] | None = None, *, progress: bool = True
    ) -> pandas.DataFrame:
        """Statistics for every tensor key matching the ``include`` globs, one row each."""
        from inspector.analysis.stats import stats_table

        return stats_table(self, include, progress=progress)

    def histogram(
        self, key: str, bins: int = 64, range: tuple[float, float] | None = None
    ) -> Histogram:
        """Bin counts of a tensor's finite values (see :mod:`inspector.analysis.stats`)."""
        from inspector.analysis.stats import histogram

        return histogram(self, key, bins, range)

    def _assemble(self, entry: Entry, dtype: str | None) -> torch.Tensor:
        import torch

        from inspector.tensors.convert import to_plain

        _check_coverage(entry, self.location)
        out = torch.empty(entry.shape or (), dtype=dtypes.to_torch(dtype or entry.dtype or ""))
        for index, chunk in enumerate(entry.chunks):
            dest = out[
                tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes, strict=True))
            ]
            value = self.source.read_chunk(entry, index, dest if dest.is_contiguous() else None)
            if value is not dest:
                plain = to_plain(value, dtype, file=self._file_of(entry, index), key=entry.key)
                dest.copy_(plain)
        return out

    def _file_of(self, entry: Entry, index: int) -> str:
        """The file chunk ``index`` of ``entry`` lies in, for messages."""
        return self.source.storage.describe(entry.chunks[index].file)


def _copied(value: Any) -> Any:
    """A deep copy of ``value``; ``_UNREAD`` when it cannot be copied (a placeholder)."""
    try:
        return copy.deepcopy(value)
    except (TypeError, copy.Error):
        return _UNREAD


def _stored_bytes(ranges: list[ByteRange]) -> dict[ByteRange, bytes]:
    """The bytes of each range that can be read (``read_object`` says why the rest cannot),
    neighbours in a file read in one request."""
    found: dict[ByteRange, bytes] = {}
    order = sorted(ranges, key=lambda r: (id(r.storage), r.name, r.offset))
    group: list[ByteRange] = []
    for where in [*order, None]:
        if group and (where is None or not _neighbours(group[0], group[-1], where)):
            start, end = group[0].offset, max(r.offset + r.length for r in group)
            try:
                data = group[0].storage.read(group[0].name, start, end - start)
            except InspectorError:
                data = None
            if data is not None:
                found.update({r: data[r.offset - start :][: r.length] for r in group})
            group = []
        if where is not None:
            group.append(where)
    return found


def _neighbours(first: ByteRange, last: ByteRange, where: ByteRange) -> bool:
    """``where`` extends the group from ``first`` to ``last`` by one read of bounded size."""
    return (
        where.storage is first.storage
        and where.name == first.name
        and where.offset <= last.offset + last.length + SKIPPED
        and where.offset + where.length - first.offset <= COALESCED
    )


class _Marking:
    """A read that finds damage records it, so the table shows it from then on; an error
    that names no key is raised again naming this one. A storage that fails a request is
    not damage (a later read may succeed)."""

    def __init__(self, damage: dict[str, str], key: str) -> None:
        self.damage, self.key = damage, key

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        if not isinstance(exc, InspectorError):
            return
        if not isinstance(exc, StorageAccessError):
            self.damage.setdefault(self.key, exc.located)
        if exc.key is None:
            raise type(exc)(exc.reason, file=exc.file, key=self.key) from exc


def with_logical(
    stored: dict[str, Entry], logical: Mapping[str, LogicalWeight]
) -> dict[str, Entry]:
    """The entries ``ck.keys()`` lists: the stored ones, a logical weight standing in place of
    its stored key when it has one (its dtype and shape the dequantized value's), else placed
    before its first part; one chunk covering it, in its first part's file."""
    if not logical:
        return stored
    before: dict[str, list[Entry]] = {}
    replaced: dict[str, Entry] = {}
    for weight in logical.values():
        entry = logical_entry(weight, stored)
        if weight.key in stored:
            replaced[weight.key] = entry
        else:
            parts = set(weight.parts.values())
            first = next((p for p in stored if p in parts), None)
            before.setdefault(first or "", []).append(entry)
    out: dict[str, Entry] = {}
    for key, entry in stored.items():
        for extra in before.get(key, ()):
            out[extra.key] = extra
        out[key] = replaced.get(key, entry)
    return out


def stored_sizes(
    entries: Mapping[str, Entry], stored: Mapping[str, Entry]
) -> list[tuple[str, int, int]]:
    """``sizes_of`` each of ``entries`` as stored: a logical weight's stored record where it
    has one, else its dtype and numel with no bytes."""
    sizes = sizes_of(stored.get(key, e) for key, e in entries.items())
    return [
        size if key in stored else (size[0], size[1], 0)
        for key, size in zip(entries, sizes, strict=True)
    ]


def logical_entry(weight: LogicalWeight, stored: Mapping[str, Entry]) -> Entry:
    """The entry of a logical weight: the dequantized dtype and shape, the component and
    nesting of its first part (its last path element renamed), no error unless its scheme
    is unknown."""
    part = stored[next(iter(weight.parts.values()))]
    tail, own_tail = part.key.rpartition(".")[2], weight.key.rpartition(".")[2]
    leaf = str(part.nested_path[-1]) if part.nested_path else part.key
    path = (*part.nested_path[:-1], leaf.removesuffix(tail) + own_tail)
    shape = weight.shape
    file = part.chunks[0].file if part.chunks else ""
    chunks = () if shape is None else (ChunkInfo((0,) * len(shape), shape, file, 0, 0),)
    error = None if weight.scheme.known else unknown_scheme(weight)
    return Entry(weight.key, "tensor", weight.dtype, shape, chunks, path, part.component, error)


def unknown_scheme(weight: LogicalWeight) -> str:
    return (
        f"unknown quantization scheme {weight.scheme.label!r}; its parts "
        f"{', '.join(weight.parts.values())} stay readable"
    )


def _check_coverage(entry: Entry, location: str) -> None:
    """Chunks must tile the tensor exactly: inside it, no overlap, nothing left out."""
    problem = layout_problem(entry.shape or (), entry.chunks)
    if problem is not None:
        raise CorruptCheckpointError(problem, file=location, key=entry.key)


def as_checkpoint(
    value: Checkpoint | str | os.PathLike, storage_options: Mapping[str, Any] | None = None
) -> Checkpoint:
    """``value`` itself when already opened, else ``open(value, storage_options)``."""
    return value if isinstance(value, Checkpoint) else open(value, storage_options)
