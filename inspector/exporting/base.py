"""What every export writer shares, at the bottom of exporting/ (nothing here imports the
writers): the result record, progress reporting, the rule that an export never writes into
its source, and writing items with skip-and-retry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inspector.errors import ExportError, InspectorError
from inspector.exporting.plan import INDEX_NAME, Planned
from inspector.exporting.verify import Verification
from inspector.formats.writing import Item
from inspector.words import counted

if TYPE_CHECKING:
    import torch

    from inspector.checkpoint import Checkpoint


@dataclass(frozen=True)
class Progress:
    """Reported to ``on_progress``: the phase (write / verify), bytes done of total, the key."""

    phase: str
    done: int
    total: int
    key: str


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote, what it left out and why, and how it checked the result.
    ``files`` and ``index`` are paths, or URLs (str) for a remote target."""

    format: str
    files: list[Path] | list[str]
    index: Path | str | None
    tensors: int
    objects: int
    bytes: int
    skipped: dict[str, str]
    conversions: dict[str, str]
    names: dict[str, str]
    seconds: float
    verification: Verification | None
    arch: str | None = None
    reason: str = ""
    notes: tuple[str, ...] = ()

    def summary(self) -> str:
        lines = [
            f"wrote {self.tensors} tensors ({self.bytes / 1e6:,.1f} MB)"
            + (f" and {self.objects} objects" if self.objects else "")
            + f" to {counted(len(self.files), 'file')} in {self.seconds:.1f} s",
            *(f"  {p}" for p in self.files),
        ]
        if self.arch:
            lines.append(f"arch {self.reason}")
        lines += [f"note: {n}" for n in self.notes]
        if self.conversions:
            lines.append(
                f"converted {len(self.conversions)} tensors, e.g. "
                f"{next(iter(self.conversions.values()))}"
            )
        if self.skipped:
            lines.append(_skipped_text(self.skipped))
        if self.verification is not None:
            lines.append(str(self.verification))
        return "\n".join(lines)


def _skipped_text(skipped: dict[str, str], shown: int = 3) -> str:
    """How many keys were left out, grouped by why (the first few reasons)."""
    by_reason: dict[str, list[str]] = {}
    for key, why in skipped.items():
        by_reason.setdefault(why, []).append(key)
    parts = [
        f"{keys[0]}: {why}" if len(keys) == 1 else f"{len(keys)} keys ({why}; e.g. {keys[0]})"
        for why, keys in by_reason.items()
    ]
    more = f"; and {len(parts) - shown} more reasons" if len(parts) > shown else ""
    return f"skipped {len(skipped)} keys: " + "; ".join(parts[:shown]) + more


def refuse_inside_source(ck: Checkpoint, out: Path) -> None:
    """Never write into a checkpoint folder, nor over a file the checkpoint is made of."""
    if not ck.is_local:
        return  # a local output cannot land inside a remote checkpoint
    source, target = Path(ck.path).resolve(), out.resolve()
    if source.is_dir() and (target == source or source in target.parents):
        raise ExportError("output would be written inside the source checkpoint", file=out)
    folder = source if source.is_dir() else source.parent
    files = {p for name in ck.source_files if (p := _resolved(folder, name))} | {source}
    candidates = {target} | {target / n for n in ("model.safetensors", INDEX_NAME)}
    if candidates & files or any(p.name.startswith("model-") and p.parent == target for p in files):
        raise ExportError("output would overwrite a file of the source checkpoint", file=out)


def _resolved(folder: Path, name: str) -> Path | None:
    """``folder / name`` resolved; None for a name no file can have (a NUL byte, say)."""
    try:
        return (folder / name).resolve()
    except (ValueError, OSError, RuntimeError):
        return None


class Meter:
    """A tqdm bar in bytes (none without ``progress``: tqdm is not even imported) plus the
    caller's callback."""

    def __init__(
        self,
        total: int,
        progress: bool,
        callback: Callable[[Progress], None] | None,
        phase: str = "write",
    ) -> None:
        self.total, self.done, self.callback, self.phase = total, 0, callback, phase
        self.bar = None
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, desc=phase)

    def __call__(self, item: Item) -> None:
        self.advance(item.name, item.nbytes)

    def advance(self, name: str, nbytes: int) -> None:
        """``nbytes`` more done, the last of them ``name``'s (also from worker processes)."""
        self.done += nbytes
        if self.bar is not None:
            self.bar.update(nbytes)
        if self.callback is not None:
            self.callback(Progress(self.phase, self.done, self.total, name))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def retrying(
    write: Callable[[list[Item]], None], items: list[Item], on_error: str, skipped: dict[str, str]
) -> list[Item]:
    """Write ``items``; in skip mode an item that fails to read is dropped and the file redone.

    Returns the items actually written.
    """
    while True:
        try:
            write(items)
            return items
        except InspectorError as exc:
            failed = exc.key if exc.key in {i.name for i in items} else None
            if on_error != "skip" or failed is None:
                raise
            skipped[failed] = f"unreadable: {exc.reason}"
            items = [i for i in items if i.name != failed]


def keyed(planned: Planned) -> Item:
    """The Item, with read errors re-labelled by the output name (for skip-and-retry)."""
    item = planned.item

    def labelled(fn: Callable[[], Any]) -> Callable[[], Any]:
        def call() -> Any:
            try:
                return fn()
            except InspectorError as exc:
                raise type(exc)(exc.reason, file=exc.file, key=item.name) from exc

        return call

    def produce() -> torch.Tensor:
        return _dense_enough(labelled(item.produce)(), item.name)

    ranges = labelled(item.ranges) if item.ranges is not None else None
    return Item(item.name, item.dtype, item.shape, produce, ranges)


def _dense_enough(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """A tensor that repeats its stored values (stride 0) is written out dense, up to
    ``DENSE_LIMIT`` bytes: past that its file would hold far more than the checkpoint
    stores, so it is an ExportError (left out with ``on_error="skip"``)."""
    from inspector.tensors import broadcast

    if broadcast.repeated_dims(tensor) and broadcast.dense_bytes(tensor) > broadcast.DENSE_LIMIT:
        stored = broadcast.dense_bytes(broadcast.stored(tensor))
        raise ExportError(
            f"repeats {stored} stored bytes (a stride-0 view) into "
            f"{broadcast.dense_bytes(tensor)}: more than the {broadcast.DENSE_LIMIT} bytes "
            "written out dense",
            key=name,
        )
    return tensor
