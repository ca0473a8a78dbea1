"""Writing an export plan with several processes (``workers=N``, or torchrun ranks), with
output byte-identical to one process's.

- Sharded safetensors: whole shard files are dealt to the processes, balanced by bytes.
- One .safetensors file: its header is written and the file pre-sized first; each process
  writes a contiguous stretch of tensors at their offsets.
- .pt: torch's zip writer lays the archive out with every tensor record reserved (a hole);
  the processes fill the records at their offsets and return their CRC-32s, which are then
  set in the records' headers (as the one-process writer does after its single pass).

The leader (the parent; rank 0) lays files out, writes the index last and renames the
temporary files to their final names only when every process succeeded; on any failure
every temporary file is removed and no index is written. Verification is split too.
"""

from __future__ import annotations

import functools
import os
import pickle
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inspector.errors import InspectorError, UsageError
from inspector.exporting import plan as planning
from inspector.exporting.plan import INDEX_NAME, Planned
from inspector.exporting.shares import (
    Done,
    FileTask,
    Plan,
    Task,
    VerifyTask,
    balance,
    ref,
    split_fill,
    split_names,
)
from inspector.exporting.verify import SourceState, Verification
from inspector.exporting.workers import Engine, Meter, Ranks, Workers
from inspector.formats.safetensors import header_bytes, index_text
from inspector.storage.local import AtomicFiles, atomic_files

if TYPE_CHECKING:
    from inspector.exporting.request import ExportRequest
    from inspector.formats.writing import Item


def engine(workers: int, distributed: bool, planned: Sequence[Planned], plan: Plan) -> Engine:
    """The processes that write ``plan``: torchrun's ranks, or ``workers`` local ones."""
    if distributed:
        return Ranks(planned)
    try:
        sent = pickle.dumps(plan)
    except Exception as exc:
        raise UsageError(
            f"workers={workers} needs options other processes can receive ({exc}); "
            "give rename as a mapping or a module-level function"
        ) from None
    return Workers(workers, with_main=b"__main__" in sent)


def write_safetensors(
    engine: Engine,
    plan: Plan,
    request: ExportRequest,
    folder: Path,
    single_name: str,
    items: list[Item],
    metadata: dict[str, str],
    skipped: dict[str, str],
    meter: Meter,
    beside: Callable[[Iterable[str]], dict[str, str]] | None = None,
) -> tuple[list[Path], Path | None, dict[str, int]]:
    """The shards (or the one file ``single_name``) and index, as the one-process writer
    lays them out, and the text files ``beside(written names)`` names (config.json).
    Returns the files, the index and each written item's CRC-32 by name (0 without
    ``request.verify``)."""
    shards = planning.plan_shards(items, request.shard_limit)
    checksums, on_error = request.verify, request.on_error
    with atomic_files(folder, request.overwrite) as files:
        if len(shards) == 1:
            final = folder / single_name

            def lay_out(items: list[Item]) -> list[list[Task]]:
                return _presized_safetensors(files, final, items, metadata, engine.size, checksums)

            results, written = _filled(engine, plan, lay_out, items, on_error, skipped, meter)
            crcs = {k: v for d in results for k, v in d.crcs.items()}
            names = {i.name: single_name for i in written}
        else:
            shard_names = planning.shard_names(len(shards))
            tasks = engine.leader(lambda: _shard_tasks(files, folder, shard_names, shards,
                                                       metadata, checksums, on_error))
            results = engine.run(plan, balance(tasks, engine.size), meter)
            by_path = {d.task.path: d for d in results}
            names, crcs = {}, {}
            for task, name in zip(tasks, shard_names, strict=True):
                done = by_path[task.path]
                skipped |= done.skipped
                names |= dict.fromkeys(done.written, name)
                crcs |= done.crcs

        def finish() -> tuple[list[Path], Path | None]:
            index = None
            if len(shards) > 1:
                index = folder / INDEX_NAME
                total = sum(i.nbytes for i in items if i.name in names)
                files.temp_for(index).write_text(index_text(names, total))
            for name, text in (beside(names) if beside is not None else {}).items():
                files.temp_for(folder / name).write_text(text)
            return files.commit(), index

        written_files, index = engine.leader(finish)
    return [p for p in written_files if p != index], index, {k: crcs.get(k, 0) for k in names}


def _shard_tasks(
    files: AtomicFiles,
    folder: Path,
    names: list[str],
    shards: list[list[Item]],
    metadata: dict[str, str],
    checksums: bool,
    on_error: str,
) -> list[Task]:
    folder.mkdir(parents=True, exist_ok=True)
    return [
        FileTask(
            str(files.temp_for(folder / name)),
            tuple(ref(i) for i in shard),
            metadata,
            checksums,
            on_error,
        )
        for name, shard in zip(names, shards, strict=True)
    ]


def _presized_safetensors(
    files: AtomicFiles,
    final: Path,
    items: list[Item],
    metadata: dict[str, str],
    count: int,
    checksums: bool,
) -> list[list[Task]]:
    """Write the header of the one file, size the file, and cut its tensors into runs."""
    final.parent.mkdir(parents=True, exist_ok=True)
    temp = files.temp_for(final)
    header = header_bytes(items, metadata)
    placed, offset = [], len(header)
    for item in items:
        placed.append((offset, item))
        offset += item.nbytes
    with open(temp, "wb", buffering=0) as f:
        f.write(header)
        os.ftruncate(f.fileno(), offset)
    return [[task] for task in split_fill(str(temp), placed, count, checksums)]


def _filled(
    engine: Engine,
    plan: Plan,
    lay_out: Callable[[list[Item]], list[list[Task]]],
    items: list[Item],
    on_error: str,
    skipped: dict[str, str],
    meter: Meter,
) -> tuple[list[Done], list[Item]]:
    """Lay out and fill one file; in skip mode an unreadable item is left out and the
    file laid out again without it (as the one-process writer redoes its file)."""
    while True:
        shares = engine.leader(functools.partial(lay_out, items))
        try:
            return engine.run(plan, shares, meter), items
        except InspectorError as exc:
            if on_error != "skip" or exc.key not in {i.name for i in items}:
                raise
            skipped[exc.key] = f"unreadable: {exc.reason}"
            items = [i for i in items if i.name != exc.key]


def write_pt(
    engine: Engine,
    plan: Plan,
    request: ExportRequest,
    structure: Callable[[list[Item]], Any],
    items: list[Item],
    skipped: dict[str, str],
    meter: Meter,
) -> tuple[list[Path], dict[str, int]]:
    """The .pt ``request.out`` holding ``structure(items)``; returns it and each item's CRC-32."""
    from inspector.formats.torch_save.writer import reserve_torch_save, set_torch_save_crcs

    out, on_error = request.out, request.on_error
    with atomic_files(out.parent, request.overwrite) as files:

        def lay_out(items: list[Item]) -> list[list[Task]]:
            out.parent.mkdir(parents=True, exist_ok=True)
            temp = files.temp_for(out)
            offsets = reserve_torch_save(temp, structure(items))
            placed = sorted((offsets[i.name], i) for i in items if i.name in offsets)
            return [[t] for t in split_fill(str(temp), placed, engine.size)]

        results, written = _filled(engine, plan, lay_out, items, on_error, skipped, meter)
        crcs = {i.name: 0 for i in written} | {k: v for d in results for k, v in d.crcs.items()}

        def finish() -> list[Path]:
            set_torch_save_crcs(files.temp_for(out), structure(written), crcs)
            return files.commit()

        return engine.leader(finish), crcs


def verify(
    engine: Engine,
    plan: Plan,
    target: Path,
    planned: list[Planned],
    nested: bool,
    meter: Meter,
    crcs: dict[str, int],
    before: SourceState,
) -> Verification:
    """:func:`.verify.verify`, each process checking a stretch of the tensors."""
    import time

    started = time.perf_counter()
    changed = tuple(engine.leader(before.changed))
    sizes = {p.item.name: p.item.nbytes for p in planned}
    runs = split_names([p.item.name for p in planned], engine.size)
    shares: list[list[Task]] = [
        [VerifyTask(str(target), tuple(run), nested, {n: crcs[n] for n in run}, changed,
                    sum(sizes[n] for n in run))]
        for run in runs
    ]
    found = {k: v for d in engine.run(plan, shares, meter) for k, v in d.reasons.items()}
    reasons = {p.item.name: found[p.item.name] for p in planned if p.item.name in found}
    return Verification(len(planned), tuple(reasons), time.perf_counter() - started, reasons)
