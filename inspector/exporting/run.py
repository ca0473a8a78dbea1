"""Export a checkpoint (``inspector.export``) to ``.safetensors`` or ``.pt``, streaming; the
model-folder formats ``hf`` and ``dcp`` are in :mod:`.model_folder`.

Tensors are read, converted (FP8 handling, :mod:`.fp8`; an optional cast) and written one
at a time, so memory is bounded by the largest tensor. Files appear under their final
names only when the whole export succeeded; the source is only read.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inspector import dtypes
from inspector.errors import ExportError, InspectorError, UsageError
from inspector.exporting import plan
from inspector.exporting import verify as checking
from inspector.exporting.plan import INDEX_NAME, Planned, Rename
from inspector.exporting.shares import SourceRef, TensorPlan
from inspector.exporting.verify import Verification
from inspector.formats.safetensors import index_text, safetensors_dtype, write_safetensors
from inspector.formats.writing import Item
from inspector.storage.local import atomic_files
from inspector.storage.remote import is_url
from inspector.version import __version__

if TYPE_CHECKING:
    import torch

    from inspector.checkpoint import Checkpoint
    from inspector.exporting.workers import Engine


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
            + f" to {len(self.files)} file(s) in {self.seconds:.1f} s",
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


def export(
    ck_or_path: Checkpoint | str | os.PathLike,
    out: str | os.PathLike,
    format: str = "safetensors",
    *,
    dtype: torch.dtype | str | None = None,
    fp8: str = "dequantize",
    model_only: bool = True,
    flatten: bool = True,
    nested: bool = False,
    include: Iterable[str] | None = None,
    exclude: Iterable[str] | None = None,
    rename: Rename = None,
    arch: str | None = None,
    naming: str | None = None,
    hf_config: Mapping[str, Any] | str | os.PathLike | None = None,
    hf_assets: str | os.PathLike | None = None,
    max_shard_size: int | str = plan.DEFAULT_SHARD_SIZE,
    overwrite: bool = False,
    verify: bool = True,
    on_error: str = "fail",
    progress: bool = True,
    on_progress: Callable[[Progress], None] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    target_options: Mapping[str, Any] | None = None,
    workers: int = 1,
    distributed: bool = False,
) -> ExportResult:
    """Write the checkpoint's tensors (model only by default) as safetensors or ``.pt``.

    safetensors: ``out`` is a folder (one ``model.safetensors``, or
    ``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json`` past
    ``max_shard_size``) or a ``*.safetensors`` file. pt: ``out`` is the file; a flat dict
    of plain tensors, or with ``nested=True`` the stored nesting (like torch's
    ``dcp_to_torch_save``). ``dtype``: a torch.dtype or its name, to cast high-precision
    values to. ``fp8``: "dequantize" (to ``dtype`` or bfloat16), "unwrap" or "keep" (see
    :mod:`inspector.exporting.fp8`). ``flatten`` drops the ``model.`` component prefix
    (decided from the stored nesting, not the spelling). ``rename``: exact stored keys
    (e.g. a KeyReport's ``mapping()``) then regex -> replacement, or a callable.
    ``on_error``: "fail" or "skip" entries that cannot be read. ``out`` may be an s3://,
    gs:// or hf:// URL: the export is written and checked in a local temporary folder, then
    uploaded (the index or single file last). ``storage_options``: fsspec options for a URL
    ``ck_or_path``; ``target_options`` for a URL ``out`` (default: ``storage_options``).

    hf: ``out`` is a Hugging Face model folder: the model weights under the HF names of
    ``arch`` ("auto" decides from the key names; "llama3", "qwen3", "qwen3_moe",
    "deepseek_v3"), transformed as HF needs them, sharded past ``max_shard_size``, with
    ``config.json`` from ``hf_config`` (a dict or a config.json path) or
    ``hf_assets/config.json``, completed and checked against the weights, and the
    tokenizer, generation config and other files of ``hf_assets`` copied as they are.
    dcp: the reverse, HF weights -> a DCP folder with flat torchtitan names of ``naming``
    ("torchtitan": 0.3, "torchtitan-2025": July 2025), for torchtitan's initial_load_path.
    Left-out keys (training state, a tied head, torchtitan-only buffers) and why are in
    ``skipped``, the architecture and why in ``arch`` and ``reason``.

    ``workers``: processes that write the plan (from a fork server: call from under
    ``if __name__ == "__main__":`` in a script); the output is byte-identical to
    ``workers=1``. ``distributed``: this process is one torchrun rank and every rank runs
    this same call (``ckpt-inspect export`` sets it under torchrun); each writes its share,
    rank 0 the index (see :mod:`inspector.exporting.parallel`).
    """
    from inspector.checkpoint import as_checkpoint

    plan.check_choice("format", format, plan.EXPORT_FORMATS)
    plan.check_choice("on_error", on_error, plan.ON_ERROR)
    if workers < 1:
        raise UsageError(f"workers must be at least 1, got {workers}")
    if is_url(out):
        from inspector.exporting.remote_target import export_to_url

        ck = as_checkpoint(ck_or_path, storage_options)

        def write_locally(local: Path) -> ExportResult:
            return export(
                ck, local, format, dtype=dtype, fp8=fp8, model_only=model_only,
                flatten=flatten, nested=nested, include=include, exclude=exclude,
                rename=rename, arch=arch, naming=naming, hf_config=hf_config,
                hf_assets=hf_assets, max_shard_size=max_shard_size, overwrite=True,
                verify=verify, on_error=on_error, progress=progress, on_progress=on_progress,
                workers=workers,
            )

        if distributed:
            raise UsageError("a URL output is written by one process or by workers, not by "
                             "torchrun ranks yet; write to a shared folder, then upload")
        options = storage_options if target_options is None else target_options
        return export_to_url(ck, str(out), options, overwrite, write_locally)
    if format in plan.MODEL_FOLDER_FORMATS:
        from inspector.exporting.model_folder import export_model_folder

        changed = {
            "model_only": not model_only,
            "flatten": not flatten,
            "nested": nested,
            "include": include is not None,
            "exclude": exclude is not None,
            "rename": rename is not None,
            "on_error": on_error != "fail",
        }
        return export_model_folder(
            as_checkpoint(ck_or_path, storage_options),
            Path(out).expanduser(),
            format,
            changed,
            arch=arch or "auto",
            naming=naming,
            hf_config=hf_config,
            hf_assets=hf_assets,
            dtype=dtypes.optional_name(dtype),
            fp8=fp8,
            max_shard_size=max_shard_size,
            overwrite=overwrite,
            verify=verify,
            progress=progress,
            on_progress=on_progress,
            workers=workers,
            distributed=distributed,
        )
    given = {"arch": arch, "naming": naming, "hf_config": hf_config, "hf_assets": hf_assets}
    if any(v is not None for v in given.values()):
        shown = ", ".join(k for k, v in given.items() if v is not None)
        raise UsageError(f"{shown} only apply to format='hf' or 'dcp'")
    if nested and (format != "pt" or rename is not None):
        raise ExportError("nested=True writes the stored nesting of a .pt; rename does not apply")
    cast = dtypes.optional_name(dtype)
    started = time.perf_counter()
    ck = as_checkpoint(ck_or_path, storage_options)
    out = Path(out).expanduser()
    refuse_inside_source(ck, out)
    spec = TensorPlan(
        SourceRef.of(ck), model_only, _tuple(include), _tuple(exclude), fp8, cast, flatten,
        rename, on_error, format != "pt",
    )
    planned, skipped, objects = spec.make(ck)
    engine = None
    if workers > 1 or distributed:
        from inspector.exporting.parallel import engine as start

        engine = start(workers, distributed, planned, spec)
        progress = progress and getattr(engine, "rank", 0) == 0
    meter = Meter(sum(p.item.nbytes for p in planned), progress, on_progress)
    before = checking.SourceState(ck)
    try:
        if engine is not None:
            files, index, written_objects, crcs = _write_parallel(
                engine, spec, ck, out, format, planned, objects, nested, max_shard_size,
                overwrite, on_error, skipped, meter, verify,
            )
        elif format == "safetensors":
            metadata = _metadata(ck, fp8, cast)
            files, index, crcs = _write_safetensors(
                out, planned, metadata, max_shard_size, overwrite, on_error, skipped, meter, verify
            )
            written_objects = 0
        else:
            files, written_objects, crcs = _write_pt(
                ck, out, planned, objects, nested, overwrite, on_error, skipped, meter
            )
            index = None
    except BaseException:
        if engine is not None:
            engine.close()
        raise
    finally:
        meter.close()
    kept = [p for p in planned if p.item.name in crcs]
    verification = None
    if verify:
        checker = Meter(sum(p.item.nbytes for p in kept), progress, on_progress, "verify")
        try:
            target = files[0] if index is None else index
            if engine is not None:
                from inspector.exporting import parallel

                verification = parallel.verify(
                    engine, spec, target, kept, nested, checker, crcs, before
                )
            else:
                verification = checking.verify(target, kept, nested, checker, crcs, before)
        finally:
            checker.close()
            if engine is not None:
                engine.close()
    elif engine is not None:
        engine.close()
    return ExportResult(
        format=format,
        files=files,
        index=index,
        tensors=len(kept),
        objects=written_objects,
        bytes=sum(p.item.nbytes for p in kept),
        skipped=skipped,
        conversions={p.item.name: p.conversion for p in kept if p.conversion},
        names={p.entry_key: p.item.name for p in kept if p.entry_key != p.item.name},
        seconds=time.perf_counter() - started,
        verification=verification,
    )


def _tuple(patterns: Iterable[str] | None) -> tuple[str, ...] | None:
    return None if patterns is None else tuple(patterns)


def _write_parallel(
    engine: Engine,
    spec: TensorPlan,
    ck: Checkpoint,
    out: Path,
    format: str,
    planned: list[Planned],
    objects: list[str],
    nested: bool,
    max_shard_size: int | str,
    overwrite: bool,
    on_error: str,
    skipped: dict[str, str],
    meter: Meter,
    checksums: bool,
) -> tuple[list[Path], Path | None, int, dict[str, int]]:
    """:func:`_write_safetensors` / :func:`_write_pt`, by the engine's processes."""
    from inspector.exporting import parallel

    items = [keyed(p) for p in planned]
    if format == "safetensors":
        single_file, folder, _ = _safetensors_layout(out, items, max_shard_size)
        name = out.name if single_file else plan.shard_names(1)[0]
        files, index, crcs = parallel.write_safetensors(
            engine, spec, folder, name, items, _metadata(ck, spec.fp8, spec.cast),
            plan.parse_size(max_shard_size), overwrite, on_error, skipped, meter, checksums,
        )
        return files, index, 0, crcs
    values = _pt_objects(ck, objects, on_error, skipped)

    def structure(items: list[Item]) -> dict[Any, Any]:
        names = {i.name for i in items}
        return _pt_structure(ck, [p for p in planned if p.item.name in names], items, values,
                             nested)

    files, crcs = parallel.write_pt(
        engine, spec, out, structure, items, overwrite, on_error, skipped, meter
    )
    return files, None, len(values), crcs


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


def _write_safetensors(
    out: Path,
    planned: list[Planned],
    metadata: dict[str, str],
    max_shard_size: int | str,
    overwrite: bool,
    on_error: str,
    skipped: dict[str, str],
    meter: Meter,
    checksums: bool,
) -> tuple[list[Path], Path | None, dict[str, int]]:
    """The shards and index; each written item's CRC-32 by name (0 without ``checksums``)."""
    items = [keyed(p) for p in planned]
    single_file, folder, shards = _safetensors_layout(out, items, max_shard_size)
    folder.mkdir(parents=True, exist_ok=True)
    names = [out.name] if single_file else plan.shard_names(len(shards))
    weight_map: dict[str, str] = {}
    crcs: dict[str, int] = {}
    with atomic_files(folder, overwrite) as files:
        for name, shard in zip(names, shards, strict=True):
            temp = files.temp_for(folder / name)

            def write(items: list[Item], temp: Path = temp) -> None:
                crcs.update(write_safetensors(temp, items, metadata, meter, checksums=checksums))

            done = retrying(write, shard, on_error, skipped)
            weight_map |= {i.name: name for i in done}
        index = None
        if len(shards) > 1:
            index = folder / INDEX_NAME
            total = sum(i.nbytes for i in items if i.name in weight_map)
            files.temp_for(index).write_text(index_text(weight_map, total))
        written = files.commit()
    return [p for p in written if p != index], index, {k: crcs.get(k, 0) for k in weight_map}


def _safetensors_layout(
    out: Path, items: list[Item], max_shard_size: int | str
) -> tuple[bool, Path, list[list[Item]]]:
    """Whether ``out`` is one ``.safetensors`` file, the folder written into, and the shards;
    refused before anything is written when a file would need shards or a dtype cannot be
    stored."""
    single_file = out.suffix == ".safetensors"
    shards = plan.plan_shards(items, plan.parse_size(max_shard_size))
    if single_file and len(shards) > 1:
        raise ExportError(
            f"needs {len(shards)} shards of at most {max_shard_size}; "
            "give a folder instead of a .safetensors file",
            file=out,
        )
    for item in items:
        safetensors_dtype(item.dtype, item.name)
    return single_file, out.parent if single_file else out, shards


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


def _metadata(ck: Checkpoint, mode: str, dtype: str | None) -> dict[str, str]:
    return {
        "format": "pt",
        "source": ck.location,
        "source_format": ck.format,
        "fp8": mode,
        "dtype": dtype or "as stored",
        "exported_by": f"checkpoint-inspector {__version__}",
    }


def _write_pt(
    ck: Checkpoint,
    out: Path,
    planned: list[Planned],
    objects: list[str],
    nested: bool,
    overwrite: bool,
    on_error: str,
    skipped: dict[str, str],
    meter: Meter,
) -> tuple[list[Path], int, dict[str, int]]:
    from inspector.formats.torch_save.writer import write_torch_save

    values = _pt_objects(ck, objects, on_error, skipped)
    out.parent.mkdir(parents=True, exist_ok=True)
    crcs: dict[str, int] = {}
    with atomic_files(out.parent, overwrite) as files:
        temp = files.temp_for(out)

        def write(items: list[Item]) -> None:
            names = {i.name for i in items}
            kept = [p for p in planned if p.item.name in names]
            crcs.clear()
            crcs.update(
                write_torch_save(temp, _pt_structure(ck, kept, items, values, nested), meter)
            )

        retrying(write, [keyed(p) for p in planned], on_error, skipped)
        written = files.commit()
    return written, len(values), crcs


def _pt_objects(
    ck: Checkpoint, objects: list[str], on_error: str, skipped: dict[str, str]
) -> dict[str, Any]:
    """The non-tensor values a .pt keeps (those torch.load(weights_only=True) can read)."""
    from inspector.formats.torch_save.writer import weights_only_problem

    values = {}
    for key in objects:
        try:
            value = ck.read_object(key)
        except InspectorError as exc:
            if on_error != "skip":
                raise
            skipped[key] = f"unreadable: {exc.reason}"
            continue
        problem = weights_only_problem(value)
        if problem:
            skipped[key] = f"not loadable with torch.load(weights_only=True): {problem}"
        else:
            values[key] = value
    return values


def _pt_structure(
    ck: Checkpoint,
    planned: list[Planned],
    items: list[Item],
    objects: dict[str, Any],
    nested: bool,
) -> dict[Any, Any]:
    """The dict a .pt holds: flat by output name, or nested like the stored paths."""
    by_name = {i.name: i for i in items}
    leaves: list[tuple[str, tuple[Any, ...], Any]] = [
        (p.item.name, p.path if nested else (p.item.name,), by_name[p.item.name]) for p in planned
    ]
    leaves += [(k, ck.entry(k).nested_path if nested else (k,), v) for k, v in objects.items()]
    return plan.nested_structure(leaves)
