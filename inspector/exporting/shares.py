"""The units of a parallel export and how one process does its share of them.

An export plan is a pure function of the checkpoint's metadata and the options, so every
worker process (or torchrun rank) re-opens the checkpoint and derives the same plan
(:class:`TensorPlan`, :class:`HfPlan`); the tasks it is handed name the planned items and
where their bytes go. Three kinds of task: a whole safetensors file (:class:`FileTask`),
items written at known offsets of a file laid out (and pre-sized) beforehand
(:class:`FillTask`: a single .safetensors, a .pt whose records were reserved), and a
verification of some written tensors (:class:`VerifyTask`). Each returns the CRC-32s of
what it wrote, so nothing is re-read to be aggregated.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inspector.errors import ExportError, InspectorError
from inspector.formats.writing import Item, write_item
from inspector.storage.local import LocalStorage
from inspector.storage.writeback import durable

if TYPE_CHECKING:
    from inspector.checkpoint import Checkpoint
    from inspector.exporting.plan import Planned
    from inspector.exporting.request import ExportRequest
    from inspector.storage.base import Storage

ItemRef = tuple[str, str, tuple[int, ...]]  # (name, dtype, shape): how a task names an item
Progress = Callable[[Item], None]


@dataclass(frozen=True)
class SourceRef:
    """A checkpoint as another process re-opens it: a local folder by path, a remote storage
    as itself (it pickles its fsspec options and builds its own filesystem)."""

    storage: Storage | str
    name: str

    @classmethod
    def of(cls, ck: Checkpoint) -> SourceRef:
        storage = ck.source.storage
        local = str(storage.root) if isinstance(storage, LocalStorage) else storage
        return cls(local, ck.source.name)

    def open(self) -> Checkpoint:
        from inspector.checkpoint import Checkpoint
        from inspector.formats.detect import open_source

        storage = LocalStorage(self.storage) if isinstance(self.storage, str) else self.storage
        return Checkpoint(open_source(storage, self.name))


@dataclass(frozen=True)
class TensorPlan:
    """The options a safetensors / .pt export plans from (see :func:`inspector.export`)."""

    source: SourceRef
    model_only: bool
    include: tuple[str, ...] | None
    exclude: tuple[str, ...] | None
    fp8: str
    cast: str | None
    flatten: bool
    rename: Any
    on_error: str
    tensors_only: bool
    fp8_scheme: str = "channel"

    @classmethod
    def of(cls, ck: Checkpoint, request: ExportRequest) -> TensorPlan:
        return cls(
            SourceRef.of(ck), request.model_only, request.include, request.exclude, request.fp8,
            request.dtype, request.flatten, request.rename, request.on_error,
            request.format != "pt", request.fp8_scheme,
        )

    def make(self, ck: Checkpoint) -> tuple[list[Planned], dict[str, str], list[str]]:
        """(planned tensors, keys left out and why, object keys): the export's whole plan."""
        from inspector.exporting import plan

        selected, skipped = plan.select(
            ck, self.model_only, self.include, self.exclude, self.on_error, self.tensors_only
        )
        tensor_keys = [k for k in selected if ck.entry(k).kind == "tensor"]
        found, consumed = plan.outputs(
            ck, tensor_keys, self.fp8, self.cast, self.on_error, self.fp8_scheme
        )
        planned = plan.name_outputs(ck, found, self.cast, self.flatten, self.rename)
        objects = [k for k in selected if ck.entry(k).kind == "object"]
        return planned, skipped | consumed, objects

    def planned(self, ck: Checkpoint) -> list[Planned]:
        return self.make(ck)[0]


@dataclass(frozen=True)
class HfPlan:
    """The options an ``hf`` export plans from, with the architecture and config resolved."""

    source: SourceRef
    arch: str
    config: Mapping[str, Any]
    fp8: str
    dtype: str | None

    def planned(self, ck: Checkpoint) -> list[Planned]:
        from inspector.exporting import hf
        from inspector.exporting.model_weights import ModelWeights
        from inspector.exporting.plan import Planned

        weights = ModelWeights(ck, self.fp8, self.dtype)
        found = hf.to_hf(weights.metas(), dict(self.config), self.arch)
        return [
            Planned(weights.item(o), weights.stored(o.source), (o.name,), weights.conversion(o))
            for o in found.outputs
        ]


Plan = TensorPlan | HfPlan


@dataclass(frozen=True)
class FileTask:
    """Write the safetensors file ``path`` (header, then ``items``), like a 1-process export;
    in skip mode an unreadable item is left out and the file redone."""

    path: str
    items: tuple[ItemRef, ...]
    metadata: Mapping[str, str]
    checksums: bool
    on_error: str

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(ref) for ref in self.items)


@dataclass(frozen=True)
class FillTask:
    """Write each item at its offset of ``path``, a file already laid out to its full size."""

    path: str
    items: tuple[tuple[int, ItemRef], ...]
    checksums: bool = True

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(ref) for _, ref in self.items)


@dataclass(frozen=True)
class VerifyTask:
    """Check the written tensors ``names`` of the output ``path`` against their CRC-32s."""

    path: str
    names: tuple[str, ...]
    nested: bool
    crcs: Mapping[str, int]
    changed: tuple[str, ...]
    nbytes: int = 0


Task = FileTask | FillTask | VerifyTask


@dataclass
class Done:
    """What one task did: CRC-32 by item name, the items written (in file order), the items
    left out and why (skip mode), and for a verification the tensors that differ and why."""

    task: Task
    crcs: dict[str, int] = field(default_factory=dict)
    written: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)


def ref(item: Item) -> ItemRef:
    return (item.name, item.dtype, tuple(item.shape))


def _nbytes(ref: ItemRef) -> int:
    from inspector import dtypes

    count = 1
    for n in ref[2]:
        count *= n
    return count * dtypes.itemsize(ref[1])


# --- who does what ---------------------------------------------------------------------------


def balance(tasks: Sequence[Task], count: int) -> list[list[Task]]:
    """``tasks`` dealt to ``count`` processes, largest first to the least loaded (ties: the
    lowest index), each share in task order: the same on every process that computes it."""
    shares: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    for i in sorted(range(len(tasks)), key=lambda i: (-tasks[i].nbytes, i)):
        least = min(range(count), key=lambda w: (loads[w], w))
        shares[least].append(i)
        loads[least] += tasks[i].nbytes
    return [[tasks[i] for i in sorted(share)] for share in shares]


def split_fill(
    path: str, items: Sequence[tuple[int, Item]], count: int, checksums: bool = True
) -> list[FillTask]:
    """``items`` (offset, item) in file order, cut into at most ``count`` runs of about equal
    bytes (each run is one process's contiguous stretch of the file)."""
    total = sum(item.nbytes for _, item in items)
    runs: list[list[tuple[int, ItemRef]]] = [[]]
    done = 0
    for offset, item in items:
        if runs[-1] and done >= total * len(runs) / count and len(runs) < count:
            runs.append([])
        runs[-1].append((offset, ref(item)))
        done += item.nbytes
    return [FillTask(path, tuple(run), checksums) for run in runs if run]


def split_names(names: Sequence[str], count: int) -> list[list[str]]:
    """``names`` in ``count`` contiguous runs of about equal length (fewer when short)."""
    per = -(-len(names) // max(count, 1)) if names else 0
    return [list(names[i : i + per]) for i in range(0, len(names), per)] if per else []


# --- doing a share ----------------------------------------------------------------------------

_cached: tuple[Plan, dict[str, Planned]] | None = None


def seed(plan: Plan, planned: Iterable[Planned]) -> None:
    """Make ``planned`` this process's plan for ``plan`` (a torchrun rank planned already)."""
    global _cached
    _cached = (plan, {p.item.name: p for p in planned})


def planned_items(plan: Plan) -> dict[str, Planned]:
    """This process's plan for ``plan``, by output name: derived once, then reused."""
    global _cached
    if _cached is None or _cached[0] != plan:
        _cached = None  # let the previous plan go first
        seed(plan, plan.planned(plan.source.open()))
    assert _cached is not None
    return _cached[1]


def run_share(plan: Plan, tasks: Sequence[Task], progress: Progress) -> list[Done]:
    """Do ``tasks`` in order; errors other than InspectorErrors become ExportErrors naming
    the file (so they survive pickling and say where)."""
    planned = planned_items(plan)
    done = []
    for task in tasks:
        try:
            done.append(_run(task, planned, progress))
        except InspectorError:
            raise
        except Exception as exc:
            raise ExportError(f"{type(exc).__name__}: {exc}", file=task.path) from None
    return done


def _run(task: Task, planned: dict[str, Planned], progress: Progress) -> Done:
    if isinstance(task, VerifyTask):
        from inspector.exporting.verify import problems

        chosen = [planned[name] for name in task.names]
        reasons = problems(task.path, chosen, task.nested, progress, task.crcs, task.changed)
        return Done(task, reasons=reasons)
    if isinstance(task, FileTask):
        return _write_file(task, [_item(planned, r) for r in task.items], progress)
    crcs = {}
    with open(task.path, "r+b", buffering=0) as f, durable(f.fileno(), progress) as written:
        for offset, item_ref in task.items:
            item = _item(planned, item_ref)
            os.lseek(f.fileno(), offset, os.SEEK_SET)
            crcs[item.name] = write_item(f.fileno(), item, crc=task.checksums)
            written(item)
    return Done(task, crcs, [r[0] for _, r in task.items])


def _write_file(task: FileTask, items: list[Item], progress: Progress) -> Done:
    from inspector.exporting.base import retrying
    from inspector.formats.safetensors import write_safetensors

    done = Done(task)

    def write(items: list[Item]) -> None:
        done.crcs = write_safetensors(
            Path(task.path), items, dict(task.metadata), progress, checksums=task.checksums
        )

    written = retrying(write, items, task.on_error, done.skipped)
    done.written = [i.name for i in written]
    return done


def _item(planned: dict[str, Planned], item_ref: ItemRef) -> Item:
    """The planned item ``item_ref`` names, refused when this process planned it otherwise."""
    from inspector.exporting.base import keyed

    found = planned.get(item_ref[0])
    if found is None or ref(found.item) != item_ref:
        raise ExportError(
            "this process planned the export differently (did the checkpoint change?)",
            key=item_ref[0],
        )
    return keyed(found)
