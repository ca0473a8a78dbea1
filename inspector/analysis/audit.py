"""Is this checkpoint whole, and can training resume from it? One report of everything wrong.

- Integrity (:mod:`.integrity`): every file the metadata names is there and long enough,
  every record's CRC-32 matches its bytes (a save with CRCs turned off is "unchecked", not
  damaged), safetensors headers and shard indexes place every tensor.
- Unfinished saves (``formats.detect.unfinished_save``): ``.distcp`` files without
  ``.metadata``, a ``.metadata.tmp``, ``tmp_*`` folders - named as such, with what is there.
- Completeness and resume readiness (:mod:`.resume`): optimizer state for every trained
  parameter, shaped like it; scheduler, dataloader (every data-parallel rank) and train state.
- With ``values=True``: NaN / Inf values, and step counters that disagree.

Everything streams: memory stays at one read block plus one chunk, whatever the size.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from inspector.analysis.findings import KINDS, SEVERITIES, Problem
from inspector.analysis.integrity import IntegrityCounts, check_integrity
from inspector.analysis.resume import optimizer_state, resume_problems
from inspector.checkpoint import Checkpoint
from inspector.checkpoint import open as open_checkpoint
from inspector.errors import InspectorError, NotACheckpointError
from inspector.formats.detect import Sign, unfinished_save
from inspector.keys.spellings import model_fqn
from inspector.keys.training import is_train_step
from inspector.progress import Counter, ProgressFn
from inspector.storage import open_location
from inspector.words import counted

if TYPE_CHECKING:
    import pandas

    from inspector.entry import Entry

TABLE_COLUMNS = ("key", "file", "kind", "severity", "message")
_SHOWN_PER_KIND = 10
_VALUE_BLOCK = 1 << 22  # elements per step of the NaN / Inf count


@dataclass(frozen=True)
class Checked:
    """What the audit covered: files and records, CRC-32s verified, bytes read for them,
    records that could not be verified, tensors scanned for values (``values=True``)."""

    checksums: bool
    values: bool
    files: int = 0
    records: int = 0
    verified: int = 0
    unchecked: int = 0
    without_checksum: int = 0
    bytes_checksummed: int = 0
    tensors_scanned: int = 0

    def text(self) -> str:
        parts = [f"{counted(self.files, 'file')}, {counted(self.records, 'record')}"]
        if self.checksums:
            read = f"{self.bytes_checksummed / 1e6:,.1f} MB read"
            parts.append(f"{counted(self.verified, 'CRC-32')} verified ({read})")
        else:
            parts.append("CRC-32s not checked (checksums=False)")
        if self.unchecked:
            parts.append(f"{self.unchecked:,} saved without CRC-32")
        if self.without_checksum:
            parts.append(f"{self.without_checksum:,} without checksums in their format")
        if self.values:
            parts.append(f"{counted(self.tensors_scanned, 'tensor')} scanned for NaN / Inf")
        return ", ".join(parts)


@dataclass(frozen=True)
class AuditReport:
    """What ``audit`` found. ``ok``: no error-severity problem (warnings and notes of what
    could not be checked may remain); ``problems`` in the order found."""

    checkpoint: str
    format: str | None  # None: the folder holds no checkpoint that opens (an unfinished save)
    problems: tuple[Problem, ...]
    checked: Checked | None = None  # None: nothing could be checked

    @property
    def ok(self) -> bool:
        return not any(p.severity == "error" for p in self.problems)

    def counts(self) -> dict[str, int]:
        """Problems per severity (``error``, ``warning``, ``info``)."""
        return {s: sum(p.severity == s for p in self.problems) for s in SEVERITIES}

    def by_kind(self, kind: str) -> list[Problem]:
        """The problems of one kind (a key of ``findings.KINDS``), in the order found."""
        return [p for p in self.problems if p.kind == kind]

    def table(self) -> pandas.DataFrame:
        """One row per problem: key, file, kind, severity, message."""
        import pandas

        rows = [[p.key, p.file, p.kind, p.severity, p.message] for p in self.problems]
        return pandas.DataFrame(rows, columns=list(TABLE_COLUMNS))

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: ``{"checkpoint", "format", "ok", "counts": {severity: n}, "checked":
        {...}, "problems": [{"key", "file", "kind", "severity", "message"}]}``."""
        return {
            "checkpoint": self.checkpoint,
            "format": self.format,
            "ok": self.ok,
            "counts": self.counts(),
            "checked": None if self.checked is None else dataclasses.asdict(self.checked),
            "problems": [p.as_dict() for p in self.problems],
        }

    def __str__(self) -> str:
        counts = self.counts()
        verdict = "OK" if self.ok else "PROBLEMS"
        summary = ", ".join(f"{n} {s}{'s' if n != 1 else ''}" for s, n in counts.items() if n)
        lines = [
            f"{self.checkpoint} ({self.format or 'no checkpoint'}): {verdict}"
            + (f" - {summary}" if summary else ""),
            f"checked: {self.checked.text() if self.checked else 'nothing (no checkpoint opens)'}",
        ]
        for severity in SEVERITIES:
            found = [p for p in self.problems if p.severity == severity]
            if found:
                lines.append(f"{severity}s:" if severity != "info" else "notes:")
                lines.extend(_listed(found))
        return "\n".join(lines)


def _listed(problems: list[Problem]) -> Iterator[str]:
    """Problems grouped by kind, at most ``_SHOWN_PER_KIND`` lines of each."""
    for kind in dict.fromkeys(p.kind for p in problems):
        of_kind = [p for p in problems if p.kind == kind]
        for p in of_kind[:_SHOWN_PER_KIND]:
            where = " ".join(
                part
                for part in (f"key {p.key!r}" if p.key else "", f"in {p.file}" if p.file else "")
                if part
            )
            yield f"  [{kind}] {where + ': ' if where else ''}{p.message}"
        if len(of_kind) > _SHOWN_PER_KIND:
            yield f"  [{kind}] ... {len(of_kind) - _SHOWN_PER_KIND} more ({KINDS[kind][1]})"


def audit(
    ck_or_path: Checkpoint | str | os.PathLike,
    checksums: bool = True,
    values: bool = False,
    *,
    progress: bool = False,
    on_progress: ProgressFn | None = None,
    cancel: threading.Event | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> AuditReport:
    """Audit a checkpoint: integrity, unfinished saves, completeness and resume readiness.

    ``checksums``: read every record and check its CRC-32 (the costly part: about one read of
    the files); ``values``: also read every floating tensor and count NaN / Inf values.
    A folder an unfinished save left (no metadata yet) gives a report, not an error.
    ``on_progress(done, total)``: bytes of the checksum pass; a set ``cancel`` event stops
    it with :class:`~inspector.progress.Cancelled` (see :mod:`inspector.progress`).
    ``storage_options``: fsspec options for a URL.
    """
    if isinstance(ck_or_path, Checkpoint):
        ck = ck_or_path
    else:
        try:
            ck = open_checkpoint(ck_or_path, storage_options)
        except NotACheckpointError:
            signs = _folder_signs(ck_or_path, storage_options)
            if not signs:
                raise
            found = tuple(Problem(None, _first(s), "unfinished", s.message) for s in signs)
            return AuditReport(str(ck_or_path), None, found)
    problems = _leftovers(ck)
    advance, close = _progress(ck, progress and checksums, on_progress, cancel)
    try:
        damage, counts = check_integrity(ck.source, checksums=checksums, advance=advance)
    finally:
        close()
    problems += damage
    problems += _unreadable(ck, problems)
    problems += resume_problems(ck)
    scanned = 0
    if values:
        value_problems, scanned = _value_problems(ck, progress)
        problems += value_problems
    return AuditReport(
        ck.location, ck.format, tuple(problems), _checked(counts, checksums, values, scanned)
    )


def _checked(counts: IntegrityCounts, checksums: bool, values: bool, scanned: int) -> Checked:
    return Checked(checksums, values, tensors_scanned=scanned, **dataclasses.asdict(counts))


def _folder_signs(path: str | os.PathLike, storage_options: Mapping[str, Any] | None) -> list[Sign]:
    """Signs of an unfinished save in the folder ``path`` (none for a file)."""
    storage, name = open_location(path, storage_options)
    if name:
        if storage.kind(name) != "dir":
            return []
        storage = storage.child(name)
    return unfinished_save(storage)


def _first(sign: Sign) -> str | None:
    """The file a sign is about, when it is one file."""
    return sign.files[0] if len(sign.files) == 1 else None


def _leftovers(ck: Checkpoint) -> list[Problem]:
    """Signs of unfinished saves in the checkpoint's folder: the checkpoint's own (a rank
    that never wrote its metadata) are errors, things beside it warnings."""
    single = bool(ck.source.name) and len(ck.source_files) < 2  # its folder may hold anything
    return [
        Problem(None, _first(s), "unfinished" if s.blocking else "leftover", s.message)
        for s in unfinished_save(ck.source.storage, contents=not single)
    ]


def _progress(
    ck: Checkpoint,
    show: bool,
    on_progress: ProgressFn | None = None,
    cancel: threading.Event | None = None,
) -> tuple[Callable[[int], None] | None, Callable[[], None]]:
    """A byte counter for the checksum pass: a tqdm bar over the source files' size when
    ``show``, and ``on_progress`` / ``cancel`` (told of and checked at each record)."""
    if not show and on_progress is None and cancel is None:
        return None, lambda: None
    total = _source_bytes(ck)
    counter = Counter(total, on_progress, cancel)
    if not show:
        return counter.step, lambda: None
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc="checksums", unit="B", unit_scale=True)

    def advance(n: int) -> None:
        counter.step(n)
        bar.update(n)

    return advance, bar.close


def _source_bytes(ck: Checkpoint) -> int:
    """The size of the checkpoint's files (those that are there)."""
    storage = ck.source.storage
    total = 0
    for name in ck.source_files:
        try:
            total += storage.size(name)
        except InspectorError:
            continue
    return total


def _unreadable(ck: Checkpoint, found: list[Problem]) -> list[Problem]:
    """Entries known to be unreadable (at open, or by an earlier read) that no problem above
    explains already."""
    explained = {p.key for p in found if p.key is not None and p.severity == "error"}
    problems = []
    for entry in ck.entries():
        error = ck.facts(entry.key).error
        if error and entry.key not in explained:
            file = entry.files[0] if entry.files else None
            problems.append(Problem(entry.key, file, "unreadable", error))
    return problems


def _value_problems(ck: Checkpoint, progress: bool) -> tuple[list[Problem], int]:
    """NaN / Inf counts of every readable floating tensor (chunk by chunk), and step counters
    that disagree with each other or with ``train_state.step``."""
    from tqdm.auto import tqdm

    from inspector import dtypes

    entries = [
        e
        for e in ck.entries()
        if e.kind == "tensor"
        and e.dtype
        and dtypes.is_floating(e.dtype)
        and not ck.facts(e.key).error
    ]
    problems = []
    for entry in tqdm(entries, desc="values", unit="tensor", disable=not progress):
        try:
            nan, inf = _non_finite(ck, entry.key)
        except InspectorError as exc:
            problems.append(Problem(entry.key, None, "unreadable", exc.reason))
            continue
        if nan or inf:
            problems.append(
                Problem(
                    entry.key,
                    entry.files[0] if entry.files else None,
                    "non-finite",
                    f"{nan:,} NaN and {inf:,} infinite values of {entry.numel:,}",
                )
            )
    return problems + _step_problems(ck), len(entries)


def _non_finite(ck: Checkpoint, key: str) -> tuple[int, int]:
    import torch

    nan = inf = 0
    for _, chunk in ck.iter_chunks(key):
        flat = chunk.reshape(-1)
        for start in range(0, flat.numel(), _VALUE_BLOCK):
            block = flat[start : start + _VALUE_BLOCK]
            if block.dtype.itemsize == 1:
                block = block.float()  # float8: few kernels
            if bool(torch.isfinite(block).all()):
                continue
            nan += int(torch.isnan(block).sum())
            inf += int(torch.isinf(block).sum())
    return nan, inf


def _step_problems(ck: Checkpoint) -> list[Problem]:
    """Each parameter's optimizer ``step`` should be one number, equal to the train step."""
    entries = ck.entries()
    params = {fqn for e in entries if (fqn := model_fqn(e)) is not None}
    steps: dict[float, list[str]] = {}
    for states in optimizer_state(entries, params, ck.profile).states.values():
        step = states.get("step")
        if step is not None and step.kind == "tensor" and step.numel == 1:
            value = _scalar(ck, step)
            if value is not None:
                steps.setdefault(value, []).append(step.key)
    problems = []
    if len(steps) > 1:
        shown = ", ".join(f"{v:g} ({len(keys)} parameters)" for v, keys in sorted(steps.items()))
        problems.append(
            Problem(None, None, "step-mismatch", f"optimizer step counters disagree: {shown}")
        )
    train = next((e for e in entries if is_train_step(e)), None)
    value = _scalar(ck, train) if train is not None else None
    if value is not None and len(steps) == 1 and next(iter(steps)) != value:
        problems.append(
            Problem(
                train.key if train else None,
                None,
                "step-mismatch",
                f"train_state step is {value:g} but the optimizer has taken "
                f"{next(iter(steps)):g} steps",
            )
        )
    return problems


def _scalar(ck: Checkpoint, entry: Entry) -> float | None:
    """A one-element tensor's (or a plain number object's) value; None if it is neither."""
    try:
        if entry.kind == "tensor":
            return float(ck.read(entry.key).reshape(-1)[0])
        value = ck.read_object(entry.key)
    except InspectorError:
        return None
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None
