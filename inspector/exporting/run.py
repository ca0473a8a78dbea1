"""Export a checkpoint (``inspector.export``) to ``.safetensors`` or ``.pt``, streaming; the
model-folder formats ``hf`` (:mod:`.hf_folder`) and ``dcp`` (:mod:`.dcp_folder`) and URL
targets (:mod:`.remote_target`) are dispatched from here.

Tensors are read, converted (FP8 handling, :mod:`.fp8`; an optional cast) and written one
at a time, so memory is bounded by the largest tensor. Files appear under their final
names only when the whole export succeeded; the source is only read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import json
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inspector.errors import ExportError, InspectorError
from inspector.exporting import plan
from inspector.exporting import verify as checking
from inspector.exporting.base import (
    ExportResult,
    Meter,
    Progress,
    keyed,
    refuse_inside_source,
    retrying,
)
from inspector.exporting.model_weights import CONFIG_NAME
from inspector.exporting.plan import INDEX_NAME, Planned
from inspector.exporting.request import ExportRequest
from inspector.exporting.shares import TensorPlan
from inspector.exporting.verify import Verification
from inspector.formats.safetensors import index_text, safetensors_dtype, write_safetensors
from inspector.formats.writing import Item
from inspector.storage.local import atomic_files, new_folder
from inspector.version import __version__

if TYPE_CHECKING:
    from inspector.checkpoint import Checkpoint
    from inspector.exporting.workers import Engine

__all__ = ["ExportRequest", "ExportResult", "Progress", "export", "run"]


def export(
    ck_or_path: Checkpoint | str | os.PathLike[str],
    out: str | os.PathLike[str],
    format: str = "auto",
    **options: Any,
) -> ExportResult:
    """Write the checkpoint's tensors (model only by default) as safetensors or ``.pt``
    (``format="auto"``: ``.pt`` for an ``out`` ending in .pt, .pth or .bin, else safetensors;
    an ``out`` whose suffix names another format than the one given is refused).

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

    Options are the fields of :class:`~inspector.exporting.request.ExportRequest`, checked
    before anything is opened (an unknown or invalid one is a UsageError naming it).
    ``workers``: processes that write the plan (from a fork server; they do not re-run a
    script's ``__main__``); the output is byte-identical to ``workers=1``.
    ``distributed``: this process is one torchrun rank and every rank runs this same call
    (``ckpt-inspect export`` sets it under torchrun); each writes its share, rank 0 the
    index (see :mod:`inspector.exporting.parallel`).
    """
    return run(ExportRequest.build(ck_or_path, out, format=format, **options))


def _signature() -> inspect.Signature:
    """``export``'s parameters as ``help()`` and Jupyter show them: the request's fields."""
    first = list(inspect.signature(export).parameters.values())[:3]
    rest = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default)
        for f in dataclasses.fields(ExportRequest)[3:]
    ]
    return inspect.Signature([*first, *rest], return_annotation="ExportResult")


export.__signature__ = _signature()  # type: ignore[attr-defined]


def run(request: ExportRequest) -> ExportResult:
    """The export ``request`` describes, by the writer of its target and format."""
    if request.is_remote:
        from inspector.exporting.remote_target import export_to_url

        return export_to_url(request, run)
    if request.format == "hf":
        from inspector.exporting.hf_folder import export_hf

        return export_hf(request)
    if request.format == "dcp":
        from inspector.exporting.dcp_folder import export_dcp

        return export_dcp(request)
    if request.format == "megatron":
        from inspector.exporting.megatron_folder import export_megatron

        return export_megatron(request)
    return export_tensors(request)


@dataclass(frozen=True)
class Written:
    """What a tensor-file writer wrote: the files, the index, the objects kept in a .pt and
    each written tensor's CRC-32 by name (0 without checksums)."""

    files: list[Path]
    index: Path | None
    objects: int
    crcs: dict[str, int]


@dataclass
class Job:
    """A tensor-file export under way: the request, the checkpoint, its plan (tensors and
    .pt objects), the keys left out and why (the writers add to them) and the processes
    writing (None: this one)."""

    request: ExportRequest
    ck: Checkpoint
    spec: TensorPlan
    planned: list[Planned]
    skipped: dict[str, str]
    objects: list[str]
    engine: Engine | None = None


def export_tensors(request: ExportRequest) -> ExportResult:
    """A .safetensors or .pt export: open, plan, write, verify, report."""
    started = time.perf_counter()
    ck = request.open()
    refuse_inside_source(ck, request.out)
    spec = TensorPlan.of(ck, request)
    job = Job(request, ck, spec, *spec.make(ck))
    before = checking.SourceState(ck)
    with _engine(job) as job.engine:
        shown = getattr(job.engine, "rank", 0) == 0
        meter = request.meter(sum(p.item.nbytes for p in job.planned), shown=shown)
        try:
            with new_folder(_folder(request)):  # a failed export leaves no folder either
                written = _write(job, meter)
        finally:
            meter.close()
        kept = [p for p in job.planned if p.item.name in written.crcs]
        verification = _verify(job, written, kept, before, shown) if request.verify else None
    return ExportResult(
        format=request.format,
        files=written.files,
        index=written.index,
        tensors=len(kept),
        objects=written.objects,
        bytes=sum(p.item.nbytes for p in kept),
        skipped=job.skipped,
        conversions={p.item.name: p.conversion for p in kept if p.conversion},
        names={p.entry_key: p.item.name for p in kept if p.entry_key != p.item.name},
        seconds=time.perf_counter() - started,
        verification=verification,
    )


def _folder(request: ExportRequest) -> Path:
    """The folder the files go into: the target, or the folder of a target file."""
    single_file = request.out.suffix == ".safetensors" or request.format == "pt"
    return request.out.parent if single_file else request.out


@contextlib.contextmanager
def _engine(job: Job) -> Iterator[Engine | None]:
    """The worker processes or torchrun ranks that write the plan (None: this process)."""
    request = job.request
    if request.workers == 1 and not request.distributed:
        yield None
        return
    from inspector.exporting.parallel import engine as start

    engine = start(request.workers, request.distributed, job.planned, job.spec)
    try:
        yield engine
    finally:
        engine.close()


def _write(job: Job, meter: Meter) -> Written:
    if job.engine is not None:
        return _write_parallel(job, job.engine, meter)
    if job.request.format == "safetensors":
        return _write_safetensors(job, meter)
    return _write_pt(job, meter)


def _verify(
    job: Job, written: Written, kept: list[Planned], before: checking.SourceState, shown: bool
) -> Verification:
    """Re-read what was written and compare it with the plan (split over the engine's
    processes, where there are some)."""
    nested = job.request.nested
    checker = job.request.meter(sum(p.item.nbytes for p in kept), "verify", shown)
    target = written.files[0] if written.index is None else written.index
    try:
        if job.engine is not None:
            from inspector.exporting import parallel

            return parallel.verify(
                job.engine, job.spec, target, kept, nested, checker, written.crcs, before
            )
        return checking.verify(target, kept, nested, checker, written.crcs, before)
    finally:
        checker.close()


def _write_parallel(job: Job, engine: Engine, meter: Meter) -> Written:
    """:func:`_write_safetensors` / :func:`_write_pt`, by the engine's processes."""
    from inspector.exporting import parallel

    request, ck, planned = job.request, job.ck, job.planned
    items = [keyed(p) for p in planned]
    if request.format == "safetensors":
        single_file, folder, _ = _safetensors_layout(request, items)
        name = request.out.name if single_file else plan.shard_names(1)[0]
        metadata = _metadata(ck, request)
        files, index, crcs = parallel.write_safetensors(
            engine, job.spec, request, folder, name, items, metadata, job.skipped, meter,
            functools.partial(_config_file, job),
        )
        return Written(files, index, 0, crcs)
    values = _pt_objects(ck, job.objects, request.on_error, job.skipped)

    def structure(items: list[Item]) -> dict[Any, Any]:
        names = {i.name for i in items}
        return _pt_structure(ck, [p for p in planned if p.item.name in names], items, values,
                             request.nested)

    files, crcs = parallel.write_pt(engine, job.spec, request, structure, items, job.skipped,
                                    meter)
    return Written(files, None, len(values), crcs)


def _write_safetensors(job: Job, meter: Meter) -> Written:
    """The shards and index; each written item's CRC-32 by name (0 without ``verify``)."""
    request, metadata = job.request, _metadata(job.ck, job.request)
    items = [keyed(p) for p in job.planned]
    single_file, folder, shards = _safetensors_layout(request, items)
    folder.mkdir(parents=True, exist_ok=True)
    names = [request.out.name] if single_file else plan.shard_names(len(shards))
    weight_map: dict[str, str] = {}
    crcs: dict[str, int] = {}
    with atomic_files(folder, request.overwrite) as files:
        for name, shard in zip(names, shards, strict=True):
            temp = files.temp_for(folder / name)

            def write(items: list[Item], temp: Path = temp) -> None:
                crcs.update(
                    write_safetensors(temp, items, metadata, meter, checksums=request.verify)
                )

            done = retrying(write, shard, request.on_error, job.skipped)
            weight_map |= {i.name: name for i in done}
        index = None
        if len(shards) > 1:
            index = folder / INDEX_NAME
            total = sum(i.nbytes for i in items if i.name in weight_map)
            files.temp_for(index).write_text(index_text(weight_map, total))
        for name, text in _config_file(job, weight_map).items():
            files.temp_for(folder / name).write_text(text)
        written = files.commit()
    crcs = {k: crcs.get(k, 0) for k in weight_map}
    return Written([p for p in written if p != index], index, 0, crcs)


def _config_file(job: Job, names: Iterable[str]) -> dict[str, str]:
    """With ``fp8="quantize"``, config.json: the one beside the source with the
    ``quantization_config`` of the tensors written, ``names`` (none without a source config)."""
    if job.request.fp8 != "quantize":
        return {}
    from inspector.exporting.model_weights import load_config
    from inspector.exporting.quantize import config_of

    config = load_config(None, None, job.ck)
    if config is None:
        return {}
    config |= {"quantization_config": config_of(names, job.request.fp8_scheme)}
    return {CONFIG_NAME: json.dumps(config, indent=2) + "\n"}


def _safetensors_layout(
    request: ExportRequest, items: list[Item]
) -> tuple[bool, Path, list[list[Item]]]:
    """Whether ``out`` is one ``.safetensors`` file, the folder written into, and the shards;
    refused before anything is written when a file would need shards or a dtype cannot be
    stored."""
    out = request.out
    single_file = out.suffix == ".safetensors"
    shards = plan.plan_shards(items, request.shard_limit)
    if single_file and len(shards) > 1:
        raise ExportError(
            f"needs {len(shards)} shards of at most {request.max_shard_size}; "
            "give a folder instead of a .safetensors file",
            file=out,
        )
    for item in items:
        safetensors_dtype(item.dtype, item.name)
    return single_file, out.parent if single_file else out, shards


def _metadata(ck: Checkpoint, request: ExportRequest) -> dict[str, str]:
    return {
        "format": "pt",
        "source": ck.location,
        "source_format": ck.format,
        "fp8": request.fp8,
        "dtype": request.dtype or "as stored",
        "exported_by": f"checkpoint-inspector {__version__}",
    }


def _write_pt(job: Job, meter: Meter) -> Written:
    from inspector.formats.torch_save.writer import write_torch_save

    request, ck = job.request, job.ck
    out = request.out
    values = _pt_objects(ck, job.objects, request.on_error, job.skipped)
    out.parent.mkdir(parents=True, exist_ok=True)
    crcs: dict[str, int] = {}
    with atomic_files(out.parent, request.overwrite) as files:
        temp = files.temp_for(out)

        def write(items: list[Item]) -> None:
            names = {i.name for i in items}
            kept = [p for p in job.planned if p.item.name in names]
            structure = _pt_structure(ck, kept, items, values, request.nested)
            crcs.clear()
            crcs.update(write_torch_save(temp, structure, meter))

        retrying(write, [keyed(p) for p in job.planned], request.on_error, job.skipped)
        written = files.commit()
    return Written(written, None, len(values), crcs)


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
