"""``Checkpoint``: one opened checkpoint, whatever its format, with lazy reads."""

from __future__ import annotations

import difflib
import itertools
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from inspector.analysis import stats
from inspector.entry import ByteRange, ChunkInfo, Entry, layout_problem
from inspector.errors import CorruptCheckpointError, InspectorError, MissingKeyError
from inspector.keys import components as keys
from inspector.keys.tree import KeyNode, build_tree
from inspector.tensors import subclass as fp8

if TYPE_CHECKING:
    import pandas

    from inspector.analysis.fqn import Consistency
    from inspector.analysis.stats import Histogram, TensorStats
    from inspector.formats.base import Source

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


class Checkpoint:
    """An opened checkpoint: metadata is in memory, tensor bytes are read when asked for."""

    def __init__(self, source: Source) -> None:
        self.source = source
        entries = source.entries()
        keys.assign_components(entries)
        fp8.mark_scaled_pairs(entries)
        self._entries = {e.key: e for e in entries}
        self._detections: dict[str, fp8.Detection] = {}
        self._layout = keys.detect_layout(
            entries, nesting=getattr(source, "nesting", source.format)
        )

    # --- what it is ---------------------------------------------------------------------
    @property
    def path(self) -> Path:
        return self.source.root

    @property
    def format(self) -> str:
        return self.source.format

    @property
    def layout(self) -> str:
        return self._layout.name

    @property
    def source_files(self) -> tuple[str, ...]:
        return self.source.source_files

    @property
    def metadata(self) -> dict[str, str]:
        return self.source.metadata

    def describe_layout(self) -> str:
        """The layout and the evidence it was decided from, as text."""
        notes = "\n".join(f"- {n}" for n in self.source.notes)
        return f"format: {self.format}\n{notes}\n{self._layout.describe()}"

    def components(self) -> dict[str, int]:
        """Number of keys per component (model, optimizer, lr_scheduler, ...)."""
        return keys.component_counts(self._entries.values())

    def tree(self, view: str = "stored") -> KeyNode:
        """The key tree's root in a view: stored, flattened (model keys at top) or prefixed."""
        return build_tree(self.entries(), view)

    def consistency(self) -> Consistency:
        """Optimizer names the model part lacks, and weights stored under several spellings."""
        from inspector.analysis.fqn import consistency

        return consistency(self)

    def __repr__(self) -> str:
        size = sum(e.nbytes for e in self._entries.values() if e.kind == "tensor")
        return (
            f"<Checkpoint {self.format} {self.layout} {str(self.path)!r}: "
            f"{len(self._entries)} keys, {size / 1e6:.1f} MB of tensors>"
        )

    # --- keys and entries ---------------------------------------------------------------
    def keys(self) -> list[str]:
        """Stored keys, in stored order."""
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
            raise MissingKeyError(f"no such key{hint}", file=self.path, key=key) from None

    def scan(self, keys: str | Iterable[str] | None = None, *, progress: bool = True) -> None:
        """Fill ``subclass`` / ``fp8`` of tensor entries (all, or ``keys``) from their chunks'
        small pickle records; cached, so later calls and reads do not repeat it."""
        from tqdm.auto import tqdm

        wanted = self._entries if keys is None else [keys] if isinstance(keys, str) else keys
        todo = [k for k in wanted if k not in self._detections]
        for key in tqdm(
            todo, desc="scanning chunks", unit="key", disable=not progress or len(todo) < 2
        ):
            self.inspect_subclass(key)

    def inspect_subclass(self, key: str) -> fp8.Detection:
        """What ``key``'s chunks hold (plain, FP8 wrapper, quantized payload, unknown subclass),
        scanned on first use and recorded in its entry."""
        entry = self.entry(key)
        if key not in self._detections:
            self._detections[key] = fp8.detect(self.source, entry)
            fp8.annotate(entry, self._detections[key])
        return self._detections[key]

    def table(self) -> pandas.DataFrame:
        """One row per entry, the Entry fields as columns (see TABLE_COLUMNS); ``subclass`` is
        filled for entries scanned so far (``ck.scan()`` scans all)."""
        import pandas

        rows = [
            (
                e.key,
                e.component,
                e.kind,
                e.dtype_name,
                e.shape,
                e.numel,
                e.nbytes,
                len(e.chunks),
                e.files,
                e.subclass,
                e.fp8,
                e.error,
            )
            for e in self._entries.values()
        ]
        return pandas.DataFrame.from_records(rows, columns=list(TABLE_COLUMNS))

    # --- reading ------------------------------------------------------------------------
    def read(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The whole tensor as a plain ``torch.Tensor``: chunks assembled, FP8 wrappers unwrapped,
        quantized payloads dequantized (straight to ``dtype`` when given, like torchao's
        ``dequantize(dtype)``; else to their logical dtype)."""
        entry = self._readable(key, "tensor")
        with _marking(entry):
            if len(entry.chunks) == 1 and entry.chunks[0].sizes == entry.shape:
                value = self.source.read_chunk(entry, 0)
                tensor = fp8.to_plain(value, dtype, file=self.path, key=key)
            else:
                tensor = self._assemble(entry, dtype)
        return tensor if dtype is None else tensor.to(dtype)

    def read_object(self, key: str) -> Any:
        """A non-tensor value (optimizer hyper-parameters, scheduler state, ...), decoded safely."""
        entry = self._readable(key, "object")
        with _marking(entry):
            return self.source.read_object(entry)

    def iter_chunks(self, key: str) -> Iterator[tuple[ChunkInfo, torch.Tensor]]:
        """Each stored chunk of a tensor as a plain tensor, one at a time (bounded memory)."""
        entry = self._readable(key, "tensor")
        for index, chunk in enumerate(entry.chunks):
            with _marking(entry):
                value = fp8.to_plain(self.source.read_chunk(entry, index), file=self.path, key=key)
            yield chunk, value

    def byte_ranges(self, key: str) -> list[ByteRange] | None:
        """The file byte ranges that, concatenated, are the tensor's row-major bytes; None
        when its chunks are not plain bytes tiling it along dim 0 (or it is a subclass)."""
        entry = self._readable(key, "tensor")
        chunks = sorted(enumerate(entry.chunks), key=lambda pair: pair[1].offsets)
        shape, row = entry.shape, 0
        ranges = []
        for index, chunk in chunks:
            if not chunk.numel:
                continue
            if shape and (chunk.offsets[0] != row or chunk.sizes[1:] != shape[1:]):
                return None
            where = self.source.chunk_bytes(entry, index)
            if where is None:
                return None
            ranges.append(ByteRange(where[0], where[1], chunk.numel * entry.dtype.itemsize))
            row += chunk.sizes[0] if shape else 1
        complete = row == shape[0] if shape else len(ranges) == 1
        return ranges if complete or not entry.numel else None

    def _readable(self, key: str, kind: str) -> Entry:
        entry = self.entry(key)
        if entry.kind != kind:
            what = "read_object" if entry.kind == "object" else "read"
            raise InspectorError(f"is a {entry.kind}; use ck.{what}()", file=self.path, key=key)
        if entry.error:
            raise CorruptCheckpointError(entry.error, file=self.path, key=key)
        return entry

    # --- numbers ------------------------------------------------------------------------
    def stats(self, key: str) -> TensorStats:
        """min / max / mean / std / absmax / L2 / zeros / NaN / Inf, computed chunk by chunk."""
        return stats.tensor_stats(self, key)

    def stats_table(
        self, include: Iterable[str] | None = None, *, progress: bool = True
    ) -> pandas.DataFrame:
        """Statistics for every tensor key matching the ``include`` globs, one row each."""
        return stats.stats_table(self, include, progress=progress)

    def histogram(
        self, key: str, bins: int = 64, range: tuple[float, float] | None = None
    ) -> Histogram:
        """Bin counts of a tensor's finite values (see :mod:`inspector.analysis.stats`)."""
        return stats.histogram(self, key, bins, range)

    def _assemble(self, entry: Entry, dtype: torch.dtype | None) -> torch.Tensor:
        _check_coverage(entry, self.path)
        out = torch.empty(entry.shape, dtype=dtype or entry.dtype)
        for index, chunk in enumerate(entry.chunks):
            dest = out[
                tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes, strict=True))
            ]
            value = self.source.read_chunk(entry, index, dest if dest.is_contiguous() else None)
            if value is not dest:
                dest.copy_(fp8.to_plain(value, dtype, file=self.path, key=entry.key))
        return out


@contextmanager
def _marking(entry: Entry) -> Iterator[None]:
    """A read that finds damage records it in the entry, so the table shows it from then on."""
    try:
        yield
    except InspectorError as exc:
        entry.error = entry.error or exc.located
        raise


def _check_coverage(entry: Entry, path: Path) -> None:
    """Chunks must tile the tensor exactly: inside it, no overlap, nothing left out."""
    problem = layout_problem(entry.shape, entry.chunks)
    if problem is not None:
        raise CorruptCheckpointError(problem, file=path, key=entry.key)


def as_checkpoint(value: Checkpoint | str | os.PathLike) -> Checkpoint:
    """``value`` itself when already opened, else ``inspector.open(value)``."""
    if isinstance(value, Checkpoint):
        return value
    import inspector

    return inspector.open(value)
